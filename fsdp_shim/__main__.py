""""""

from __future__ import annotations

from fsdp_shim.tools.cli import main

raise SystemExit(main())
