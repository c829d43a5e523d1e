"""``_registry``: live contexts and the process groups they claim, per thread. Pure data: no process
group is needed (groups are keys by identity), and a context is anything with its three fields."""

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


def test_claims_are_per_thread_and_counted():
    group_a, group_b = object(), object()
    me = registry.current_thread()
    assert registry.claim(me, [group_a], context=True)
    assert registry.claim(me, [group_a, group_b], context=True)  # nested: the same thread claims again
    other: list[bool] = []
    thread = threading.Thread(target=lambda: other.append(registry.claim(registry.current_thread(), [group_b])))
    thread.start()
    thread.join()
    assert other == [False]  # another thread is refused, and claims nothing
    registry.release([group_a, group_b], me)
    assert registry.has_live_context(me)
    registry.release([group_a], me)
    assert not registry.has_live_context(me)
    thread = threading.Thread(target=lambda: other.append(registry.claim(registry.current_thread(), [group_b])))
    thread.start()
    thread.join()
    assert other == [False, True]  # free again once every claim is given back
    registry.release([group_b])


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
        registry.forget(holder, None)
        registry.forget(keeps_nothing, None)
    assert not registry.has_live_slots() and registry.owner_of((id(module), "weight")) is None
