"""The streaming weight sync: full parameters unit by unit, the next unit in flight.

``iter_full_params`` (its generator: ``stream_full_params``) serves the RL weight sync (send every full
parameter to an inference engine) without a context and without swapping anything. Owns the stream's plan
(``batch_params``: one batch a unit, small ones merged; ``_vllm`` reuses it) and its one batch in flight;
the gathers are the engine's. What it guarantees (batches, memory, fresh tensors, refusals, the cast, what
is read): [Note: streaming], at ``stream_full_params``.
"""

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
from fsdp_shim._common import is_fsdp1_tree, run_each
from fsdp_shim._gather.engine import BucketGather, resolve_device, start_gather
from fsdp_shim._gather.layout import (
    Receiver,
    bucket_cap,
    gathered_dtype,
    receivers_for_stream,
)
from fsdp_shim._refusals import on_meta_device, refuse_busy, refuse_placements, untracked_parameter
from fsdp_shim._scope import fsdp_slot_owners, module_label, slot_key, tracked_sharded

logger = logging.getLogger("fsdp_shim")

#: The stream's default bucket cap, in MiB. Larger than the summon's 4: with a
#: whole batch in flight, fewer and larger collectives won (the figures:
#: ``docs/gather-engine.md``).
STREAM_BUCKET_MB = 6.0

FullParams = Iterator[tuple[str, torch.Tensor | None]]
#: ``iter_full_params(keep_dtype=...)``: which parameters travel uncast. One glob
#: pattern or several (``fnmatch``, case-sensitive, against the dotted name),
#: or a predicate on the name.
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
    #: The mesh each is gathered over where FSDP2's differs from the DTensor's (``_fsdp2.gather_mesh``), else None.
    meshes: list[Any] = field(default_factory=list)


class _Distinct(NamedTuple):
    """One distinct parameter: every name it has (a tie has several), what to gather, its unit."""

    names: list[str]
    tensor: torch.Tensor
    unit: object | None  # the FSDP2 param group that manages it
    mesh: Any  # the mesh FSDP2 gathers it over (``_fsdp2.gather_mesh``), or None: its own


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
                found[id(identity)].names.append(fqn)  # a tie: named by its first name
                continue
            found[id(identity)] = _Distinct([fqn], tensor, owner[1] if owner is not None else None,
                                            None if owner is None else fsdp2.gather_mesh(owner[0]))
    return list(found.values())


def batch_params(
    model: nn.Module, bucket_bytes: int, cast_to: torch.dtype | None, uncast: Callable[[str], bool] | None = None,
) -> list[_Batch]:
    """Every distinct parameter of ``model``, named and batched. See [Note: streaming].

    ``uncast`` picks, by name, parameters that travel in their stored dtype
    instead of ``cast_to`` (``keep_dtype``).
    """
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
    """Consecutive batches that fit one bucket together travel together: one collective, not several."""
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
    """One batch, its DTensors' buckets staged and (unless ``launch=False``) their collectives launched.

    One gather per dtype the batch's DTensors travel in (cast, and exempted by
    ``keep_dtype``), in the batch's order of first appearance, so every rank
    starts and finishes them alike. If starting one raises, those already
    started are waited for first (see [Note: every posted work is waited for]
    in ``_gather.engine``).
    """

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
        """Wait for every launched collective of the batch (its values are in); nothing is copied out.

        Returns what blocks the host until they have completed (see [Note: bounded run-ahead] in ``_gather.engine``).
        """
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
                    # a copy, always: ``.to()`` returns the parameter itself where device and dtype
                    # match, and a kept tensor would change with the model (see [Note: streaming])
                    dtype = gathered_dtype(tensor, cast)
                    fulls[index] = tensor.detach().to(device=out_device or tensor.device, dtype=dtype, copy=True)
        return fulls

    def drop(self) -> BaseException | None:
        """Wait for every launched gather, each even if another's wait raises, and drop them; the first error."""
        pending_gathers, self._pending = self._pending, []
        return run_each(pending.abandon for _, pending in pending_gathers)


def _drop_all(in_flight: list[_InFlightBatch], raising: bool = False) -> None:
    """The stream's end: every launched gather waited for.

    ``raising``: raise the first failed wait (on an error path the error already propagating wins).
    """
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
    """The generator behind ``fsdp_shim.iter_full_params`` (arguments already checked).

    [Note: streaming]
    ``iter_full_params`` serves the RL weight sync (send every full parameter to
    an inference engine) without a context and without swapping anything:

    * *Batches.* The model's parameters are split into batches: one per FSDP2
      unit (its param group: what one ``recurse=False`` summon gathers), and runs
      of parameters no unit manages (tensor parallel alone, plain tensors) cut at
      the bucket cap. Consecutive batches that fit one bucket together are
      merged: one collective instead of several. Ties are one parameter, named by
      ``named_parameters()``'s first name. The plan reads only structure, so
      every rank makes the same.
    * *One batch in flight, the next one staged.* Batch ``k + 1`` is staged
      (copied in and cast, see [Note: staged, then launched] in ``_gather.engine``)
      before batch ``k`` is waited for, so the CPU's copies overlap batch ``k``'s
      transfer. Its collectives are launched, all of batch ``k + 1``'s, as
      soon as batch ``k`` is in and before it is handed out. So batch
      ``k + 1`` transfers while the caller sends batch ``k``, and is finished
      only when the caller asks for it.
    * *Bounded memory.* The generator holds two adjacent batches: batch ``k``'s
      full tensors (and, while they are copied out, its bucket buffers) and
      batch ``k + 1``'s staged or in-flight buffers, plus padding (at most
      ``W - 1`` rows a tensor); it drops each tensor at the next step.
    * *Fresh memory.* Every full tensor handed out is fresh memory nothing
      else writes: a caller may keep it, or anything that reaches its memory.
    * *Refused up front, never dropped.* The stream refuses what the summon refuses (``_refusals``,
      the summon's words) before its first batch and its groups' step before each launch (the loop
      body may break one), claims its groups until it ends, and on any error or early stop waits for
      every batch in flight (left part way, it marks its groups: below).
    * *Cast before gather.* With ``dtype``, floating shards are cast as they are
      copied into the bucket (see [Note: cast before gather] in ``_gather.engine.start_gather``).
      ``keep_dtype`` exempts chosen parameters (an MoE router's gate, kept fp32
      for the engine): they travel in their stored dtype, so their values are
      exact. A tie is kept if any of its names is chosen. A batch's exempt
      DTensors are gathered apart from its cast ones; their buckets would be
      separate anyway (a bucket holds one dtype), so this costs no collective.
    * *What is read.* The sharded parameters FSDP2 and the optimizer hold (fp32
      masters under a ``param_dtype`` policy), also when a forward left a unit
      unsharded. No FSDP2 state is touched.

    An error or early stop (the caller's ``break``, an exception in its loop body) after the first
    collective and before the last batch is in leaves the stream part way: this rank marks its groups
    out of step, as the other ranks may have posted batches it never will (see [Note: a one-sided fault
    leaves its own mark] in ``_gather.engine``). To take some parameters only, iterate to the end on every rank.

    No rank runs ahead: batch ``k + 1`` is launched only once the host has seen batch ``k - 1`` complete
    (on NCCL ``wait()`` does not block the host, and a rank that receives nothing would otherwise post the
    whole model's gathers at once; see [Note: bounded run-ahead] in ``_gather.engine``).
    """
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
    # Part way from the first collective posted until the last batch is finished: left then (an error, the
    # caller's early close), this rank marks its groups (see [Note: a one-sided fault leaves its own mark]).
    # ``posted`` is also the owner of the stream's claim on its groups, made and given back in one ``try``.
    posted, all_in = health.Call(), False
    completed_before: list[Callable[[], object]] = []  # batch k - 1's completion, in step k
    grad_enabled = torch.is_grad_enabled()  # the caller's, as each step starts: put back on every error path
    try:
        health.claim(posted, health.current_thread(), process_groups, lambda: call)
        if batches:
            in_flight.append(_InFlightBatch(batches[0], bucket_bytes, receiver, posted))
        for index, batch in enumerate(batches):
            grad_enabled = torch.is_grad_enabled()
            if index + 1 < len(batches):  # staged while batch k arrives, launched once it is in
                in_flight.append(_InFlightBatch(batches[index + 1], bucket_bytes, receiver, posted, launch=False))
            arrived = in_flight[0]
            fences = arrived.wait()  # left in the list until it is in: see below
            in_flight.pop(0)
            if in_flight:
                # the caller's loop body ran since the last launch: a summon there may have failed one-sidedly
                health.require_live_groups(process_groups, lambda: call)
                for fence in completed_before:  # batch k - 1 complete before k + 1 is posted: [Note: bounded run-ahead]
                    fence()
                in_flight[0].launch()  # batch k + 1 on the wire while batch k is copied out
            completed_before = fences
            fulls = arrived.finish(holds_fulls, device)
            del arrived
            if not in_flight:
                all_in = True  # the last batch is in: every collective of the stream is done, on every rank
            sent_bytes += batch.nbytes
            for position, name in enumerate(batch.names):
                yield name, fulls[position]
                fulls[position] = None  # valid until the next step: see [Note: streaming]
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
        # Again on every path: each undo is done twice (both idempotent), so that an interrupt at the first
        # statement of one handler is made good by the next (see [Note: claims] in ``_health``).
        health.release(posted)
        torch._C._set_grad_enabled(grad_enabled)
    logger.debug(
        "iter_full_params: %d batches, %.1f MiB gathered (%s), full tensors on this rank: %s, %.1f ms",
        len(batches), sent_bytes / 2**20, dtype or "stored dtypes", holds_fulls, (time.perf_counter() - started) * 1e3,
    )
