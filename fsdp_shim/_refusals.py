"""The summon's and the stream's refusals: each before any change or collective, alike on every rank. FSDP1's
misuse gets FSDP1's exception types; the rest name the parameter and say what to do. Group health: ``_health``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _health as health
from fsdp_shim import _registry as registry
from fsdp_shim._compat import cast_wrapper_master, ungatherable_reason, writeback_refusal
from fsdp_shim._gather.layout import Meshes
from fsdp_shim._scope import (
    CachedSummon,
    Scope,
    first_untracked_slot,
    module_label,
    sharded_params,
    slot_fqn,
    slot_key,
)

if TYPE_CHECKING:
    from fsdp_shim._fsdp2 import FSDPParamGroup, FSDPState


def validate_args(writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> None:
    """Reject what FSDP1's ``_validate_unshard_params_args`` rejects, with the same types, and warn as it warns."""
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            f"with_grads={with_grads}, offload_to_cpu={offload_to_cpu} is not supported yet"
        )
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
    if offload_to_cpu and not rank0_only:  # FSDP1's warning, on every rank as FSDP1's
        warnings.warn(OFFLOAD_WARNING, stacklevel=4)  # validate_args <- summon <- the patch's wrapper <- caller


#: FSDP1's warning word for word ("the" and "unsharded" joined as there), so filters of FSDP1's catch ours.
OFFLOAD_WARNING = (
    "offload_to_cpu=True and rank0_only=False may result in the"
    "unsharded parameters being redundantly copied to CPU memory for "
    "GPUs sharing the same CPU memory, which risks CPU OOM. We "
    "recommend using offload_to_cpu=True with rank0_only=True."
)


#: Said when a summon happens during forward or backward; FSDP1's own sentence comes first.
FORWARD_BACKWARD_ERROR = "Cannot manually unshard parameters during forward/backward"


def refuse_before_anything(
    module: nn.Module, scope: Scope, writeback: bool, thread: int, cached: CachedSummon | None = None,
) -> tuple[list[dist.ProcessGroup], list[DTensor]]:
    """Every misuse this call can detect. Returns the process groups it gathers over, checked alive (the engine
    does not check again), and each parameter's DTensor; ``cached`` skips the specs it passed before."""
    refuse_busy(lambda: f"summon_full_params({module_label(module)})", scope.states, list(scope.groups))
    if registry.has_live_slots():
        for entry in scope.params:
            for slot in entry.slots:
                owner = registry.owner_of(slot_key(*slot))
                if owner is not None and owner.thread != thread:
                    raise RuntimeError(
                        f"summon_full_params({module_label(module)}) refused: {slot_fqn(module, slot)!r} is "
                        "summoned by a context in another thread. Use one thread per rank for collectives."
                    )
    shardeds = sharded_params(scope)
    untracked = first_untracked_slot(scope.params, shardeds)
    if untracked is not None:
        raise untracked_parameter(slot_fqn(module, untracked))
    specs = []
    for entry, sharded in zip(scope.params, shardeds, strict=True):
        if sharded._local_tensor.is_meta:  # FSDP2's lazy init would fail half way and leave its state broken
            raise on_meta_device(f"summon_full_params({module_label(module)})", slot_fqn(module, entry.slots[0]))
        specs.append(sharded._spec)
    groups = None if cached is None else cached.checked_groups(specs, writeback)
    if groups is not None:
        health.require_live_groups(groups, lambda: f"the scope of summon_full_params({module_label(module)})")
    else:
        named = ((lambda e=entry: slot_fqn(module, e.slots[0]), sharded)
                 for entry, sharded in zip(scope.params, shardeds, strict=True))
        groups = refuse_placements(named, writeback, scope.meshes)
        if cached is not None:
            cached.passed(specs, writeback, groups)
    return groups, shardeds  # gradients are rank-local: ``_grads.agreed_grads`` checks them after agreeing


def on_meta_device(call: str, fqn: str) -> RuntimeError:
    """A parameter still on the meta device: nothing to gather."""
    return RuntimeError(
        f"{call} refused: {fqn!r} is still on the meta device. Materialise the model first "
        "(model.to_empty(device=...), then initialise its parameters); nothing was changed."
    )


def refuse_busy(call: Callable[[], str], states: list[FSDPState], groups: list[FSDPParamGroup]) -> None:
    """A forward or backward in progress: FSDP1's ``AssertionError``, its sentence first. ``call()`` names the call."""
    busy = fsdp2.busy_training_state(states, groups)
    if busy is not None:
        raise AssertionError(
            f"{FORWARD_BACKWARD_ERROR}: {call()} during FSDP2 forward/backward (training state {busy})")


def refuse_placements(
    named: Iterable[tuple[Callable[[], str], DTensor]], writeback: bool, gather_meshes: Meshes = None,
) -> list[dist.ProcessGroup]:
    """Refuse placements this torch cannot gather (or write back) and dead or out-of-step groups; returns the
    groups the DTensors gather over. ``named``: ``(namer, DTensor)``; ``gather_meshes``: FSDP2's, where not its own."""
    meshes: dict[int, tuple[Callable[[], str], DeviceMesh]] = {}  # one name a mesh
    for index, (name, dtensor) in enumerate(named):
        placements = dtensor.placements
        reason = ungatherable_reason(placements)
        if reason is None and writeback:
            reason = writeback_refusal(placements)
        if reason is not None:
            raise NotImplementedError(f"cannot summon {name()!r}: {reason}")
        local = dtensor._local_tensor
        if type(local) is not Tensor and hasattr(local, "fsdp_pre_all_gather") and cast_wrapper_master(local) is None:
            raise gather_extension(name(), type(local))
        mesh = None if gather_meshes is None else gather_meshes[index]
        if mesh is None:
            mesh = dtensor.device_mesh
        meshes.setdefault(id(mesh), (name, mesh))
    groups: list[dist.ProcessGroup] = []
    for name, mesh in meshes.values():
        groups += health.live_mesh_dim_groups(mesh, lambda: repr(name()))  # noqa: B023  # called within this iteration, before name changes
    return list({id(g): g for g in groups}.values())


def gather_extension(fqn: str, subclass: type) -> NotImplementedError:
    """The refusal of a tensor subclass with FSDP2's all-gather extension (``fsdp_pre_all_gather``: how training
    moves it, not its values), other than a cast wrapper (``_compat.cast_wrapper_master``), which is gathered as
    its master and written back in place. A plain all-gather of the rest (torchao's ``NF4Tensor``) fails inside
    the subclass, naming no parameter."""
    return NotImplementedError(
        f"cannot summon {fqn!r}: it is a {subclass.__module__}.{subclass.__qualname__}, a tensor subclass that "
        "FSDP2 gathers through its all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather); "
        "summon_full_params and iter_full_params do not gather such tensors. Leave it out of the call (summon "
        "the units or parameters around it), or use FSDP2's own unit.unshard() / unit.reshard() for it. "
        "Nothing was gathered."
    )


def refuse_writeback_inside_no_writeback(module: nn.Module, enclosing: Iterable[registry.LiveContext]) -> None:
    """A nested ``writeback=True`` call whose parameters an enclosing ``writeback=False`` context holds."""
    if any(not live.call.writeback for live in enclosing):
        raise RuntimeError(
            f"summon_full_params({module_label(module)}, writeback=True) inside an enclosing "
            "writeback=False context that already holds some of its parameters: their edits would "
            "be discarded by the outer context. Use writeback=True outside, or summon after it."
        )


def refuse_grad_layouts(call: str, name: str, plain: type | None = None) -> RuntimeError:
    """``with_grads``' refusal of a gradient laid out otherwise than its parameter (``plain``: its plain type)."""
    if plain is not None:
        return RuntimeError(f"{call} refused: {name!r} is a plain {plain.__name__}, not a DTensor like its "
                            "parameter. Nothing was gathered.")
    return RuntimeError(
        f"{call} refused: {name!r} is laid out otherwise than its parameter on some ranks and missing or laid "
        "out differently on others, so the ranks cannot gather it alike. Nothing was gathered.")


def untracked_parameter(fqn: str) -> RuntimeError:
    """The refusal for a slot FSDP2 manages that holds a parameter FSDP2 does not track."""
    return RuntimeError(
        f"{fqn!r} holds a parameter assigned after fully_shard (or a tie made or undone since): FSDP2 does "
        "not track it, and its forward, its optimizer and every gather keep using the parameter fully_shard "
        "registered, so neither summon_full_params nor iter_full_params can serve it. Assign parameters "
        "and ties before fully_shard, or copy new values into the existing parameter (under torch.no_grad(): "
        "param.copy_(new), or inside summon_full_params(writeback=True)). Nothing was gathered."
    )
