#!/usr/bin/env python3
"""Run summons and streams in a loop on local gloo ranks, to catch crashes that a test run is too short for.

    python scripts/stress.py                       # every mode, 60 s each, 2 ranks, width 256
    python scripts/stress.py --seconds 80 summon_all stream_all
    python scripts/stress.py --seconds 120 faults  # random faults; shards checked against a twin each round
    python scripts/stress.py --repeat 10 --malloc alternate summon_all per_unit_rank0 \
        stream_all stream_rank0 unshard fsdp1      # each bench contender alone, under glibc's checks

Each mode runs in fresh ranks and prints how many rounds every rank finished, or how it failed. ``unshard``
(FSDP2's ``unshard()``/``reshard()``) and ``fsdp1`` (FSDP1's own summon) run the loop without the shim's gather,
to pin an abort on a contender. ``faults`` checks [Note: faults] in ``fsdp_shim/_summon.py`` with the tests'
harness (``tests/_faults.py``): each round, on a fresh group with a 2 s timeout, a summon (writeback on or off)
with a random edit or fault (an all-gather raising on one rank or both; a peer that never enters), then every
shard compared bit for bit with an unsharded twin's rows. Exit status 1 if any mode failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from unittest import mock

from fsdp_shim.tools.launch import RankError, run_on_ranks

MODES = ["summon_all", "summon_rank0", "per_unit_all", "per_unit_rank0", "stream_all", "stream_rank0", "unshard",
         "fsdp1", "faults"]
MALLOC_DEBUG = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
TESTS = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests")


def _fault_rounds(width: int, seconds: float) -> tuple[int, int, int]:
    """Rounds, faults injected and shard mismatches of the ``faults`` mode (see the module docstring)."""
    import copy
    import random

    import torch
    import torch.distributed as dist

    import fsdp_shim
    from fsdp_shim.tools.models import LMConfig, build_lm, shard_lm

    sys.path.insert(0, TESTS)
    from _faults import InjectedFault, inject, short_timeout_mesh

    twin = build_lm(LMConfig(vocab=97, width=width, layers=3, heads=4))
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = {"faults": 0, "mismatches": 0}

    def one_round(rounds: int) -> None:
        draw = random.Random(rounds)  # the same draw on every rank
        fault = draw.choice(["none", "stall", "all_gather"])
        where = draw.choice(["rank 0", "rank 1", "every rank"])
        faulty = where == "every rank" or int(where[-1]) == rank
        writeback = draw.random() < 0.5
        after = draw.randrange(4)
        mesh = short_timeout_mesh(2.0)
        model = shard_lm(copy.deepcopy(twin), mesh)
        if fault == "none":
            name, param = draw.choice(list(twin.named_parameters()))
            factor = draw.choice([0.5, 2.0, -1.0])
            with fsdp_shim.summon_full_params(model, writeback=writeback, bucket_mb=0.002):
                with torch.no_grad():
                    model.get_parameter(name).mul_(factor)
            if writeback:
                with torch.no_grad():
                    param.mul_(factor)
        elif fault == "stall":
            counts["faults"] += 1
            if not faulty or where == "every rank":  # else this rank never enters; the other one times out
                with contextlib.suppress(RuntimeError), fsdp_shim.summon_full_params(model, writeback=writeback):
                    pass
        else:
            counts["faults"] += faulty
            with contextlib.suppress(InjectedFault, RuntimeError), inject(fault, after=after if faulty else 10**9):
                with fsdp_shim.summon_full_params(model, writeback=writeback, bucket_mb=0.002):
                    pass
        for (name, param), (_, want) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
            mine = torch.chunk(want.detach(), world, dim=0)
            rows = mine[rank] if rank < len(mine) else want.detach()[:0]
            local = param._local_tensor
            if not torch.equal(local[: rows.shape[0]], rows):
                counts["mismatches"] += 1
                print(f"rank {rank} round {rounds}: {name} differs ({fault}, {where}, wb={writeback})",
                      file=sys.stderr, flush=True)

    return _each_round(seconds, one_round), counts["faults"], counts["mismatches"]


def _each_round(seconds: float, one_round: Callable[[int], None]) -> int:
    """``one_round(n)`` for n = 0, 1, ... until rank 0 has run ``seconds``: every rank stops after the same one."""
    import torch
    import torch.distributed as dist

    end, rounds = time.monotonic() + seconds, 0
    while True:
        go = torch.tensor([int(time.monotonic() < end)])
        dist.broadcast(go, 0)
        if not go.item():
            return rounds
        one_round(rounds)
        rounds += 1


def _rounds(mode: str, width: int, seconds: float) -> int:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import fsdp_shim
    from fsdp_shim.tools.models import LMConfig, build_lm, shard_lm, wrap_lm_fsdp1

    if mode == "faults":
        return _fault_rounds(width, seconds)  # type: ignore[return-value]
    config = LMConfig(vocab=1000, width=width, layers=12, heads=4)
    model = shard_lm(build_lm(config))
    units = [unit for _, unit in fsdp_shim.fsdp_units(model)]
    fsdp1_model = wrap_lm_fsdp1(build_lm(config), torch.device("cpu")) if mode == "fsdp1" else None

    def summon_each(rank0_only: bool, modules: list = units, recurse: bool = False) -> None:
        for module in modules:
            with FSDP.summon_full_params(module, recurse=recurse, writeback=False, rank0_only=rank0_only):
                pass

    def unshard() -> None:
        for unit in units:
            unit.unshard()  # type: ignore[operator]
        for unit in units:
            unit.reshard()  # type: ignore[operator]

    def stream(rank0_only: bool) -> None:
        for dtype in (None, torch.bfloat16):
            for _name, full in fsdp_shim.iter_full_params(model, dtype=dtype, rank0_only=rank0_only):
                del full

    one_round: Callable[[], None] = {
        "summon_all": lambda: summon_each(False, [model], True),
        "summon_rank0": lambda: summon_each(True, [model], True),
        "per_unit_all": lambda: summon_each(False), "per_unit_rank0": lambda: summon_each(True),
        "stream_all": lambda: stream(False), "stream_rank0": lambda: stream(True), "unshard": unshard,
        "fsdp1": lambda: summon_each(False, [fsdp1_model], True),
    }[mode]
    return _each_round(seconds, lambda _: one_round())


def _malloc_env(kind: str, run: int) -> dict[str, str]:
    """glibc's checks for the ranks of one run (see --malloc's help)."""
    if kind == "alternate":
        kind = "debug" if run % 2 == 0 else "perturb"
    return {"debug": {"LD_PRELOAD": MALLOC_DEBUG, "MALLOC_CHECK_": "3"},
            "perturb": {"MALLOC_PERTURB_": str(0x5A + run % 7)}}.get(kind, {})


def _run_mode(mode: str, args: argparse.Namespace, seconds: float, env: dict[str, str]) -> tuple[bool, str]:
    """One run of ``mode`` in fresh ranks with ``env`` set for them: (clean, what to print)."""
    try:
        with mock.patch.dict(os.environ, env):  # the spawned ranks inherit it
            rounds = run_on_ranks(_rounds, args.ranks, (mode, args.width, seconds), on_progress=None,
                                  timeout_s=seconds + 300)
    except RankError as exc:
        return False, f"FAILED\n{exc}"
    if mode == "faults":
        done, injected, bad = rounds[0][0], sum(r[1] for r in rounds), sum(r[2] for r in rounds)
        return not bad, (f"{'clean' if not bad else 'MISMATCHES'}, {done} rounds, {injected} faults injected "
                         f"(summed over ranks: a stall counts on each), {bad} shard mismatches")
    return True, f"clean, {rounds[0]} rounds"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", default=[], metavar="MODE",  # no choices=: 3.11 checks the default
                        help=f"any of {', '.join(MODES)} (default: all)")
    parser.add_argument("--seconds", type=float, default=60.0, help="per run of a mode (default 60)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mode, each in fresh ranks (default 1)")
    parser.add_argument("--malloc", choices=["plain", "debug", "perturb", "alternate"], default="plain",
                        help="glibc's checks in the ranks: debug preloads libc_malloc_debug with MALLOC_CHECK_=3 "
                             "(tcache off), perturb sets MALLOC_PERTURB_ (tcache on), alternate switches each run")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=256, help="hidden size of the 12-layer model (default 256)")
    args = parser.parse_args(argv)
    if set(args.modes) - set(MODES):
        parser.error(f"unknown mode in {args.modes}: the modes are {', '.join(MODES)}")
    if args.malloc in ("debug", "alternate") and not os.path.exists(MALLOC_DEBUG):
        parser.error(f"--malloc {args.malloc} needs {MALLOC_DEBUG} (glibc 2.34 or later)")
    failed = 0
    summary = []
    for mode in args.modes or MODES:
        aborts, started = 0, time.monotonic()
        for run in range(args.repeat):
            env = _malloc_env(args.malloc, run)
            clean, said = _run_mode(mode, args, args.seconds, env)
            aborts += not clean
            label = " ".join(f"{k}={v}" for k, v in env.items()) or "plain malloc"
            print(f"{mode} [{run + 1}/{args.repeat}, {label}]: {said}", flush=True)
        failed += aborts > 0
        summary.append((mode, args.repeat, aborts, (time.monotonic() - started) / 60))
    if args.repeat > 1:
        print("\nmode              runs  aborts  minutes")
        for mode, runs, aborts, minutes in summary:
            print(f"{mode:<16} {runs:>5} {aborts:>7} {minutes:>8.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
