# ruff: noqa: PLC0415  (imports deferred throughout: parsing imports nothing heavy, see the docstring)
"""The ``fsdp-shim`` command: ``check``, ``bench`` and ``run``.

Parsing imports nothing heavy: torch is imported only once a command runs,
so ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from fsdp_shim import _versions

EPILOG = """exit status: 0 success; 1 a scenario or run failed; 2 bad usage, or the
ranks could not be started. Environment: FSDP_SHIM_DISABLE=1 turns the shim
off; FSDP_SHIM_BUCKET_MB sets the gather bucket size; logging: the
"fsdp_shim" logger (FSDP_SHIM_LOG=debug shows each summon's route, size and time)."""


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _environment_line(ranks: int, device: str) -> str:
    import torch
    import wrapt

    return (
        f"torch {torch.__version__}, wrapt {getattr(wrapt, '__version__', '?')}, fsdp_shim {_versions.__version__}; "
        f"{ranks} ranks, {_backend(device)} on {device}"
    )


def _usage_problem(args: argparse.Namespace) -> str | None:
    """One line saying what is wrong with the arguments, or None. Checked before anything starts."""
    if args.ranks < 1:
        return f"--ranks must be at least 1, got {args.ranks}"
    if args.timeout <= 0:
        return f"--timeout must be positive, got {args.timeout}"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda: this machine has no usable CUDA device (torch.cuda.is_available() is False)"
        if args.ranks > torch.cuda.device_count():
            return (f"--device cuda: {args.ranks} ranks need {args.ranks} GPUs, "
                    f"this machine has {torch.cuda.device_count()}")
    elif args.ranks > 4 * (os.cpu_count() or 1):
        most = 4 * (os.cpu_count() or 1)
        return f"--ranks {args.ranks} on {os.cpu_count()} CPU cores would not make progress; use at most {most}"
    if getattr(args, "reps", 1) < 1:
        return f"--reps must be at least 1, got {args.reps}"
    if getattr(args, "warmup", 0) < 0:
        return f"--warmup must be 0 or more, got {args.warmup}"
    return None


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    import fsdp_shim
    from fsdp_shim.tools.check import check_on_rank
    from fsdp_shim.tools.launch import RankError, run_on_ranks

    if _versions.env_flag(_versions.DISABLE_ENV):
        print(f"fsdp-shim check: {_versions.DISABLE_ENV}={os.environ[_versions.DISABLE_ENV]} is set, so the shim "
              "is off and summon_full_params is FSDP1's own: nothing to check. Unset it to run the scenarios.")
        return 1
    if fsdp_shim.unsupported_reason is not None:
        mode = "refuses DTensor summons" if fsdp_shim.is_patched() else "is inactive"
        print(f"fsdp-shim check: the shim {mode} here: {fsdp_shim.unsupported_reason}")
        return 1

    print(f"fsdp-shim check: {_environment_line(args.ranks, args.device)}")
    if args.verbose:
        from fsdp_shim import _fsdp2
        from fsdp_shim.instrumentations import statuses

        verified = "verified" if _versions.is_verified_torch(torch.__version__) else (
            "supported, not itself verified" if _versions.is_supported_torch(torch.__version__) else
            "newer than the verified range, served because every internal below is present")
        print(f"  supported: {', '.join(_versions.INSTRUMENTS)}; torch {torch.__version__} is {verified}")
        print(f"  patched: {fsdp_shim.is_patched()}")
        missing = _fsdp2.missing_internals()
        print(f"  FSDP2 internals read or written: {len(_fsdp2.READS)}, "
              f"{'all present' if not missing else 'MISSING ' + ', '.join(missing)}: "
              f"{', '.join(_fsdp2.READS)}")
        for module, status in statuses().items():
            print(f"  instrumentation {module}: {status}")
    print(f"fsdp-shim check: starting {args.ranks} ranks, then the scenarios...", flush=True)
    try:
        per_rank = run_on_ranks(check_on_rank, args.ranks, (args.device,), backend=_backend(args.device),
                                timeout_s=args.timeout)
    except RankError as exc:
        print(f"FAILED to run: {exc}")
        return 2
    width = max(len(o.name) for o in per_rank[0]) + 2
    print(f"\n{'scenario':<{width}}{'result':<8}{'ms':>9}  detail")
    failures = skipped = 0
    for index, outcome in enumerate(per_rank[0]):
        ranks_ok = all(r[index].ok for r in per_rank)
        failures += not ranks_ok
        skip = ranks_ok and all(r[index].skipped for r in per_rank)
        skipped += skip
        detail = outcome.detail if outcome.ok else next(r[index].detail for r in per_rank if not r[index].ok)
        result = "SKIP" if skip else "PASS" if ranks_ok else "FAIL"
        print(f"{outcome.name:<{width}}{result:<8}{outcome.ms:>9.1f}  {detail}")
        if args.verbose:
            for line in outcome.paths:
                print(f"{'':<{width}}  path: {line}")
    total = len(per_rank[0])
    print(f"\n{total - failures - skipped} passed, {failures} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failures else 0


def _format_bytes(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def cmd_bench(args: argparse.Namespace) -> int:
    from fsdp_shim.tools.bench import BenchConfig, memory_on_rank, time_on_rank
    from fsdp_shim.tools.launch import RankError, run_on_ranks

    cfg = BenchConfig(
        layers=args.layers, width=args.width, vocab=args.vocab, reps=args.reps, warmup=args.warmup,
        device=args.device, bucket_mb=tuple(args.bucket_mb), per_unit=not args.no_per_unit,
        rank0_only=args.rank0_only, fsdp1=args.fsdp1, between=not args.no_between, stream=not args.no_stream,
    )
    backend = _backend(args.device)
    deadline = time.monotonic() + args.timeout  # --timeout bounds the whole command
    try:
        result = run_on_ranks(time_on_rank, args.ranks, (cfg,), backend=backend, timeout_s=args.timeout)[0]
        print("fsdp-shim bench: peak memory run", file=sys.stderr)
        result["peak_extra_bytes"] = run_on_ranks(memory_on_rank, args.ranks, (cfg,), backend=backend,
                                                  timeout_s=max(1.0, deadline - time.monotonic()))[0]
    except RankError as exc:
        print(f"FAILED to run: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"fsdp-shim bench: {_environment_line(args.ranks, args.device)}")
    print(f"model: {cfg.layers} layers, width {cfg.width}, {_format_bytes(result['model_bytes']).strip()} fp32; "
          f"{cfg.reps} reps after {cfg.warmup} warm-up, contenders interleaved\n")
    print(f"{'contender':<22}{'median ms':>11}{'IQR ms':>9}{'peak extra':>15}{'page faults':>13}")
    for name, ms in result["median_ms"].items():
        iqr, faults = result["iqr_ms"][name], result["median_minor_faults"][name]
        print(f"{name:<22}{ms:>11.1f}{iqr:>9.1f}{_format_bytes(result['peak_extra_bytes'][name]):>15}{faults:>13.0f}")
    print(f"\n{'median of per-rep ratios':<36}value    IQR")
    for label, value in result["ratios"].items():
        print(f"{label:<36}{value:.3f}  {result['ratio_iqr'][label]:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-shim", epilog=EPILOG,
        description="FSDP1's summon_full_params for FSDP2, HSDP and tensor-parallel (DTensor) models.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-shim {_versions.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser, timeout: int) -> None:
        sub.add_argument("--ranks", type=int, default=2, help="processes to spawn (default 2)")
        sub.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                         help="cpu: gloo on the CPU (default); cuda: NCCL, one GPU per rank")
        sub.add_argument("--timeout", type=float, default=timeout,
                         help=f"seconds the whole command may take, start-up included, before its ranks "
                              f"are stopped (default {timeout})")

    check = commands.add_parser("check", help="verify the RL call-site patterns on this machine (a toy model)",
                                epilog=EPILOG)
    common(check, 300)
    check.add_argument("--verbose", "-v", action="store_true",
                       help="versions, instrumentations, and each call's route and gather path, in order")
    check.set_defaults(func=cmd_check)

    bench = commands.add_parser("bench", help="time the shim against unshard(), FSDP1 and full_tensor()",
                                epilog=EPILOG)
    common(bench, 1200)
    bench.add_argument("--layers", type=int, default=12, help="transformer blocks, one FSDP unit each (default 12)")
    bench.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    bench.add_argument("--vocab", type=int, default=1000, help="vocabulary size, tied embedding (default 1000)")
    bench.add_argument("--reps", type=int, default=10, help="timed repetitions of every contender (default 10)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    bench.add_argument("--bucket-mb", type=float, nargs="*", default=[], help="extra shim contenders at these caps")
    bench.add_argument("--no-per-unit", action="store_true", help="skip the recurse=False weight-sync loop")
    bench.add_argument("--no-between", action="store_true",
                       help="skip summon between forward and backward (reshard_after_forward=False)")
    bench.add_argument("--no-stream", action="store_true",
                       help="skip iter_full_params (fp32, bf16), full_tensor()+cast and the raw all-gather")
    bench.add_argument("--rank0-only", action="store_true", help="add a rank0_only=True shim contender")
    bench.add_argument("--fsdp1", action=argparse.BooleanOptionalAction, default=True, help="FSDP1 contender")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.set_defaults(func=cmd_bench)

    run = commands.add_parser("run", help="run a program with the patch applied, exactly like python",
                              prefix_chars="\0")
    run.add_argument("program", nargs=argparse.REMAINDER, help="SCRIPT | -m MODULE | -c COMMAND, then ARGS")
    run.set_defaults(func=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after "run" belongs to the program
        from fsdp_shim.run import main as run_main

        return run_main(argv[1:], prog="fsdp-shim run")
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _usage_problem(args)
    if problem is not None:
        parser.exit(2, f"fsdp-shim {args.command}: error: {problem}\n")
    _configure_logging()
    return int(args.func(args))


def _configure_logging() -> None:
    """``FSDP_SHIM_LOG=debug`` (or info, warning) shows the ``fsdp_shim`` logger on stderr."""
    level = os.environ.get("FSDP_SHIM_LOG", "").strip().upper()
    if level:
        logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
        logging.getLogger("fsdp_shim").setLevel(level)

