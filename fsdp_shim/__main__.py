from fsdp_shim.cli import main

raise SystemExit(main())
