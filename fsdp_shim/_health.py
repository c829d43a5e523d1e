"""Group health: which thread claims each process group, which groups are out of step, destroyed or
unguarded on NCCL, and how far a rank may run ahead. Summons and streams ask here before their first collective
and mark here what they leave part way; the engine (``_gather``) decides none of it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim._compat import cuda_backend_of
from fsdp_shim._errors import DestroyedGroupError, GroupOutOfStepError
from fsdp_shim._gather.layout import mesh_dim_groups

logger = logging.getLogger("fsdp_shim")

_lock = threading.Lock()

#: This thread's identity (a C function: no Python frame on the hot path).
current_thread = threading.get_ident


#: ``id(owner)`` -> its claim on process groups (a context's, or a stream's): see [Note: claims].
_claims: dict[int, Claim] = {}


@dataclass(frozen=True, slots=True)
class Claim:
    """One owner's claim: its thread, its groups' ``id``s, and whether it is a context (``has_live_context``)."""

    thread: int
    groups: frozenset[int]
    context: bool


def has_live_context(thread: int) -> bool:
    return bool(_claims) and any(c.context and c.thread == thread for c in list(_claims.values()))


def claim(owner: object, thread: int, groups: Sequence[dist.ProcessGroup], call: Callable[[], str], *,
          context: bool = False) -> None:
    """Claim ``groups`` for ``owner`` (a context, or a stream) in ``thread``, adding to its earlier claim;
    ``call()`` names the call. Refused, claiming nothing, before any collective, if another thread's owner holds
    one: two threads' collectives on one group interleave (FSDP's rule: one thread per rank calls collectives).

    [Note: claims]
    One record per owner, made by one dict store and given back by one dict pop (``release``): an interrupt
    lands before or after either, never inside, and a second release finds nothing. So an owner releases in a
    ``finally`` on every path, claimed or not.
    """
    ids = frozenset(map(id, groups))
    with _lock:
        # a copy (one C call): ``release`` pops without the lock, as one dict operation
        busy = any(c.thread != thread and not c.groups.isdisjoint(ids) for c in list(_claims.values()))
        if not busy:
            earlier = _claims.get(id(owner))
            if earlier is not None:
                ids, context = ids | earlier.groups, context or earlier.context
            _claims[id(owner)] = Claim(thread, ids, context)  # the one store: see [Note: claims]
    if busy:  # named outside the lock: ``call`` is the caller's code
        raise RuntimeError(
            f"{call()} refused: another thread has a summon_full_params context or an iter_full_params "
            "stream open on the same process group, and two threads issuing collectives on one group "
            "corrupt each other. Use one thread per rank for collectives."
        )


def release(owner: object) -> None:
    """Give back ``owner``'s claim, if it has one (one pop: see [Note: claims])."""
    _claims.pop(id(owner), None)


#: Out-of-step groups (``mark_out_of_step``): what was raised, and the buffers held while the group lives.
_out_of_step: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[str, list[object]]] = weakref.WeakKeyDictionary()


def mark_part_way(groups: Iterable[dist.ProcessGroup], error: BaseException) -> None:
    """This rank left a call's gathers over ``groups`` part way: see ``Call``."""
    for group in groups:
        mark_out_of_step(group, error, part_way=True)


def mark_out_of_step(
    group: dist.ProcessGroup, error: BaseException, buffers: Iterable[object] = (), part_way: bool = False,
) -> None:
    """Record that a collective posted on ``group`` may never complete (its wait raised, or a call left it
    part way). It cannot be withdrawn and the group's next collective would pair with it, so every later summon
    or stream over the group refuses at once (``require_live_groups``) where FSDP would hang. ``buffers`` are
    held while the group lives: gloo still writes a late peer's data into them. Recovery: a new process group,
    or a restarted job."""
    what = f"{type(error).__name__}: {error}".splitlines()[0][:200]
    if part_way:
        what = f"this rank left a gather part way on {what}"
    reason, held = _out_of_step.setdefault(group, (what, []))
    held.extend(buffers)


def destroyed_group(user: Callable[[], str]) -> DestroyedGroupError:
    """The refusal for a mesh whose process group was destroyed (or belongs to another world)."""
    return DestroyedGroupError(
        f"cannot gather {user()}: its device mesh uses a process group that was destroyed or belongs to "
        "another process group world (was it sharded before destroy_process_group()?)"
    )


NcclFaultRule = Literal["watchdog", "blocking_wait", "unguarded"]


def nccl_fault_rule(env: Mapping[str, str]) -> NcclFaultRule:
    """What stops a failed NCCL all-gather from being read as arrived (on NCCL ``wait()`` raises nothing).
    ``"watchdog"`` (async error handling 1, 3 or unset: torch's default) ends the process, so nothing is
    written back, though work queued behind the gather runs on partial values; ``"blocking_wait"``
    (``TORCH_NCCL_BLOCKING_WAIT=1``) raises as gloo does; ``"unguarded"`` (handling 0 or 2, no blocking wait)
    could hand out values that never arrived: the shim warns once. Older ``NCCL_*`` spellings count too."""
    def value(name: str, default: str) -> str:
        return env.get(f"TORCH_{name}", env.get(name, default)).strip()

    if value("NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
        return "blocking_wait"
    return "unguarded" if value("NCCL_ASYNC_ERROR_HANDLING", "3") in ("0", "2") else "watchdog"


_fault_rule_checked: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def unguarded_nccl_warning(spelling: str, env: Mapping[str, str]) -> str:
    """The warning for an NCCL group (created as ``spelling``) whose faults nothing notices (``"unguarded"``)."""
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING"))
    return (
        f"NCCL serves the CUDA tensors of a process group created with backend {spelling!r}, with "
        f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling} and no TORCH_NCCL_BLOCKING_WAIT: a failed or timed-out "
        "all-gather is not noticed, so summon_full_params and iter_full_params could hand out (and with "
        "writeback=True write back) values that never arrived. Unset TORCH_NCCL_ASYNC_ERROR_HANDLING (or set it "
        "to 3, torch's default: the watchdog tears the process down on a failed collective), or set "
        "TORCH_NCCL_BLOCKING_WAIT=1 (process-wide: every NCCL collective then blocks the host, and torch's "
        "watchdog no longer times them). See docs/troubleshooting.md."
    )


def serves_cuda_with_nccl(group: dist.ProcessGroup) -> tuple[bool, str]:
    """Whether NCCL serves ``group``'s CUDA tensors (the group's answer, else the spelling's), and the spelling."""
    spelling = str(dist.get_backend(group))
    backend = fsdp2.cuda_backend_name(group)
    if backend is None:
        return cuda_backend_of(spelling) == "nccl", spelling
    return "nccl" in backend.lower(), spelling


def warn_if_unguarded(groups: Iterable[dist.ProcessGroup]) -> None:
    """Warn once a process, for the first of ``groups`` on NCCL whose faults nothing notices (``nccl_fault_rule``)."""
    for group in groups:
        if group in _fault_rule_checked:
            continue
        _fault_rule_checked.add(group)
        if nccl_fault_rule(os.environ) != "unguarded":
            continue
        nccl, spelling = serves_cuda_with_nccl(group)  # "nccl", "undefined", "cuda:nccl,cpu:gloo", ...
        if nccl:
            logger.warning("%s", unguarded_nccl_warning(spelling, os.environ))
            return


def require_live_groups(groups: Iterable[dist.ProcessGroup], user: Callable[[], str]) -> None:
    """Refuse a destroyed, foreign or out-of-step group here, not inside a collective; ``user()`` names the caller."""
    for group in groups:
        if not fsdp2.is_live_group(group):
            raise destroyed_group(user)
        if _out_of_step and group in _out_of_step:
            raise GroupOutOfStepError(
                f"cannot gather {user()}: an earlier gather on its process group never completed on this rank "
                f"({_out_of_step[group][0]}), so the ranks are out of step and the next collective could hang or "
                "pair with the wrong one. Destroy and recreate the process group (dist.destroy_process_group(group), "
                "a new group and the model sharded on it), or restart the job (docs/troubleshooting.md)."
            )


def live_mesh_dim_groups(mesh: DeviceMesh, user: Callable[[], str]) -> list[dist.ProcessGroup]:
    """``mesh_dim_groups``, checked by ``require_live_groups`` (one torch cannot resolve is refused alike),
    and ``warn_if_unguarded``."""
    try:
        groups = mesh_dim_groups(mesh)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:  # torch's words differ by release
        raise destroyed_group(user) from error
    require_live_groups(groups, user)
    warn_if_unguarded(groups)
    return groups


class Call:
    """One summon's or stream's record, passed to the engine: whether a collective was attempted yet
    (``any``: a class attribute until then), and ``lost``, which marks one that may never complete.

    [Note: a one-sided fault leaves its own mark]
    A fault on one rank (an out-of-memory error while staging) may raise after some of the call's collectives
    were posted; the others post the rest, and this rank's next collective would pair with a stale one (gloo
    aborts; NCCL hangs or hands over another tensor's shards). A rank cannot tell a one-sided fault from one on
    every rank, so leaving a call part way after its first collective marks every group of the call
    (``mark_part_way``). Before the first collective nothing is marked: the group stays usable.
    """

    any = False
    lost = staticmethod(mark_out_of_step)


#: What blocks until each of the last summons that received nothing here has completed, oldest first: the
#: run-ahead bound across calls ([Note: bounded run-ahead] in ``_gather.engine``). One for the process: the
#: receiving rank works through the calls in program order.
CALLS_BEHIND: collections.deque[Callable[[], object]] = collections.deque()
