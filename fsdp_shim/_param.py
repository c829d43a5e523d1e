"""One parameter of a summon: where it lives (``ScopedParam``) and what a context does with it
(``SummonedParam``): to full, to sharded, its changes, its writeback.

A *slot* is a ``(module, attribute name)`` pair; a parameter tied across two
modules has two slots, and stays one object in both. ``_place``
is the one writer of module slots in the package: entry puts the full
parameter in every slot (``to_full``), a forward inside puts its cast there
and back (``SummonedParam.cast_for_forward``), exit puts back the exact
objects the slots held (``to_sharded``). Which edits exit keeps, and when it
refuses: [Note: exit checks] at ``SummonedParam.judge``; how they are written:
[Note: writeback needs no collective], above ``write_back_locals``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _registry as registry
from fsdp_shim._compat import WRITABLE_PARTIAL_OPS, partial_reduce_op
from fsdp_shim._errors import WritebackRefusedError
from fsdp_shim._gather.layout import Dim0Layout, dim0_layout

#: What a slot of a summoned tensor holds at exit when it holds nothing (deleted inside).
MISSING = object()


@dataclass
class ScopedParam:
    """One distinct DTensor parameter in scope and every slot that holds it."""

    slots: list[tuple[nn.Module, str]]
    fsdp_param: fsdp2.FSDPParam | None = None  # None: a DTensor FSDP2 does not manage (TP)
    group: fsdp2.FSDPParamGroup | None = None
    is_buffer: bool = False  # a DTensor buffer: gathered and swapped like a parameter

    def sharded(self) -> nn.Parameter:
        """The DTensor parameter: FSDP2's (and the optimizer's) object, or the attribute's."""
        if self.fsdp_param is not None:
            return fsdp2.sharded_param(self.fsdp_param)
        module, name = self.slots[0]
        return self.tensors(module)[name]

    def tensors(self, module: nn.Module) -> dict[str, Any]:
        """The dict a slot of this entry lives in: ``_parameters`` or ``_buffers``."""
        return module._buffers if self.is_buffer else module._parameters


def shard_versions(sharded: DTensor) -> tuple[int, int, int]:
    """In-place changes to a shard: the DTensor's own version counter (DTensor ops bump it,
    not the local tensor's) and the local tensor's (direct edits of ``_local_tensor``).

    The shards are FSDP2's parameters, made outside any ``inference_mode``: they always
    have version counters (an in-place edit inside ``inference_mode`` bumps them too).
    """
    local = sharded._local_tensor
    return (sharded._version, id(local), local._version)


class SummonedParam:
    """One scoped parameter (or DTensor buffer) while a context holds it, on every rank.

    Made for every parameter in scope on every rank, holder of full tensors or
    not: the registry's record of the context (see [Note: every rank decides
    alike] in ``_summon``). Where this rank holds full tensors, ``to_full``
    puts one new ``nn.Parameter`` in every slot and ``to_sharded`` puts back
    the exact objects the slots held; elsewhere ``full`` stays None and the
    slots keep their shards. Those two, ``inspect_slots`` and
    ``carry_requires_grad`` take a context's parameters all at once: every summon runs them, so
    their loops make no call a parameter.
    """

    __slots__ = (
        "scoped", "sharded", "layout", "full", "full_version", "versions_at_entry", "shard_copy", "originals",
        "current", "shard_changed", "full_changed", "nothing_to_write",
    )

    def __init__(self, scoped: ScopedParam, sharded: DTensor, layout: Dim0Layout | None) -> None:
        self.scoped = scoped
        self.sharded = sharded  # the DTensor parameter, unchanged, restored on exit
        self.layout = layout  # how it was gathered; writeback reuses it
        #: What every slot holds inside: an nn.Parameter (a plain tensor for buffers); None on a rank
        #: that holds no full tensors (``rank0_only``), whose slots keep ``sharded``.
        self.full: torch.Tensor | None = None
        #: ``full._version`` once its values arrived; None for an inference tensor (no version counter).
        self.full_version: int | None = 0
        #: ``shard_versions(sharded)`` at entry; recorded only under writeback, the one reader of it and of
        #: ``shard_changed``.
        self.versions_at_entry = (0, 0, 0)
        #: The local shard's values at entry, under writeback only: an edit through ``.data`` moves no
        #: version counter, so exit compares values too. See [Note: exit checks].
        self.shard_copy: torch.Tensor | None = None
        #: What each slot held before ``to_full``, ``(tensors, name, object)``: what ``to_sharded`` puts back.
        self.originals: list[tuple[dict[str, Any], str, Any]] = []
        #: What the slots held at exit: ``full``, a replacement, or ``MISSING``. See [Note: exit checks].
        self.current: Any = None
        self.shard_changed = False  # by someone else, inside the context (set at exit, before any replay)
        self.full_changed = False  # the full tensor (or its replacement) holds edits (set with shard_changed)
        #: This rank's slice of ``current`` holds the shard's very bits: a write would change nothing.
        self.nothing_to_write = False

    @property
    def slots(self) -> list[tuple[nn.Module, str]]:
        return self.scoped.slots

    @property
    def is_buffer(self) -> bool:
        return self.scoped.is_buffer

    def cast_for_forward(self, dtype: torch.dtype, casts: dict[int, nn.Parameter], record: list[list[Any]]) -> None:
        """Put in each slot a cast to ``dtype`` of what it holds (one cast an object, in ``casts``); what
        the slots held is appended to ``record`` before any slot changes, for ``put_back``."""
        held = [module._parameters.get(name, MISSING) for module, name in self.scoped.slots]
        values = []
        for current in held:
            if isinstance(current, torch.Tensor) and current.is_floating_point() and current.dtype != dtype:
                cast = casts.get(id(current))
                if cast is None:
                    with torch.no_grad():
                        cast = casts[id(current)] = nn.Parameter(current.detach().to(dtype),
                                                                 requires_grad=current.requires_grad)
                current = cast
            values.append(current)
        record.append(held)  # recorded before it is placed: an interrupt in ``_place`` is put back too
        _place([(module._parameters, name, value) for (module, name), value in
                zip(self.scoped.slots, values, strict=True)])

    def put_back(self, held: list[Any]) -> None:
        """Undo ``cast_for_forward``: each slot holds what it held before (a deleted one stays deleted; one
        the cast had not reached yet holds it still)."""
        _place([(module._parameters, name, value) for (module, name), value in
                zip(self.scoped.slots, held, strict=False)])

    # -- exit --------------------------------------------------------------
    def may_hold_edits(self) -> bool:
        """Whether the full tensor may hold edits.

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
        if self.current is not self.full or self.full_version is None:
            return True
        assert self.full is not None  # inspected only where this rank holds full tensors
        return self.full._version != self.full_version

    def judge(self, exit_dtype: torch.dtype | None = None) -> None:
        """What changed inside a ``writeback=True`` context, by version counters and by value.

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

        One compare where nothing changed (this rank's slice of the full tensor
        against the shard); where they differ, each is compared with the shard as
        it was at entry, to tell which side changed.
        A ``Partial`` shard holds one of many values with the same reduction, so
        only versions judge it, and it is always written.

        ``exit_dtype``: the dtype the shard will have once the conversions made
        inside are replayed on it (``.double()`` through its unit), if another
        than its own. Values are compared in it, so an edit that only the new
        dtype can hold (``p.add_(2**-40)`` after ``.double()``) counts as one;
        the old shard widened as the replay widens it is the baseline.
        """
        sharded, current = self.sharded, self.current
        self.shard_changed = shard_versions(sharded) != self.versions_at_entry
        self.full_changed = self.may_hold_edits()
        if current is MISSING or any(p.is_partial() for p in sharded.placements):
            return
        if current.shape != sharded.shape:
            self.full_changed = True  # ``p.data = other_shape``: write_back_locals refuses it
            return
        local = sharded._local_tensor
        value = local_value(sharded, current.detach(), self.layout, exit_dtype)
        entry_copy = self.shard_copy
        if exit_dtype is not None and exit_dtype != local.dtype:
            local, entry_copy = local.to(exit_dtype), None if entry_copy is None else entry_copy.to(exit_dtype)
        if value is None or same_bits(value, local):
            self.nothing_to_write = True
            return
        self.shard_changed = self.shard_changed or not same_bits(local, entry_copy)
        self.full_changed = self.full_changed or not same_bits(value, entry_copy)

# -- a context's parameters, all at once: the loops every summon runs, kept free of calls ---------------

def _place(writes: Iterable[tuple[dict[str, Any], str, Any]]) -> None:
    """Each ``(tensors, name, value)``: ``value`` into a module's ``_parameters`` or ``_buffers`` dict
    (``MISSING``: the slot is emptied). The one writer of module slots in the package."""
    for tensors, name, value in writes:
        if value is MISSING:
            tensors.pop(name, None)
        else:
            tensors[name] = value


def hide_slots(slots: Sequence[tuple[dict[str, Any], str]]) -> list[tuple[dict[str, Any], str, Any]]:
    """Each slot emptied to ``None`` (which ``nn.Module`` skips) for a while, keeping its key and place;
    returns what they held, for ``put_back_slots``."""
    held = [(tensors, name, tensors[name]) for tensors, name in slots if tensors.get(name) is not None]
    _place([(tensors, name, None) for tensors, name, _ in held])
    return held


def put_back_slots(held: Sequence[tuple[dict[str, Any], str, Any]]) -> None:
    """Undo ``hide_slots``."""
    _place(held)


def to_full(params: Sequence[SummonedParam], fulls: Sequence[torch.Tensor | None],
            grads: dict[int, torch.Tensor] | None, writeback: bool) -> None:
    """Each full tensor (as a new ``nn.Parameter``, a plain tensor for a buffer) into every slot of its
    parameter: ties stay one object. What the slots held is kept first (``originals``), so
    ``to_sharded`` restores every slot whatever this call reached."""
    writes: list[tuple[dict[str, Any], str, Any]] = []
    for index, (param, full) in enumerate(zip(params, fulls, strict=True)):
        assert full is not None  # ranks that hold full tensors hold every one
        sharded, scoped = param.sharded, param.scoped
        value: torch.Tensor = full
        is_buffer = scoped.is_buffer
        if not is_buffer:
            # nn.Parameter(full, requires_grad), without its Python __new__ for the plain
            # tensors the gather makes: the very call that __new__ makes for them.
            value = (torch.Tensor._make_subclass(nn.Parameter, full, sharded.requires_grad)
                     if type(full) is torch.Tensor else nn.Parameter(full, requires_grad=sharded.requires_grad))
            if grads and index in grads:
                value.grad = grads[index]
        param.full = value
        param.full_version = None if value.is_inference() else value._version  # its values are in
        if writeback:
            param.versions_at_entry = shard_versions(sharded)
            param.shard_copy = sharded._local_tensor.clone()
        originals = param.originals
        for module, name in scoped.slots:
            tensors = module._buffers if is_buffer else module._parameters
            originals.append((tensors, name, tensors[name]))
            writes.append((tensors, name, value))
    _place(writes)  # every original is kept by now: ``to_sharded`` restores whatever this reached


def to_sharded(params: Sequence[SummonedParam]) -> None:
    """Every slot gets back the exact object it held before ``to_full`` (nothing, where it never ran)."""
    writes: list[tuple[dict[str, Any], str, Any]] = []
    for param in reversed(params):
        writes += param.originals
    _place(writes)
    for param in params:  # forgotten only once placed: a second call after an interrupt places them again
        param.originals = []


def inspect_slots(params: Sequence[SummonedParam],
                  exit_dtype: Callable[[SummonedParam], torch.dtype | None] | None = None) -> None:
    """Record what each parameter's slots hold now (``current``): its full tensor, a replacement, or
    ``MISSING``; with ``exit_dtype`` (under writeback), then judge each (``judge``). See [Note: exit checks]."""
    for param in params:
        full, scoped = param.full, param.scoped
        slots = scoped.slots
        if len(slots) == 1:  # the common case, and every summon's: one slot still holding the full tensor
            module, name = slots[0]
            if (module._buffers if scoped.is_buffer else module._parameters).get(name) is full:
                param.current = full
                continue
        values = [scoped.tensors(m).get(n, MISSING) for m, n in slots]
        if any(v is MISSING or v is None for v in values):
            param.current = MISSING
            continue
        replacements = list({id(v): v for v in values if v is not full}.values())
        if len(replacements) > 1 and not all(torch.equal(replacements[0], v) for v in replacements[1:]):
            param.current = MISSING  # tied slots replaced by different values: no one value
        else:
            param.current = replacements[0] if replacements else full
    if exit_dtype is not None:
        for param in params:
            param.judge(exit_dtype(param))


def carry_requires_grad(params: Sequence[SummonedParam]) -> None:
    """``requires_grad`` set inside carries over to the sharded parameter, as FSDP1
    (``use_orig_params=True``) keeps it on its one object."""
    for param in params:
        current = param.current
        if param.scoped.is_buffer or not isinstance(current, torch.Tensor):
            continue
        if current.requires_grad != param.sharded.requires_grad:
            param.sharded.requires_grad_(current.requires_grad)


def write_back(params: Sequence[SummonedParam], name: Callable[[SummonedParam], str], with_grads: bool) -> None:
    """All or nothing: every parameter is checked before the first byte is written.

    Under ``with_grads`` the gradients go into the same ``write_back_locals`` call as the parameters, so
    every value of both is checked and made (their allocations included) before the first write: a
    refusal, an out-of-memory error or an interrupt while a gradient's value is made writes no parameter
    either. ``name`` names a parameter in messages. Reads what ``SummonedParam.judge`` recorded.
    """
    problems: list[str] = []
    items: list[tuple[DTensor, torch.Tensor, Dim0Layout | None]] = []
    for item in params:
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
        raise WritebackRefusedError(
            "summon_full_params writeback refused, nothing written:\n  " + "\n  ".join(problems))
    if with_grads:  # written with the parameters, in one call: see the docstring
        for item in params:
            sharded_grad, full = item.sharded.grad, item.full
            if isinstance(sharded_grad, DTensor) and full is not None and full.grad is not None:
                items.append((sharded_grad, full.grad, None))
    write_back_locals(items)


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

    Every shape is checked, and every source made (a conversion or a
    redistribute allocates), before anything is written: a bad tensor, an
    allocation failure or an interrupt leaves all shards as they were. The
    write itself is one in-place copy into existing storage.
    """
    for dtensor, full, _ in items:
        if full.shape != dtensor.shape:
            raise WritebackRefusedError(
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


def same_bits(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether two tensors hold the very same bits: a NaN equals itself, -0.0 differs from 0.0.

    ``b`` None (no copy was kept) differs from anything. Floating tensors are
    compared as integers of their width (as fast as a float compare, and exact
    about NaN and signed zeros).
    """
    if b is None or a.shape != b.shape or a.dtype != b.dtype:
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


def sharded_param(param: torch.Tensor) -> nn.Parameter | None:
    """The sharded parameter a live context's full ``param`` stands for, else None."""
    summoned = cast("SummonedParam | None", registry.record_of(param))
    return None if summoned is None else summoned.scoped.sharded()


def original_params(param: torch.Tensor) -> list[nn.Parameter]:
    """Every object the slots of a summoned ``param`` held outside contexts.

    The sharded parameter and, for a unit a forward had left unsharded when
    a map was built, FSDP2's unsharded parameter too. Empty if ``param`` is
    not a live context's full parameter.
    """
    summoned = cast("SummonedParam | None", registry.record_of(param))
    if summoned is None:
        return []
    found = [summoned.scoped.sharded()]
    if summoned.scoped.fsdp_param is not None:
        unsharded = fsdp2.unsharded_param_if_any(summoned.scoped.fsdp_param)
        if unsharded is not None:
            found.append(unsharded)
    return found
