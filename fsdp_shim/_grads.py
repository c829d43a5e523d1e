"""Gradients under ``with_grads``: which exist, agreed by every rank, then gathered.

Which gradients exist is rank-local (``.grad``), and the collectives a call runs must not be
(see [Note: every rank decides alike] in ``_summon``): the ranks agree first, in one small
all-reduce a mesh (``_gather.engine.agree_on_grads``), then the agreed gradients are gathered
like the parameters, into full gradients by scope position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_shim import _registry as registry
from fsdp_shim._gather.engine import Posted, agree_on_grads, gather_full_tensors
from fsdp_shim._gather.layout import Receiver
from fsdp_shim._refusals import group_in_use, refuse_grad_layouts, refuse_placements
from fsdp_shim._scope import Scope, module_label, slot_fqn

__all__ = ["agreed_grads", "gather_grads"]


def agreed_grads(
    module: nn.Module, scope: Scope, dtensors: list[DTensor], writeback: bool, thread: int
) -> tuple[list[tuple[int, DTensor]], list[dist.ProcessGroup]]:
    """The gradients to gather under ``with_grads``, as every rank agrees (one small all-reduce a mesh), and
    the process groups of those on another mesh, claimed for ``thread`` (the caller releases them).

    Which gradients exist is rank-local (a rank whose parameter took no
    part in the backward has none), and the buckets a gather runs must be
    the same on every rank. So, as FSDP1's ``unshard_grad`` does, the ranks
    agree first: a gradient that no rank of its parameter's mesh has stays
    ``None``; one that some ranks lack is gathered with zeros there (and is
    ``None`` again on those ranks after exit). A gradient on another layout
    than its parameter (mesh, placements, shape or dtype) is gathered by its
    own spec where every rank has one laid out the same way, and refused on
    every rank otherwise: zeros could not be given its layout, and differing
    layouts gather differently.
    """
    by_mesh: dict[int, list[int]] = {}
    meshes = scope.meshes  # FSDP2's, where they differ from the specs' (see [Note: the group is FSDP2's])
    for index, dtensor in enumerate(dtensors):
        mesh = None if meshes is None else meshes[index]
        by_mesh.setdefault(id(dtensor.device_mesh if mesh is None else mesh), []).append(index)
    agreed = agree_on_grads(dtensors, by_mesh, meshes)  # a collective, before any gather
    chosen: list[tuple[int, DTensor]] = []
    foreign: list[tuple[Callable[[], str], DTensor]] = []
    call = f"summon_full_params({module_label(module)}, with_grads=True)"
    for index, (missing, present, other_layout, one_layout) in agreed.items():
        if not present:
            continue
        sharded = dtensors[index]
        grad = sharded.grad
        def name(i: int = index) -> str:
            return f"{slot_fqn(module, scope.params[i].slots[0])}.grad"
        if other_layout:  # refused alike: every rank knows what every other holds
            if missing or not one_layout:
                raise refuse_grad_layouts(call, name())
            if not isinstance(grad, DTensor):
                raise refuse_grad_layouts(call, name(), type(grad))
            foreign.append((name, grad))
        if grad is None:
            grad = torch.zeros_like(sharded)  # FSDP1's zeros, in the parameter's layout: no communication
        chosen.append((index, cast(DTensor, grad)))
    # gradients on another mesh: their groups are checked (refused before any write), then claimed
    groups = refuse_placements(foreign, writeback=writeback) if foreign else []
    if groups and not registry.claim(thread, groups):
        raise group_in_use(call)
    return chosen, groups


def gather_grads(
    grads: list[tuple[int, DTensor]], holds_fulls: bool, out_device: torch.device | None, bucket_bytes: int,
    receiver: Receiver, collective_bytes: int | None, posted: Posted, meshes: list[Any] | None = None,
) -> dict[int, torch.Tensor]:
    """Gather the agreed gradients (``agreed_grads``): full gradients by scope position,
    over their parameters' ``meshes`` (the scope's)."""
    gathered = gather_full_tensors(
        [grad for _, grad in grads],
        holds_fulls=holds_fulls,
        out_device=out_device,
        bucket_bytes=bucket_bytes,
        receiver=receiver,
        collective_bytes=collective_bytes,
        meshes=None if meshes is None else [meshes[i] for i, _ in grads],
        posted=posted,
    )
    return {i: g for (i, _), g in zip(grads, gathered.tensors, strict=True) if g is not None}
