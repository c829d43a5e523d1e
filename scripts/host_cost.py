#!/usr/bin/env python3
"""Host cost per call, where NCCL users pay it: torch's ``fake`` process group, one process, any world size.

    python scripts/host_cost.py                          # W = 8, 64, 1024 and HSDP 8 x 128; both models
    python scripts/host_cost.py --world 8 --models units96 --reps 15
    python scripts/host_cost.py --runs 3                 # each configuration in 3 fresh processes
    python scripts/host_cost.py --device cuda --world 1  # on a GPU: the same contenders, one real rank

On NCCL a small unit's all-gather costs tens of microseconds, so a per-unit
weight-sync loop is decided by host cost: Python, allocations, copies. The
``fake`` backend's collectives return at once without moving data, so what
this times is that host cost, at any world size, on the CPU (the shim takes
its all-gather path there, as on NCCL). Each configuration runs in a fresh
process (``--runs N``: N processes, and the ratio is the median of their
medians). Contenders are interleaved within each repetition, in a new
shuffled order each time (seeded: every run shuffles alike), so that no
contender keeps the same predecessor: a contender's cost depends on the
allocator state the one before it leaves. (Until 0.7.1 the order rotated,
which keeps every predecessor: the per-unit summon always ran right after
the ``full_tensor()`` loop, and ``unshard()`` after the ``rank0_only``
summon.) Each timed pass follows an untimed one of the same contender, so
that what is timed is that contender's own steady state. With the default
11 repetitions a run's median ratio moves by about +-0.05 on a small
machine; with ``--reps 21``, by about +-0.03 (0.7.1's table in ``docs/host-cost.md``
ran ``--runs 3 --reps 21``). The table gives the median ms per unit, each contender's ratio to
FSDP2's own ``unshard()``/``reshard()`` loop (median of per-repetition
ratios, with the first run's IQR, and each run's median), and Python calls
per unit (cProfile, one pass).

Contenders: the shim's per-unit ``summon_full_params(unit, recurse=False,
writeback=False)`` loop with ``rank0_only`` off and on; FSDP2's
``unshard()``+``reshard()`` loop; one whole-model summon; ``iter_full_params``
in fp32 and bf16; one ``full_tensor()`` per parameter.
Models: ``bench`` (``fsdp-shim bench``'s: 12 blocks of width 256, tied
1000-token embedding, 13 units) and ``units96`` (96 units of
``Linear(64, 64)`` + ``LayerNorm(64)``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

#: The fake backend cannot be wrapped by TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprint checks (its
#: wrapper needs a real store), and a wrapper would time its own work: each measuring process runs without.
_FAKE_ENV = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}

CONTENDERS = ("summon_unit", "summon_unit_rank0", "unshard", "summon_model", "stream_fp32", "stream_bf16",
              "full_tensor_loop")


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 4:
        m = statistics.median(values)
        return min(values), m, max(values)
    q1, m, q3 = statistics.quantiles(values, n=4)
    return q1, m, q3


def _one(world: str, model_name: str, reps: int, device: str) -> dict:
    """Run in a fresh process: one world size (``W`` or ``RxS`` for HSDP) and one model."""
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    import fsdp_shim
    from fsdp_shim.tools.models import LMConfig, build_lm

    dims = tuple(int(d) for d in world.split("x"))
    size = 1
    for d in dims:
        size *= d
    if device == "cpu":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    else:  # one real rank on an accelerator: the shim's own overhead, no collective to speak of
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
        torch.cuda.set_device(0)
    names = ("replicate", "shard") if len(dims) == 2 else None
    mesh = init_device_mesh(device, dims, mesh_dim_names=names)
    if model_name == "bench":
        model = build_lm(LMConfig(vocab=1000, width=256, layers=12, heads=4)).to(device)
        units = [*model.blocks, model]
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(96)]).to(device)
        units = [*model, model]
        for unit in model:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def summon_unit(rank0_only: bool) -> None:
        for unit in units:
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=rank0_only):
                pass

    def unshard() -> None:
        for unit in units:
            unit.unshard()
            unit.reshard()

    def summon_model() -> None:
        with FSDP.summon_full_params(model, writeback=False):
            pass

    def stream(dtype) -> None:
        for _ in fsdp_shim.iter_full_params(model, dtype=dtype):
            pass

    def full_tensor_loop() -> None:
        for p in model.parameters():
            p.full_tensor()

    runs = {
        "summon_unit": lambda: summon_unit(False),
        "summon_unit_rank0": lambda: summon_unit(True),
        "unshard": unshard,
        "summon_model": summon_model,
        "stream_fp32": lambda: stream(None),
        "stream_bf16": lambda: stream(torch.bfloat16),
        "full_tensor_loop": full_tensor_loop,
    }
    for run in runs.values():  # warm-up: lazy init, caches, allocator
        run()
        run()
    calls = {}
    for name, run in runs.items():
        profile = cProfile.Profile()
        profile.enable()
        run()
        profile.disable()
        calls[name] = pstats.Stats(profile).total_calls / len(units)  # type: ignore[attr-defined]
    samples: dict[str, list[float]] = {name: [] for name in runs}
    shuffle = random.Random(0)
    for rep in range(reps):
        order = shuffle.sample(list(runs), len(runs))  # a rotation would keep each one's predecessor
        for name in order:
            runs[name]()  # untimed: what the last contender left in the allocator is not this one's cost
            sync()
            start = time.perf_counter()
            runs[name]()
            sync()
            samples[name].append((time.perf_counter() - start) * 1e3 / len(units))
    ratios = {name: [s / u for s, u in zip(samples[name], samples["unshard"])] for name in runs}
    dist.destroy_process_group()
    return {
        "world": world, "model": model_name, "units": len(units), "device": device, "torch": torch.__version__,
        "median_ms_per_unit": {n: statistics.median(v) for n, v in samples.items()},
        "ratio_to_unshard": {n: _quantiles(v) for n, v in ratios.items()},
        "python_calls_per_unit": calls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", nargs="+", default=["8", "64", "1024", "8x128"],
                        help="world sizes; RxS is HSDP with R replicas of S shards (default: 8 64 1024 8x128)")
    parser.add_argument("--models", nargs="+", default=["bench", "units96"], choices=["bench", "units96"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--runs", type=int, default=1,
                        help="fresh processes per configuration; the ratio is the median of their medians")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--one", nargs=2, metavar=("WORLD", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1], args.reps, args.device)))
        return 0
    rows = []
    for model in args.models:
        for world in args.world:
            runs = []
            for _ in range(args.runs):
                proc = subprocess.run([sys.executable, __file__, "--one", world, model, "--reps", str(args.reps),
                                       "--device", args.device], capture_output=True, text=True, env=_FAKE_ENV)
                if proc.returncode != 0:
                    print(f"{model} W={world}: FAILED\n{proc.stderr[-3000:]}", flush=True)
                    return 1
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            rows.extend(runs)
            first = runs[0]
            print(f"\n{model} ({first['units']} units), W={world}, {first['device']}, torch {first['torch']}, "
                  f"{len(runs)} run(s) of {args.reps} repetitions", flush=True)
            print(f"  {'contender':<18} {'ms/unit':>8} {'/ unshard':>10} {'IQR (run 1)':>14} {'runs':>20} "
                  f"{'calls/unit':>11}")
            for name in CONTENDERS:
                medians = [run["ratio_to_unshard"][name][1] for run in runs]
                q1, _, q3 = first["ratio_to_unshard"][name]
                ms = statistics.median(run["median_ms_per_unit"][name] for run in runs)
                each = " ".join(f"{m:.2f}" for m in medians) if len(runs) > 1 else ""
                print(f"  {name:<18} {ms:>8.3f} {statistics.median(medians):>10.2f} {f'{q1:.2f}-{q3:.2f}':>14} "
                      f"{each:>20} {first['python_calls_per_unit'][name]:>11.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
