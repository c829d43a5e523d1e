"""What exit inspects, and the writeback policy it decides: which edits are kept, which refused.

A summon's exit reads, before anything is restored or replayed, what each
summoned tensor's slots hold (``inspect_slots``) and, under ``writeback=True``,
what changed where (``judge_changes``); ``write_back`` then writes all or
nothing. ``_summon`` calls them in that order.

[Note: exit checks]
Before the slots are restored, each summoned tensor's slots are read: they
hold its full tensor, a replacement (assignment, ``load_state_dict(assign=
True)``), or nothing (deleted). ``requires_grad`` of what they hold carries over
to the sharded parameter, as FSDP1 (``use_orig_params=True``) keeps it. Under
``writeback=True`` a replacement is written back (FSDP1 writes back the new
value of a replaced original parameter too), and the whole writeback is
refused, with nothing written and every parameter named, for a deleted slot,
or for a parameter changed both as a full tensor and in its shard (say an
optimizer step on the sharded parameter): one of the two changes would be
lost. A shard changed while its full tensor was not is left as it is.
"Changed" is decided by version counters *and* by value: under
``writeback=True`` entry keeps a copy of each local shard, and exit compares
both the shard and this rank's slice of the full tensor with it, bit for
bit, because an edit through ``.data`` (``p.data.copy_(new)``, optimizers
that step ``p.data``) moves no counter. A full tensor whose slice still
holds the shard's bits is not written (the write would change nothing). The
decision is per rank, like the writeback itself: an edit that reaches only
some ranks' slices is judged on each rank by what reached it.

[Note: inference mode]
A summon entered under ``torch.inference_mode()`` (generation code often is)
gathers into inference tensors, which have no version counter, so an edit
of a full tensor cannot be detected by version there. Such a full tensor
counts as changed by version, and the value compare of [Note: exit checks]
decides: a slice that still holds the shard's bits is not written, any
other is, and if its shard also changed inside the context the writeback is
refused as for any parameter changed on both sides. Nothing else in the
context reads a version of a full tensor (a forward inside casts afresh
every time). Shards are FSDP2's parameters, made outside inference mode,
and keep their counters.
``no_grad`` and ``enable_grad`` inside change nothing here: versions are
counted either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from fsdp_shim._compat import WRITABLE_PARTIAL_OPS, partial_reduce_op
from fsdp_shim._gather.layout import Dim0Layout, dim0_layout
from fsdp_shim._scope import ScopedParam

#: What a slot of a summoned tensor holds at exit when it holds nothing (deleted inside).
MISSING = object()


def shard_versions(sharded: DTensor) -> tuple[int, int, int]:
    """In-place changes to a shard: the DTensor's own version counter (DTensor ops bump it,
    not the local tensor's) and the local tensor's (direct edits of ``_local_tensor``).

    The shards are FSDP2's parameters, made outside any ``inference_mode``: they always
    have version counters (an in-place edit inside ``inference_mode`` bumps them too).
    """
    local = sharded._local_tensor
    return (sharded._version, id(local), local._version)


def judge_changes(item: SwappedParam, exit_dtype: torch.dtype | None = None) -> None:
    """What changed inside a ``writeback=True`` context, by version counters and by value.

    See [Note: exit checks]. One compare where nothing changed (this rank's
    slice of the full tensor against the shard); where they differ, each is
    compared with the shard as it was at entry, to tell which side changed.
    A ``Partial`` shard holds one of many values with the same reduction, so
    only versions judge it, and it is always written.

    ``exit_dtype``: the dtype the shard will have once the conversions made
    inside are replayed on it (``.double()`` through its unit), if another
    than its own. Values are compared in it, so an edit that only the new
    dtype can hold (``p.add_(2**-40)`` after ``.double()``) counts as one;
    the old shard widened as the replay widens it is the baseline.
    """
    item.shard_changed = shard_versions(item.sharded) != item.shard_versions
    item.full_changed = item.changed_full()
    if item.current is MISSING or any(p.is_partial() for p in item.sharded.placements):
        return
    if item.current.shape != item.sharded.shape:
        item.full_changed = True  # ``p.data = other_shape``: write_back_locals refuses it
        return
    local = item.sharded._local_tensor
    value = local_value(item.sharded, item.current.detach(), item.layout, exit_dtype)
    entry_copy = item.shard_copy
    if exit_dtype is not None and exit_dtype != local.dtype:
        local, entry_copy = local.to(exit_dtype), None if entry_copy is None else entry_copy.to(exit_dtype)
    if value is None or same_bits(value, local):
        item.nothing_to_write = True
        return
    item.shard_changed = item.shard_changed or not same_bits(local, entry_copy)
    item.full_changed = item.full_changed or not same_bits(value, entry_copy)


@dataclass(slots=True)
class SwappedParam:
    """One scoped parameter (or DTensor buffer) while summoned."""

    entry: ScopedParam
    sharded: DTensor  # the DTensor parameter, unchanged, restored on exit
    #: What every slot holds inside: an nn.Parameter (a plain tensor for buffers); None on a rank that
    #: holds no full tensors (``rank0_only``), whose slots keep ``sharded``.
    full: torch.Tensor | None
    layout: Dim0Layout | None  # how it was gathered; writeback reuses it
    #: full._version once its values arrived; None for an inference tensor (no version counter).
    full_version: int | None = 0
    #: See ``shard_versions``; recorded only under writeback, the one reader of it and of ``shard_changed``.
    shard_versions: tuple[int, int, int] = (0, 0, 0)
    #: The local shard's values at entry, under writeback only: an edit through ``.data`` moves no
    #: version counter, so exit compares values too. See [Note: exit checks].
    shard_copy: torch.Tensor | None = None
    #: What the slots held at exit: ``full``, a replacement, or ``MISSING``. See [Note: exit checks].
    current: Any = None
    shard_changed: bool = False  # by someone else, inside the context (set at exit, before any replay)
    full_changed: bool = False  # the full tensor (or its replacement) holds edits (set with shard_changed)
    #: This rank's slice of ``current`` holds the shard's very bits: a write would change nothing.
    nothing_to_write: bool = False

    @property
    def slots(self) -> list[tuple[nn.Module, str]]:
        return self.entry.slots

    @property
    def is_buffer(self) -> bool:
        return self.entry.is_buffer

    def changed_full(self) -> bool:
        """Whether the full tensor may hold edits. See [Note: inference mode]."""
        if self.current is not self.full or self.full_version is None:
            return True
        return self.full._version != self.full_version


def inspect_slots(swapped: list[SwappedParam]) -> None:
    """Record what each summoned tensor's slots hold now: its full tensor, a replacement, or ``MISSING``."""
    for item in swapped:
        slots = item.entry.slots
        if len(slots) == 1:  # the common case, and every summon's: one slot still holding the full tensor
            module, name = slots[0]
            if (module._buffers if item.entry.is_buffer else module._parameters).get(name) is item.full:
                item.current = item.full
                continue
        values = [item.entry.tensors(m).get(n, MISSING) for m, n in slots]
        if any(v is MISSING or v is None for v in values):
            item.current = MISSING
            continue
        replacements = list({id(v): v for v in values if v is not item.full}.values())
        if len(replacements) > 1 and not all(torch.equal(replacements[0], v) for v in replacements[1:]):
            item.current = MISSING  # tied slots replaced by different values: no one value
        else:
            item.current = replacements[0] if replacements else item.full


def write_back(swapped: list[SwappedParam], name: Callable[[SwappedParam], str], with_grads: bool) -> None:
    """All or nothing: every parameter is checked before the first byte is written.

    ``name`` names a parameter in messages. Reads what ``judge_changes`` recorded.
    """
    problems: list[str] = []
    items: list[tuple[DTensor, torch.Tensor, Dim0Layout | None]] = []
    for item in swapped:
        if item.current is MISSING:
            problems.append(f"{name(item)}: deleted (or tied slots replaced by different tensors) "
                            "inside the context, so there is no value to write back")
            continue
        if item.nothing_to_write:
            continue
        if item.shard_changed:
            if item.full_changed:
                problems.append(
                    f"{name(item)}: changed inside the context and, separately, in its shard "
                    "(an optimizer step on the sharded parameter?); writeback would overwrite one of them"
                )
            continue  # the shard's own change stands; the full tensor holds nothing new
        items.append((item.sharded, item.current.detach(), item.layout))
    if problems:
        raise RuntimeError("summon_full_params writeback refused, nothing written:\n  " + "\n  ".join(problems))
    write_back_locals(items)
    if with_grads:
        write_back_locals([
            (item.sharded.grad, item.full.grad, None)  # type: ignore[misc]
            for item in swapped
            if item.sharded.grad is not None and item.full.grad is not None
        ])


# -- the writeback ---------------------------------------------------------------------------------
# The local writeback: an edited full tensor back into this rank's shard, in place, with no collective.
#
# [Note: writeback needs no collective]
# Every rank already holds the whole (possibly edited) full tensor inside the
# context, so each rank copies rows ``[r * c, r * c + local_rows)`` of it into
# its own local shard, in place. HSDP replicas hold identical full tensors and
# so write identical shards. This is what FSDP1's ``_writeback_to_local_shard``
# does with its flat parameter. Other placements (tensor parallel, strided,
# ``Partial``) take their local value by a local redistribute.


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


def local_value(
    dtensor: DTensor, full: torch.Tensor, layout: Dim0Layout | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """What this rank's shard of ``dtensor`` would hold for ``full``, in the shard's dtype (or
    ``dtype``); None for an empty dim-0 shard.

    The value writeback copies in, and the one exit compares with the shard
    as it was at entry to tell an edit of the full tensor that no version
    counter saw (``p.data.copy_(new)``).
    """
    local = dtensor._local_tensor
    if layout is None:
        layout = dim0_layout(dtensor)
    if layout is None:
        return _local_value(dtensor, full, dtype)
    if not layout.local_rows:
        return None
    return full.narrow(0, layout.row_offset, layout.local_rows).to(local.device, dtype or local.dtype)


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


def _local_value(dtensor: DTensor, full: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
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
    replicated = DTensor.from_local(full.to(local.device, dtype or local.dtype), mesh, [Replicate()] * mesh.ndim,
                                    run_check=False)
    value = replicated.redistribute(mesh, targets).to_local()
    for dim, op in partial_ops.items():
        if op not in WRITABLE_PARTIAL_OPS:
            raise NotImplementedError(f"cannot write back into placement {placements[dim]}")
        if op == "sum" and mesh.get_local_rank(dim) != 0:
            value = torch.zeros_like(value)
    return value
