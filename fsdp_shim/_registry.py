"""The contexts live on this rank, in every thread, and the lookups nesting, routing and the stream make."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

#: A slot, as contexts claim it: ``(id(module), attribute name)`` (``_scope.slot_key`` makes one).
SlotKey = tuple[int, str]


class Summoned(Protocol):
    """What the registry reads of one record (``_param.SummonedParam``), kept on every rank."""

    @property
    def full(self) -> torch.Tensor | None: ...

    @property
    def sharded(self) -> torch.Tensor: ...

    @property
    def slots(self) -> list[tuple[nn.Module, str]]: ...

    @property
    def is_buffer(self) -> bool: ...


class LiveContext(Protocol):
    """What the registry reads of one live context (``_summon.DTensorSummon``). Lookups derive their maps on
    first ask: registering costs one dict entry."""

    @property
    def thread(self) -> int: ...

    @property
    def call(self) -> Call: ...

    @property
    def summoned(self) -> Sequence[Summoned]: ...


class Call(Protocol):
    """What the registry's readers need of a live context's arguments (``_summon.SummonCall``)."""

    @property
    def writeback(self) -> bool: ...

    @property
    def rank0_only(self) -> bool: ...


@dataclass(eq=False, slots=True)
class _Registered:
    """A registered context, and the maps lookups derived from its records."""

    context: LiveContext
    slot_keys: set[SlotKey] | None = None
    fulls: dict[int, Summoned] | None = None
    tensors: dict[int, Summoned] | None = None

    def keys(self) -> set[SlotKey]:
        """The slots its records were swapped into."""
        if self.slot_keys is None:
            self.slot_keys = {(id(module), name) for record in self.context.summoned for module, name in record.slots}
        return self.slot_keys

    def full_record(self, param: torch.Tensor) -> Summoned | None:
        """The record whose full parameter is ``param`` itself (buffers are not parameters)."""
        if self.fulls is None:
            self.fulls = {id(r.full): r for r in self.context.summoned if r.full is not None and not r.is_buffer}
        record = self.fulls.get(id(param))
        return record if record is not None and record.full is param else None

    def tensor_record(self, tensor: object) -> Summoned | None:
        """The record whose full tensor or sharded DTensor is ``tensor`` itself."""
        if self.tensors is None:
            self.tensors = {id(r.sharded): r for r in self.context.summoned}
            self.tensors.update((id(r.full), r) for r in self.context.summoned if r.full is not None)
        record = self.tensors.get(id(tensor))
        return record if record is not None and (record.full is tensor or record.sharded is tensor) else None


#: ``id(context)`` -> each live context (any thread) whose slots hold its full tensors, in entry order.
_live: dict[int, _Registered] = {}


def slots_of_thread(thread: int) -> dict[SlotKey, LiveContext]:
    """The slots this thread's live contexts swapped (what a nested call leaves alone)."""
    registered = list(_live.values())
    return {key: r.context for r in registered if r.context.thread == thread for key in r.keys()}


def has_live_slots() -> bool:
    """Whether any thread has a context open that swapped a slot."""
    return bool(_live)


def owner_of(key: SlotKey) -> LiveContext | None:
    """The live context that summoned slot ``key``, if any (on every rank alike)."""
    for registered in list(_live.values()):
        if key in registered.keys():
            return registered.context
    return None


def summoned_at(key: SlotKey, value: object = None) -> Summoned | None:
    """The record summoned into slot ``key``, or whose full or sharded tensor it holds (``value``): alike on
    every rank."""
    if not _live:
        return None
    for registered in list(_live.values()):
        if key in registered.keys():
            for record in registered.context.summoned:
                if any((id(m), n) == key for m, n in record.slots):
                    return record
    held = holding(value)
    return None if held is None else held[1]


def holding(tensor: object) -> tuple[LiveContext, Summoned] | None:
    """The live context and record whose full tensor or sharded DTensor is ``tensor`` itself. A tie made inside
    (``side.weight = blocks[0].fc2.weight``) puts the full parameter in an unswapped slot on a holder, the shard
    elsewhere: both stand for one record, so routing, scope and the stream read the record, never the type."""
    if not _live or tensor is None:
        return None
    for registered in list(_live.values()):
        record = registered.tensor_record(tensor)
        if record is not None:
            return registered.context, record
    return None


def register(context: LiveContext) -> None:
    """``context`` has gathered and its records are complete; on every rank, holder or not."""
    _live[id(context)] = _Registered(context)


def forget(context: LiveContext) -> None:
    """``context`` has ended: its slots hold their own objects again (one pop: a second finds nothing)."""
    _live.pop(id(context), None)


def record_of(param: torch.Tensor) -> Summoned | None:
    """The record of a live full parameter (this very object), else None."""
    for registered in list(_live.values()):
        record = registered.full_record(param)
        if record is not None:
            return record
    return None


