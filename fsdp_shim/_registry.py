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
import torch
import torch.distributed as dist
import torch.nn as nn
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fsdp_shim._scope import SlotKey


_lock = threading.Lock()


class Summoned(Protocol):
    """What the registry reads of one summoned tensor's record (``_exit_checks.SwappedParam``)."""

    @property
    def full(self) -> torch.Tensor: ...

    @property
    def slots(self) -> list[tuple[nn.Module, str]]: ...

    @property
    def is_buffer(self) -> bool: ...


@dataclass(eq=False, slots=True)
class LiveContext:
    """One live context as the registry sees it: plain data, filled in by the swap.

    ``records`` is the swap's own list of what it summoned, complete before
    ``add_slots`` and ``add_fulls``; the registry derives the slot keys and the full
    parameters from it when a rare lookup asks (nesting, threads,
    ``sharded_param``), so that registering costs one dict entry a call.
    """

    thread: int
    writeback: bool
    records: list[Summoned] = field(default_factory=list)
    _slot_keys: set[SlotKey] | None = None
    _fulls: dict[int, Summoned] | None = None

    def slot_keys(self) -> set[SlotKey]:
        """The slots its records were swapped into."""
        if self._slot_keys is None:
            self._slot_keys = {(id(module), name) for record in self.records for module, name in record.slots}
        return self._slot_keys

    def full_record(self, param: torch.Tensor) -> Summoned | None:
        """The record whose full parameter is ``param`` itself (buffers are not parameters)."""
        if self._fulls is None:
            self._fulls = {id(r.full): r for r in self.records if not r.is_buffer}
        record = self._fulls.get(id(param))
        return record if record is not None and record.full is param else None


#: ``id(context)`` -> each live context (any thread) whose slots hold its full tensors, in entry order.
#: One entry a context, not one a slot: see ``LiveContext``.
_slot_swaps: dict[int, LiveContext] = {}
#: ``id(context)`` -> each live context whose full parameters are out (until its exit forgets them).
_full_swaps: dict[int, LiveContext] = {}
#: ``id(process group)`` -> (owning thread, open contexts of that thread on it).
_groups: dict[int, tuple[int, int]] = {}
#: threads with a live context -> how many.
_depth: dict[int, int] = {}


def current_thread() -> int:
    return threading.get_ident()


def slots_of_thread(thread: int) -> dict[SlotKey, LiveContext]:
    """The slots this thread's live contexts swapped (what a nested call leaves alone)."""
    contexts = list(_slot_swaps.values())
    return {key: live for live in contexts if live.thread == thread for key in live.slot_keys()}


def has_live_slots() -> bool:
    """Whether any thread has a context open that swapped a slot."""
    return bool(_slot_swaps)


def owner_of(key: SlotKey) -> LiveContext | None:
    """The live context that swapped slot ``key``, if any."""
    for live in list(_slot_swaps.values()):
        if key in live.slot_keys():
            return live
    return None


def add_slots(live: LiveContext) -> None:
    """``live``'s slots now hold its full tensors (its ``records`` are complete: see ``LiveContext``)."""
    _slot_swaps[id(live)] = live


def remove_slots(live: LiveContext) -> None:
    """``live``'s slots hold their own objects again."""
    _slot_swaps.pop(id(live), None)


def add_fulls(live: LiveContext) -> None:
    """``live``'s full parameters are out, until ``remove_fulls``."""
    _full_swaps[id(live)] = live


def remove_fulls(live: LiveContext) -> None:
    _full_swaps.pop(id(live), None)


def record_of(param: torch.Tensor) -> Summoned | None:
    """The record of a live full parameter (this very object), else None."""
    for live in list(_full_swaps.values()):
        record = live.full_record(param)
        if record is not None:
            return record
    return None


def has_live_context(thread: int) -> bool:
    return _depth.get(thread, 0) > 0


def claim(thread: int, groups: Iterable[dist.ProcessGroup]) -> bool:
    """Claim ``groups`` for this thread (a context or a stream); False, claiming nothing, if another
    thread uses one of them (``_refusals.group_in_use`` says why that is refused)."""
    groups = list(groups)
    with _lock:
        for group in groups:
            owner = _groups.get(id(group))
            if owner is not None and owner[0] != thread:
                return False
        for group in groups:
            owner = _groups.get(id(group))
            _groups[id(group)] = (thread, 1 if owner is None else owner[1] + 1)
    return True


def release(groups: Iterable[dist.ProcessGroup]) -> None:
    """Give back one claim on each of ``groups``."""
    with _lock:
        for group in groups:
            owner = _groups.get(id(group))
            if owner is None:
                continue
            if owner[1] <= 1:
                del _groups[id(group)]
            else:
                _groups[id(group)] = (owner[0], owner[1] - 1)


def enter(thread: int, groups: Iterable[dist.ProcessGroup]) -> bool:
    """``claim`` for a new context of this thread, which then has one more live context."""
    if not claim(thread, groups):
        return False
    with _lock:
        _depth[thread] = _depth.get(thread, 0) + 1
    return True


def leave(thread: int, groups: Iterable[dist.ProcessGroup]) -> None:
    """Undo ``enter``."""
    release(groups)
    with _lock:
        remaining = _depth.get(thread, 0) - 1
        if remaining > 0:
            _depth[thread] = remaining
        else:
            _depth.pop(thread, None)
