"""Which contexts are live, per thread: slots, full parameters and process groups. Data only.

[Note: threads]
Contexts are per thread. Nesting (a context inside another) is a property of
one thread: a nested call leaves the slots its own thread's enclosing context
swapped to that context. A context in another thread is never nested: its
slots are refused, and so is any process group it is using, because two
threads issuing collectives on one group interleave them (the ranks then
disagree, corrupt each other's buffers or abort). The rule is FSDP's own: one
thread per rank calls collectives. Every refusal comes before any collective
or change.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

#: A slot, as contexts claim it: ``(id(module), attribute name)`` (``_scope.slot_key`` makes one).
SlotKey = tuple[int, str]

_lock = threading.Lock()


class Summoned(Protocol):
    """What the registry reads of one summoned tensor's record (``_param.SummonedParam``).

    Every rank records every tensor in scope, holder of full tensors or not
    (``full`` is None where this rank holds none: ``rank0_only``): what a
    nested call or a stream decides from the registry is then the same on
    every rank (see [Note: every rank decides alike] in ``_summon``).
    """

    @property
    def full(self) -> torch.Tensor | None: ...

    @property
    def sharded(self) -> torch.Tensor: ...

    @property
    def slots(self) -> list[tuple[nn.Module, str]]: ...

    @property
    def is_buffer(self) -> bool: ...


class LiveContext(Protocol):
    """What the registry reads of one live context (``_summon.DTensorSummon``, the context itself).

    ``summoned`` is complete when the context is registered, on every rank
    alike (see ``Summoned``); the registry
    derives the slot keys and the full parameters from it when a rare lookup
    asks (nesting, threads, ``sharded_param``), so that registering costs one
    dict entry a call.
    """

    @property
    def thread(self) -> int: ...

    @property
    def writeback(self) -> bool: ...

    @property
    def summoned(self) -> Sequence[Summoned]: ...


@dataclass(eq=False, slots=True)
class _Registered:
    """A registered context, and what lookups derived from its records (worked out on first ask)."""

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
#: ``id(process group)`` -> (owning thread, open contexts of that thread on it).
_groups: dict[int, tuple[int, int]] = {}
#: threads with a live context -> how many.
_depth: dict[int, int] = {}


#: This thread's identity (a C function: no Python frame on the hot path).
current_thread = threading.get_ident


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
    """The record of the tensor a live context summoned into slot ``key``, or whose full or sharded
    tensor is ``value``, what the slot holds (a tie made inside: see [Note: what a slot stands for]), if
    any (on every rank alike): what the slot stands for, whatever this rank's slot holds."""
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
    """The live context, and its record, whose full tensor or sharded DTensor is ``tensor`` itself.

    [Note: what a slot stands for]
    A slot no context swapped may still hold what a context summoned: a tie
    made inside one (``side.weight = blocks[0].fc2.weight``) puts there the
    full parameter where this rank holds full tensors and the shard where it
    does not (``rank0_only``). Either stands for the same record, which every
    rank keeps alike, so routing, scope and the stream read the slot through
    the record, never through its type (see [Note: every rank decides alike]
    in ``_summon``).
    """
    if not _live or tensor is None:
        return None
    for registered in list(_live.values()):
        record = registered.tensor_record(tensor)
        if record is not None:
            return registered.context, record
    return None


def register(context: LiveContext) -> None:
    """``context`` has gathered: its slots hold its full tensors where this rank holds them, and its
    records are complete (see ``LiveContext``). Called on every rank, holder or not."""
    _live[id(context)] = _Registered(context)


def forget(context: LiveContext, claimed: Sequence[dist.ProcessGroup] | None) -> None:
    """``context`` has ended: its slots hold their own objects again; with ``claimed``, the groups it
    claimed are given back and its thread has one live context fewer."""
    _live.pop(id(context), None)
    if claimed is not None:
        release(claimed, context.thread)


def record_of(param: torch.Tensor) -> Summoned | None:
    """The record of a live full parameter (this very object), else None."""
    for registered in list(_live.values()):
        record = registered.full_record(param)
        if record is not None:
            return record
    return None


def has_live_context(thread: int) -> bool:
    return _depth.get(thread, 0) > 0


def claim(thread: int, groups: Sequence[dist.ProcessGroup], *, context: bool = False) -> bool:
    """Claim ``groups`` for this thread, for a stream or (``context``) a new context, which then counts
    as one more live context of the thread; False, claiming nothing, if another thread uses one of them
    (``_refusals.group_in_use`` says why that is refused)."""
    with _lock:
        for group in groups:
            owner = _groups.get(id(group))
            if owner is not None and owner[0] != thread:
                return False
        for group in groups:
            owner = _groups.get(id(group))
            _groups[id(group)] = (thread, 1 if owner is None else owner[1] + 1)
        if context:
            _depth[thread] = _depth.get(thread, 0) + 1
    return True


def release(groups: Sequence[dist.ProcessGroup], thread: int | None = None) -> None:
    """Give back one claim on each of ``groups``; with ``thread``, undo a ``claim(context=True)`` of it."""
    with _lock:
        for group in groups:
            owner = _groups.get(id(group))
            if owner is None:
                continue
            if owner[1] <= 1:
                del _groups[id(group)]
            else:
                _groups[id(group)] = (owner[0], owner[1] - 1)
        if thread is not None:
            remaining = _depth.get(thread, 0) - 1
            if remaining > 0:
                _depth[thread] = remaining
            else:
                _depth.pop(thread, None)
