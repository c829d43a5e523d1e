"""Who receives full tensors, and whether this rank keeps them: FSDP1's ``rank0_only``, on meshes.

The one place that decides it, for the summon and for the stream. The gather
engine is told the answer (a ``_layout.Receiver``, and ``keep`` for this
rank) and never decides it.

FSDP1's ``rank0_only`` means rank 0 *of the FSDP shard group*: under HSDP that
is rank 0 of every replica. With no FSDP2 unit to name a shard group (tensor
parallel alone, or the stream, which walks a whole model whose units may sit
on different meshes) it is global rank 0. The gather may deliver to more
ranks than keep (a superset is always correct); it never delivers to fewer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from fsdp_shim import _fsdp2_internals as fsdp2
from fsdp_shim._layout import Receiver
from fsdp_shim._scope import Scope


class Receivers(NamedTuple):
    receiver: Receiver  # which ranks the gather delivers to
    keep: bool  # whether this rank keeps the full tensors it is delivered


_EVERY_RANK = Receivers("all", True)


def for_summon(scope: Scope, rank0_only: bool) -> Receivers:
    """Who receives a summon's full tensors (see the module docstring)."""
    if not rank0_only:
        return _EVERY_RANK
    if not scope.groups:
        return Receivers("global_rank0", dist.get_rank() == 0)
    keep = True
    for group in scope.groups:  # a per-unit summon's path: a loop, not a generator
        if fsdp2.shard_rank(group) != 0:
            keep = False
            break
    if scope.fsdp2_only:
        # each shard group's rank 0 keeps, and is rank 0 of the group the gather runs over
        return Receivers("group_rank0", keep)
    return Receivers("all", keep)  # FSDP2 units and other DTensors in one call: the simple, safe answer


def for_stream(rank0_only: bool) -> Receivers:
    """Who receives ``iter_full_params``' tensors: every rank, or global rank 0 alone."""
    if not rank0_only:
        return _EVERY_RANK
    return Receivers("global_rank0", not dist.is_initialized() or dist.get_rank() == 0)
