"""The weight sync's two-group shape (``tests/test_weight_sync.py``) on any backend: 3 ranks, one GPU each.

Ranks 0 and 1 train with FSDP2 (and FSDP1, for the reference); rank 2 is the
engine, on a model-update group {0, 2}. compose-rl's per-unit loop and
``iter_full_params`` both run, every bucket all-gathered, and rank 2 checks
what it received against FSDP1's sends and the unsharded model. On NCCL this
is the shape TRL and open-instruct reported deadlocks in; every group has a
timeout, so a hang ends in an error.

    python scripts/two_groups.py --device cuda     # needs 3 GPUs (and pytest: the shape is the tests')
    python scripts/two_groups.py                   # gloo on the CPU, as the tests
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    sys.path[:0] = [str(TESTS), str(TESTS / "stand_ins")]  # the spawned ranks inherit it
    import torch  # noqa: PLC0415

    if args.device == "cuda" and torch.cuda.device_count() < 3:
        print(f"two_groups: skipped, {torch.cuda.device_count()} GPU(s) visible, 3 needed")
        return 0
    import test_weight_sync as shape  # noqa: PLC0415

    from fsdp_shim.tools.launch import RankPool  # noqa: PLC0415

    backend = "nccl" if args.device == "cuda" else "gloo"
    cases = [
        (f"compose-rl loop, {layout}, {tie}", shape.rank_engine_receives_what_fsdp1_sends, (layout, tie == "tied"))
        for layout in ("ppo", "grpo") for tie in ("untied", "tied")
    ] + [
        (f"iter_full_params, {dtype or 'fp32'}", shape.rank_stream_to_the_engine,
         (getattr(torch, dtype) if dtype else None,))
        for dtype in (None, "bfloat16")
    ]
    failed = 0
    with RankPool(3, backend=backend, timeout_s=args.timeout) as pool:
        for label, function, case_args in cases:
            started = time.monotonic()
            try:
                pool.run(function, *case_args)
                print(f"ok    {label} ({time.monotonic() - started:.1f} s)")
            except Exception as error:  # noqa: BLE001  (reported; the next case runs while the pool lives)
                failed += 1
                print(f"FAIL  {label}: {error}")
                if not pool.alive:
                    break
    print(f"two_groups on {backend}: {len(cases) - failed} of {len(cases)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
