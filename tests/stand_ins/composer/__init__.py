"""Stand-in for Composer (mosaicml 0.32.1): only the FSDP gate and the generate call site. See ../README.md."""
