"""The ``fsdp-shim`` command: ``check``, ``bench`` and ``run``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
import wrapt

import fsdp_shim
from fsdp_shim import _versions


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _environment_line(ranks: int, device: str) -> str:
    return (
        f"torch {torch.__version__}, wrapt {getattr(wrapt, '__version__', '?')}, fsdp_shim {fsdp_shim.__version__}; "
        f"{ranks} ranks, {_backend(device)} on {device}"
    )


def cmd_check(args: argparse.Namespace) -> int:
    from fsdp_shim._check import check_on_rank  # noqa: PLC0415
    from fsdp_shim._launch import RankError, run_on_ranks  # noqa: PLC0415

    print(f"fsdp-shim check: {_environment_line(args.ranks, args.device)}")
    if args.verbose:
        verified = "verified" if _versions.is_verified_torch(torch.__version__) else (
            "supported, not itself verified" if _versions.is_supported_torch(torch.__version__) else "UNSUPPORTED")
        print(f"  supported: {', '.join(_versions.INSTRUMENTS)}; torch {torch.__version__} is {verified}")
        print(f"  patched: {fsdp_shim.is_patched()}")
        if fsdp_shim.unsupported_reason is None:
            from fsdp_shim._instrumentation import statuses  # noqa: PLC0415

            for module, status in statuses().items():
                print(f"  instrumentation {module}: {status}")
    try:
        per_rank = run_on_ranks(check_on_rank, args.ranks, (args.device,), backend=_backend(args.device),
                                timeout_s=args.timeout)
    except RankError as exc:
        print(f"FAILED to run: {exc}")
        return 2
    width = max(len(o.name) for o in per_rank[0]) + 2
    print(f"\n{'scenario':<{width}}{'result':<8}{'ms':>9}  detail")
    failures = 0
    for index, outcome in enumerate(per_rank[0]):
        ranks_ok = all(r[index].ok for r in per_rank)
        failures += not ranks_ok
        detail = outcome.detail if outcome.ok else next(r[index].detail for r in per_rank if not r[index].ok)
        print(f"{outcome.name:<{width}}{'PASS' if ranks_ok else 'FAIL':<8}{outcome.ms:>9.1f}  {detail}")
        if args.verbose:
            for line in outcome.paths:
                print(f"{'':<{width}}  path: {line}")
    total = len(per_rank[0])
    print(f"\n{total - failures} passed, {failures} failed")
    return 1 if failures else 0


def _format_bytes(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def cmd_bench(args: argparse.Namespace) -> int:
    from fsdp_shim._bench import BenchConfig, memory_on_rank, time_on_rank  # noqa: PLC0415
    from fsdp_shim._launch import run_on_ranks  # noqa: PLC0415

    cfg = BenchConfig(
        layers=args.layers, width=args.width, vocab=args.vocab, reps=args.reps, warmup=args.warmup,
        device=args.device, bucket_mb=tuple(args.bucket_mb), per_unit=not args.no_per_unit,
        rank0_only=args.rank0_only, fsdp1=args.fsdp1, between=not args.no_between,
    )
    backend = _backend(args.device)
    result = run_on_ranks(time_on_rank, args.ranks, (cfg,), backend=backend, timeout_s=args.timeout)[0]
    print("fsdp-shim bench: peak memory run", file=sys.stderr)
    result["peak_extra_bytes"] = run_on_ranks(memory_on_rank, args.ranks, (cfg,), backend=backend,
                                              timeout_s=args.timeout)[0]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"fsdp-shim bench: {_environment_line(args.ranks, args.device)}")
    print(f"model: {cfg.layers} layers, width {cfg.width}, {_format_bytes(result['model_bytes']).strip()} fp32; "
          f"{cfg.reps} reps after {cfg.warmup} warm-up, contenders interleaved\n")
    print(f"{'contender':<22}{'median ms':>11}{'peak extra':>15}")
    for name, ms in result["median_ms"].items():
        print(f"{name:<22}{ms:>11.1f}{_format_bytes(result['peak_extra_bytes'][name]):>15}")
    print(f"\n{'median of per-rep ratios':<36}value")
    for label, value in result["ratios"].items():
        print(f"{label:<36}{value:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-shim", description=fsdp_shim.__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser, timeout: int) -> None:
        sub.add_argument("--ranks", type=int, default=2, help="processes to spawn (default 2)")
        sub.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL")
        sub.add_argument("--timeout", type=float, default=timeout, help="seconds before giving up on the ranks")

    check = commands.add_parser("check", help="verify the RL call-site patterns on this machine")
    common(check, 300)
    check.add_argument("--verbose", "-v", action="store_true", help="versions, backend and each call's path")
    check.set_defaults(func=cmd_check)

    bench = commands.add_parser("bench", help="time the shim against unshard(), FSDP1 and full_tensor()")
    common(bench, 1200)
    bench.add_argument("--layers", type=int, default=12)
    bench.add_argument("--width", type=int, default=256)
    bench.add_argument("--vocab", type=int, default=1000)
    bench.add_argument("--reps", type=int, default=10)
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--bucket-mb", type=float, nargs="*", default=[], help="extra shim contenders at these caps")
    bench.add_argument("--no-per-unit", action="store_true", help="skip the recurse=False weight-sync loop")
    bench.add_argument("--no-between", action="store_true",
                       help="skip summon between forward and backward (reshard_after_forward=False)")
    bench.add_argument("--rank0-only", action="store_true", help="add a rank0_only=True shim contender")
    bench.add_argument("--fsdp1", action=argparse.BooleanOptionalAction, default=True, help="FSDP1 contender")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.set_defaults(func=cmd_bench)

    run = commands.add_parser("run", help="run a program with the patch applied (like python)",
                              prefix_chars="\0")
    run.add_argument("program", nargs=argparse.REMAINDER, help="SCRIPT [ARGS] or -m MODULE [ARGS]")
    run.set_defaults(func=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after "run" belongs to the program
        from fsdp_shim.run import main as run_main  # noqa: PLC0415

        run_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    return int(args.func(args))
