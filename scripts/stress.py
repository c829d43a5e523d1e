#!/usr/bin/env python3
"""Run summons and streams in a loop on local gloo ranks, to catch crashes that a test run is too short for.

    python scripts/stress.py                       # every mode, 60 s each, 2 ranks, width 256
    python scripts/stress.py --seconds 80 summon_all stream_all
    python scripts/stress.py --width 768 stream_rank0
    python scripts/stress.py --seconds 120 faults  # random faults; shards checked against a twin each round

Each mode runs in fresh ranks for ``--seconds`` and prints how many rounds
every rank finished, or how it failed. This is how the heap corruption behind
the note "no coalesced all-gather" in ``docs/gather-engine.md`` was found and
bisected: a whole-model ``rank0_only=False`` summon loop died ("malloc():
unaligned tcache chunk detected") in 5 of 8 runs of 80 s with gloo's
coalesced all-gather, in 0 of 6 without. A crash that comes once a minute
needs several runs of each mode to rule out. Exit status: 0 if every mode
ran clean, 1 otherwise.

``faults`` checks [Note: faults] in ``fsdp_shim/_swap.py`` the long way: each
round, on a fresh process group (a fault leaves one out of step) with a 2 s
timeout, it shards a copy of an unsharded twin and summons it, on a transport
drawn at random (point to point, all-gather), with ``writeback`` on or off and
either no fault (then a random edit, made on the twin too) or one drawn from:
an exception in a send, a receive or an all-gather, on rank 0, rank 1 or
both, at a random call; a peer that never enters. After every round each
rank compares its local shards, bit for bit, with its rows of the twin. It
prints rounds, faults injected and mismatches (which must be 0). It uses the
tests' fault harness (``tests/_faults.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from fsdp_shim._launch import RankError, run_on_ranks

MODES = ["summon_all", "summon_rank0", "per_unit_all", "stream_all", "stream_rank0", "faults"]
TESTS = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests")


def _fault_rounds(width: int, seconds: float) -> tuple[int, int, int]:
    """Rounds, faults injected and shard mismatches of the ``faults`` mode (see the module docstring)."""
    import copy
    import random

    import torch
    import torch.distributed as dist

    import fsdp_shim
    from fsdp_shim._models import LMConfig, build_lm, shard_lm

    sys.path.insert(0, TESTS)
    from _faults import InjectedFault, inject, short_timeout_mesh, transport

    twin = build_lm(LMConfig(vocab=97, width=width, layers=3, heads=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    end = time.monotonic() + seconds
    rounds = faults = mismatches = 0
    while True:
        go = torch.tensor([int(time.monotonic() < end)])
        dist.broadcast(go, 0)  # every rank stops after the same round
        if not go.item():
            return rounds, faults, mismatches
        draw = random.Random(rounds)  # the same draw on every rank
        how = draw.choice(["auto", "all_gather"])
        fault = draw.choice(["none", "stall", "isend", "irecv", "all_gather"] if how == "auto"
                            else ["none", "stall", "all_gather"])
        where = draw.choice(["rank 0", "rank 1", "every rank"])
        faulty = where == "every rank" or int(where[-1]) == rank
        writeback = draw.random() < 0.5
        after = draw.randrange(4)
        mesh = short_timeout_mesh(2.0)
        model = shard_lm(copy.deepcopy(twin), mesh)
        if fault == "none":
            name, param = draw.choice(list(twin.named_parameters()))
            factor = draw.choice([0.5, 2.0, -1.0])
            with transport(how), fsdp_shim.summon_full_params(model, writeback=writeback, bucket_mb=0.002):
                with torch.no_grad():
                    model.get_parameter(name).mul_(factor)
            if writeback:
                with torch.no_grad():
                    param.mul_(factor)
        elif fault == "stall":
            faults += 1
            if faulty and where != "every rank":
                pass  # this rank never enters; the other one times out
            else:
                try:
                    with transport(how), fsdp_shim.summon_full_params(model, writeback=writeback):
                        pass
                except RuntimeError:
                    pass
        else:
            faults += faulty
            try:
                with transport(how), inject(fault, after=after if faulty else 10**9):
                    with fsdp_shim.summon_full_params(model, writeback=writeback, bucket_mb=0.002):
                        pass
            except (InjectedFault, RuntimeError):
                pass
        for (name, param), (_, want) in zip(model.named_parameters(), twin.named_parameters()):
            mine = torch.chunk(want.detach(), world, dim=0)
            rows = mine[rank] if rank < len(mine) else want.detach()[:0]
            local = param._local_tensor
            if not torch.equal(local[: rows.shape[0]], rows):
                mismatches += 1
                print(f"rank {rank} round {rounds}: {name} differs ({how}, {fault}, {where}, wb={writeback})",
                      file=sys.stderr, flush=True)
        rounds += 1


def _rounds(mode: str, width: int, seconds: float) -> int:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack
    import torch
    import torch.distributed as dist

    import fsdp_shim
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_shim._models import LMConfig, build_lm, shard_lm

    if mode == "faults":
        return _fault_rounds(width, seconds)  # type: ignore[return-value]
    model = shard_lm(build_lm(LMConfig(vocab=1000, width=width, layers=12, heads=4)))
    units = [unit for _, unit in fsdp_shim.fsdp_units(model)]

    def summon(rank0_only: bool) -> None:
        with FSDP.summon_full_params(model, writeback=False, rank0_only=rank0_only):
            pass

    def per_unit() -> None:
        for unit in units:
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=False):
                pass

    def stream(rank0_only: bool) -> None:
        for dtype in (None, torch.bfloat16):
            for _name, full in fsdp_shim.iter_full_params(model, dtype=dtype, rank0_only=rank0_only):
                del full

    one_round: Callable[[], None] = {
        "summon_all": lambda: summon(False),
        "summon_rank0": lambda: summon(True),
        "per_unit_all": per_unit,
        "stream_all": lambda: stream(False),
        "stream_rank0": lambda: stream(True),
    }[mode]
    end = time.monotonic() + seconds
    rounds = 0
    while True:
        go = torch.tensor([int(time.monotonic() < end)])
        dist.broadcast(go, 0)  # every rank stops after the same round
        if not go.item():
            return rounds
        one_round()
        rounds += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", choices=MODES, default=MODES, metavar="MODE",
                        help=f"any of {', '.join(MODES)} (default: all)")
    parser.add_argument("--seconds", type=float, default=60.0, help="per mode (default 60)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256, help="hidden size of the 12-layer model (default 256)")
    args = parser.parse_args(argv)
    failed = 0
    for mode in args.modes:
        try:
            rounds = run_on_ranks(_rounds, args.ranks, (mode, args.width, args.seconds), on_progress=None,
                                  timeout_s=args.seconds + 300)
            if mode == "faults":
                done, injected = rounds[0][0], sum(r[1] for r in rounds)
                bad = sum(r[2] for r in rounds)
                failed += bad > 0
                print(f"faults: {'clean' if not bad else 'MISMATCHES'}, {done} rounds, {injected} faults injected "
                      f"(rank-faults, stalls counted once), {bad} shard mismatches", flush=True)
                continue
            print(f"{mode}: clean, {rounds[0]} rounds", flush=True)
        except RankError as exc:
            failed += 1
            print(f"{mode}: FAILED\n{exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
