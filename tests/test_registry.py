"""``_registry``: the live contexts, per thread, and what nesting, routing and the stream look up in them (no
process group is needed: a context is anything with its three fields)."""

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


def test_a_registered_context_answers_for_its_slots_and_full_parameters_until_forgotten():
    module = nn.Linear(2, 2)
    full = nn.Parameter(torch.ones(2, 2))
    record = _Record(full, module.weight, [(module, "weight")])
    holder = _Context(threading.get_ident(), summoned=[record])
    keeps_nothing = _Context(threading.get_ident(), summoned=[_Record(None, module.bias, [(module, "bias")])])
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
