#!/usr/bin/env python3
"""NCCL's completion contract on one GPU: two processes, real values, all-gathers that land late.

NCCL refuses two ranks on one GPU, so two ranks join a **gloo** group on ``cuda:0``, and all-gathers on CUDA
tensors land as NCCL's do: the output NaN-filled, the values copied in late on a side stream, ``work.wait()``
only making the current stream wait (``LateWire``); a read too early, on another stream or of a reused block shows
as NaN or another bucket's values. Reduce-scatters and all-reduces go through the host in order. Under it, on each
rank: every ``fsdp-shim check`` scenario (exact values); ``CPUOffloadPolicy`` pinned shards overwritten right after
the summon returns; the run-ahead of a rank that receives nothing. Exit status 1 if any failed (2: no CUDA).
``scripts/device_check.sh`` runs it first.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_shim
from fsdp_shim.tools.check import check_on_rank
from fsdp_shim.tools.launch import run_on_ranks
from fsdp_shim.tools.models import LMConfig, build_lm, shard_lm

_LATE_CYCLES = 2_000_000  # ~1 ms at the H200's clock: every all-gather lands after its post returns


class _Landing(dist.distributed_c10d.Work):
    """NCCL's work: ``wait()`` orders the current stream after the landing, at once (a ``Work``: FSDP2 waits on one)."""

    def __init__(self, event: torch.cuda.Event) -> None:
        super().__init__()
        self.event = event

    def wait(self, timeout: Any = None) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


class LateWire:
    """Wraps ``torch.distributed``'s collectives for CUDA tensors; records landings in flight at each post."""

    def __init__(self) -> None:
        self.side = torch.cuda.Stream()
        self.kept: list[tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]] = []  # as NCCL's work stashes
        self.in_flight: list[int] = []
        self.cycles = _LATE_CYCLES
        self.originals: dict[str, Any] = {}

    def __enter__(self) -> LateWire:
        late = ("all_gather_into_tensor", "all_gather_single")
        for name in (*late, "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast"):
            if hasattr(dist, name):
                self._wrap(name, self._late if name in late else self._via_host)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        for name, original in self.originals.items():
            setattr(dist, name, original)
        self.kept.clear()

    def _wrap(self, name: str, how: Any) -> None:
        original = self.originals[name] = getattr(dist, name)
        signature = inspect.signature(original)
        setattr(dist, name, lambda *a, **k: how(original, signature.bind(*a, **k)))

    def _late(self, original: Any, bound: inspect.BoundArguments) -> Any:
        out_name, in_name = list(bound.signature.parameters)[:2]
        output, input_ = bound.arguments[out_name], bound.arguments[in_name]
        if not output.is_cuda:
            return original(*bound.args, **bound.kwargs)
        async_op = bound.arguments.pop("async_op", False)
        host_out = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        bound.arguments[out_name], bound.arguments[in_name] = host_out, input_.cpu()  # .cpu(): after its producer
        original(*bound.args, **bound.kwargs)  # the wire
        if output.is_floating_point():
            output.fill_(math.nan)  # what a read before arrival sees
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.cycles)
            output.copy_(host_out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.kept = [(e, keep) for e, keep in self.kept if not e.query()]
        self.kept.append((event, (output, host_out)))
        self.in_flight.append(len(self.kept))
        work = _Landing(event)
        if async_op:
            return work
        work.wait()
        return None

    def _via_host(self, original: Any, bound: inspect.BoundArguments) -> Any:
        cuda = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor) and v.is_cuda}
        if not cuda:
            return original(*bound.args, **bound.kwargs)
        async_op = bound.arguments.pop("async_op", False)
        average = bound.arguments.get("op") == dist.ReduceOp.AVG
        if average:
            bound.arguments["op"] = dist.ReduceOp.SUM
        host = {k: v.cpu() for k, v in cuda.items()}
        bound.arguments.update(host)
        original(*bound.args, **bound.kwargs)
        for k, v in cuda.items():
            v.copy_(host[k].div_(dist.get_world_size(bound.arguments.get("group"))) if average else host[k])
        done = torch.cuda.Event()
        done.record()
        return _Landing(done) if async_op else None


def _control() -> str:
    """The wire bites: a read before ``wait()`` sees NaN, one after it the values."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    mine = torch.full((1024,), float(dist.get_rank() + 1), device="cuda")
    out = torch.empty(2048, device="cuda")
    work = gather(out, mine, async_op=True)
    early = out.cpu()
    work.wait()
    late = out.cpu()
    want = torch.cat([torch.full((1024,), 1.0), torch.full((1024,), 2.0)])
    if not (torch.isnan(early).all() and torch.equal(late, want)):
        raise AssertionError(f"early read NaN: {bool(torch.isnan(early).all())}, late exact: {torch.equal(late, want)}")
    return "a read before wait() saw NaN on all 2048 elements, one after it the exact values"


def _offload_write_after_return() -> str:
    """CPUOffloadPolicy: the copy-in from pinned shards has finished when the summon returns."""
    config = LMConfig(vocab=211, width=256, layers=3)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    reference = build_lm(config)
    model = build_lm(config).cuda()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    shards = [p.to_local().detach() for p in model.parameters()]
    assert all(s.device.type == "cpu" and s.is_pinned() for s in shards), "shards not pinned on the host"
    saved = [shard.clone() for shard in shards]
    with FSDP.summon_full_params(model, writeback=False):
        for shard in shards:  # a host write right after the return, as an optimizer step on CPU shards
            shard.fill_(1000.0)
        bad = [n for (n, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True)
               if not torch.equal(p.detach().cpu(), r.detach())]
    for shard, value in zip(shards, saved, strict=True):
        shard.copy_(value)
    if bad:
        raise AssertionError(f"{len(bad)} gathered tensors torn by a host write after the return: {bad[:3]}")
    return f"{len(shards)} params exact after a host write to every pinned shard right after the return"


def _run_ahead(wire: LateWire) -> str:
    """Landings not complete at each all-gather a rank posts, each landing ~20 ms late (a slow wire): a rank
    that receives nothing must block on the one before last ([Note: bounded run-ahead]), not post them all."""
    model = shard_lm(build_lm(LMConfig(vocab=211, width=64, layers=8)).cuda(),
                     init_device_mesh("cuda", (dist.get_world_size(),)))
    counts = {}
    wire.cycles = 40_000_000
    try:
        for label in ("per-unit summon loop", "stream"):
            wire.in_flight.clear()
            if label == "stream":
                for _ in fsdp_shim.iter_full_params(model, rank0_only=True, bucket_mb=0.01):
                    pass
            else:
                for _, unit in fsdp_shim.fsdp_units(model):
                    with FSDP.summon_full_params(unit, writeback=False, rank0_only=True, recurse=False):
                        pass
            torch.cuda.synchronize()
            counts[label] = (max(wire.in_flight, default=0), len(wire.in_flight))
    finally:
        wire.cycles = _LATE_CYCLES
    if dist.get_rank() == 1 and counts["per-unit summon loop"][0] > 2:
        raise AssertionError(f"unbounded: {counts}")
    return ", ".join(f"{label}: at most {m} of {n} all-gathers landing" for label, (m, n) in counts.items())


def _row(name: str, fn: Any) -> tuple[str, bool, str]:
    dist.barrier()
    try:
        return name, True, fn()
    except Exception as exc:  # noqa: BLE001  (reported in the table)
        return name, False, f"{type(exc).__name__}: {exc}"


def on_rank() -> list[tuple[str, bool, str]]:
    torch.cuda.set_device(0)
    with LateWire() as wire:
        rows = [_row("the late wire itself (negative control)", _control)]
        rows += [(f"check: {o.name}", o.ok, o.detail) for o in check_on_rank("cuda")]
        fsdp_shim.patch()
        rows.append(_row("CPUOffloadPolicy copy-in", _offload_write_after_return))
        rows.append(_row("run-ahead of a rank that receives nothing", lambda: _run_ahead(wire)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("device_late: no CUDA device; nothing to emulate on the host", file=sys.stderr)
        return 2
    ranks = run_on_ranks(on_rank, 2, timeout_s=args.timeout)
    failed = 0
    for rank, rows in enumerate(ranks):
        for name, ok, detail in rows:
            failed += not ok
            print(f"late wire, 2 gloo ranks on one GPU, rank {rank}: {name}: {'PASS' if ok else 'FAIL'}: {detail}")
    print(f"device_late: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
