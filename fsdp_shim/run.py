"""``fsdp-shim run`` / ``python -m fsdp_shim.run``: patch, then run a program as ``python`` would.

    torchrun --nproc-per-node 8 -m fsdp_shim.run train.py --lr 3e-4
    fsdp-shim run -m my_pkg.train --lr 3e-4

``sys.argv``, ``sys.path[0]``, ``__main__`` and the exit status are those the
program would have under plain ``python``; the only difference is that
``FullyShardedDataParallel.summon_full_params`` is patched first.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence


USAGE = "usage: python -m fsdp_shim.run (SCRIPT | -m MODULE) [ARGS ...]"


def split_command(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``["-m", "pkg.train", "--lr", "1"]`` -> ``("pkg.train", ["--lr", "1"])``.

    Parsed by hand, not argparse: everything after the script or module
    belongs to the program, ``--help`` included.
    """
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        return argv[1], argv[2:]
    if argv[0].startswith("-m") and len(argv[0]) > 2:  # python's own "-mpkg" spelling
        return argv[0][2:], argv[1:]
    return None, argv


def launch(module: str | None, program: Sequence[str]) -> None:
    """Patch, then hand this process to the program. Does not return normally."""
    import fsdp_shim  # noqa: PLC0415  (the import itself does not patch if FSDP_SHIM_DISABLE is set)

    fsdp_shim.patch()
    if module is not None:
        sys.argv = [module, *program]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = program[0]
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    module, program = split_command(sys.argv[1:] if argv is None else argv)
    launch(module, program)


if __name__ == "__main__":
    main()
