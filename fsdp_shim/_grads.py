"""Gradients under ``with_grads``: which exist, agreed by every rank, then gathered like the parameters."""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_shim import _health as health
from fsdp_shim._errors import DestroyedGroupError, GroupOutOfStepError
from fsdp_shim._gather.engine import comm_device_of, gather_full_tensors
from fsdp_shim._gather.layout import Meshes, Receiver, mesh_dim_groups
from fsdp_shim._refusals import refuse_grad_layouts, refuse_placements
from fsdp_shim._scope import Scope, module_label, slot_fqn

if TYPE_CHECKING:
    from fsdp_shim._registry import LiveContext

__all__ = ["agreed_grads", "gather_grads"]


def agreed_grads(
    module: nn.Module, scope: Scope, dtensors: list[DTensor], writeback: bool, owner: LiveContext, posted: health.Call,
) -> tuple[list[tuple[int, DTensor]], list[dist.ProcessGroup], BaseException | None]:
    """The gradients to gather, as every rank agrees; the process groups of those on another mesh, claimed for
    ``owner``; and what making FSDP1's zeros raised on this rank, if anything (the parameters' gather agrees on it).

    Which gradients exist is rank-local, and a gather's buckets must not be, so the ranks agree first, as FSDP1's
    ``unshard_grad`` does: a gradient no rank of its mesh has stays ``None``; one some ranks lack is gathered with
    zeros there. One laid out otherwise than its parameter is gathered by its own spec where every rank lays it out
    alike, else refused everywhere (zeros could not take its layout). The agreement is the call's first collective:
    a fault from then on marks the call's groups, but a refusal made from the agreed answer is alike on every rank,
    keeps them in step, and is raised once nothing else can fail."""
    by_mesh: dict[int, list[int]] = {}
    meshes = scope.meshes
    agreement: list[Any] = []  # the meshes the agreement runs over
    for index, dtensor in enumerate(dtensors):
        mesh = dtensor.device_mesh if meshes is None or meshes[index] is None else meshes[index]
        if id(mesh) not in by_mesh:
            agreement.append(mesh)
        by_mesh.setdefault(id(mesh), []).append(index)
    flags = _local_flags(dtensors, by_mesh)  # allocated before the first collective
    call = f"summon_full_params({module_label(module)}, with_grads=True)"
    refusal: BaseException | None = None
    failure: BaseException | None = None
    groups: list[dist.ProcessGroup] = []
    try:
        agreed = agree_on_grads(dtensors, by_mesh, flags, meshes, posted)  # a collective, before any gather
        chosen: list[tuple[int, Any]] = []  # a gradient, or None for FSDP1's zeros
        foreign: list[tuple[Callable[[], str], DTensor]] = []
        for index, (missing, present, other_layout, one_layout) in agreed.items():
            if not present:
                continue
            grad = dtensors[index].grad
            def name(i: int = index) -> str:
                return f"{slot_fqn(module, scope.params[i].slots[0])}.grad"
            if other_layout:
                if missing or not one_layout:
                    refusal = refuse_grad_layouts(call, name())
                elif not isinstance(grad, DTensor):
                    refusal = refuse_grad_layouts(call, name(), type(grad))
                if refusal is not None:
                    break
                foreign.append((name, cast(DTensor, grad)))
            chosen.append((index, grad))
        if refusal is None:  # gradients on another mesh: their groups checked, then claimed
            try:
                groups = refuse_placements(foreign, writeback=writeback) if foreign else []
            except (NotImplementedError, DestroyedGroupError, GroupOutOfStepError) as refused:  # before any gather
                refusal = refused
        if refusal is None:
            try:
                chosen = [(i, torch.zeros_like(dtensors[i]) if g is None else g) for i, g in chosen]
            except BaseException as error:  # noqa: BLE001  # KeyboardInterrupt too: agreed on, then raised as itself
                failure, chosen = error, []
            if groups:
                health.claim(owner, owner.thread, groups, lambda: call)
    except BaseException as error:
        if posted.any and refusal is None:
            health.mark_part_way([*(g for mesh in agreement for g in mesh_dim_groups(mesh)), *groups], error)
        raise
    if refusal is not None:
        posted.any = False  # refused alike on every rank, from the agreed answer: nothing is pending
        raise refusal
    return cast(list[tuple[int, DTensor]], chosen), groups, failure


def gather_grads(
    grads: list[tuple[int, DTensor]], holds_fulls: bool, out_device: torch.device | None, bucket_bytes: int,
    receiver: Receiver, collective_bytes: int | None, posted: health.Call, meshes: list[Any] | None = None,
    behind: collections.deque[Callable[[], object]] | None = None,
) -> dict[int, torch.Tensor]:
    """Gather the agreed gradients: full gradients by scope position, over their parameters' ``meshes``."""
    gathered = gather_full_tensors(
        [grad for _, grad in grads],
        holds_fulls=holds_fulls,
        out_device=out_device,
        bucket_bytes=bucket_bytes,
        receiver=receiver,
        collective_bytes=collective_bytes,
        meshes=None if meshes is None else [meshes[i] for i, _ in grads],
        posted=posted,
        behind=behind,
    )
    return {i: g for (i, _), g in zip(grads, gathered.tensors, strict=True) if g is not None}


class GradPresence(NamedTuple):
    """What the ranks of a parameter's mesh hold as its gradient, agreed by all of them."""

    missing: bool  # some rank has none
    present: bool  # some rank has one
    other_layout: bool  # some rank's is not a DTensor laid out as the parameter (mesh, placements, shape, dtype)
    one_layout: bool  # every rank that has a gradient lays it out the same way


def _laid_out_as(grad: torch.Tensor, param: DTensor) -> bool:
    return (isinstance(grad, DTensor) and grad.device_mesh is param.device_mesh and grad.placements == param.placements
            and grad.shape == param.shape and grad.dtype == param.dtype
            and grad._local_tensor.shape == param._local_tensor.shape)


def _layout_code(grad: torch.Tensor) -> int:
    """A number for a gradient's global layout, the same on every rank that has the same one."""
    if isinstance(grad, DTensor):
        text = f"{grad.device_mesh.mesh.tolist()}:{grad.placements}:{tuple(grad.shape)}:{grad.dtype}"
    else:
        text = f"plain:{tuple(grad.shape)}:{grad.dtype}"
    return zlib.crc32(text.encode())


_NO_CODE = -(1 << 62)


def _local_flags(dtensors: Sequence[DTensor], by_mesh: dict[int, list[int]]) -> list[torch.Tensor]:
    """What this rank holds as each parameter's gradient, five numbers a parameter (``agree_on_grads``),
    one tensor a mesh, on the device its collectives run on."""
    out: list[torch.Tensor] = []
    for indices in by_mesh.values():
        local: list[int] = []
        for index in indices:
            param = dtensors[index]
            grad = param.grad
            other = grad is not None and not _laid_out_as(grad, param)
            code = None if grad is None else _layout_code(grad)
            local += [grad is None, grad is not None, other,
                      _NO_CODE if code is None else code, _NO_CODE if code is None else -code]
        out.append(torch.tensor(local, dtype=torch.int64).to(comm_device_of(dtensors[indices[0]])))
    return out


def agree_on_grads(
    dtensors: Sequence[DTensor], by_mesh: dict[int, list[int]], flags: list[torch.Tensor], meshes: Meshes,
    posted: health.Call,
) -> dict[int, GradPresence]:
    """Which of ``dtensors`` have gradients, the same on every rank: one ``all_reduce(MAX)`` of ``flags``
    over each dim of each mesh gives, per parameter, missing somewhere, present somewhere, laid out otherwise
    somewhere, and the largest and negated smallest layout code (equal: one layout everywhere)."""
    agreed: dict[int, GradPresence] = {}
    for indices, mesh_flags in zip(by_mesh.values(), flags, strict=True):
        mesh = None if meshes is None else meshes[indices[0]]  # its owner's, where it says (see ``Meshes``)
        for group in mesh_dim_groups(dtensors[indices[0]].device_mesh if mesh is None else mesh):
            posted.any = True  # from its attempt: an interrupt right after it returns is one-sided
            dist.all_reduce(mesh_flags, op=dist.ReduceOp.MAX, group=group)
        values = mesh_flags.tolist()
        for position, index in enumerate(indices):
            missing, present, other, largest, negated_smallest = values[5 * position:5 * position + 5]
            agreed[index] = GradPresence(bool(missing), bool(present), bool(other), largest == -negated_smallest)
    return agreed
