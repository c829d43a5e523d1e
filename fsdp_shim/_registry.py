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
#: ``id(swap)`` -> each live context (any thread) whose slots are swapped, in entry order. A swap
#: answers for its own slots (``slot_keys()``): registering the swap, not each slot, keeps the
#: per-unit summon's bookkeeping at one entry a call; lookups (nesting, threads) are the rare path.
_slot_swaps: dict[int, Any] = {}
#: ``id(swap)`` -> each live context whose full parameters are out (``record_of(id)``).
_full_swaps: dict[int, Any] = {}
#: ``id(process group)`` -> (owning thread, open contexts of that thread on it).
_groups: dict[int, tuple[int, int]] = {}
#: threads with a live context -> how many.
_depth: dict[int, int] = {}


def current_thread() -> int:
    return threading.get_ident()


def slots_of_thread(thread: int) -> dict[SlotKey, Any]:
    """The slots this thread's live contexts swapped (what a nested call leaves alone)."""
    swaps = list(_slot_swaps.values())
    return {key: swap for swap in swaps if swap.thread == thread for key in swap.slot_keys()}


def has_live_slots() -> bool:
    """Whether any thread has a context open that swapped a slot."""
    return bool(_slot_swaps)


def owner_of(key: SlotKey) -> Any:
    """The live context that swapped slot ``key``, if any."""
    for swap in list(_slot_swaps.values()):
        if key in swap.slot_keys():
            return swap
    return None


def add_slots(swap: Any) -> None:
    """``swap``'s slots now hold its full tensors."""
    _slot_swaps[id(swap)] = swap


def remove_slots(swap: Any) -> None:
    _slot_swaps.pop(id(swap), None)


def add_fulls(swap: Any) -> None:
    """``swap``'s full parameters are out, until ``remove_fulls``."""
    _full_swaps[id(swap)] = swap


def remove_fulls(swap: Any) -> None:
    _full_swaps.pop(id(swap), None)


def record_of(param: torch.Tensor) -> Any:
    """The ``SwappedParam`` record of a live full parameter (this very object), else None."""
    for swap in list(_full_swaps.values()):
        record = swap.record_of(id(param))
        if record is not None and record.full is param:
            return record
    return None


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
