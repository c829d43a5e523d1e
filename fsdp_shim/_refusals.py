"""Every check a summon makes before any change or collective, alike on every rank.

FSDP1's argument checks (``validate_args``, with FSDP1's exception types);
then, in ``refuse_before_anything``: a forward or backward in progress,
another thread's context, a parameter FSDP2 does not track, the meta device,
placements that cannot be gathered or written back, and dead process groups;
for a call nested in a ``writeback=False`` context, ``writeback=True`` over
the parameters that context holds (``refuse_writeback_inside_no_writeback``);
and a process group another thread's context is using (``group_in_use``,
raised where ``_registry.enter`` fails to claim it, atomically). A check
that raises here leaves everything as it was: nothing has been changed or
sent yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_shim import _diagnostics
from fsdp_shim import _fsdp2_internals as fsdp2
from fsdp_shim import _registry as registry
from fsdp_shim._compat import ungatherable_reason, writeback_refusal
from fsdp_shim._layout import mesh_dim_groups, require_live_groups
from fsdp_shim._plans import SummonPlan

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from fsdp_shim._scope import (
    Scope,
    first_untracked_slot,
    module_label,
    slot_fqn,
    slot_key,
    untracked_parameter,
)


def validate_args(
    writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool, module: nn.Module | None = None
) -> None:
    """Reject what FSDP1's ``_validate_unshard_params_args`` rejects, with the same types.

    FSDP1's warning comes from every rank; ours once per group (``_diagnostics``).
    """
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            f"with_grads={with_grads}, offload_to_cpu={offload_to_cpu} is not supported yet"
        )
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
    if offload_to_cpu and not rank0_only:
        mesh = None if module is None else next(
            (p.device_mesh for p in module.parameters() if isinstance(p, DTensor)), None)
        _diagnostics.warn(
            "offload_to_cpu=True and rank0_only=False may result in the unsharded parameters "
            "being redundantly copied to CPU memory for GPUs sharing the same CPU memory, which "
            "risks CPU OOM. We recommend using offload_to_cpu=True with rank0_only=True.",
            stacklevel=4,  # validate_args <- summon <- the patch's wrapper <- caller
            mesh=mesh,
        )


#: Said when a summon happens during forward or backward; FSDP1's own sentence comes first.
FORWARD_BACKWARD_ERROR = "Cannot manually unshard parameters during forward/backward"


def refuse_before_anything(
    module: nn.Module, scope: Scope, writeback: bool, thread: int, plan: SummonPlan | None = None
) -> tuple[list[dist.ProcessGroup], list[DTensor]]:
    """Every misuse this call can detect, before any collective or change, alike on every rank.

    Returns the process groups the call gathers over (every dim of every
    mesh in scope), checked alive: the engine need not check again; and
    each scoped parameter's DTensor, as resolved now (``_swap._prepare`` reuses
    them unless FSDP2 adopts other ones). With a
    ``plan``, the checks that depend on a DTensor's spec alone (placements,
    meshes) are skipped for the specs it passed before (see [Note: summon
    plans] in ``_plans``); the rest runs on every call.
    """
    refuse_busy(lambda: f"summon_full_params({module_label(module)})", scope.states, list(scope.groups))
    if registry.has_live_slots():  # a context open in any thread: are any of ours in another one's?
        for entry in scope.params:
            for slot in entry.slots:
                owner = registry.owner_of(slot_key(*slot))
                if owner is not None and owner.thread != thread:
                    raise RuntimeError(
                        f"summon_full_params({module_label(module)}) refused: {slot_fqn(module, slot)!r} is "
                        "summoned by a context in another thread. Use one thread per rank for collectives."
                    )
    shardeds: list[DTensor] = [entry.sharded() for entry in scope.params]  # type: ignore[misc]
    untracked = first_untracked_slot(scope.params, shardeds)
    if untracked is not None:
        raise untracked_parameter(slot_fqn(module, untracked))
    specs = []
    for entry, sharded in zip(scope.params, shardeds):
        if sharded._local_tensor.is_meta:  # FSDP2's lazy init would fail half way and leave its state broken
            raise RuntimeError(
                f"summon_full_params({module_label(module)}) refused: {slot_fqn(module, entry.slots[0])!r} is "
                "still on the meta device. Materialise the model first (model.to_empty(device=...), then "
                "initialise its parameters); nothing was changed."
            )
        specs.append(sharded._spec)
    groups = None if plan is None else plan.checked_groups(specs, writeback)
    if groups is not None:
        require_live_groups(groups, lambda: f"the scope of summon_full_params({module_label(module)})")
        return groups, shardeds
    named = ((lambda e=entry: slot_fqn(module, e.slots[0]), sharded) for entry, sharded in zip(scope.params, shardeds))
    groups = refuse_placements(named, writeback)
    if plan is not None:
        plan.passed(specs, writeback, groups)
    return groups, shardeds


def refuse_busy(call: Callable[[], str], states: list[FSDPState], groups: list[FSDPParamGroup]) -> None:
    """A forward or backward in progress: FSDP1's ``AssertionError``, its sentence first. ``call()`` names the call."""
    busy = fsdp2.busy_training_state(states, groups)
    if busy is not None:
        raise AssertionError(f"{FORWARD_BACKWARD_ERROR}: {call()} during FSDP2 forward/backward (training state {busy})")


def refuse_placements(
    named: Iterable[tuple[Callable[[], str], DTensor]], writeback: bool
) -> list[dist.ProcessGroup]:
    """Every placement this torch cannot gather (or, under ``writeback``, write back), and every dead or
    out-of-step group, refused before anything moves; the process groups the DTensors gather over.

    ``named``: each DTensor with a function that names it (worked out only to raise). The summon
    and the stream both ask here, so they refuse the same things in the same words.
    """
    meshes: dict[int, tuple[Callable[[], str], DTensor]] = {}  # one DTensor a mesh
    for name, dtensor in named:
        placements = dtensor.placements
        reason = ungatherable_reason(placements)
        if reason is None and writeback:
            reason = writeback_refusal(placements)
        if reason is not None:
            raise NotImplementedError(f"cannot summon {name()!r}: {reason}")
        meshes.setdefault(id(dtensor.device_mesh), (name, dtensor))
    groups: list[dist.ProcessGroup] = []
    for name, dtensor in meshes.values():
        mesh_groups = mesh_dim_groups(dtensor.device_mesh)
        require_live_groups(mesh_groups, lambda: repr(name()))  # noqa: B023
        groups += mesh_groups
    return list({id(g): g for g in groups}.values())


def refuse_writeback_inside_no_writeback(module: nn.Module, enclosing: Iterable[registry.LiveContext]) -> None:
    """A nested ``writeback=True`` call whose parameters an enclosing ``writeback=False`` context holds."""
    if any(not live.writeback for live in enclosing):
        raise RuntimeError(
            f"summon_full_params({module_label(module)}, writeback=True) inside an enclosing "
            "writeback=False context that already holds some of its parameters: their edits would "
            "be discarded by the outer context. Use writeback=True outside, or summon after it."
        )


def group_in_use(call: str) -> RuntimeError:
    """The refusal when ``_registry.enter`` finds a process group in use by another thread's context or stream."""
    return RuntimeError(
        f"{call} refused: another thread has a summon_full_params context or an iter_full_params stream "
        "open on the same process group, and two threads issuing collectives on "
        "one group corrupt each other. Use one thread per rank for collectives."
    )
