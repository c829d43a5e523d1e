"""``iter_full_params``: the stream's plan (``batch_params``, which ``_vllm`` reuses) and its batches in flight."""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _health as health
from fsdp_shim import _registry as registry
from fsdp_shim._common import run_each
from fsdp_shim._gather.engine import BucketGather, resolve_device, start_gather
from fsdp_shim._gather.layout import (
    Receiver,
    bucket_cap,
    gathered_dtype,
    receivers_for_stream,
)
from fsdp_shim._refusals import on_meta_device, refuse_busy, refuse_placements, untracked_parameter
from fsdp_shim._scope import fsdp_slot_owners, module_label, slot_key, tracked_sharded
from fsdp_shim._scope_rule import is_fsdp1_tree

logger = logging.getLogger("fsdp_shim")

#: The stream's default bucket cap, in MiB: larger than the summon's 4, measured in ``docs/gather-engine.md``.
STREAM_BUCKET_MB = 6.0

FullParams = Iterator[tuple[str, torch.Tensor | None]]
KeepDtype = str | Sequence[str] | Callable[[str], bool] | None


def name_matcher(keep_dtype: KeepDtype) -> Callable[[str], bool] | None:
    """``keep_dtype`` as a predicate on a parameter's name; ``TypeError`` for anything else."""
    if keep_dtype is None:
        return None
    if isinstance(keep_dtype, str):
        keep_dtype = (keep_dtype,)
    if callable(keep_dtype):
        return keep_dtype
    patterns = list(keep_dtype) if isinstance(keep_dtype, Sequence) else None
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            "iter_full_params: keep_dtype must be a glob pattern, a non-empty sequence of them, or a "
            f"predicate on the parameter's name, got {keep_dtype!r}"
        )
    return lambda name: any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclass
class _Batch:
    """Parameters gathered together: one FSDP2 unit, or a run of unmanaged ones."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)  # sharded DTensors or plain tensors
    casts: list[torch.dtype | None] = field(default_factory=list)  # what each travels in; None: stored
    nbytes: int = 0  # gathered size
    meshes: list[Any] = field(default_factory=list)  # FSDP2's gather mesh where it differs, else None


class _Distinct(NamedTuple):
    """One distinct parameter: every name it has (a tie has several), what to gather, its unit."""

    names: list[str]
    tensor: torch.Tensor
    unit: object | None  # the FSDP2 param group that manages it
    mesh: Any  # the mesh FSDP2 gathers it over, where it differs from the DTensor's (``_fsdp2.gather_mesh``)


def _distinct_params(model: nn.Module) -> list[_Distinct]:
    """Every distinct parameter of ``model`` in ``named_parameters()`` order, with all its names."""
    named = list(model.named_modules())
    states = {id(s): s for s in (fsdp2.fsdp_state_of(m) for _, m in named) if s is not None}
    owners = fsdp_slot_owners(states.values()).by_slot
    found: dict[int, _Distinct] = {}
    for prefix, module in named:
        for name, value in module._parameters.items():
            if value is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            key = slot_key(module, name)
            owner = owners.get(key)
            tensor: torch.Tensor = value
            if owner is not None:  # FSDP2's sharded parameter, whatever form the slot holds
                sharded = tracked_sharded(owner[0], owner[1], module, name)
                if sharded is None:
                    raise untracked_parameter(fqn)
                tensor = sharded
            else:  # a slot a live summon holds stands for the DTensor it summoned, on every rank alike
                record = registry.summoned_at(key, value)
                if record is not None:
                    tensor = value = record.sharded
            identity: object = owner[0] if owner is not None else value
            if id(identity) in found:
                found[id(identity)].names.append(fqn)
                continue
            found[id(identity)] = _Distinct([fqn], tensor, owner[1] if owner is not None else None,
                                            None if owner is None else fsdp2.gather_mesh(owner[0]))
    return list(found.values())


def batch_params(
    model: nn.Module, bucket_bytes: int, cast_to: torch.dtype | None, uncast: Callable[[str], bool] | None = None,
) -> list[_Batch]:
    """Every distinct parameter, batched: one batch per FSDP2 unit, unmanaged ones cut at the bucket cap, small
    neighbours merged. Reads structure only: every rank plans alike. ``uncast``: names that keep their dtype."""
    batches: dict[int, _Batch] = {}
    ordered: list[_Batch] = []
    rest: _Batch | None = None
    uncast_count = 0
    for param in _distinct_params(model):
        cast = cast_to
        if cast_to is not None and uncast is not None and any(uncast(name) for name in param.names):
            cast, uncast_count = None, uncast_count + 1
        nbytes = param.tensor.numel() * gathered_dtype(param.tensor, cast).itemsize
        if param.unit is not None:
            batch = batches.get(id(param.unit))
            if batch is None:
                batch = batches[id(param.unit)] = _Batch()
                ordered.append(batch)
        else:
            if rest is None or (rest.tensors and rest.nbytes + nbytes > bucket_bytes):
                rest = _Batch()
                ordered.append(rest)
            batch = rest
        batch.names.append(param.names[0])
        batch.tensors.append(param.tensor)
        batch.casts.append(cast)
        batch.meshes.append(param.mesh)
        batch.nbytes += nbytes
    if cast_to is not None and uncast is not None and not uncast_count:
        logger.warning("iter_full_params: keep_dtype matched no parameter; every floating one is cast to %s", cast_to)
    return _merge_small(ordered, bucket_bytes)


def _merge_small(batches: list[_Batch], bucket_bytes: int) -> list[_Batch]:
    """Consecutive batches that fit one bucket together, merged: one collective, not several."""
    merged: list[_Batch] = []
    for batch in batches:
        last = merged[-1] if merged else None
        if last is not None and last.nbytes + batch.nbytes <= bucket_bytes:
            last.names += batch.names
            last.tensors += batch.tensors
            last.casts += batch.casts
            last.meshes += batch.meshes
            last.nbytes += batch.nbytes
        else:
            merged.append(_Batch(list(batch.names), list(batch.tensors), list(batch.casts), batch.nbytes,
                                 list(batch.meshes)))
    return merged


class _InFlightBatch:
    """One batch, staged and (unless ``launch=False``) launched: one gather per dtype, in order of first
    appearance (alike on every rank); if one fails to start, those started are waited for first."""

    def __init__(self, batch: _Batch, bucket_bytes: int, receiver: Receiver, posted: health.Call, launch: bool = True):
        self.batch = batch
        by_cast: dict[torch.dtype | None, tuple[list[int], list[DTensor], list[Any]]] = {}
        for index, (tensor, cast, mesh) in enumerate(zip(batch.tensors, batch.casts, batch.meshes, strict=True)):
            if isinstance(tensor, DTensor):
                indices, dtensors, meshes = by_cast.setdefault(cast, ([], [], []))
                indices.append(index)
                dtensors.append(tensor)
                meshes.append(mesh)
        self._pending: list[tuple[list[int], BucketGather]] = []
        try:
            for cast, (indices, dtensors, meshes) in by_cast.items():
                self._pending.append((indices, start_gather(dtensors, cast_to=cast, bucket_bytes=bucket_bytes,
                                                            receiver=receiver, launch=launch, meshes=meshes,
                                                            posted=posted)))
        except BaseException:
            self.drop()
            raise

    def launch(self) -> None:
        """Launch the staged collectives (a collective: every rank, in batch order)."""
        for _, pending in self._pending:
            pending.launch()

    def wait(self) -> list[Callable[[], object]]:
        """Wait for the batch's collectives; returns what blocks the host until they complete."""
        fences: list[Callable[[], object]] = []
        try:
            for _, pending in self._pending:
                fence = pending.wait()
                if fence is not None:
                    fences.append(fence)
        except BaseException:
            self.drop()
            raise
        return fences

    def finish(self, holds_fulls: bool, out_device: torch.device | None) -> list[torch.Tensor | None]:
        fulls: list[torch.Tensor | None] = [None] * len(self.batch.tensors)
        try:
            for indices, pending in self._pending:
                batch_fulls = pending.finish(holds_fulls=holds_fulls, out_device=out_device).tensors  # None: not held
                for index, full in zip(indices, batch_fulls, strict=True):
                    fulls[index] = full
        except BaseException:
            self.drop()
            raise
        self._pending = []
        if holds_fulls:
            for index, (tensor, cast) in enumerate(zip(self.batch.tensors, self.batch.casts, strict=True)):
                if fulls[index] is None and not isinstance(tensor, DTensor):
                    # a copy, always: ``.to()`` may return the parameter itself, which changes with the model
                    dtype = gathered_dtype(tensor, cast)
                    fulls[index] = tensor.detach().to(device=out_device or tensor.device, dtype=dtype, copy=True)
        return fulls

    def drop(self) -> BaseException | None:
        """Wait for every launched gather, each even if another's wait raises, and drop them; the first error."""
        pending_gathers, self._pending = self._pending, []
        return run_each(pending.abandon for _, pending in pending_gathers)


def _drop_all(in_flight: list[_InFlightBatch], raising: bool = False) -> None:
    """Wait for every launched gather; ``raising``: raise the first failed wait (off error paths)."""
    error = None
    try:
        for pending in in_flight:
            error = pending.drop() or error
    finally:
        in_flight.clear()
    if raising and error is not None:
        raise error


def check_stream_args(
    model: object, dtype: object, bucket_mb: float | None, keep_dtype: object = None, device: object = None,
) -> None:
    """Refuse bad arguments at the call, before the generator (and any collective) starts."""
    bucket_cap(bucket_mb, STREAM_BUCKET_MB)
    if device is not None:
        torch.device(device)  # type: ignore[call-overload]  # raises for a device torch cannot name
    name_matcher(keep_dtype)  # type: ignore[arg-type]  # any object: raises TypeError for one it cannot use
    if not isinstance(model, nn.Module):
        raise TypeError(f"iter_full_params expects an nn.Module, got {type(model).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"iter_full_params: dtype must be a floating torch.dtype or None, got {dtype!r}")
    if is_fsdp1_tree(model, recurse=True):
        raise TypeError(
            "iter_full_params serves FSDP2, HSDP and tensor-parallel (DTensor) models; this one holds FSDP1 "
            "units: use FSDP.summon_full_params(unit, recurse=False, rank0_only=True) per unit instead"
        )


def stream_full_params(
    model: nn.Module,
    *,
    dtype: torch.dtype | None,
    rank0_only: bool,
    device: torch.device | str | None,
    bucket_mb: float | None,
    keep_dtype: KeepDtype = None,
) -> FullParams:
    """The generator behind ``fsdp_shim.iter_full_params`` (arguments checked). Batch ``k + 1`` is staged before
    ``k`` is waited for, and launched once ``k`` is in and the host has seen ``k - 1`` complete (on NCCL
    ``wait()`` does not block the host: a rank receiving nothing would post every gather at once). So ``k + 1``
    transfers while the caller uses ``k``. Reads FSDP2's sharded parameters, even of a unit left unsharded.
    Left part way, it marks its groups out of step (``health.Call``)."""
    bucket_bytes = bucket_cap(bucket_mb, STREAM_BUCKET_MB).bucket_bytes
    device = resolve_device(device)
    call = f"iter_full_params({module_label(model)})"
    states = [state for state in (fsdp2.fsdp_state_of(m) for m in model.modules()) if state is not None]
    refuse_busy(lambda: call, states, [group for state in states for group in fsdp2.param_groups(state)])
    batches = batch_params(model, bucket_bytes, dtype, name_matcher(keep_dtype))
    distributed = [(name, t, mesh) for b in batches for name, t, mesh in zip(b.names, b.tensors, b.meshes, strict=True)
                   if isinstance(t, DTensor)]
    meta = next((name for name, t, _ in distributed if t._local_tensor.is_meta), None)
    if meta is not None:
        raise on_meta_device(call, meta)
    named = ((lambda n=name: n, t) for name, t, _ in distributed)
    process_groups = refuse_placements(named, writeback=False, gather_meshes=[mesh for _, _, mesh in distributed])
    receiver, holds_fulls = receivers_for_stream(rank0_only)
    started = time.perf_counter()
    in_flight: list[_InFlightBatch] = []
    sent_bytes = 0
    posted, all_in = health.Call(), False  # ``posted`` also owns the stream's claim on its groups
    completed_before: list[Callable[[], object]] = []  # batch k - 1's completion, in step k
    grad_enabled = torch.is_grad_enabled()  # the caller's, as each step starts: put back on every error path
    try:
        health.claim(posted, health.current_thread(), process_groups, lambda: call)
        if batches:
            in_flight.append(_InFlightBatch(batches[0], bucket_bytes, receiver, posted))
        for index, batch in enumerate(batches):
            grad_enabled = torch.is_grad_enabled()
            if index + 1 < len(batches):
                in_flight.append(_InFlightBatch(batches[index + 1], bucket_bytes, receiver, posted, launch=False))
            arrived = in_flight[0]
            fences = arrived.wait()  # left in the list until it is in, so an error path drops it
            in_flight.pop(0)
            if in_flight:
                # the caller's loop body ran since the last launch and may have left a group out of step
                health.require_live_groups(process_groups, lambda: call)
                for fence in completed_before:
                    fence()
                in_flight[0].launch()
            completed_before = fences
            fulls = arrived.finish(holds_fulls, device)
            del arrived
            if not in_flight:
                all_in = True  # the last batch is in: every collective of the stream is done, on every rank
            sent_bytes += batch.nbytes
            for position, name in enumerate(batch.names):
                yield name, fulls[position]
                fulls[position] = None  # valid until the next step
        grad_enabled = torch.is_grad_enabled()  # the caller's as the stream ends: the finally changes nothing
    except BaseException as error:
        if posted.any and not all_in:  # marked first: an interrupt in the drop below cannot skip it
            health.mark_part_way(process_groups, error)
        torch._C._set_grad_enabled(grad_enabled)  # the engine's switch, if an interrupt cut it short
        _drop_all(in_flight)  # failed, or the caller stopped early (GeneratorExit)
        raise
    else:
        _drop_all(in_flight, raising=True)
        health.release(posted)
    finally:
        # Each undo again (idempotent): an interrupt at the first statement of one handler is made good here.
        health.release(posted)
        torch._C._set_grad_enabled(grad_enabled)
    logger.debug(
        "iter_full_params: %d batches, %.1f MiB gathered (%s), full tensors on this rank: %s, %.1f ms",
        len(batches), sent_bytes / 2**20, dtype or "stored dtypes", holds_fulls, (time.perf_counter() - started) * 1e3,
    )
