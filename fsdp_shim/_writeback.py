"""The local writeback: an edited full tensor back into this rank's shard, in place, with no collective.

[Note: writeback needs no collective]
Every rank already holds the whole (possibly edited) full tensor inside the
context, so each rank copies rows ``[r * c, r * c + local_rows)`` of it into
its own local shard, in place. HSDP replicas hold identical full tensors and
so write identical shards. This is what FSDP1's ``_writeback_to_local_shard``
does with its flat parameter. Other placements (tensor parallel, strided,
``Partial``) take their local value by a local redistribute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from fsdp_shim._compat import WRITABLE_PARTIAL_OPS, partial_reduce_op
from fsdp_shim._layout import Dim0Layout, dim0_layout


@torch.no_grad()
def write_back_locals(items: Sequence[tuple[DTensor, torch.Tensor, Dim0Layout | None]]) -> None:
    """Copy this rank's slice of each ``full`` into its ``dtensor``'s local shard, in place.

    No collective. See [Note: writeback needs no collective]. ``layout`` is
    the one the gather used, if it took the fast path. The fast-path copies
    run as one foreach op.

    Every shape is checked before anything is written, so a bad tensor leaves
    all shards as they were.
    """
    for dtensor, full, _ in items:
        if full.shape != dtensor.shape:
            raise RuntimeError(
                f"cannot write back a tensor of shape {tuple(full.shape)} into a parameter "
                f"of shape {tuple(dtensor.shape)}: writeback keeps the original shape"
            )
    destinations: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for dtensor, full, layout in items:  # every source is computed before anything is written
        source = local_value(dtensor, full, layout)
        if source is not None:
            destinations.append(dtensor._local_tensor)
            sources.append(source)
    if destinations:
        torch._foreach_copy_(destinations, sources)


def local_value(dtensor: DTensor, full: torch.Tensor, layout: Dim0Layout | None = None) -> torch.Tensor | None:
    """What this rank's shard of ``dtensor`` would hold for ``full``; None for an empty dim-0 shard.

    The value writeback copies in, and the one exit compares with the shard
    as it was at entry to tell an edit of the full tensor that no version
    counter saw (``p.data.copy_(new)``).
    """
    local = dtensor._local_tensor
    if layout is None:
        layout = dim0_layout(dtensor)
    if layout is None:
        return _local_value(dtensor, full)
    if not layout.local_rows:
        return None
    return full.narrow(0, layout.row_offset, layout.local_rows).to(local.device, local.dtype)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the very same bits: a NaN equals itself, -0.0 differs from 0.0.

    Floating tensors are compared as integers of their width (as fast as a
    float compare, and exact about NaN and signed zeros).
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        width = _SAME_WIDTH_INT.get(a.element_size(), torch.uint8)
        return torch.equal(a.reshape(-1).contiguous().view(width), b.reshape(-1).contiguous().view(width))
    return torch.equal(a, b)


def _local_value(dtensor: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor for ``full`` under ``dtensor``'s placements, with no communication.

    Replicate -> Shard (plain or strided) is a local chunk. A ``Partial`` mesh
    dim is written as a value whose reduction is ``full``: the full chunk on
    coordinate 0 and zeros elsewhere for a sum, the full chunk everywhere for
    avg, max and min.
    """
    local = dtensor._local_tensor
    mesh = dtensor.device_mesh
    placements = list(dtensor.placements)
    partial_ops = {dim: partial_reduce_op(p) for dim, p in enumerate(placements) if p.is_partial()}
    targets = [Replicate() if dim in partial_ops else p for dim, p in enumerate(placements)]
    replicated = DTensor.from_local(full.to(local.device, local.dtype), mesh, [Replicate()] * mesh.ndim,
                                    run_check=False)
    value = replicated.redistribute(mesh, targets).to_local()
    for dim, op in partial_ops.items():
        if op not in WRITABLE_PARTIAL_OPS:
            raise NotImplementedError(f"cannot write back into placement {placements[dim]}")
        if op == "sum" and mesh.get_local_rank(dim) != 0:
            value = torch.zeros_like(value)
    return value
