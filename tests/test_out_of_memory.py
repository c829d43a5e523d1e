"""Fail like FSDP1: an out-of-memory error during a summon's entry never costs the process group (issue 58).

FSDP1 allocates a unit's flat parameter before that unit's one all-gather, so
an out-of-memory error there is raised before anything is posted and the
caller's "free some memory, retry" works on the same group. The summon
allocates every buffer its gathers need (each full tensor it keeps, the
buckets' outputs, a non-receiving rank's two cycling buffers) before it posts
anything, then the ranks agree, in one small all-reduce, that every one of
them could: so an allocation failure on every rank alike, or on one rank only,
raises on every rank before any all-gather, and nothing pending can pair with
the next call's gather (see [Note: allocate, agree, gather] in
``fsdp_shim/_gather/engine.py``).

How: a ``TorchFunctionMode`` raises ``torch.OutOfMemoryError`` at the n-th
allocating torch call that fsdp_shim's own code makes during a summon's entry,
for every n a clean entry makes, on every rank alike and, where the ranks
allocate differently (``rank0_only``), on some ranks only. After each: the
faulting rank saw its own error, every shard is bit-identical, nothing was
left marked, and the same process group serves the next summon with exact
values (2 gloo ranks; an unsharded reference from the same seed).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

import fsdp_shim
from _faults import assert_untouched, local_shards, short_timeout_mesh
from _helpers import LMConfig, build_lm, patched, shard_lm
from fsdp_shim import _health

CONFIG = LMConfig(layers=3)
SMALL = 0.002  # MiB: several buckets a unit
OOM: type[BaseException] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

#: Torch calls that allocate (or may: ``.to``/``.clone`` where they copy), as the shim makes them.
_ALLOCATING = {torch.empty, torch.empty_like, torch.zeros_like, torch.tensor, torch.Tensor.new_empty,
               torch.Tensor.clone, torch.Tensor.to}


class _Allocations(TorchFunctionMode):
    """Counts the allocating calls fsdp_shim's own frames make; raises an ``OutOfMemoryError`` at call ``fail``."""

    def __init__(self, fail: int | None = None) -> None:
        super().__init__()
        self.fail, self.calls, self.raised = fail, 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ALLOCATING and sys._getframe(1).f_globals.get("__name__", "").startswith("fsdp_shim."):
            self.calls += 1
            if self.calls == self.fail:
                self.raised = OOM(f"injected: out of memory at allocation {self.calls} ({func.__name__})")
                raise self.raised
        return func(*args, **(kwargs or {}))


def _calls(model) -> dict[str, Callable[[], Any]]:
    unit = model.blocks[1]
    return {
        "per_unit": lambda: FSDP.summon_full_params(unit, recurse=False, writeback=False),
        "per_unit_rank0_only": lambda: FSDP.summon_full_params(unit, recurse=False, writeback=False,
                                                               rank0_only=True),
        "model_in_buckets_writeback": lambda: fsdp_shim.summon_full_params(model, writeback=True, bucket_mb=SMALL),
        "model_offload_rank0_only": lambda: FSDP.summon_full_params(model, writeback=False, rank0_only=True,
                                                                    offload_to_cpu=True),
        # gradients on rank 0 only: FSDP1's zeros are made on the others, after the gradients' agreement
        "with_grads_on_one_rank": lambda: FSDP.summon_full_params(model, writeback=False, with_grads=True),
    }


def _enter(call: Callable[[], Any], mode: _Allocations) -> tuple[Any, BaseException | None]:
    """Enter the context with ``mode`` on; the context (None if entry raised) and what entry raised."""
    context = call()
    try:
        with mode:
            context.__enter__()
    except BaseException as error:  # noqa: BLE001  # the injected OOM, or a peer's
        return None, error
    return context, None


def _exact_inside(model, ref, call: Callable[[], Any], rank0_only: bool) -> None:
    """The summon's full parameters equal the reference's, bit for bit (where this rank holds them)."""
    with call():
        if not rank0_only or dist.get_rank() == 0:
            for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                if not isinstance(p, DTensor):
                    assert torch.equal(p, r), name


def rank_an_out_of_memory_error_at_any_allocation_leaves_the_group_usable(which: str) -> dict[str, Any]:
    mesh = short_timeout_mesh(10.0)  # a case that left the ranks out of step ends in seconds, not minutes
    ref = build_lm(CONFIG)
    model = shard_lm(build_lm(CONFIG), mesh)
    rank0_only = "rank0_only" in which
    call = _calls(model)[which]
    if which == "with_grads_on_one_rank" and dist.get_rank() == 0:
        for param in model.parameters():
            param.grad = torch.ones_like(param)
    with patched():
        counting = _Allocations()
        context, error = _enter(call, counting)
        assert error is None, error
        context.__exit__(None, None, None)
        counts = [0] * dist.get_world_size()
        dist.all_gather_object(counts, counting.calls)
        before = local_shards(model)
        peer_errors: list[str] = []
        for n in range(1, max(counts) + 1):  # past a rank's own count, that rank allocates without a fault
            mode = _Allocations(fail=n)
            context, error = _enter(call, mode)
            if mode.raised is not None:
                assert error is mode.raised, f"allocation {n}: the caller saw {error!r}, not its own error"
            elif error is not None:  # a peer's failure, agreed before any all-gather: the same kind of error
                assert isinstance(error, OOM), f"allocation {n}: {error!r}"
                peer_errors.append(str(error))
            if context is not None:  # every value arrived: exact, then nothing written back
                try:
                    if not rank0_only or dist.get_rank() == 0:
                        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                            assert isinstance(p, DTensor) or torch.equal(p, r), f"allocation {n}: {name}"
                finally:
                    context.__exit__(None, None, None)
            assert_untouched(model, before)
            assert mesh.get_group() not in _health._out_of_step, f"allocation {n}: the group was marked"
            _exact_inside(model, ref, call, rank0_only)  # the same group serves the next summon, exact
            _exact_inside(model, ref, lambda: FSDP.summon_full_params(model, writeback=False), False)
    return {"counts": counts, "peer_errors": len(peer_errors), "example": peer_errors[:1]}


@pytest.mark.parametrize("which", ["per_unit", "per_unit_rank0_only", "model_in_buckets_writeback",
                                   "model_offload_rank0_only", "with_grads_on_one_rank"])
def test_an_out_of_memory_error_at_any_allocation_leaves_the_group_usable(dist_run, which):
    results = dist_run(2, rank_an_out_of_memory_error_at_any_allocation_leaves_the_group_usable, which)
    counts = results[0]["counts"]
    print(f"\n{which}: allocations per rank {counts}; raised by a peer's failure: "
          f"{[r['peer_errors'] for r in results]} {results[0]['example'] or results[1]['example']}")
    assert min(counts) >= 1 and max(counts) >= 2, counts  # the sweep reaches past the first allocation
    if counts[0] != counts[1]:  # some faults hit one rank only: its peer raised too, before any all-gather
        assert sum(r["peer_errors"] for r in results) > 0, results


def rank_a_one_sided_out_of_memory_error_in_a_per_unit_loop_gives_no_wrong_values() -> list[str]:
    """Issue 58's measurement on 0.16.0: rank 1 ran out of memory at its first allocation in the summon of unit 1,
    and both ranks went on to unit 2 (the loop's caller caught the error). Rank 0's unit-1 summon *succeeded* with
    wrong ``1.weight`` and ``1.bias`` (it had paired with rank 1's unit-2 gather), and rank 1's unit-2 summon
    succeeded with a wrong weight. Now both ranks raise at unit 1, before any all-gather, and unit 2 is exact."""
    mesh = short_timeout_mesh(10.0)
    ref = build_lm(CONFIG)
    model = shard_lm(build_lm(CONFIG), mesh)
    seen = []
    with patched():
        for index, (unit, twin) in enumerate(zip(model.blocks, ref.blocks, strict=True)):
            mode = _Allocations(fail=1 if index == 1 and dist.get_rank() == 1 else None)
            context, error = _enter(lambda u=unit: FSDP.summon_full_params(u, recurse=False, writeback=False), mode)
            if error is not None:
                assert isinstance(error, OOM), error
                seen.append(f"unit {index}: {'its own' if error is mode.raised else 'a peer'} out-of-memory error")
                continue
            try:
                for (name, p), (_, r) in zip(unit.named_parameters(), twin.named_parameters(), strict=True):
                    assert torch.equal(p, r), f"unit {index}: {name} differs from the reference"
            finally:
                context.__exit__(None, None, None)
            seen.append(f"unit {index}: exact")
    return seen


def test_a_one_sided_out_of_memory_error_in_a_per_unit_loop_gives_no_wrong_values(dist_run):
    own, peer = dist_run(2, rank_a_one_sided_out_of_memory_error_in_a_per_unit_loop_gives_no_wrong_values)
    assert own == ["unit 0: exact", "unit 1: a peer out-of-memory error", "unit 2: exact"], own
    assert peer == ["unit 0: exact", "unit 1: its own out-of-memory error", "unit 2: exact"], peer


def rank_the_agreement_reaches_every_rank_of_the_call() -> str:
    """The ranks agree over every dim of every mesh of the call, so a failure anywhere reaches every rank,
    whichever groups each posts on. A 2x2 (dp, tp) mesh, tensor parallel alone, ``rank0_only`` (global rank 0
    receives: the fast-path bucket moves on tp{0,1} only), one weight on the fast path and one (sharded on dim
    1) through ``full_tensor()`` on every tp group. An agreement over the groups each rank posts on left rank 0
    deciding to gather while the others raised (a review of the first version found it)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    rows, cols = torch.randn(8, 6), torch.randn(6, 8)
    module = nn.Module()
    module.rows = nn.Parameter(distribute_tensor(rows, mesh, [Replicate(), Shard(0)]))
    module.cols = nn.Parameter(distribute_tensor(cols, mesh, [Replicate(), Shard(1)]))

    def call():
        return FSDP.summon_full_params(module, writeback=False, rank0_only=True)

    from fsdp_shim._gather import engine

    def fails(*args, **kwargs):  # rank 3 keeps nothing and has nothing to allocate here: its reservation fails
        raise OOM("injected: out of memory in rank 3's reservation")

    reserve = engine.reserve_buffers
    with patched():
        if dist.get_rank() == 3:
            engine.reserve_buffers = fails
        try:
            context, error = _enter(call, _Allocations())
        finally:
            engine.reserve_buffers = reserve
        assert context is None and isinstance(error, OOM), (context, error)
        assert not any(g in _health._out_of_step for g in mesh.get_all_groups())
        with call():
            if dist.get_rank() == 0:
                assert torch.equal(module.rows, rows) and torch.equal(module.cols, cols)
    return "raised, then exact"


def test_the_agreement_reaches_every_rank_of_the_call(dist_run):
    assert dist_run(4, rank_the_agreement_reaches_every_rank_of_the_call) == ["raised, then exact"] * 4
