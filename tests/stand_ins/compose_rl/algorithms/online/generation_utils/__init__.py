"""Stand-in for compose-rl (not installable here); written for fsdp_shim tests, no upstream code."""
