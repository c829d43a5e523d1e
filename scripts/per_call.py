#!/usr/bin/env python3
"""Per-call cost of one ``recurse=False`` summon: the shim on FSDP2 against FSDP1, as the model grows.

    python scripts/per_call.py                    # 2 ranks, 15 repetitions
    python scripts/per_call.py --ranks 3 --reps 30

The RL weight sync summons one unit at a time, so what a call costs beyond
its transfer must not grow with the rest of the model. Each model here has
tiny blocks (width 8: 872 parameters, 3.4 KiB a unit, so the time is nearly
all overhead), and the same middle block is summoned with
``recurse=False, writeback=False`` and ``rank0_only`` off and on, in:

- 12 units;
- 96 units;
- 12 units and 5,000 more small parameters on the root.

FSDP1 runs the same call on the same architecture (``use_orig_params=True``,
one FSDP unit per block), interleaved with the shim in every repetition. The
report gives median milliseconds and the median of per-repetition ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from fsdp_shim.tools.launch import RankError, run_on_ranks

MODELS = {"12 units": (12, 0), "96 units": (96, 0), "12 units + 5,000 parameters": (12, 5000)}


def _per_call_ms(reps: int) -> list[tuple[str, bool, float, float, float]]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import fsdp_shim
    from fsdp_shim.tools.models import Block, LMConfig, build_lm, shard_lm, wrap_lm_fsdp1

    fsdp_shim.patch()

    def build(layers: int, extra: int) -> nn.Module:
        model = build_lm(LMConfig(vocab=10, width=8, layers=layers, heads=4))
        if extra:
            model.extra = nn.ParameterList(nn.Parameter(torch.full((2,), float(i))) for i in range(extra))
        return model

    rows = []
    for label, (layers, extra) in MODELS.items():
        fsdp2_model = shard_lm(build(layers, extra))
        fsdp1_model = wrap_lm_fsdp1(build(layers, extra), torch.device("cpu"))
        fsdp2_unit = fsdp2_model.blocks[layers // 2]
        fsdp1_unit = fsdp1_model.module.blocks[layers // 2]  # the FSDP1 unit that wraps the block
        assert isinstance(fsdp1_unit, FSDP) and isinstance(fsdp1_unit.module, Block)
        for rank0_only in (False, True):
            times: dict[str, list[float]] = {"shim": [], "fsdp1": []}
            for rep in range(reps + 2):  # two warm-ups
                for name, unit in (("shim", fsdp2_unit), ("fsdp1", fsdp1_unit)):
                    dist.barrier()
                    start = time.perf_counter()
                    with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=rank0_only):
                        pass
                    if rep >= 2:
                        times[name].append(time.perf_counter() - start)
            ratio = statistics.median(a / b for a, b in zip(times["shim"], times["fsdp1"]))
            rows.append((label, rank0_only, statistics.median(times["shim"]) * 1e3,
                         statistics.median(times["fsdp1"]) * 1e3, ratio))
        del fsdp1_model, fsdp2_model
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions (default 15)")
    args = parser.parse_args(argv)
    try:
        rows = run_on_ranks(_per_call_ms, args.ranks, (args.reps,), timeout_s=900)[0]
    except RankError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"{'model':<30}{'rank0_only':>11}{'shim ms':>9}{'FSDP1 ms':>10}{'shim/FSDP1':>12}")
    for label, rank0_only, shim_ms, fsdp1_ms, ratio in rows:
        print(f"{label:<30}{rank0_only!s:>11}{shim_ms:>9.2f}{fsdp1_ms:>10.2f}{ratio:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
