"""One parameter of a summon: where it lives (``ScopedParam``) and what a context does with it
(``SummonedParam``). A *slot* is a ``(module, attribute name)`` pair: a tied parameter has several, one object
in all. ``_place`` is the package's one writer of module slots.
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
    """In-place changes to a shard: the DTensor's version counter (DTensor ops bump it) and the local tensor's."""
    local = sharded._local_tensor
    return (sharded._version, id(local), local._version)


class SummonedParam:
    """One scoped parameter (or DTensor buffer) while a context holds it; the registry's record, made on every
    rank ([Note: every rank decides alike] in ``_summon``)."""

    __slots__ = (
        "scoped", "sharded", "layout", "full", "full_version", "versions_at_entry", "shard_copy", "originals",
        "current", "shard_changed", "full_changed", "nothing_to_write",
    )

    def __init__(self, scoped: ScopedParam, sharded: DTensor, layout: Dim0Layout | None) -> None:
        self.scoped = scoped
        self.sharded = sharded
        self.layout = layout  # how it was gathered; writeback reuses it
        self.full: torch.Tensor | None = None  # in every slot inside; None where this rank holds none
        self.full_version: int | None = 0  # ``full._version`` once its values arrived; None: no counter
        self.versions_at_entry = (0, 0, 0)  # under writeback only, as ``shard_copy``
        self.shard_copy: torch.Tensor | None = None
        self.originals: list[tuple[dict[str, Any], str, Any]] = []  # what ``to_sharded`` puts back
        self.current: Any = None  # what the slots held at exit: ``full``, a replacement, or ``MISSING``
        self.shard_changed = False  # these three: set by ``judge``, before any replay
        self.full_changed = False
        self.nothing_to_write = False

    @property
    def slots(self) -> list[tuple[nn.Module, str]]:
        return self.scoped.slots

    @property
    def is_buffer(self) -> bool:
        return self.scoped.is_buffer

    def cast_for_forward(self, dtype: torch.dtype, casts: dict[int, nn.Parameter], record: list[list[Any]]) -> None:
        """Put in each slot a cast to ``dtype`` of what it holds (one cast an object, in ``casts``)."""
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
        """Undo ``cast_for_forward`` (a slot it had not reached yet holds its value still)."""
        _place([(module._parameters, name, value) for (module, name), value in
                zip(self.scoped.slots, held, strict=False)])

    # -- exit --------------------------------------------------------------
    def may_hold_edits(self) -> bool:
        """Whether the full tensor may hold edits (one without a version counter may: the values decide)."""
        if self.current is not self.full or self.full_version is None:
            return True
        assert self.full is not None  # inspected only where this rank holds full tensors
        return self.full._version != self.full_version

    def judge(self, exit_dtype: torch.dtype | None = None) -> None:
        """What changed inside a ``writeback=True`` context, per rank, for ``write_back``: by version *and* by
        value, bit for bit against the shard copied at entry (an edit through ``.data`` moves no counter); a
        slice still holding the shard's bits is not written. A ``Partial`` shard is judged by versions only and
        always written. ``exit_dtype``: the shard's dtype once conversions inside are replayed, if another;
        values compare in it."""
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

# -- a context's parameters at once: every summon runs these loops, so they make no call a parameter ----

def _place(writes: Iterable[tuple[dict[str, Any], str, Any]]) -> None:
    """Each ``(tensors, name, value)`` into a module's ``_parameters`` or ``_buffers`` (``MISSING``: emptied)."""
    for tensors, name, value in writes:
        if value is MISSING:
            tensors.pop(name, None)
        else:
            tensors[name] = value


def hide_slots(slots: Sequence[tuple[dict[str, Any], str]]) -> list[tuple[dict[str, Any], str, Any]]:
    """Each slot emptied to ``None`` (which ``nn.Module`` skips), keeping its key; returns what they held."""
    held = [(tensors, name, tensors[name]) for tensors, name in slots if tensors.get(name) is not None]
    _place([(tensors, name, None) for tensors, name, _ in held])
    return held


def put_back_slots(held: Sequence[tuple[dict[str, Any], str, Any]]) -> None:
    """Undo ``hide_slots``."""
    _place(held)


def to_full(params: Sequence[SummonedParam], fulls: Sequence[torch.Tensor | None],
            grads: dict[int, torch.Tensor] | None, writeback: bool) -> None:
    """Each full tensor (a new ``nn.Parameter``, plain for a buffer) into every slot of its parameter."""
    writes: list[tuple[dict[str, Any], str, Any]] = []
    for index, (param, full) in enumerate(zip(params, fulls, strict=True)):
        assert full is not None  # ranks that hold full tensors hold every one
        sharded, scoped = param.sharded, param.scoped
        value: torch.Tensor = full
        is_buffer = scoped.is_buffer
        if not is_buffer:
            value = (torch.Tensor._make_subclass(nn.Parameter, full, sharded.requires_grad)  # __new__'s own call
                     if type(full) is torch.Tensor else nn.Parameter(full, requires_grad=sharded.requires_grad))
            if grads and index in grads:
                value.grad = grads[index]
        param.full = value
        param.full_version = None if value.is_inference() else value._version
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
    """Record what each parameter's slots hold now (``current``); under writeback (``exit_dtype``), judge each."""
    for param in params:
        full, scoped = param.full, param.scoped
        slots = scoped.slots
        if len(slots) == 1:  # the common case: one slot still holding the full tensor
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
    """``requires_grad`` set inside carries to the sharded parameter, as FSDP1 (``use_orig_params``) keeps it."""
    for param in params:
        current = param.current
        if param.scoped.is_buffer or not isinstance(current, torch.Tensor):
            continue
        if current.requires_grad != param.sharded.requires_grad:
            param.sharded.requires_grad_(current.requires_grad)


def write_back(params: Sequence[SummonedParam], name: Callable[[SummonedParam], str], with_grads: bool) -> None:
    """All or nothing, by what ``judge`` recorded: a slot holding a replacement (``load_state_dict(assign=True)``)
    is written, as FSDP1 does; a shard changed alone stays; a deleted slot, or one changed both in full and in
    its shard, refuses the whole writeback naming every such parameter. Gradients (``with_grads``) go into the
    same ``write_back_locals`` call, so a failure making one writes no parameter either."""
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
    if with_grads:
        for item in params:
            sharded_grad, full = item.sharded.grad, item.full
            if isinstance(sharded_grad, DTensor) and full is not None and full.grad is not None:
                items.append((sharded_grad, full.grad, None))
    write_back_locals(items)


@torch.no_grad()
def write_back_locals(items: Sequence[tuple[DTensor, torch.Tensor, Dim0Layout | None]]) -> None:
    """This rank's slice of each ``full`` into its ``dtensor``'s local shard, in place, with no collective
    (as FSDP1's ``_writeback_to_local_shard``). Every shape is checked and every source made before anything is
    written: a failure or an interrupt leaves all shards as they were."""
    for dtensor, full, _ in items:
        if full.shape != dtensor.shape:
            raise WritebackRefusedError(
                f"cannot write back a tensor of shape {tuple(full.shape)} into a parameter "
                f"of shape {tuple(dtensor.shape)}: writeback keeps the original shape"
            )
    destinations: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for dtensor, full, layout in items:
        source = local_value(dtensor, full, layout)
        if source is not None:
            destinations.append(dtensor._local_tensor)
            sources.append(source)
    if destinations:
        torch._foreach_copy_(destinations, sources)


def local_value(
    dtensor: DTensor, full: torch.Tensor, layout: Dim0Layout | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """What this rank's shard of ``dtensor`` would hold for ``full``, in the shard's dtype (or ``dtype``);
    None for an empty dim-0 shard."""
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
    """The very same bits (a NaN equals itself, -0.0 differs from 0.0); ``b`` None differs from anything."""
    if b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        width = _SAME_WIDTH_INT.get(a.element_size(), torch.uint8)
        return torch.equal(a.reshape(-1).contiguous().view(width), b.reshape(-1).contiguous().view(width))
    return torch.equal(a, b)


def _local_value(dtensor: DTensor, full: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's local tensor for ``full`` under ``dtensor``'s placements, with no communication. A
    ``Partial`` dim gets a value whose reduction is ``full``: zeros off coordinate 0 for a sum."""
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
    """What a live full ``param``'s slots held outside contexts: the sharded parameter and FSDP2's unsharded
    one, if any (a map built after a forward holds it); else empty."""
    summoned = cast("SummonedParam | None", registry.record_of(param))
    if summoned is None:
        return []
    found = [summoned.scoped.sharded()]
    if summoned.scoped.fsdp_param is not None:
        unsharded = fsdp2.unsharded_param_if_any(summoned.scoped.fsdp_param)
        if unsharded is not None:
            found.append(unsharded)
    return found
