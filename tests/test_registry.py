"""``_registry``: live contexts and the process groups they claim, per thread (no process group is
needed: claims key groups by identity, and a context is anything with its three fields); group health
(out of step, destroyed) on real groups."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp_shim import _registry as registry


@dataclass(eq=False)
class _Record:
    full: torch.Tensor | None
    sharded: torch.Tensor
    slots: list[tuple[nn.Module, str]]
    is_buffer: bool = False


@dataclass(eq=False)
class _Context:
    thread: int
    writeback: bool = False
    summoned: list[_Record] = field(default_factory=list)


def _claims_in_another_thread(group: object) -> str | None:
    """What claiming ``group`` in a new thread raises (None: claimed, and given back)."""
    said: list[str | None] = []

    def claim() -> None:
        owner = object()
        try:
            registry.claim(owner, registry.current_thread(), [group], lambda: "the call")  # type: ignore[list-item]
        except RuntimeError as error:
            said.append(str(error))
        else:
            said.append(None)
        finally:
            registry.release(owner)

    thread = threading.Thread(target=claim)
    thread.start()
    thread.join()
    return said[0]


def test_claims_are_per_thread_and_per_owner():
    group_a, group_b = object(), object()
    me = registry.current_thread()
    outer, nested = object(), object()
    registry.claim(outer, me, [group_a], lambda: "outer", context=True)  # type: ignore[list-item]
    registry.claim(nested, me, [group_a, group_b], lambda: "nested", context=True)  # type: ignore[list-item]
    refused = _claims_in_another_thread(group_b)
    assert refused is not None and refused.startswith("the call refused: another thread"), refused
    assert set(registry._claims) == {id(outer), id(nested)}  # the refused claim took nothing
    registry.release(nested)
    registry.release(nested)  # a second release (an interrupted exit's second pass) gives back nothing more
    assert registry.has_live_context(me)
    assert _claims_in_another_thread(group_b) is None  # only the outer claim is left: group_a
    assert _claims_in_another_thread(group_a) is not None
    registry.claim(outer, me, [group_b], lambda: "with_grads' other mesh")  # type: ignore[list-item]  # adds
    assert _claims_in_another_thread(group_b) is not None
    registry.release(outer)
    assert not registry.has_live_context(me)
    assert _claims_in_another_thread(group_a) is None  # free again once every claim is given back
    assert registry._claims == {}


def test_a_registered_context_answers_for_its_slots_and_full_parameters_until_forgotten():
    module = nn.Linear(2, 2)
    full = nn.Parameter(torch.ones(2, 2))
    record = _Record(full, module.weight, [(module, "weight")])
    holder = _Context(registry.current_thread(), summoned=[record])
    keeps_nothing = _Context(registry.current_thread(), summoned=[_Record(None, module.bias, [(module, "bias")])])
    registry.register(holder)
    registry.register(keeps_nothing)
    try:
        assert registry.has_live_slots()
        assert registry.owner_of((id(module), "weight")) is holder
        assert registry.owner_of((id(module), "bias")) is keeps_nothing  # every rank alike, holder or not
        assert registry.summoned_at((id(module), "weight")) is record
        assert registry.record_of(full) is record
        assert registry.record_of(torch.ones(2, 2)) is None  # equal values, another object
        assert set(registry.slots_of_thread(holder.thread)) == {(id(module), "weight"), (id(module), "bias")}
        assert registry.slots_of_thread(holder.thread + 1) == {}
    finally:
        registry.forget(holder)
        registry.forget(keeps_nothing)
    assert not registry.has_live_slots() and registry.owner_of((id(module), "weight")) is None


def rank_group_health_on_real_groups():
    """``require_live_groups`` passes a live group; refuses a destroyed one and one marked out of step, each
    with its own typed error, naming the user and (out of step) what the failed wait raised; a part-way mark
    says so; the failed collective's buffers are held for as long as the group lives."""
    import pytest
    import torch.distributed as dist

    from fsdp_shim import DestroyedGroupError, GroupOutOfStepError

    ranks = list(range(dist.get_world_size()))
    live, marked, part_way, destroyed = (dist.new_group(ranks) for _ in range(4))
    registry.require_live_groups([live, marked, part_way, destroyed], lambda: "x")
    buffer = torch.ones(3)
    registry.mark_out_of_step(marked, TimeoutError("the wait timed out\nsecond line"), [buffer])
    registry.mark_part_way([part_way], MemoryError("out of memory"))
    dist.destroy_process_group(destroyed)
    registry.require_live_groups([live], lambda: "x")
    with pytest.raises(GroupOutOfStepError, match=r"cannot gather the model: .*\(TimeoutError: the wait timed out\)"):
        registry.require_live_groups([live, marked], lambda: "the model")
    with pytest.raises(GroupOutOfStepError, match="this rank left a gather part way on MemoryError: out of memory"):
        registry.require_live_groups([part_way], lambda: "the model")
    with pytest.raises(DestroyedGroupError, match="cannot gather the model: its device mesh uses a process group"):
        registry.require_live_groups([destroyed], lambda: "the model")
    assert registry._out_of_step[marked][1] == [buffer]  # never freed under a late peer
    return dist.get_rank()


def test_group_health_on_real_groups(dist_run):
    assert dist_run(2, rank_group_health_on_real_groups) == [0, 1]
