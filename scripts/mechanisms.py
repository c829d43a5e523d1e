#!/usr/bin/env python3
"""A/B each CPU-only mechanism of the gather engine against its removal, interleaved, on 2 gloo ranks.

    python scripts/mechanisms.py                     # 12 x 256 and 12 x 768, 3 runs each
    python scripts/mechanisms.py --widths 768 --runs 1 --reps 9

Mechanisms, each switched off by a patch of this process's modules only:
``recycled`` (the stream's recycled buffers: every request fresh) and
``split`` (direct or packed per bucket by size, against all packed and all
direct). The scratch pool and the summon's early hand-out were measured
the same way and removed in 0.6.0 (docs/gather-engine.md). Workloads: the per-unit ``rank0_only`` summon loop (compose-rl's
weight sync), the whole-model summon, and the fp32 and bf16 streams. Within
a repetition every variant runs once, the order rotating; the figure is the
median over repetitions of variant / baseline (everything on), per run.
Nothing here is asserted: it informs docs/gather-engine.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("baseline", "no_recycled", "all_packed", "all_direct")
WORKLOADS = ("per_unit_rank0", "whole_model", "stream_fp32", "stream_bf16")


@contextlib.contextmanager
def _variant(name: str) -> Iterator[None]:
    from fsdp_shim import _gloo, _host_buffers

    saved = (_host_buffers.RecycledBuffers.take, _gloo.DIRECT_BYTES)
    if name == "no_recycled":
        _host_buffers.RecycledBuffers.take = _host_buffers.FullBuffers.take  # type: ignore[method-assign]
    elif name == "all_packed":
        _gloo.DIRECT_BYTES = 1 << 62
    elif name == "all_direct":
        _gloo.DIRECT_BYTES = 0
    try:
        yield
    finally:
        _host_buffers.RecycledBuffers.take, _gloo.DIRECT_BYTES = saved


def rank_measure(width: int, reps: int) -> dict[str, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import fsdp_shim
    from fsdp_shim._models import LMConfig, build_lm, shard_lm

    model = shard_lm(build_lm(LMConfig(vocab=1000, width=width, layers=12, heads=4)))
    units = [*model.blocks, model]

    def per_unit() -> None:
        for unit in units:
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                pass

    def whole() -> None:
        with FSDP.summon_full_params(model, writeback=False):
            pass

    def stream(dtype: torch.dtype | None) -> Callable[[], None]:
        return lambda: [None for _ in fsdp_shim.iter_full_params(model, dtype=dtype)] and None

    work = {"per_unit_rank0": per_unit, "whole_model": whole, "stream_fp32": stream(None),
            "stream_bf16": stream(torch.bfloat16)}
    times: dict[str, dict[str, list[float]]] = {w: {v: [] for v in VARIANTS} for w in work}
    order = list(VARIANTS)
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        order = order[1:] + order[:1]
        for variant in order:
            with _variant(variant):
                for name, run in work.items():
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    dist.barrier()
                    if rep:
                        times[name][variant].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 768])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    from fsdp_shim._launch import run_on_ranks

    for width in args.widths:
        print(f"\n## 12 x {width}, 2 gloo ranks: median of variant / baseline per run ({args.reps} reps)")
        print("| workload | " + " | ".join(VARIANTS[1:]) + " | baseline ms |")
        print("|---|" + "---|" * len(VARIANTS))
        results = [run_on_ranks(rank_measure, 2, (width, args.reps), timeout_s=1800, on_progress=None)[0]
                   for _ in range(args.runs)]
        for workload in WORKLOADS:
            cells = []
            for variant in VARIANTS[1:]:
                ratios = [statistics.median(b / a for a, b in zip(r[workload]["baseline"], r[workload][variant]))
                          for r in results]
                cells.append(", ".join(f"{x:.2f}" for x in ratios))
            base = ", ".join(f"{statistics.median(r[workload]['baseline']) * 1e3:.0f}" for r in results)
            print(f"| {workload} | " + " | ".join(cells) + f" | {base} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
