"""``fsdp-shim run`` / ``python -m fsdp_shim.run`` (``torchrun ... -m fsdp_shim.run train.py``): patch, then run a
program as ``python`` would: ``sys.argv``, ``sys.path[0]``, ``__main__``, an absolute ``__file__``, the exit
status, the messages for a missing file or an unknown option (exit 2) and tracebacks (the program's frames
only) are plain ``python``'s. Patched as ``import fsdp_shim`` patches (disabled, refusing or inactive alike).
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import traceback
import types
from collections.abc import Sequence
from types import TracebackType

USAGE = "usage: {prog} (SCRIPT | -m MODULE | -c COMMAND) [ARGS ...]"
HELP = """{usage}

Run a Python program with FullyShardedDataParallel.summon_full_params patched
for FSDP2 (DTensor) models, exactly as `python` would run it.

  SCRIPT [ARGS]     run a script file
  -m MODULE [ARGS]  run a library module as a script
  -c COMMAND [ARGS] run a program passed in as a string
  -h, --help        show this help and exit

Environment: FSDP_SHIM_DISABLE=1 runs the program without patching.
"""


class UsageError(Exception):
    """Bad launcher arguments: reported like python's own, exit status 2."""


def split_command(argv: Sequence[str]) -> tuple[str, str | None, list[str]]:
    """``["-m", "pkg.train", "--lr", "1"]`` -> ``("module", "pkg.train", ["--lr", "1"])`` (or ``"command"``,
    ``"script"``, ``"help"``). Not argparse: all after the target is the program's, ``--help`` too."""
    argv = list(argv)
    if not argv:
        raise UsageError("missing SCRIPT, -m MODULE or -c COMMAND")
    first = argv[0]
    if first in ("-h", "--help"):
        return "help", None, []
    for flag, kind in (("-m", "module"), ("-c", "command")):
        if first == flag:
            if len(argv) < 2:
                raise UsageError(f"Argument expected for the {flag} option")
            return kind, argv[1], argv[2:]
        if first.startswith(flag) and len(first) > 2:  # python's own "-mpkg" spelling
            return kind, first[2:], argv[1:]
    if first.startswith("-") and first != "-":
        raise UsageError(f"unknown option {first}")
    return "script", first, argv[1:]


def _program_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the launcher's and runpy's frames from the top of a traceback."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (filename.startswith("<frozen runpy") or os.path.abspath(filename) in ours):
            break
        tb = tb.tb_next
    return tb


def _fresh_main(file: str | None) -> dict[str, object]:
    """A new ``__main__`` module, as the interpreter makes for a script or ``-c``."""
    module = types.ModuleType("__main__")
    module.__dict__.update({"__builtins__": builtins, "__spec__": None, "__loader__": None, "__cached__": None})
    if file is not None:
        module.__file__ = file
    sys.modules["__main__"] = module
    return module.__dict__


def _run_program(kind: str, target: str, program: list[str]) -> None:
    if kind == "module":
        sys.argv = [target, *program]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if kind == "command":
        sys.argv = ["-c", *program]
        sys.path[0] = ""
        exec(compile(target, "<string>", "exec"), _fresh_main(None))  # noqa: S102  (python -c does this)
        return
    script = os.path.abspath(target)  # python >= 3.9 gives __main__ an absolute __file__
    sys.argv = [target, *program]  # ... and keeps argv[0] as typed
    sys.path[0] = os.path.dirname(script)
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    exec(code, _fresh_main(script))  # noqa: S102  (python SCRIPT does this)


def run_patched(kind: str, target: str, program: Sequence[str]) -> int:
    """Patch as the import does, then run the program; returns its exit status."""
    if kind == "script" and not os.path.exists(target):
        exe = os.path.basename(sys.executable)
        print(f"{exe}: can't open file {os.path.abspath(target)!r}: [Errno 2] No such file or directory",
              file=sys.stderr)
        return 2
    import fsdp_shim  # noqa: PLC0415  (torch is imported by the activation below, not at ours)

    fsdp_shim.unsupported_reason  # noqa: B018  (activates: patches, refusing where unserved, unless disabled)
    try:
        _run_program(kind, target, list(program))
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001  (reported as python reports it)
        traceback.print_exception(type(exc), exc, _program_frames(exc.__traceback__))
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python -m fsdp_shim.run") -> int:
    usage = USAGE.format(prog=prog)
    try:
        kind, target, program = split_command(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{exc}\n{usage}\nTry `{prog} --help' for more information.", file=sys.stderr)
        return 2
    if kind == "help":
        print(HELP.format(usage=usage))
        return 0
    assert target is not None
    return run_patched(kind, target, program)


if __name__ == "__main__":
    sys.exit(main())
