"""The gather engine (FSDP2's ``_fsdp_collectives``, for buckets): DTensors in, full tensors out.

Stages a bucket (``stage_bucket``: output, copy-in), launches, waits and copies out, with the ``full_tensor()``
fallback, through one driver (``BucketGather``) shared by the summon (``gather_full_tensors``) and the stream
(``start_gather``). It knows nothing of modules or FSDP state, and keeps nothing between calls. Invariants: every
posted work is waited for, whatever raises; no rank runs more than two buckets or batches past the last one it saw
complete; what a call posted, and what may never complete, goes on the call's record (``Posted``), whose owner
marks its groups. ``docs/gather-engine.md`` maps the notes and their measurements."""

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

_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """``dist.all_gather_single`` (``all_gather_into_tensor`` before 2.13; the old name warns since), looked up at
    each call: whatever wraps ``torch.distributed`` (a tracer, the tests' faults) sees the shim's collectives too."""
    return getattr(dist, _ALL_GATHER)(*args, **kwargs)


def all_gather_coalesced(outputs: list[Any], inputs: list[Any], group: dist.ProcessGroup) -> Any:
    """Several all-gathers over ``group`` in one launch, one dtype and device (``_compat.coalesces_all_gathers``):
    one grouped NCCL call, one gloo collective. The process group's own method, looked up at each call."""
    return group.allgather_into_tensor_coalesced(outputs, inputs)


class Waitable(Protocol):
    """A collective's ``dist.Work``."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@dataclass(eq=False)
class InFlight:
    """A staged bucket (``InPlace`` or ``AllGatherFlight``). ``work``, once launched, is waited for before
    anything it reads or writes, all held here, is let go (``_wait_all``)."""

    bucket: list[BucketEntry]
    split_sizes: list[int]  # each tensor's padded shard, in elements
    work: Waitable | None = None
    call: Posted | None = None  # the record of the call that launched it
    ends_launch: bool = False  # the last bucket of its launch ([Note: one launch a group])

    def launched(self, posted: Posted) -> None:
        """Launch this flight's collective, ``posted`` set first (a no-op for anything else)."""


@dataclass(eq=False)
class InPlace(InFlight):
    """No collective: a shard group of one, or nothing to move. ``padded_fulls``: None where this rank keeps nothing."""

    padded_fulls: list[torch.Tensor] | None = None


# [Note: posted from the attempt]
# An interrupt right after c10d posted, or before the ``Work`` is stored, looks like a launch that raised. So a
# call counts as posted from the attempt, and ``launched`` drops ``launch`` before calling it: a flight with
# neither ``launch`` nor ``work`` whose input is still held has unknown work, so ``_wait_once`` tells the call
# it is lost (its buffers held for good, its group marked).
@dataclass(eq=False)
class AllGatherFlight(InFlight):
    """A bucket all-gathered into one flat output of ``W`` rank blocks, copied out afterwards. ``launch``: the
    collective, until launched; ``gather_input``: what it sends (its block of ``output``, or a shard as it is), held
    until waited for."""

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


# [Note: one launch a group]
# A single unit's summon (and each batch of the stream) posts its buckets on one process group, dtype and device
# as one launch, as FSDP2's ``unshard()`` posts one all-gather: launches cost host time and NCCL kernel starts,
# and grow with the world size. Each bucket keeps its own output (a tensor above the cap lands in its full tensor:
# held once, where FSDP2's flat buffer holds it twice), so a launch is a coalesced all-gather. The plan decides
# which buckets share a launch (``layout.BucketPlan.launches``), from metadata every rank shares; a launch is
# what ``ahead`` counts and what the run-ahead bound paces, and its buckets share one ``Work``.
def launched_together(flights: Sequence[InFlight], posted: Posted) -> None:
    """One launch: each ``launched()``, or several all-gathers coalesced ([Note: posted from the attempt])."""
    gathers = [f for f in flights if isinstance(f, AllGatherFlight) and f.launch is not None]
    if len(gathers) < 2:
        for flight in gathers:
            flight.launched(posted)
        return
    posted.any = True
    for flight in gathers:
        flight.call, flight.launch = posted, None
    group = gathers[0].bucket[0].layout.group
    work = all_gather_coalesced([f.output for f in gathers], [f.gather_input for f in gathers], group)
    for flight in gathers:
        flight.work = work


def copy_in(
    bucket: list[BucketEntry], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    block: torch.Tensor, unpadded: bool, host_copies: list[Any] | None = None,
) -> torch.Tensor:
    """This rank's padded shards, back to back, in ``block`` (its block of the output): the all-gather's input.
    A bucket of one whose shard needs no padding, cast or move is its own input ([Note: a bucket of one]). Shards in
    host memory (``CPUOffloadPolicy``) move by a ``non_blocking`` copy, which a host write (an optimizer step right
    after the summon) could tear: each records an event on ``host_copies``, synchronised in ``BucketGather.finish``.
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
        event = getattr(torch, device.type).Event()
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
    """Copy in this rank's padded shards, in place in the output as FSDP2 does; the collective is left for
    ``launched()``. With ``reserved`` ([Note: allocate, agree, gather]) it allocates nothing. Under ``no_grad``."""
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
        output: torch.Tensor = reserved.output  # type: ignore[assignment]  # set for a gather (no cast(): hot path)
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
    """A shard group of one rank (one GPU, HSDP with one shard a replica): each full tensor a fresh copy of its
    shard (``padded_fulls``, if reserved), never an alias, so ``writeback=False`` edits are discarded as in FSDP1."""
    if padded_fulls is None:
        padded_fulls = [torch.empty(padded, dtype=dtype, device=device) for padded in split_sizes]
    shards = [s if type(s) is torch.Tensor else gathered_local(s) for s in [b.dtensor._local_tensor for b in bucket]]
    torch._foreach_copy_(padded_fulls, [s.reshape(-1) for s in shards])
    return InPlace(bucket, split_sizes, padded_fulls=padded_fulls)


# [Note: allocate, agree, gather]
# FSDP1 allocates a unit's flat parameter before its one all-gather, so an out-of-memory error leaves the group
# usable. A summon allocates everything its buckets need first (the full tensors it keeps, two cycling output
# buffers: [Note: one bucket in flight], host landing buffers when offloading), then every rank says in one
# all-reduce over every dim of every mesh of the call (``agree_ready``) whether it could. If one could not,
# every rank raises before any all-gather: one-sided or not, nothing is posted and "free memory, retry" works.
# Still allocating between collectives: the ``full_tensor()`` fallback and the stream's batches (two at most);
# a failure there leaves the call part way ([Note: a one-sided fault leaves its own mark] in ``_health``).
class Reserve(NamedTuple):
    """What a summon keeps of its gathers, known before it allocates (see [Note: allocate, agree, gather])."""

    holds_fulls: bool  # this rank keeps the full tensors (``layout.Delivery``)
    out_device: torch.device | None  # where they live, if not where they are gathered (``offload_to_cpu``)


class Reserved(NamedTuple):
    """One bucket's buffers: ``output`` (a bucket of one's kept full tensor, else a view of a cycling buffer),
    ``fulls`` (what its copy-out fills), ``host`` (where an offloaded output lands)."""

    output: torch.Tensor | None
    fulls: list[torch.Tensor] | None
    host: torch.Tensor | None


class _Own(NamedTuple):
    numel: int
    dtype: torch.dtype
    device: torch.device


class _Turn(NamedTuple):
    """A view at ``offset`` bytes into shared buffer ``buffer`` (a device's cycling one, or a host landing one)."""

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
    """What ``reserve_buffers`` allocates for ``plan``'s buckets, worked out once and kept on the plan.

    Outputs nobody keeps take turns in one buffer per device, a launch's outputs one turn, even turns at its front,
    odd at its back, so launches ``k`` and ``k + 1`` (in flight together) never overlap. The agreement's groups are
    every dim of every mesh, in first-seen order: ranks' own groups differ, whole meshes do not."""
    sizes: dict[torch.device, list[int]] = {}  # each device's outputs nobody keeps: bytes a launch, in turn order
    last_launch: dict[torch.device, int] = {}
    landing: dict[torch.device, int] = {}  # the largest output offloaded in pieces, per host device
    recipes: list[Any] = []
    launch_of = [launch for launch, n in enumerate(plan.launches) for _ in range(n)]
    for bucket, shape, launch in zip(buckets, plan.shapes, launch_of, strict=True):
        layout, device, dtype = bucket[0].layout, comm_device_of(bucket[0].dtensor), shape.dtype
        target = keep.out_device if keep.holds_fulls and keep.out_device is not None else device
        numel = layout.world_size * sum(shape.split_sizes)
        if not delivers_over(receiver, layout.group):
            recipes.append((None, None, None))
        elif layout.world_size == 1:  # copies of the shards, where they are kept (``_start_alone``)
            recipes.append((None, [((n,), dtype, target) for n in shape.split_sizes] if keep.holds_fulls else None,
                            None))
        elif keep.holds_fulls and len(bucket) == 1 and target == device:
            recipes.append((_Own(numel, dtype, device), None, None))  # its output is the full tensor
        else:
            turns = sizes.setdefault(device, [])
            if last_launch.get(device) != launch:  # a launch's outputs are in flight together: one turn
                last_launch[device] = launch
                turns.append(0)
            output = (device, len(turns) - 1, turns[-1], numel, dtype)  # placed below, once sizes are known
            turns[-1] += _aligned(numel * dtype.itemsize)
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
        device, turn, within, numel, dtype = spec
        buffer = index[device]
        offset = 0 if turn % 2 == 0 else shared[buffer][0] - sizes[device][turn]
        return _Turn(buffer, offset + within, numel, dtype)

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
    """The agreement's flag, never an inference tensor: later calls write it in place."""
    with torch.inference_mode(False):
        return torch.zeros(1, dtype=torch.int64, device=device)


def reserve_buffers(recipe: Reservation, out: list[Reserved]) -> None:
    """Allocate what ``recipe`` says into ``out``. On a failure nothing stays referenced: the exception's frames
    would hold it through the caller's ``except`` block, where its retry needs the memory."""
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
    """Whether every rank allocated (``failure``: this one's error); if not, every rank raises before any
    all-gather. ``posted`` is set from the attempt and cleared where every rank refuses alike."""
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
    """The call's record (``_health.Call``): ``any`` once a collective is attempted; ``lost`` is told of each
    posted collective that may never complete, with the buffers it may still write."""

    any: bool

    def lost(self, group: dist.ProcessGroup, error: BaseException, buffers: Sequence[object] = (),
             part_way: bool = False) -> None: ...


def resolve_device(device: torch.device | str | int | None) -> torch.device | None:
    """A device as torch means it: ``"cpu:0"`` is the host, ``"cuda"`` the current GPU (results are placed by
    ``==``, which an unresolved ``"cuda"`` never equals)."""
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
    """Wait for ``flight``'s collective, once. A wait that raises an ``Exception`` (a timeout, a dead peer) is
    told to the call (``Posted.lost``) and not retried; a ``KeyboardInterrupt`` leaves it to be waited again."""
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
    On NCCL ``wait()`` returns at once and the watchdog times each collective from its post, so a rank that receives
    nothing (``rank0_only``, not rank 0) would post a whole sync's gathers while rank 0 works through the first, and
    the last would time out. So no rank posts bucket (or batch, or call) ``k + 1`` before ``k - 1`` has completed,
    while ``k`` stays on the wire: on CUDA an event recorded after ``k - 1``'s ``wait()``, on the host the work's own
    future. Across calls, ``gather_full_tensors`` paces by ``behind`` (``_health.CALLS_BEHIND``) on a rank that keeps
    nothing; a receiving rank's own consumer paces it, so it pays nothing. A host wait chooses no collective, so
    ranks may differ in it.
    """
    if device.type == "cpu":
        # Each work's future, chained to one whose value is an int (``id``, a C function: no Python frame, so no
        # interrupt can land in the callback, which torch would wrap in a RuntimeError): the fence must not keep the
        # gathered buffers alive past their batch (the stream holds two units at most).
        futures = [work.get_future().then(id) for work in works]  # type: ignore[attr-defined]  # a dist.Work
        return lambda: [future.wait() for future in futures]
    event = getattr(torch, device.type).Event()
    event.record()  # on the current stream, which ``wait()`` ordered after the collectives
    return event.synchronize


def _wait_all(flights: Sequence[InFlight]) -> BaseException | None:
    """Wait for every launched collective in ``flights``, each even if another's wait raises; the first error.

    Whatever raises while buckets are in flight (a copy, an allocation, a launch, a ``KeyboardInterrupt``), every
    collective already launched is waited for, once, before the error propagates, and its buffers are held until
    then: c10d cannot withdraw a posted collective, a buffer freed under it would be written after free, and one left
    unmatched would pair with the next call's. A fault on every rank alike raises at the same bucket on each, before
    its collective, so the ranks stay in step."""
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
    """Wait for the bucket's collective and copy each tensor out ([Note: bucket layout] in ``layout``). Under
    ``no_grad``. Offloaded full tensors land in pageable memory, as FSDP1's do: pinned memory would stay with torch's
    host caching allocator for the life of the process.

    [Note: a bucket of one]
    A bucket of one tensor: its output *is* its padded full tensor, so the result is a view and nothing is copied
    out (nor in, where its shard is already padded, cast and placed). Tensors above the bucket cap always take this
    path: the gather moves each byte once, as FSDP1's flat parameter does."""
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
        # the whole bucket at once, then split where it landed
        output = output.to(out_device) if reserved is None or reserved.host is None else reserved.host.copy_(output)
    if len(flight.bucket) == 1:
        padded = [output.view(flight.bucket[0].layout.padded_shape)]
    else:
        padded = _copy_out(output, flight, None if reserved is None else reserved.fulls)
    # each full tensor: its first rows, the buffer itself where nothing is padded (a slice: cheaper than narrow())
    return [buf if buf.shape[0] == b.layout.shape[0] else buf[:b.layout.shape[0]]
            for buf, b in zip(padded, flight.bucket, strict=True)]


def _copy_out(output: torch.Tensor, flight: AllGatherFlight, padded: list[torch.Tensor] | None = None
              ) -> list[torch.Tensor]:
    """Scatter a multi-tensor bucket's output into a padded buffer a tensor (``padded``, if reserved): only the
    rank blocks that hold rows ([Note: bucket layout] in ``layout``)."""
    world_size = flight.bucket[0].layout.world_size
    blocks = flight.blocks
    if padded is None:
        padded = [output.new_empty(_copy_out_shape(b.layout, blocks)) for b in flight.bucket]
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
    """An ``InPlace`` bucket's full tensors: views of its padded ones."""
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
        local = gathered_local(local)
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
    """The one driver: a list of DTensors' buckets, staged ``ahead`` launches at a time, finished in order.

    ``ahead=1``: the summon's window ([Note: one bucket in flight]); ``ahead=None``: every bucket at once, the
    stream's batch (``start_gather``). ``together``: buckets share launches where they can ([Note: one launch a group]).
    A collective: every rank builds, launches and finishes the same gathers in the same order."""

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
        together: bool = False,
    ) -> None:
        self._posted = posted
        self.last_work: tuple[Waitable, torch.device] | None = None  # its last collective: ``gather_full_tensors``
        self._host_copies: list[Any] = []
        self.plan = bucket_plan(dtensors, bucket_bytes, cast_to, reuse=plan, collective_bytes=collective_bytes,
                                meshes=meshes, together=together)
        buckets, self._fallback = self.plan.bind(dtensors), list(self.plan.fallback)
        self._dtensors = list(dtensors)
        self._meshes = meshes
        self._cast_to = cast_to
        self._receiver = receiver
        self._unstaged = collections.deque(zip(buckets, self.plan.shapes, strict=True))
        self._launches = collections.deque(self.plan.launches)  # buckets a launch, for those not staged
        self._ahead = len(self._launches) if ahead is None else ahead
        self._in_flight = 0  # launches staged and not finished
        self._flights: collections.deque[InFlight] = collections.deque()
        self._to_launch: list[list[InFlight]] = []  # staged launches whose collectives ``launch`` posts
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
        """``reserve_buffers``, then ``agree_ready`` ([Note: allocate, agree, gather]); ``failure``: one this rank
        met earlier in the call, agreed on instead. Posted from its start: a fault before the agreement is one-sided
        as far as this rank knows."""
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
        """Stage (and launch) launches until ``ahead`` are in flight beyond the ``finishing`` one."""
        reserved = self._reserved
        while self._unstaged and self._in_flight - finishing < self._ahead:
            staged: list[InFlight] = []
            for _ in range(self._launches.popleft()):
                staged.append(stage_bucket(*self._unstaged.popleft(), self._receiver, self._host_copies,
                                           None if reserved is None else reserved.popleft()))
                self._flights.append(staged[-1])  # recorded before its collective is posted: never dropped
            staged[-1].ends_launch = True
            self._in_flight += 1
            if launch:
                launched_together(staged, self._posted)
            else:
                self._to_launch.append(staged)

    def launch(self) -> None:
        """Launch every staged launch's collectives, in bucket order. A collective; a no-op once done."""
        try:
            for staged in self._to_launch:
                launched_together(staged, self._posted)
        except BaseException:
            self._drop()
            raise
        self._to_launch, self._unlaunched = [], False

    def wait(self) -> Callable[[], object] | None:
        """Wait for every launched collective, in bucket order (``finish`` copies out); what blocks the host until
        they have completed, if any was posted ([Note: bounded run-ahead])."""
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
        """Wait and copy out, bucket by bucket, then the fallbacks; with each tensor's layout (writeback's)."""
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
                    self.last_work = work, flight.output.device  # type: ignore[attr-defined]  # it posted
                if flight.ends_launch:
                    self._in_flight -= 1
                    if self._unstaged and self.last_work is not None:  # launch k + 2 will wait for this one
                        fence = completion((self.last_work[0],), self.last_work[1])
                flights.popleft()
                del flight
            if self._fallback:
                self._posted.any = True  # full_tensor() posts collectives of its own (counted first: it may raise)
            for index in self._fallback:
                results[index] = _gather_fallback(self._dtensors[index], holds_fulls, out_device, self._cast_to,
                                                  None if self._meshes is None else self._meshes[index])
            self._fallback = []
            if self._host_copies:  # no copy from host memory still reads a shard (``copy_in``)
                self._host_copies[-1].synchronize()
                self._host_copies.clear()
            return Gathered(results, layouts, self.plan)
        except BaseException:
            self._drop()
            raise
        finally:
            torch._C._set_grad_enabled(grad_enabled)

    def _drop(self) -> BaseException | None:
        """Wait for every launched collective and drop the rest. Raises nothing; returns the first failed wait."""
        flights, self._flights = list(self._flights), collections.deque()
        self._to_launch, self._launches, self._in_flight = [], collections.deque(), 0
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
    """All-gather every DTensor in ``dtensors`` to a plain full tensor. A collective: every rank of the meshes calls
    it with the same tensors in the same order, after the caller refused what cannot be gathered.

    [Note: one bucket in flight]
    Bucket ``k + 1`` is launched before bucket ``k`` is copied out, so the copy-out overlaps the next transfer, and
    at most two buckets' outputs are alive: beyond the full tensors, two buckets.

    ``holds_fulls=False`` (``rank0_only``, other ranks) takes part and returns ``None``s; a ``receiver`` other than
    ``"all"`` needs it on every rank it does not name (``layout.Delivery``). ``out_device``: where results go
    (``offload_to_cpu``). Results never alias local shards. ``posted``: the call's record; ``behind``: the process's
    earlier calls a rank that keeps nothing paces itself by ([Note: bounded run-ahead])."""
    paced = None if holds_fulls else behind  # [Note: bounded run-ahead]: call k - 1 done before k + 1
    while paced and len(paced) > 1:
        paced[0]()  # dropped once done: an interrupt in the wait leaves it to the next call
        paced.popleft()
    try:
        gather = BucketGather(dtensors, bucket_bytes=bucket_bytes, receiver=receiver, ahead=1, plan=plan,
                              collective_bytes=collective_bytes, meshes=meshes, posted=posted,
                              reserve=Reserve(holds_fulls, out_device), failure=failure,
                              together=collective_bytes is not None)  # one unit: [Note: one launch a group]
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
    """Stage every bucket of ``dtensors`` and launch (unless ``launch=False``) its all-gather: the whole batch in
    flight while the caller works; ``finish`` collects it, fallbacks (``full_tensor()``) included. With ``cast_to``
    each floating shard is cast as it is copied in, so the gather moves the cast bytes; casting is elementwise, so
    this equals casting the full tensor.

    Staging is the host's part (copy-in, cast, output); launching posts the all-gather. The stream stages batch
    ``k + 1`` before it waits for batch ``k`` and launches it once ``k`` is in: the copies overlap the wire, and the
    group never holds more than one batch's collectives."""
    return BucketGather(dtensors, cast_to=cast_to, bucket_bytes=bucket_bytes, receiver=receiver, launch=launch,
                        meshes=meshes, posted=posted, together=True)
