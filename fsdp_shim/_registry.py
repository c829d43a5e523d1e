"""Which contexts are live, per thread: slots, full parameters and process groups.

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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from fsdp_shim._scope import SlotKey

_lock = threading.Lock()
#: slot -> the live context (any thread) that swapped it.
_slots: dict[SlotKey, Any] = {}
#: ``id(full parameter)`` -> its ``_SwappedParam`` record, while its context is live.
_fulls: dict[int, Any] = {}
#: ``id(process group)`` -> (owning thread, open contexts of that thread on it).
_groups: dict[int, tuple[int, int]] = {}
#: threads with a live context -> how many.
_depth: dict[int, int] = {}


def current_thread() -> int:
    return threading.get_ident()


def slots_of_thread(thread: int) -> dict[SlotKey, Any]:
    """The slots this thread's live contexts swapped (what a nested call leaves alone)."""
    with _lock:
        return {key: swap for key, swap in _slots.items() if swap.thread == thread}


def has_live_slots() -> bool:
    """Whether any thread has a context open that swapped a slot."""
    return bool(_slots)


def owner_of(key: SlotKey) -> Any:
    return _slots.get(key)


def add_slot(key: SlotKey, swap: Any) -> None:
    _slots[key] = swap


def remove_slot(key: SlotKey) -> None:
    _slots.pop(key, None)


def add_full(param: torch.Tensor, record: Any) -> None:
    _fulls[id(param)] = record


def remove_full(param: torch.Tensor) -> None:
    _fulls.pop(id(param), None)


def record_of(param: torch.Tensor) -> Any:
    """The ``_SwappedParam`` record of a live full parameter (this very object), else None."""
    record = _fulls.get(id(param))
    return record if record is not None and record.full is param else None


def has_live_context(thread: int) -> bool:
    return _depth.get(thread, 0) > 0


def enter(thread: int, groups: Iterable[dist.ProcessGroup], label: str) -> None:
    """Claim ``groups`` for this thread's new context; refuse one another thread is using."""
    groups = list(groups)
    with _lock:
        for group in groups:
            owner = _groups.get(id(group))
            if owner is not None and owner[0] != thread:
                raise RuntimeError(
                    f"summon_full_params({label}) refused: another thread has a summon_full_params "
                    "context open on the same process group, and two threads issuing collectives on "
                    "one group corrupt each other. Use one thread per rank for collectives."
                )
        for group in groups:
            owner = _groups.get(id(group))
            _groups[id(group)] = (thread, 1 if owner is None else owner[1] + 1)
        _depth[thread] = _depth.get(thread, 0) + 1


def leave(thread: int, groups: Iterable[dist.ProcessGroup]) -> None:
    with _lock:
        for group in groups:
            owner = _groups.get(id(group))
            if owner is None:
                continue
            if owner[1] <= 1:
                del _groups[id(group)]
            else:
                _groups[id(group)] = (owner[0], owner[1] - 1)
        remaining = _depth.get(thread, 0) - 1
        if remaining > 0:
            _depth[thread] = remaining
        else:
            _depth.pop(thread, None)
