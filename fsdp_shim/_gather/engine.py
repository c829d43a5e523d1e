"""The gather engine: DTensors in, full tensors out, one bucket or one batch in flight.

Owns a bucket's staging (``stage_bucket``: its output allocated, its copy-in, its all-gather held until
launched), its record in flight (``InPlace``, ``AllGatherFlight``), the launch, the copy-out, the
``full_tensor()`` fallback, and the one driver (``BucketGather``) the summon (``gather_full_tensors``) and
the stream (``start_gather``) use: FSDP2's ``_fsdp_collectives``, for buckets. Nothing here knows about
modules, FSDP state or swapping; ``_summon`` and ``_stream`` decide *what* to gather and where it goes.

Invariants: every posted work is waited for, whatever raises (``_wait_all``); no rank runs more than two
buckets or batches past the last one it saw complete (``completion``); what a call posted, and what may never
complete, is written on the call's record (``Posted``), whose owner marks its groups: the engine decides
nothing of group health and keeps no state between calls. Each mechanism is a note beside its code;
``docs/gather-engine.md`` maps them, with the measurements behind each.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_shim._compat import gathered_local
from fsdp_shim._gather.layout import (
    BucketEntry,
    BucketPlan,
    BucketShape,
    Dim0Layout,
    Meshes,
    Receiver,
    bucket_plan,
    delivers_over,
    gathered_dtype,
    mesh_dim_groups,
)

logger = logging.getLogger("fsdp_shim")


_CPU = torch.device("cpu")

#: ``all_gather_into_tensor`` was renamed ``all_gather_single`` in 2.13 (the old name warns).
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before 2.13), looked up on ``torch.distributed``
    at each call: whatever wraps the boundary (a tracer, the tests' fault injection) sees the shim's
    collectives too."""
    return getattr(dist, _ALL_GATHER)(*args, **kwargs)


class Waitable(Protocol):
    """A collective's ``dist.Work``."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@dataclass(eq=False)
class InFlight:
    """A staged bucket, in one of two shapes (``InPlace``, ``AllGatherFlight``); its collective until it is in.

    ``work`` is its launched collective (``None`` where there is none, or
    until it is launched); everything the collective reads or writes is
    held here until ``work`` is waited for (see [Note: every posted work
    is waited for]).
    """

    bucket: list[BucketEntry]
    split_sizes: list[int]  # each tensor's padded shard, in elements
    work: Waitable | None = None
    call: Posted | None = None  # the record of the call that launched it

    def launched(self, posted: Posted) -> None:
        """Launch this flight's collective, ``posted`` set first (a no-op for anything else)."""


@dataclass(eq=False)
class InPlace(InFlight):
    """Full tensors already where they stay, with no collective: a shard group of one, or nothing to move.

    ``padded_fulls`` are the padded full tensors; ``None`` where this rank
    receives nothing (a group without the receiver).
    """

    padded_fulls: list[torch.Tensor] | None = None


# [Note: posted from the attempt]
# An interrupt can land inside torch's Python wrapper right after c10d
# posted a collective, or right after the launch returns, before its
# ``Work`` is stored; from outside, either looks like a launch that
# raised. So a call counts as posted (``Posted``) from the attempt, and
# ``AllGatherFlight.launched`` drops ``launch`` before calling it: a
# flight with neither ``launch`` nor ``work`` whose input is still held
# was attempted and its work is unknown, so ``_wait_once`` keeps its
# buffers for good and marks its group out of step on this rank.
@dataclass(eq=False)
class AllGatherFlight(InFlight):
    """A bucket all-gathered into one flat output of ``W`` rank blocks, copied out afterwards.

    ``launch`` holds the collective while the bucket is staged and not yet
    launched (see [Note: staged, then launched]); ``gather_input`` is what
    it sends (this rank's block of ``output``, or a shard sent as it is),
    held until it is waited for.
    """

    output: torch.Tensor | None = None
    blocks: int = 0  # the rank blocks of ``output`` that hold rows (``BucketShape.blocks``)
    launch: Callable[[], Waitable] | None = None
    gather_input: torch.Tensor | None = None
    reserved: Reserved | None = None  # where the copy-out lands, allocated before the call's first collective

    def launched(self, posted: Posted) -> None:
        """See [Note: posted from the attempt]."""
        launch = self.launch
        if launch is not None:
            self.call = posted
            posted.any = True
            self.launch = None
            self.work = launch()


def copy_in(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    block: torch.Tensor, unpadded: bool, host_copies: list[Any] | None = None,
) -> torch.Tensor:
    """This rank's padded shards, back to back, in ``block`` (its block of the output): the all-gather's input.
    ``unpadded``: the plan's word that every shard fills its padded size (``BucketShape.unpadded``).

    A bucket of one whose shard needs no padding, cast or move is its own
    input, and nothing is copied (see [Note: a bucket of one]).

    [Note: copy-in from host memory]
    Shards in host memory (FSDP2's ``CPUOffloadPolicy``, pinned) are moved to
    the device by a ``non_blocking`` copy, which the device runs when its
    stream reaches it: a host write to a shard before then (an optimizer step
    on the CPU shards right after the summon returns) would tear the gathered
    values. So each such copy records an event on ``host_copies``, and the
    gather synchronises the last one before it returns
    (``BucketGather.finish``): by then no copy still reads the shards. The
    copies precede their all-gathers on the stream, so the wait is short and
    the overlap of copy-in and all-gather is kept.
    """
    per_rank = sum(split_sizes)
    shards = [s if type(s) is torch.Tensor else gathered_local(s)  # a cast wrapper: its master (_compat)
              for s in [b.dtensor._local_tensor for b in bucket]]
    local = shards[0]
    if (len(bucket) == 1 and local.numel() == per_rank and local.dtype == dtype and local.device == device
            and local.is_contiguous()):
        return local.view(-1)
    sources = [s.reshape(-1) for s in shards]  # a view where it can be
    if unpadded and sources[0].device == device:
        # no padding, no move (a bucket holds one device): one cat, casting too
        torch.cat(sources, out=block)
        return block
    destinations: list[torch.Tensor] = []
    for local, padded, piece in zip(sources, split_sizes, torch.split_with_sizes(block, split_sizes), strict=True):
        numel = local.numel()
        destinations.append(piece[:numel])
        if padded > numel:  # zeros: padding is never exposed, but stays deterministic
            piece[numel:].zero_()
    torch._foreach_copy_(destinations, sources, non_blocking=True)  # casts and moves in the same pass
    if host_copies is not None and device.type != "cpu" and sources[0].device.type == "cpu":
        event = getattr(torch, device.type).Event()  # see [Note: copy-in from host memory]
        event.record()
        host_copies.append(event)
    return block


def comm_device_of(dtensor: DTensor) -> torch.device:
    """The device collectives on this mesh run on (CPU-offloaded shards are staged there)."""
    device_type = dtensor.device_mesh.device_type
    if device_type == "cpu":
        return _CPU
    handle = getattr(torch, device_type)
    return torch.device(device_type, handle.current_device())


def stage_bucket(bucket: list[BucketEntry], shape: BucketShape, receiver: Receiver = "all",
                 host_copies: list[Any] | None = None, reserved: Reserved | None = None) -> InFlight:
    """Copy in this rank's padded shards; the bucket's collective is left for ``launched()``.

    As FSDP2 does, the input is this rank's block of the output buffer, so the
    copy-in needs no buffer of its own and the all-gather runs in place. A
    bucket of one tensor whose shard needs no padding, cast or move is sent
    as it is: no copy-in at all (see [Note: a bucket of one]).
    With ``reserved`` (the summon: see [Note: allocate, agree, gather]) it allocates nothing.
    Called under ``no_grad``.
    """
    first = bucket[0]
    world_size, group, rank = first.layout.world_size, first.layout.group, first.layout.rank
    split_sizes, dtype = shape.split_sizes, shape.dtype
    comm_device = comm_device_of(first.dtensor)
    if not delivers_over(receiver, group):
        return InPlace(bucket, split_sizes)  # nobody on this group receives: nothing to move
    if world_size == 1:
        if reserved is not None and reserved.fulls is None:
            return InPlace(bucket, split_sizes)  # this rank keeps nothing: nothing to copy
        return _start_alone(bucket, split_sizes, dtype, comm_device, None if reserved is None else reserved.fulls)
    per_rank = sum(split_sizes)
    if reserved is not None:
        output = cast(torch.Tensor, reserved.output)
    else:
        output = torch.empty(world_size * per_rank, dtype=dtype, device=comm_device)
    gather_input = copy_in(bucket, split_sizes, dtype, comm_device, output[rank * per_rank:(rank + 1) * per_rank],
                           shape.unpadded, host_copies)
    launch = functools.partial(all_gather_single, output, gather_input, group=group, async_op=True)
    return AllGatherFlight(bucket, split_sizes, output=output, blocks=shape.blocks, launch=launch,
                           gather_input=gather_input, reserved=reserved)


def _start_alone(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    padded_fulls: list[torch.Tensor] | None = None,
) -> InFlight:
    """A shard group of one rank: each full tensor is its shard, copied once.

    [Note: a group of one]
    When the shard mesh dim has one rank (one GPU, or HSDP with one shard per
    replica), nothing is exchanged: each full tensor is a fresh copy of its
    shard (cast on the way where asked), made in one ``_foreach_copy_`` per
    bucket. The copy is still needed: results never alias live shards, so
    ``writeback=False`` edits are discarded as FSDP1's ``FULL_SHARD`` discards
    them. ``padded_fulls``: where the copies go, if reserved already.
    """
    if padded_fulls is None:
        padded_fulls = [torch.empty(padded, dtype=dtype, device=device) for padded in split_sizes]
    shards = [s if type(s) is torch.Tensor else gathered_local(s) for s in [b.dtensor._local_tensor for b in bucket]]
    torch._foreach_copy_(padded_fulls, [s.reshape(-1) for s in shards])
    return InPlace(bucket, split_sizes, padded_fulls=padded_fulls)


# [Note: allocate, agree, gather]
# FSDP1 allocates a unit's flat parameter before the unit's one all-gather,
# so an out-of-memory error is raised before anything is posted and the
# group stays usable. A summon gathers in several buckets, so it allocates
# what all of them need first: each full tensor it keeps (a bucket of
# one's output is its full tensor), the buffers the other buckets' outputs
# take turns in (at most two buckets are in flight: [Note: one bucket in
# flight]; so a rank that keeps nothing, under ``rank0_only``, holds no more
# than two outputs, as before), and for offloaded full tensors a host
# buffer to land in. Then every rank says, in one small all-reduce over
# every dim of every mesh of the call (``agree_ready``: a summon is a
# collective of the whole mesh), whether it could: if any could not, every
# rank raises before any all-gather, the failing rank its own error, the
# others an error of the same kind. So an out-of-memory error
# on every rank alike, or on one rank only, leaves nothing posted and the
# group usable, and the caller's "free memory, retry" works as on FSDP1.
# What still allocates between collectives: the ``full_tensor()`` fallback
# (DTensor allocates inside it) and the stream's batches (it holds two at
# most, so it cannot allocate a model ahead); a failure there leaves the
# call part way (see [Note: a one-sided fault leaves its own mark]).
class Reserve(NamedTuple):
    """What a summon keeps of its gathers, known before it allocates (see [Note: allocate, agree, gather])."""

    holds_fulls: bool  # this rank keeps the full tensors (``layout.Delivery``)
    out_device: torch.device | None  # where they live, if not where they are gathered (``offload_to_cpu``)


class Reserved(NamedTuple):
    """One bucket's buffers, allocated before the call's first collective.

    ``output``: its all-gather's (the kept full tensor itself for a bucket of one, else a view of one of two
    cycling buffers); ``fulls``: the padded full tensors its copy-out fills (None: the output is the full
    tensor, or this rank keeps none); ``host``: where the output is copied on the host first (offload).
    """

    output: torch.Tensor | None
    fulls: list[torch.Tensor] | None
    host: torch.Tensor | None


class _Own(NamedTuple):
    """A tensor of its own."""

    numel: int
    dtype: torch.dtype
    device: torch.device


class _Turn(NamedTuple):
    """A view at ``offset`` bytes into the shared buffer ``buffer`` (a device's cycling buffer for outputs: even
    turns at its front, odd ones at its back; a host's landing buffer for offloaded outputs)."""

    buffer: int
    offset: int
    numel: int
    dtype: torch.dtype


#: How one bucket's ``Reserved`` is made: its output and host copy (``_Own``, ``_Turn`` or None), and its fulls
#: (each ``(shape, dtype, device)``, or None).
_BucketRecipe = tuple[_Own | _Turn | None, list[tuple[tuple[int, ...], torch.dtype, torch.device]] | None,
                      _Own | _Turn | None]


class Reservation(NamedTuple):
    """What a summon's gathers allocate, worked out once per plan, receiver and ``Reserve`` (``reservation``)."""

    shared: list[tuple[int, torch.device]]  # the cycling and landing buffers: bytes, device
    buckets: list[_BucketRecipe]
    groups: list[dist.ProcessGroup]  # what ``agree_ready`` reduces over: every dim of every mesh of the call
    flag: torch.Tensor  # the agreement's, made once: allocating it could fail where a rank has run out


_ALIGN = 256  # bytes: where each view into a shared buffer starts, as the caching allocator aligns blocks


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def reservation(plan: BucketPlan, buckets: Sequence[list[BucketEntry]], receiver: Receiver, keep: Reserve,
                dtensors: Sequence[DTensor], meshes: Meshes) -> Reservation:
    """What ``reserve_buffers`` allocates for ``plan``'s buckets (see [Note: allocate, agree, gather]): worked out
    once, kept on the plan under ``(receiver, keep)``.

    The outputs nobody keeps take turns in one buffer per device: even turns at its front, odd ones at its
    back, so bucket ``k`` and ``k + 1`` (in flight together: [Note: one bucket in flight]) never overlap,
    and it is as large as the largest two adjacent outputs, what they took before. The agreement runs over
    every dim of every mesh the call's tensors live on, in the order they first appear, alike on every rank:
    a rank's groups differ from another's, and only a reduction over whole meshes tells every rank the same.
    """
    sizes: dict[torch.device, list[int]] = {}  # each device's outputs nobody keeps, in turn order (bytes)
    landing: dict[torch.device, int] = {}  # the largest output offloaded in pieces, per host device
    recipes: list[Any] = []
    for bucket, shape in zip(buckets, plan.shapes, strict=True):
        layout, device, dtype = bucket[0].layout, comm_device_of(bucket[0].dtensor), shape.dtype
        target = keep.out_device if keep.holds_fulls and keep.out_device is not None else device
        numel = layout.world_size * sum(shape.split_sizes)
        if not delivers_over(receiver, layout.group):
            recipes.append((None, None, None))
        elif layout.world_size == 1:  # see [Note: a group of one]: copies of the shards, where they are kept
            recipes.append((None, [((n,), dtype, target) for n in shape.split_sizes] if keep.holds_fulls else None,
                            None))
        elif keep.holds_fulls and len(bucket) == 1 and target == device:
            recipes.append((_Own(numel, dtype, device), None, None))  # its output is the full tensor
        else:
            turns = sizes.setdefault(device, [])
            turns.append(_aligned(numel * dtype.itemsize))
            output = (device, len(turns) - 1, numel, dtype)  # placed below, once the buffer's size is known
            if not keep.holds_fulls:
                recipes.append((output, None, None))
            elif len(bucket) == 1:  # offloaded: the host copy is the full tensor
                recipes.append((output, None, _Own(numel, dtype, target)))
            else:
                fulls = [(_copy_out_shape(b.layout, shape.blocks), dtype, target) for b in bucket]
                host = None
                if target != device:
                    landing[target] = max(landing.get(target, 0), numel * dtype.itemsize)
                    host = ("host", target, numel, dtype)
                recipes.append((output, fulls, host))
    shared = [(max([a + b for a, b in zip(turns, turns[1:], strict=False)] + turns), device)
              for device, turns in sizes.items()]
    index = {device: i for i, device in enumerate(sizes)}
    shared += [(nbytes, device) for device, nbytes in landing.items()]
    hosts = {device: len(sizes) + i for i, device in enumerate(landing)}

    def placed(spec: Any) -> Any:
        if not isinstance(spec, tuple) or isinstance(spec, _Own):
            return spec
        if spec[0] == "host":
            return _Turn(hosts[spec[1]], 0, spec[2], spec[3])
        device, turn, numel, dtype = spec
        buffer = index[device]
        offset = 0 if turn % 2 == 0 else shared[buffer][0] - sizes[device][turn]
        return _Turn(buffer, offset, numel, dtype)

    mesh_groups: dict[int, dist.ProcessGroup] = {}
    seen: set[int] = set()
    for position, dtensor in enumerate(dtensors):
        owner = meshes[position] if meshes is not None else None
        mesh = owner if owner is not None else dtensor.device_mesh
        if id(mesh) not in seen:
            seen.add(id(mesh))
            for group in mesh_dim_groups(mesh):
                mesh_groups.setdefault(id(group), group)
    made = Reservation(shared, [(placed(o), f, placed(h)) for o, f, h in recipes], list(mesh_groups.values()),
                       _flag(comm_device_of(dtensors[0])))
    plan.reservations[receiver, keep] = made
    return made


def _flag(device: torch.device) -> torch.Tensor:
    """The agreement's flag: a normal tensor, also when the plan is made under ``inference_mode`` (the flag is
    reused by later calls, which write it in place)."""
    with torch.inference_mode(False):
        return torch.zeros(1, dtype=torch.int64, device=device)


def reserve_buffers(recipe: Reservation, out: list[Reserved]) -> None:
    """Allocate what ``recipe`` says into ``out``, by bucket (see [Note: allocate, agree, gather]). On a failure
    nothing it allocated stays referenced (an exception's frames would keep it, on every rank, for as long as
    the caller's ``except`` block runs: the memory its retry needs)."""
    shared: list[torch.Tensor] = []
    try:
        shared += [torch.empty(n, dtype=torch.uint8, device=device) for n, device in recipe.shared]
        out += [Reserved(_made(output, shared),
                         None if fulls is None else [torch.empty(s, dtype=t, device=d) for s, t, d in fulls],
                         _made(host, shared)) for output, fulls, host in recipe.buckets]
    except BaseException:
        out.clear()
        shared.clear()
        raise


def _made(spec: _Own | _Turn | None, shared: list[torch.Tensor]) -> torch.Tensor | None:
    if spec is None:
        return None
    if isinstance(spec, _Own):
        return torch.empty(spec.numel, dtype=spec.dtype, device=spec.device)
    return shared[spec.buffer][spec.offset:spec.offset + spec.numel * spec.dtype.itemsize].view(spec.dtype)


#: What a rank says in ``agree_ready``: it could allocate; it ran out of memory; something else failed.
_READY, _OUT_OF_MEMORY, _FAILED = 0, 1, 2
_OOM: type[BaseException] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def agree_ready(groups: Sequence[dist.ProcessGroup], failure: BaseException | None, posted: Posted,
                flag: torch.Tensor) -> None:
    """Whether every rank allocated what its gathers need (``failure``: what this one raised); if not, every
    rank raises, before any all-gather: one ``all_reduce(MAX)`` a group. ``posted`` is set from the attempt
    (an interrupt right after it is one-sided) and cleared where every rank refuses alike (nothing is
    pending). See [Note: allocate, agree, gather]."""
    posted.any = True
    flag.fill_(_READY if failure is None else _OUT_OF_MEMORY if isinstance(failure, _OOM) else _FAILED)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    agreed = int(flag.item())
    if agreed == _READY:
        return
    posted.any = False  # every rank refuses here alike: nothing is pending
    if failure is not None:
        raise failure
    what = "ran out of memory" if agreed == _OUT_OF_MEMORY else "failed"
    raise (_OOM if agreed == _OUT_OF_MEMORY else RuntimeError)(
        f"another rank {what} while allocating for this gather, so no rank gathered anything; the process "
        "group is usable (see that rank's error)")


class Posted(Protocol):
    """The record of the call a gather belongs to, its caller's (``_health.Call``): ``any`` is set once a
    collective is posted (from the attempt: [Note: posted from the attempt]), ``lost`` is told of each posted
    collective that may never complete, with the buffers it may still write (never to be freed under it)."""

    any: bool

    def lost(self, group: dist.ProcessGroup, error: BaseException, buffers: Sequence[object] = (),
             part_way: bool = False) -> None: ...



def resolve_device(device: torch.device | str | int | None) -> torch.device | None:
    """A device as a user names it, as torch means it: the host for ``"cpu"`` and ``"cpu:0"``; an
    accelerator named without an index (``"cuda"``, ``torch.device("cuda")``) is the current one.

    Results land where the resolved device says, compared with ``==``: an unresolved ``"cuda"`` never
    equals the ``cuda:k`` a tensor is on, and only a host target offloads (``_finish_bucket``).
    """
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return _CPU
    if device.index is None:
        handle = getattr(torch, device.type, None)
        if handle is not None and hasattr(handle, "current_device"):
            return torch.device(device.type, handle.current_device())
    return device


def _wait_once(flight: InFlight) -> None:
    """Wait for ``flight``'s collective, once (see [Note: every posted work is waited for]).

    A wait that raises an ``Exception`` (a timeout, a dead peer) is told to
    the call's record (``Posted.lost``: its owner marks the group) and is not retried. A ``KeyboardInterrupt`` leaves
    the work in place, so the caller's clean-up waits for it again.
    """
    work = flight.work
    if work is None:
        if isinstance(flight, AllGatherFlight) and flight.launch is None and flight.gather_input is not None:
            # attempted, its work unknown: see [Note: posted from the attempt]
            cast(Posted, flight.call).lost(flight.bucket[0].layout.group, RuntimeError(
                "an all-gather's launch was cut short"), [flight.output, flight.gather_input], True)  # held first
            flight.gather_input = None
        return
    try:
        work.wait()
    except Exception as error:
        flight.work = None  # never waited twice
        held = (flight.output, flight.gather_input) if isinstance(flight, AllGatherFlight) else ()
        cast(Posted, flight.call).lost(flight.bucket[0].layout.group, error, held)  # never freed under it
        raise
    flight.work = None
    if isinstance(flight, AllGatherFlight):
        flight.gather_input = None


def completion(works: Sequence[Waitable], device: torch.device) -> Callable[[], object]:
    """What blocks the host until ``works`` (waited for, on ``device``) have completed.

    [Note: bounded run-ahead]
    On NCCL ``work.wait()`` only makes the current stream wait: it returns at
    once, and NCCL's watchdog times each collective from its post. A rank that
    receives nothing (``rank0_only``, not rank 0) does no host work after a
    wait, so, unbounded, it would post every gather of a sync within
    milliseconds, and the last ones would time out while rank 0's consumer
    works through the first ones. So no rank ever has more than two buckets
    (the summon) or batches (the stream) posted ahead of the last one it saw
    complete: before posting ``k + 1`` it blocks the host on ``k - 1``'s
    completion, while ``k`` stays on the wire (its overlap, and the stream's
    on the receiving rank, kept). On CUDA, ``k - 1``'s completion is an event
    recorded on the current stream right after its ``wait()``, synchronised;
    on the host, the work's own future (gloo's ``wait()`` already blocked, so
    it is done). A gather of one or two buckets never needs one.
    Across calls the same holds for the per-unit weight-sync loop, one
    summon a unit, whose non-receiving ranks would otherwise post every unit's
    gather while rank 0 sends the first: on a rank that receives nothing,
    ``gather_full_tensors`` blocks on call ``k - 1``'s last collective before
    call ``k + 1`` posts (``behind``, kept by ``_health`` for each group). A receiving rank's own consumer
    paces it, so it pays nothing; a host wait chooses no collective, so ranks
    may differ in it.
    """
    if device.type == "cpu":
        # Each work's future, chained to one whose value is an int (``id``, a C function: no Python frame, so
        # no interrupt can land in the callback, which torch would wrap in a RuntimeError): the fence must not
        # keep the gathered buffers alive past their batch (the stream holds two units at most).
        futures = [work.get_future().then(id) for work in works]  # type: ignore[attr-defined]  # a dist.Work
        return lambda: [future.wait() for future in futures]
    event = getattr(torch, device.type).Event()
    event.record()  # on the current stream, which ``wait()`` ordered after the collectives
    return event.synchronize


def _wait_all(flights: Sequence[InFlight]) -> BaseException | None:
    """Wait for every launched collective in ``flights``, each even if another's wait raises; the first error.

    [Note: every posted work is waited for]
    Whatever raises while buckets are in flight (a staging copy, an
    allocation, a launch, a copy-out, a ``KeyboardInterrupt``), every
    collective already launched is waited for before the error propagates,
    each one even if another's wait raises, and its buffers are held until
    then: c10d cannot withdraw a posted collective, a buffer freed under one
    would be written after it is freed, and a collective left unmatched would
    pair with the next call's. A fault that hits every rank alike raises at
    the same bucket on each, before that bucket's collective is posted, so the
    ranks stay in step; the group stays usable if it raised before the call's
    first collective, and is marked out of step otherwise, as a one-sided
    fault must be (see [Note: a one-sided fault leaves its own mark]). A wait that fails (a
    timeout, a dead peer) records the group as out of step (see
    [Note: out of step] in ``_health``). A work is never waited for twice.
    """
    first: BaseException | None = None
    for flight in flights:
        try:
            _wait_once(flight)
        except BaseException as error:  # noqa: BLE001  (KeyboardInterrupt too: the others are still waited for)
            first = first or error
            if flight.work is not None:  # interrupted: wait for it once more, uninterrupted this time
                try:
                    _wait_once(flight)
                except BaseException:  # noqa: BLE001  (the first error is the one returned)
                    pass
    return first


def _finish_bucket(flight: InFlight, holds_fulls: bool, out_device: torch.device | None) -> list[torch.Tensor]:
    """Wait for the bucket's collective and copy each tensor out. See [Note: bucket layout] in ``layout``.

    [Note: offloaded memory]
    Full tensors moved to the host (``offload_to_cpu``, ``device="cpu"``) live
    in pageable memory, as FSDP1's do, and go back to the allocator when the
    caller drops them. Pinned memory would come from torch's host caching
    allocator, which rounds each block up to a power of two and keeps it for the
    life of the process: a model's worth pinned for good on every rank that
    offloads, beside an inference engine that needs it. The copy is one
    ``.to("cpu")`` a bucket, synchronous (the host reads the values next).

    [Note: a bucket of one]
    With one tensor in a bucket the ``(W, S)`` output *is* its padded full tensor
    (rank blocks of ``c`` rows, back to back), so the result is a view of the
    first ``n`` rows and nothing is copied out; if its shard already has ``c``
    rows, in the gathered dtype, on the collective's device, the shard itself is
    the all-gather input and nothing is copied in either. Tensors larger than the
    bucket cap always take this path: the gather moves each byte once, as
    FSDP1's flat parameter does.

    Called under ``no_grad``.
    """
    _wait_once(flight)
    if isinstance(flight, InPlace):  # a group of one, or nothing moved: already in place
        return [_to_device(full, out_device) for full in _in_place_results(flight)] if holds_fulls else []
    assert isinstance(flight, AllGatherFlight)
    if not holds_fulls:
        return []  # rank0_only: this rank holds nothing once the gather is done
    output = flight.output
    assert output is not None, "a rank that keeps full tensors received them"
    reserved = flight.reserved
    if out_device is not None and out_device != output.device:
        # The whole bucket at once, then split where it landed. To the host (offload_to_cpu,
        # ``device="cpu"``): pageable memory, as FSDP1's offloaded parameters are, in one
        # copy that the host waits for; see [Note: offloaded memory].
        output = output.to(out_device) if reserved is None or reserved.host is None else reserved.host.copy_(output)
    if len(flight.bucket) == 1:  # see [Note: a bucket of one]
        padded = [output.view(flight.bucket[0].layout.padded_shape)]
    else:
        padded = _copy_out(output, flight, None if reserved is None else reserved.fulls)
    # each full tensor: its first rows, the buffer itself where nothing is padded (a slice: cheaper than narrow())
    return [buf if buf.shape[0] == b.layout.shape[0] else buf[:b.layout.shape[0]]
            for buf, b in zip(padded, flight.bucket, strict=True)]


def _copy_out(output: torch.Tensor, flight: AllGatherFlight, padded: list[torch.Tensor] | None = None
              ) -> list[torch.Tensor]:
    """Scatter a multi-tensor bucket's output into fresh padded buffers, one a tensor (``padded``, if reserved).

    See [Note: bucket layout] in ``layout``: only the first ``R`` rank blocks hold rows,
    so only they are copied, into buffers of ``R * c_i`` rows.
    """
    world_size = flight.bucket[0].layout.world_size
    blocks = flight.blocks
    if padded is None:
        padded = [output.new_empty(_copy_out_shape(b.layout, blocks)) for b in flight.bucket]  # output's dtype, device
    sizes = flight.split_sizes  # explicit view sizes, never -1: a tensor may have no elements
    out = [buf.view(blocks, n) for buf, n in zip(padded, sizes, strict=True)]
    blocked = output.view(world_size, sum(sizes))
    torch.split_with_sizes_copy(blocked if blocks == world_size else blocked[:blocks], sizes, dim=1, out=out)
    return padded


def _copy_out_shape(layout: Dim0Layout, blocks: int) -> tuple[int, ...]:
    """A multi-tensor bucket's padded buffer for one tensor: ``blocks`` rank blocks of its rows."""
    return layout.padded_shape if blocks == layout.world_size else (blocks * layout.chunk_rows, *layout.shape[1:])


def _views(padded_fulls: list[torch.Tensor], flight: InFlight) -> list[torch.Tensor]:
    """Each full tensor: the first rows of its padded buffer, in its shape."""
    return [buf[: b.dtensor.numel()].view(b.dtensor.shape) for buf, b in zip(padded_fulls, flight.bucket, strict=True)]


def _in_place_results(flight: InPlace) -> list[torch.Tensor]:
    """A ``InPlace`` bucket's full tensors: views of the padded full tensors the transfer wrote into."""
    assert flight.padded_fulls is not None, "a rank that keeps full tensors received them"
    return _views(flight.padded_fulls, flight)


def _to_device(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return tensor if device is None or tensor.device == device else tensor.to(device)


@torch.no_grad()
def _gather_fallback(
    dtensor: DTensor, holds_fulls: bool, out_device: torch.device | None, cast_to: torch.dtype | None = None,
    mesh: DeviceMesh | None = None,
) -> torch.Tensor | None:
    dtype = gathered_dtype(dtensor, cast_to)
    local = dtensor._local_tensor
    if type(local) is not torch.Tensor:
        local = gathered_local(local)  # a cast wrapper: its master (_compat)
    source = dtensor
    if local is not dtensor._local_tensor or (mesh is not None and mesh is not dtensor.device_mesh):
        source = DTensor.from_local(local, dtensor.device_mesh if mesh is None else mesh,  # its owner's: ``Meshes``
                                    dtensor.placements, run_check=False, shape=dtensor.shape, stride=dtensor.stride())
    if dtype != source.dtype:
        source = cast(DTensor, source.to(dtype))  # a local, elementwise cast
    full = source.full_tensor()
    if not holds_fulls:
        return None
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()  # replicated: never alias the live shard
    if out_device is not None and full.device != out_device:
        full = full.to(out_device)
    return full


class Gathered(NamedTuple):
    tensors: list[torch.Tensor | None]  # full tensors, None where this rank does not hold them
    layouts: list[Dim0Layout | None]  # fast-path layouts, for ``write_back_locals``
    plan: BucketPlan  # what the gather followed; a caller may pass it back for the same tensors


class BucketGather:
    """The one driver: a list of DTensors' buckets, staged ``ahead`` at a time, finished in order.

    Staging copies a bucket in; launching posts its all-gather. ``ahead``
    buckets are staged beyond the one being finished: ``ahead=1`` is the
    summon's window, bucket ``k + 1`` in flight while ``k`` is copied out,
    two at most (see [Note: one bucket in flight]); ``ahead=None`` stages
    every bucket at once, the stream's, a whole batch in flight
    (see [Note: staged, then launched]). A collective: every rank builds,
    launches and finishes the same gathers in the same order. Whatever
    raises, in construction, ``finish`` or ``abandon``, every launched
    collective is waited for first (see [Note: every posted work is waited for]).
    """

    def __init__(
        self,
        dtensors: Sequence[DTensor],
        *,
        cast_to: torch.dtype | None = None,
        bucket_bytes: int,
        receiver: Receiver = "all",
        ahead: int | None = None,
        launch: bool = True,
        plan: BucketPlan | None = None,
        collective_bytes: int | None = None,
        meshes: Meshes = None,
        posted: Posted,
        reserve: Reserve | None = None,
        failure: BaseException | None = None,
    ) -> None:
        self._posted = posted
        self.last_work: tuple[Waitable, torch.device] | None = None  # its last collective: ``gather_full_tensors``
        self._host_copies: list[Any] = []  # see [Note: copy-in from host memory]
        self.plan = bucket_plan(dtensors, bucket_bytes, cast_to, reuse=plan, collective_bytes=collective_bytes,
                                meshes=meshes)
        buckets, self._fallback = self.plan.bind(dtensors), list(self.plan.fallback)
        self._dtensors = list(dtensors)
        self._meshes = meshes
        self._cast_to = cast_to
        self._receiver = receiver
        self._unstaged = collections.deque(zip(buckets, self.plan.shapes, strict=True))
        self._ahead = len(buckets) if ahead is None else ahead
        self._flights: collections.deque[InFlight] = collections.deque()
        self._unlaunched = not launch  # staged buckets whose collectives ``launch`` (or ``finish``) posts
        self._reserved: collections.deque[Reserved] | None = None
        grad_enabled = torch.is_grad_enabled()
        try:  # switched inside the try that puts it back
            torch._C._set_grad_enabled(False)  # ``no_grad`` as one C call: see [Note: hot path] in ``_summon``
            if reserve is not None:
                self._reserved = collections.deque(self._reserve_and_agree(buckets, reserve, failure))
            self._stage_ahead(launch)
        except BaseException:
            self._drop()
            raise
        finally:
            torch._C._set_grad_enabled(grad_enabled)

    def _reserve_and_agree(self, buckets: list[list[BucketEntry]], keep: Reserve,
                           failure: BaseException | None = None) -> list[Reserved]:
        """``reserve_buffers``, then ``agree_ready`` (see [Note: allocate, agree, gather]); ``failure``: one this rank
        met earlier in the call, agreed on instead. Posted from its start: a fault before the agreement (outside
        the allocations it agrees on) is one-sided as far as this rank knows; ``agree_ready`` clears it where
        every rank refuses alike."""
        self._posted.any = True
        recipe = self.plan.reservations.get((self._receiver, keep))
        if recipe is None:
            recipe = reservation(self.plan, buckets, self._receiver, keep, self._dtensors, self._meshes)
        reserved: list[Reserved] = []
        try:
            if failure is None:
                reserve_buffers(recipe, reserved)
        except BaseException as error:  # noqa: BLE001  # KeyboardInterrupt too: agreed on, then raised as itself
            failure = error
        try:
            agree_ready(recipe.groups, failure, self._posted, recipe.flag)
        except BaseException:
            reserved.clear()  # not kept alive by this frame while the caller handles the error
            raise
        return reserved

    def _stage_ahead(self, launch: bool, finishing: int = 0) -> None:
        """Stage (and launch) buckets until ``ahead`` are in flight beyond the ``finishing`` one."""
        reserved = self._reserved
        while self._unstaged and len(self._flights) - finishing < self._ahead:
            flight = stage_bucket(*self._unstaged.popleft(), self._receiver, self._host_copies,
                                  None if reserved is None else reserved.popleft())
            self._flights.append(flight)  # recorded before its collective is posted: never dropped
            if launch:
                flight.launched(self._posted)

    def launch(self) -> None:
        """Launch every staged bucket's collective, in bucket order. A collective; a no-op once done."""
        try:
            for flight in self._flights:
                flight.launched(self._posted)
        except BaseException:
            self._drop()
            raise
        self._unlaunched = False

    def wait(self) -> Callable[[], object] | None:
        """Wait for every launched collective, in bucket order: the values are in; ``finish`` copies out.

        The stream waits for batch ``k``, launches batch ``k + 1``, then copies
        batch ``k`` out, so the copies overlap the next transfer. On an error
        every launched collective is still waited for (see [Note: every posted work is waited for]).
        Returns what blocks the host until they have completed, if any was posted (see [Note: bounded run-ahead]).
        """
        works: list[Waitable] = []
        device = _CPU
        try:
            for flight in self._flights:
                work = flight.work
                _wait_once(flight)
                if work is not None:
                    works.append(work)
                    device = cast(torch.Tensor, cast(AllGatherFlight, flight).output).device
        except BaseException:
            self._drop()
            raise
        return completion(works, device) if works else None

    def finish(self, *, holds_fulls: bool, out_device: torch.device | None = None) -> Gathered:
        """Wait and copy out, bucket by bucket (each output freed, or its cycling buffer free for bucket ``k + 2``,
        as soon as it is copied), then the fallbacks;
        with the layout each tensor was gathered by (writeback reuses it)."""
        if self._unlaunched:
            self.launch()
        grad_enabled = torch.is_grad_enabled()
        try:
            torch._C._set_grad_enabled(False)
            results: list[torch.Tensor | None] = [None] * len(self._dtensors)
            layouts: list[Dim0Layout | None] = [None] * len(self._dtensors)
            flights = self._flights
            fence: Callable[[], object] | None = None  # bucket k - 1's completion, once bucket k is being finished
            while flights:
                flight = flights[0]  # left in place until it is in: a fault below still waits for it
                if self._unstaged:
                    if fence is not None:  # see [Note: bounded run-ahead]
                        fence()
                        fence = None
                    self._stage_ahead(launch=True, finishing=1)  # the next bucket moves while this one is copied out
                for b in flight.bucket:
                    layouts[b.position] = b.layout
                work = flight.work
                # strict=False: _finish_bucket returns nothing where this rank keeps nothing (rank0_only)
                for b, full in zip(flight.bucket, _finish_bucket(flight, holds_fulls, out_device), strict=False):
                    results[b.position] = full
                if work is not None:
                    device = flight.output.device  # type: ignore[attr-defined]  # an AllGatherFlight: it posted
                    self.last_work = work, device
                    if self._unstaged:  # a bucket k + 2 is still to be posted: it will wait for this
                        fence = completion((work,), device)
                flights.popleft()
                del flight
            if self._fallback:
                self._posted.any = True  # full_tensor() posts collectives of its own (counted first: it may raise)
            for index in self._fallback:
                results[index] = _gather_fallback(self._dtensors[index], holds_fulls, out_device, self._cast_to,
                                                  None if self._meshes is None else self._meshes[index])
            self._fallback = []
            if self._host_copies:  # no copy from host memory still reads a shard: [Note: copy-in from host memory]
                self._host_copies[-1].synchronize()
                self._host_copies.clear()
            return Gathered(results, layouts, self.plan)
        except BaseException:
            self._drop()
            raise
        finally:
            torch._C._set_grad_enabled(grad_enabled)

    def _drop(self) -> BaseException | None:
        """Wait for every launched collective and drop everything: staged buckets and the fallbacks never
        run. Raises nothing; returns the first failed wait (the error paths re-raise their own error)."""
        flights, self._flights = list(self._flights), collections.deque()
        if self._reserved is not None:
            self._reserved.clear()
        self._unstaged.clear()
        self._fallback = []
        return _wait_all(flights)

    def abandon(self) -> None:
        """``_drop``, on an early stop: raises the first failed wait, after waiting for all of them."""
        error = self._drop()
        if error is not None:
            raise error


def gather_full_tensors(
    dtensors: Sequence[DTensor],
    *,
    holds_fulls: bool = True,
    out_device: torch.device | None = None,
    bucket_bytes: int,
    receiver: Receiver = "all",
    plan: BucketPlan | None = None,
    collective_bytes: int | None = None,
    meshes: Meshes = None,
    posted: Posted,
    failure: BaseException | None = None,
    behind: collections.deque[Callable[[], object]] | None = None,
) -> Gathered:
    """All-gather every DTensor in ``dtensors`` to a plain full tensor, one bucket in flight.

    [Note: one bucket in flight]
    Bucket ``k + 1``'s collective is launched before bucket ``k``
    is copied out, so the copy-out overlaps the next transfer. At most two
    buckets' outputs are alive at once (inputs live inside them), so the extra
    memory beyond the full tensors is at most two buckets.

    A collective: every rank of the meshes involved must call it with the same
    tensors in the same order. ``holds_fulls=False`` takes part in the collectives
    but returns ``None`` for every tensor (``rank0_only`` on other ranks).
    ``out_device`` moves results there bucket by bucket (``offload_to_cpu``).
    ``posted`` is the call's record (``Posted``); ``behind``, the record of the group's earlier calls this rank
    paces itself by where it keeps nothing ([Note: bounded run-ahead]).
    Results never alias the DTensors' local storage. With a ``receiver`` other
    than ``"all"``, ``holds_fulls`` must be False on every rank it does not name
    (``layout.Delivery`` says both).

    The caller has refused what cannot be gathered (placements this torch gets
    wrong, dead or out-of-step groups: ``_refusals.refuse_placements``) before
    calling; the engine does not check again. ``meshes``: the mesh each is gathered over where its owner
    says (``layout.Meshes``).
    """
    paced = None if holds_fulls else behind  # [Note: bounded run-ahead]: call k - 1 done before k + 1
    try:
        while paced and len(paced) > 1:
            paced.popleft()()
        gather = BucketGather(dtensors, bucket_bytes=bucket_bytes, receiver=receiver, ahead=1, plan=plan,
                              collective_bytes=collective_bytes, meshes=meshes, posted=posted,
                              reserve=Reserve(holds_fulls, out_device), failure=failure)
        gathered = gather.finish(holds_fulls=holds_fulls, out_device=out_device)
    except BaseException:
        if paced is not None:
            paced.clear()  # a failed call's completion is not waited for by the next
        raise
    last = gather.last_work
    if paced is not None and last is not None and not last[0].is_completed():  # gloo's wait blocked: complete
        paced.append(completion((last[0],), last[1]))
    return gathered


def start_gather(
    dtensors: Sequence[DTensor],
    *,
    cast_to: torch.dtype | None = None,
    bucket_bytes: int,
    receiver: Receiver = "all",
    launch: bool = True,
    meshes: Meshes = None,
    posted: Posted,
) -> BucketGather:
    """Stage every bucket of ``dtensors`` and launch its all-gather now; ``finish`` collects them.

    The whole batch is in flight at once, so it transfers while the caller
    does other work: the streaming sync keeps one unit in flight this way.
    With ``launch=False`` the buckets are only staged (copied in, cast) and
    ``BucketGather.launch`` starts their collectives later. Fallback tensors
    (``full_tensor()``, blocking) are gathered in ``finish``.

    [Note: staged, then launched]
    A bucket starts in two steps. Staging does the CPU's part: the padded input
    copied in and cast, the output allocated. Launching posts the all-gather.
    The summon does both at once (``BucketGather``'s default). The stream
    stages batch ``k + 1`` *before* it waits for batch ``k``: the copies and
    casts run while batch ``k`` is on the wire. Batch ``k + 1``'s collectives
    are launched only once batch ``k`` is in, so the process group never holds
    more than one batch's collectives. Every bucket moves by the all-gather,
    on every backend: the one collective NCCL users take, and the one gloo
    runs in the tests (``docs/gather-engine.md`` says why gloo's point-to-point
    transport was deleted).

    [Note: cast before gather]
    With ``cast_to`` (``iter_full_params(dtype=...)``), each floating local shard
    is cast while it is copied into the bucket, so the all-gather moves the cast
    bytes (half of fp32 for bf16) and the full tensor is born in that dtype.
    Casting is elementwise, so this equals casting the gathered full tensor.
    """
    return BucketGather(dtensors, cast_to=cast_to, bucket_bytes=bucket_bytes, receiver=receiver, launch=launch,
                        meshes=meshes, posted=posted)
