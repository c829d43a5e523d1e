"""The gather engine: DTensors in, full tensors out, and the local writeback.

Stateless functions with explicit inputs, in the manner of FSDP2's
``_fsdp_collectives.py``. Nothing here knows about modules, FSDP state or
swapping; ``_swap`` decides *what* to gather and where the results go.

[Note: dim-0 layout]
FSDP2 and DTensor's ``Shard(0)`` both split dim 0 the way ``torch.chunk`` does:
with ``W`` ranks on the shard mesh dim and ``n`` rows, every rank's chunk has
``c = ceil(n / W)`` rows except the trailing ones, which are shorter or empty.
Rank ``r`` holds rows ``[r * c, min(n, (r + 1) * c))``. Padding each local
shard to ``c`` rows makes all contributions the same size, so one
``all_gather_into_tensor`` per bucket gathers many parameters at once.

[Note: bucket layout]
A bucket is a list of parameters sharing one process group, dtype and device.
Each rank's all-gather input is the concatenation of its padded shards
(``c_i * row_i`` elements each, ``S`` in all), written straight into its own
block of the output buffer. The output is ``W`` such blocks
back to back, so viewed as ``(W, S)`` column ranges ``[off_i, off_i + c_i *
row_i)`` hold parameter ``i``'s rank blocks, and one ``split_with_sizes_copy``
scatters every parameter into its own padded ``(W * c_i, *rest)`` buffer. The
full tensor handed out is a view of that buffer's first ``n_i`` rows: the only
memory beyond the full size is the padding (at most ``W - 1`` rows a tensor).

[Note: one bucket in flight]
Bucket ``k + 1``'s collective (or messages) is launched before bucket ``k``
is copied out, so the copy-out overlaps the next transfer. At most two
buckets' outputs are alive at once (inputs live inside them), so the extra
memory beyond the full tensors is at most two buckets (the default cap is
sized for that).

[Note: point to point]
On gloo (CPU) no bucket moves by a collective: each is sent with
``isend``/``irecv`` from the ranks that hold shards to the ranks that
receive, every rank of the group (``receiver="all"``) or one
(``rank0_only``). gloo's ``all_gather_into_tensor`` and ``gather`` each
collect into a flat tensor of their own and copy it into the output, and
the all-gather is slow on the wire besides. 2 ranks on loopback, twelve
blocks of the bench model's shapes, each block's shards packed,
all-gathered and copied out: 48.8 ms at 12 x 256; the same blocks sent
point to point took 0.83x of that, and 0.49x at 12 x 768 (3 ranks: 0.72x).
Two forms, chosen per bucket by message size:

* *Direct*, when a bucket's tensors average at least
  ``_POINT_TO_POINT_BYTES`` (1 MiB) of shard a rank: each receiver
  allocates each padded full tensor and posts one receive per (tensor,
  sender) straight into that sender's rows; every rank sends each shard,
  as it is, to every other receiver. Nothing is copied but a receiver's
  own rows. At 12 x 768: 0.39x the all-gather's time (3 ranks: 0.62x).
  ``plan_buckets`` gives a tensor with at least ``_ALONE_BYTES`` (1 MiB)
  of shard a bucket of its own here, so a large tensor is always sent
  direct, never packed with small ones and copied out again (the bf16
  stream at 12 x 768: 0.47 -> 0.41 and 0.44 -> 0.38 of the per-unit
  loop, interleaved, where the bf16 ``qkv`` weight had shared a bucket).
* *Packed* otherwise: a message costs about 50 us, so a 12 x 256 block's
  dozen small tensors travel faster as one (direct, they took 1.4x the
  all-gather's time): each rank packs its padded shards as for an
  all-gather (a receiver into its own block of the output) and sends the
  block to every other receiver, which posts one receive per sender
  straight into that sender's block; the output is copied out as an
  all-gather's is.

The shim's per-unit summon loop against FSDP1's (12 x 256, 2 ranks,
interleaved) went from 1.16x (all-gather) to 0.98x for every rank, and
from 0.70x (``gather``) to 0.51x with ``rank0_only``.

Both sides derive every message from global metadata and post them in
program order, so they agree: a packed bucket's messages carry one tag
(``_PACKED_TAG``), a direct bucket's tensor ``i`` that tag ``+ 1 + i``,
and messages with one tag between two ranks match in order. They are
outside the group's collective order, so they are posted as soon as a
bucket is staged (see [Note: staged, then launched]). On other backends the all-gather stays
(``moves_point_to_point``), as in FSDP1 and FSDP2: nobody has measured
there, and ``rank0_only``'s other ranks drop what they receive.
``global_rank0`` (``iter_full_params``) skips, on every rank of it, a
group that does not contain global rank 0: under HSDP only global rank
0's replica moves anything. The ``full_tensor()`` fallback is unchanged
(every rank receives).

[Note: scratch buffers]
A multi-tensor bucket's output buffer is scratch: every full tensor is
copied out of it. On the CPU a fresh buffer of a few MiB comes from ``mmap``
each time (glibc maps a request as large as the last freed one anew), and
touching it costs page faults: an all-gather into a fresh 8 MiB output took
12.4 ms against 9.8 ms into a reused one (2 gloo ranks). So each thread keeps
its last few CPU scratch buffers, by size, and a per-unit loop over identical
blocks reuses one. At most ``_Scratch.KEEP`` buffers of at most a bucket (plus
padding) each stay allocated. Accelerators' caching allocators do this
already; buffers handed out as full tensors are never scratch.

[Note: recycled buffers]
A stream's full tensors are valid until its next step, so it can reuse
their memory: on the CPU a fresh full tensor of a few MiB is a fresh
``mmap`` whose every page faults when first written (rank 0 of a bf16
stream at 12 x 768, 2 gloo ranks: about 5,000 faults a pass; of the
per-unit summon loop, up to 57,000, with malloc's state deciding). Each batch
allocates the full tensors it writes at staging (point to point, a bucket
of one, a group of one) through a ``RecycledBuffers`` that may take the
buffers of the batch two steps before it, the one handed out at the last
step. A buffer is taken only for a request of its exact size, dtype and
device, and only while its storage's use count is what it was when the
buffer was alone: a tensor, a view or a pending ``Work`` a caller still
holds keeps it out, so a caller that keeps tensors past their step (against
the documented contract) gets fresh memory and correct values, never a
buffer written under it. What the batch did not take is freed once it is
staged, or sooner, at the first request none of them has the size for
(another unit's structure: they are gone before fresh memory is taken), so
the stream's memory bound is unchanged. A packed bucket's full tensors,
allocated at its copy-out, stay fresh. Accelerators' caching allocators
reuse memory already; nothing is recycled there. 2 gloo ranks, 12 x 768,
interleaved, recycled / fresh: the fp32 stream 0.79, 0.77 and 0.80 in
three runs; the bf16 stream 0.87 in one, but 1.02 and 1.04 in two after
``_post_direct`` began sending each cast shard at once (why its gain went
is not known; the bench's bf16 stream still went from 83-91 ms to 76-85).
12 x 256, one run: fp32 0.95, bf16 0.87. The summon does not recycle: its
full tensors are freed at exit, as FSDP1's are, and memory kept between
calls would be memory a training step does not get back.

[Note: a bucket of one]
With one tensor in a bucket the ``(W, S)`` output *is* its padded full tensor
(rank blocks of ``c`` rows, back to back), so the result is a view of the
first ``n`` rows and nothing is copied out; if its shard already has ``c``
rows, in the gathered dtype, on the collective's device, the shard itself is
the all-gather input and nothing is copied in either. Tensors larger than the
bucket cap always take this path: for big models the gather moves each byte
once, as FSDP1's flat parameter does.

[Note: a group of one]
When the shard mesh dim has one rank (one GPU, or HSDP with one shard per
replica), the shard is the whole tensor and nothing is exchanged: each full
tensor is a fresh copy of its shard (cast on the way where asked), made in
one ``_foreach_copy_`` per bucket, with no collective, no bucket buffer and
no copy-out. The copy is still needed: results never alias live shards, so
``writeback=False`` edits are discarded as FSDP1's ``FULL_SHARD`` discards
them. One rank, 12 x 256 on the CPU: the whole-model summon went from two
copies of every byte (into the bucket, then out of it) to one.

[Note: no coalesced all-gather]
On gloo, ``all_gather_into_tensor`` gathers into a flat tensor of its own
and copies it into the output, so a bucket's copy-out after it is a second
copy. 0.4.0 skipped that copy with the process group's coalesced
all-gather (``allgather_into_tensor_coalesced``, one output per full
tensor). 0.4.1 dropped it: a stress loop of whole-model
``rank0_only=False`` summons on 2 gloo ranks (12 x 256, two buckets in
flight, torch 2.13) died of heap corruption ("malloc(): unaligned tcache
chunk detected") in 5 of 8 runs of 80 s with it, and ran clean in 6 of 6
without. The cause was not found (the same call on plain tensors, two in
flight, ran clean for 2 x 60 s). Since 0.4.2 gloo moves no bucket by a
collective at all ([Note: point to point]); ``scripts/stress.py`` ran
every mode of it clean (see the changelog).

[Note: values arriving]
A summon's own bookkeeping (new ``nn.Parameter`` objects in every slot,
group marks, hooks) needs the full tensor *objects*, not their values. So
``start_full_tensors`` hands out the last bucket's full tensors while it is
still in flight, and the swap runs meanwhile; ``Arrival.wait()`` comes
before the context's body, and on every error path. Where the messages (or
the collective) write straight into the full tensors (direct point to
point, a bucket of one) they are those destinations; a packed bucket's are
allocated empty and filled by its copy-out, which ``Arrival.wait()`` runs
once the bucket is in (``_CopiedOut``). For a per-unit summon (one bucket)
that hides the swap's Python behind the transfer: with packed buckets, 2
gloo ranks, 12 x 256, ``rank0_only=False``, the per-unit loop went from
0.91 to 0.89 and from 1.11 to 0.98 of FSDP1's in two interleaved runs.
Anything that reads a value, or its version counter (the copy into the
full tensors bumps it), waits first.

[Note: staged, then launched]
A bucket starts in two steps. Staging does the CPU's part: the padded input
copied in and cast, the output or full tensors allocated. Launching posts
the collective. The summon does both at once (``_start_bucket``). On gloo
every bucket moves point to point and its messages are posted while it is
staged ([Note: point to point]), a receiver posting its receives before it
copies its own rows, so that copy overlaps the transfer (copying first
made the per-unit loop 1.12x slower at 12 x 768). The stream stages batch
``k + 1`` *before* it waits for batch ``k``: the copies and casts run while
batch ``k`` is on the wire, and on gloo batch ``k + 1``'s messages are then
moving while ``k`` is copied out and consumed. A collective (NCCL) is
launched only once batch ``k`` is in, so the process group never holds more
than one batch's collectives: launching them earlier was faster on gloo
but a rank died of heap corruption in 2 of 6 stress runs, while the
coalesced all-gather was in use (see [Note: no coalesced all-gather]), and
nobody has run that on NCCL. 2 gloo ranks, interleaved, stream / per-unit
summon loop, while buckets still moved by collectives: at 12 x 256 bf16
0.55 -> 0.46, fp32 0.88 -> 0.70; at 12 x 768 bf16 0.76 -> 0.67, fp32 1.04
-> 0.98 by staging, then bf16 0.64 -> 0.59 and fp32 0.87 -> 0.75 by
posting point-to-point messages at staging.

[Note: cast before gather]
With ``cast_to`` (``iter_full_params(dtype=...)``), each floating local shard
is cast while it is copied into the bucket, so the all-gather moves the cast
bytes (half of fp32 for bf16) and the full tensor is born in that dtype.
Casting is elementwise, so this equals casting the gathered full tensor.

[Note: writeback needs no collective]
Every rank already holds the whole (possibly edited) full tensor inside the
context, so each rank copies rows ``[r * c, r * c + local_rows)`` of it into its
own local shard, in place. HSDP replicas hold identical full tensors and so
write identical shards. This is what FSDP1's ``_writeback_to_local_shard``
does with its flat parameter.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from fsdp_shim import _diagnostics
from fsdp_shim._compat import (
    WRITABLE_PARTIAL_OPS,
    all_gather_single,
    is_dim0_shard,
    is_live_group,
    is_replicate,
    partial_reduce_op,
    storage_use_count,
    ungatherable_reason,
)

logger = logging.getLogger("fsdp_shim")

#: Environment variable that overrides the default bucket cap, in MiB.
BUCKET_ENV = "FSDP_SHIM_BUCKET_MB"
#: Default cap on one bucket's gathered (full, padded) size. Chosen with
#: ``fsdp-shim bench --bucket-mb``: see README "Performance".
DEFAULT_BUCKET_MB = 4.0


def bucket_bytes_from_env(explicit: float | None = None, default_mb: float = DEFAULT_BUCKET_MB) -> int:
    """The bucket cap in bytes: ``explicit`` MiB, else ``$FSDP_SHIM_BUCKET_MB``, else ``default_mb``."""
    if explicit is None:
        raw = os.environ.get(BUCKET_ENV)
        if raw:
            try:
                explicit = float(raw)
            except ValueError:
                raise ValueError(f"{BUCKET_ENV}={raw!r} is not a number of MiB") from None
    mib = default_mb if explicit is None else explicit
    if mib <= 0:
        raise ValueError(f"bucket size must be positive, got {mib} MiB")
    return int(mib * 1024 * 1024)


class Dim0Layout(NamedTuple):
    """Where one rank's local shard sits in the full tensor. See [Note: dim-0 layout]."""

    group: dist.ProcessGroup
    world_size: int  # W: ranks on the shard mesh dim
    rank: int  # r: this rank's coordinate on it
    chunk_rows: int  # c = ceil(n / W)
    row_numel: int  # elements per dim-0 row
    local_rows: int  # rows this rank holds, c or fewer

    @property
    def padded_numel(self) -> int:  # one rank's padded contribution
        return self.chunk_rows * self.row_numel

    @property
    def row_offset(self) -> int:  # first full-tensor row of this rank's shard
        return self.rank * self.chunk_rows


_mesh_dims: dict[tuple[int, int], tuple[weakref.ref[DeviceMesh], tuple[dist.ProcessGroup, int, int]]] = {}


def _mesh_dim(mesh: DeviceMesh, mesh_dim: int) -> tuple[dist.ProcessGroup, int, int]:
    """(group, size, local rank) of one mesh dim, cached: DeviceMesh's lookups cost ~10 us each."""
    key = (id(mesh), mesh_dim)
    cached = _mesh_dims.get(key)
    if cached is None or cached[0]() is not mesh:
        info = (mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
        cached = _mesh_dims[key] = (weakref.ref(mesh), info)
    return cached[1]


def mesh_dim_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """The process group of every dim of ``mesh`` (what gathering a DTensor on it may use)."""
    return [_mesh_dim(mesh, dim)[0] for dim in range(mesh.ndim)]


def _require_live_groups(dtensors: Sequence[DTensor]) -> None:
    """A destroyed (or foreign) process group fails here, clearly, not inside a collective."""
    meshes: set[int] = set()
    for index, dtensor in enumerate(dtensors):
        if id(dtensor.device_mesh) in meshes:
            continue  # checked already, in this call
        meshes.add(id(dtensor.device_mesh))
        for group in mesh_dim_groups(dtensor.device_mesh):
            if not is_live_group(group):
                raise RuntimeError(
                    f"cannot gather tensor {index} of shape {tuple(dtensor.shape)}: its device mesh uses a "
                    "process group that was destroyed or belongs to another process group world "
                    "(was the DTensor created before destroy_process_group()?)"
                )


#: ``id(spec)`` -> (the DTensorSpec, weakly; the local shape seen; its layout). See ``dim0_layout``.
_layouts: dict[int, tuple[weakref.ref[Any], torch.Size, Dim0Layout | None]] = {}


def rows_held(rows: int, chunk_rows: int, coordinate: int) -> int:
    """Rows of a ``rows``-row tensor that shard ``coordinate`` holds under ``Shard(0)``. See [Note: dim-0 layout]."""
    return max(0, min(chunk_rows, rows - coordinate * chunk_rows))


def dim0_layout(dtensor: DTensor) -> Dim0Layout | None:
    """The batched-gather layout of ``dtensor``, or ``None`` if only ``full_tensor()`` applies.

    Cached per ``DTensorSpec`` (mesh, placements and global shape, which a
    DTensor never changes) and local shape: an FSDP2 parameter keeps its
    spec for life, and working the layout out costs ~13 us a tensor, a fifth
    of a per-unit summon's Python. The spec is held weakly, its entry dropped
    with it.
    """
    spec = dtensor._spec
    local_shape = dtensor._local_tensor.shape
    cached = _layouts.get(id(spec))
    if cached is not None and cached[0]() is spec and cached[1] == local_shape:
        return cached[2]
    layout = _work_out_dim0_layout(dtensor)
    key = id(spec)
    _layouts[key] = (weakref.ref(spec, lambda _, key=key: _layouts.pop(key, None)), local_shape, layout)  # type: ignore[misc]
    return layout


def _work_out_dim0_layout(dtensor: DTensor) -> Dim0Layout | None:
    """``dim0_layout``, uncached.

    The fast path covers placements with exactly one plain ``Shard(0)`` and
    ``Replicate`` everywhere else (FSDP, HSDP, dim-0 tensor parallel), tested
    by exact type (see [Note: torch versions] in ``_compat``). Anything else
    (another shard dim, ``_StridedShard``, ``Partial``, several shardings, a
    placement type this code has never seen) falls back. The choice depends
    on placements only, never on this rank's local tensor, so all ranks choose
    alike and their collectives match.
    """
    placements = dtensor.placements
    shard_dims = [i for i, p in enumerate(placements) if is_dim0_shard(p)]
    if len(shard_dims) != 1 or dtensor.ndim == 0:
        return None
    if not all(is_replicate(p) for i, p in enumerate(placements) if i != shard_dims[0]):
        return None
    group, world_size, rank = _mesh_dim(dtensor.device_mesh, shard_dims[0])
    rows = dtensor.shape[0]
    chunk_rows = -(-rows // world_size)
    expected_rows = rows_held(rows, chunk_rows, rank)
    local_shape = tuple(dtensor._local_tensor.shape)
    if local_shape != (expected_rows, *dtensor.shape[1:]):
        raise ValueError(
            f"DTensor of shape {tuple(dtensor.shape)} with {placements} holds a local shard of "
            f"shape {local_shape} on mesh rank {rank}, not the torch.chunk slice "
            f"{(expected_rows, *dtensor.shape[1:])} that Shard(0) implies"
        )
    row_numel = 1
    for size in dtensor.shape[1:]:
        row_numel *= size
    return Dim0Layout(group, world_size, rank, chunk_rows, row_numel, expected_rows)


class _Batched(NamedTuple):
    position: int  # in the caller's list
    dtensor: DTensor
    layout: Dim0Layout


def gathered_dtype(tensor: torch.Tensor, cast_to: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``cast_to`` for floating tensors, else its own."""
    if cast_to is not None and tensor.is_floating_point():
        return cast_to
    return tensor.dtype


def plan_buckets(
    dtensors: Sequence[DTensor], bucket_bytes: int, cast_to: torch.dtype | None = None
) -> tuple[list[list[_Batched]], list[int]]:
    """Split ``dtensors`` into fast-path buckets and fallback indices.

    Buckets hold tensors of one (process group, dtype, device) in the caller's
    order and close when the next tensor would push the gathered size past
    ``bucket_bytes``. A tensor larger than the cap gets a bucket of its own
    and leaves the open bucket open: the small tensors around it (a layer's
    norms and biases around its big matrices) share one collective instead
    of one each between the big ones, which a collective's fixed cost (about
    0.5 ms on gloo) made 1.14x FSDP1 in a per-unit loop over 27 MiB units.
    Where buckets move point to point, a tensor whose shard (in the dtype
    it travels in) carries at least ``_ALONE_BYTES`` travels alone too: it
    is then sent direct, never copied into a bucket and out again (see
    [Note: point to point]).
    ``cast_to`` is the dtype floating tensors travel in (see [Note: cast
    before gather]). The plan depends only on global metadata, so every rank
    builds the same one and issues the same collectives in the same order.
    """
    buckets: list[list[_Batched]] = []
    fallback: list[int] = []
    open_buckets: dict[tuple[object, torch.dtype, torch.device], tuple[list[_Batched], list[int]]] = {}
    direct: dict[dist.ProcessGroup, bool] = {}  # whether a group's buckets move point to point
    for index, dtensor in enumerate(dtensors):
        layout = dim0_layout(dtensor)
        if layout is None:
            fallback.append(index)
            continue
        dtype = gathered_dtype(dtensor, cast_to)
        key = (layout.group, dtype, dtensor._local_tensor.device)
        nbytes = layout.world_size * layout.padded_numel * dtype.itemsize
        if layout.group not in direct:
            direct[layout.group] = moves_point_to_point(layout.group)
        if nbytes > bucket_bytes or (direct[layout.group] and nbytes >= _ALONE_BYTES * layout.world_size):
            buckets.append([_Batched(index, dtensor, layout)])
            continue
        bucket, size = open_buckets.get(key, (None, [0]))
        if bucket is None or size[0] + nbytes > bucket_bytes:
            bucket, size = [], [0]
            buckets.append(bucket)
            open_buckets[key] = (bucket, size)
        bucket.append(_Batched(index, dtensor, layout))
        size[0] += nbytes
    return buckets, fallback


def _comm_device(dtensor: DTensor) -> torch.device:
    """The device collectives on this mesh run on (CPU-offloaded shards are staged there)."""
    device_type = dtensor.device_mesh.device_type
    if device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, device_type)
    return torch.device(device_type, handle.current_device())


#: Who receives full tensors. ``"all"``: every rank (all-gather). ``"group_rank0"``:
#: rank 0 of each process group gathered over (FSDP1's ``rank0_only``: each
#: shard group's). ``"global_rank0"``: global rank 0 alone; buckets over groups
#: without it are skipped. See [Note: point to point].
Receiver = Literal["all", "group_rank0", "global_rank0"]


#: ``FSDP_SHIM_TRANSPORT``: ``auto`` (the default: point to point on gloo, the
#: all-gather elsewhere) or ``all_gather`` (the collective everywhere: on gloo,
#: the path NCCL users take, which CI's second pass of the suite runs). Read at
#: import; ``set_transport`` changes it.
TRANSPORT_ENV = "FSDP_SHIM_TRANSPORT"
TRANSPORTS = ("auto", "all_gather")
_transport = "auto"


def set_transport(transport: str) -> str:
    """Choose the transport (``TRANSPORTS``); returns the previous one. Not for use while a gather runs."""
    global _transport
    if transport not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV} must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    previous, _transport = _transport, transport
    return previous


def _transport_from_env() -> None:
    value = os.environ.get(TRANSPORT_ENV, "").strip().lower() or "auto"
    try:
        set_transport(value)
    except ValueError as exc:
        _diagnostics.log_warning("fsdp_shim: %s; using auto", exc)


def moves_point_to_point(group: dist.ProcessGroup) -> bool:
    """Whether buckets on ``group`` move by point-to-point messages rather than by a collective.

    gloo: measured faster for every receiver, one or all (see [Note: point
    to point]), unless the transport is ``all_gather``. Elsewhere (NCCL) the
    all-gather stays, as FSDP1 and FSDP2 do: nobody has measured there yet.
    """
    return _transport == "auto" and dist.get_backend(group) == "gloo"


class _Waitable(Protocol):
    """A collective's ``dist.Work``, or several point-to-point ones (``_AllOf``)."""

    def wait(self) -> Any: ...


class _InFlight(NamedTuple):
    bucket: list[_Batched]
    output: torch.Tensor | None  # 1D, world_size * sum(split_sizes); None where this rank receives nothing
    split_sizes: list[int]
    work: _Waitable | None
    scratch_input: torch.Tensor | None = None  # a sender's input, reusable once ``work`` is done
    #: The padded full tensors themselves, when the messages land in them directly (point to point, alone).
    padded_fulls: list[torch.Tensor] | None = None
    #: The bucket's collective, while it is staged and not yet launched. See [Note: staged, then launched].
    launch: Callable[[], _Waitable] | None = None

    @property
    def receives(self) -> bool:
        """Whether full tensors arrive on this rank."""
        return self.output is not None or self.padded_fulls is not None

    def launched(self) -> _InFlight:
        """This flight with its collective launched; itself if it has none or it already is."""
        if self.launch is None:
            return self
        return self._replace(work=self.launch(), launch=None)


def _start_bucket(
    bucket: list[_Batched], cast_to: torch.dtype | None = None, receiver: Receiver = "all"
) -> _InFlight:
    """Stage the bucket and launch its collective at once."""
    return _stage_bucket(bucket, cast_to, receiver).launched()


@torch.no_grad()
def _stage_bucket(
    bucket: list[_Batched], cast_to: torch.dtype | None = None, receiver: Receiver = "all",
    buffers: FullBuffers | None = None,
) -> _InFlight:
    """Copy in this rank's padded shards; the bucket's collective is left for ``launched()``.

    Full tensors written in place (and a bucket of one's output) come from
    ``buffers``: fresh memory unless a stream recycles (see [Note: recycled
    buffers]).

    On gloo there is no collective: the bucket moves point to point, and its
    messages are posted here (see [Note: point to point] and [Note: staged,
    then launched]).

    As FSDP2 does, the input is this rank's block of the output buffer, so the
    copy-in needs no buffer of its own and the all-gather runs in place. A
    bucket of one tensor whose shard needs no padding, cast or move is sent
    as it is: no copy-in at all (see [Note: a bucket of one]).
    """
    first = bucket[0]
    world_size, group, rank = first.layout.world_size, first.layout.group, first.layout.rank
    split_sizes = [b.layout.padded_numel for b in bucket]
    dtype = gathered_dtype(first.dtensor, cast_to)
    comm_device = _comm_device(first.dtensor)
    buffers = buffers or _FRESH
    global_ranks = dist.get_process_group_ranks(group)  # by group rank
    receivers = range(world_size)  # group ranks that receive full tensors
    if receiver != "all":
        root = 0 if receiver == "global_rank0" else global_ranks[0]
        if root not in global_ranks:
            return _InFlight(bucket, None, split_sizes, None)  # nobody here receives: nothing to move
        receivers = range(global_ranks.index(root), global_ranks.index(root) + 1)
    if world_size == 1:
        return _start_alone(bucket, split_sizes, dtype, comm_device, buffers)
    if moves_point_to_point(group):
        route = _Route(split_sizes, dtype, comm_device, receivers, global_ranks, buffers)
        if sum(split_sizes) * dtype.itemsize >= _POINT_TO_POINT_BYTES * len(bucket):
            return _post_direct(bucket, route)
        return _post_packed(bucket, route)
    per_rank = sum(split_sizes)
    output = _bucket_output(bucket, world_size * per_rank, dtype, comm_device, buffers)
    gather_input, _ = _copy_in(bucket, split_sizes, dtype, comm_device, output.narrow(0, rank * per_rank, per_rank))
    launch = functools.partial(all_gather_single, output, gather_input, group=group, async_op=True)
    return _InFlight(bucket, output, split_sizes, None, launch=launch)


def _bucket_output(
    bucket: list[_Batched], numel: int, dtype: torch.dtype, device: torch.device, buffers: FullBuffers
) -> torch.Tensor:
    """A bucket's flat output: scratch, except that a bucket of one hands it out as its full tensor."""
    if len(bucket) > 1:
        return _scratch.take(numel, dtype, device)
    return buffers.take(numel, dtype, device)


def _copy_in(
    bucket: list[_Batched], split_sizes: list[int], dtype: torch.dtype, device: torch.device,
    block: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's padded shards, back to back: (the input, the scratch it lives in if any).

    Packed into ``block`` (this rank's block of the output), or into scratch
    where this rank receives nothing. A bucket of one whose shard needs no
    padding, cast or move is its own input (see [Note: a bucket of one]).
    """
    per_rank = sum(split_sizes)
    local = bucket[0].dtensor._local_tensor
    if (len(bucket) == 1 and local.numel() == per_rank and local.dtype == dtype and local.device == device
            and local.is_contiguous()):
        return local.view(-1), None
    scratch_input = None
    if block is None:  # a sender only: scratch, given back once its messages are out
        block = scratch_input = _scratch.take(per_rank, dtype, device)
    destinations: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    offset = 0
    for b, padded in zip(bucket, split_sizes):
        local = b.dtensor._local_tensor.reshape(-1)
        destinations.append(block.narrow(0, offset, local.numel()))
        sources.append(local)
        if padded > local.numel():  # zeros: padding is never exposed, but stays deterministic
            block.narrow(0, offset + local.numel(), padded - local.numel()).zero_()
        offset += padded
    torch._foreach_copy_(destinations, sources, non_blocking=True)  # casts and moves in the same pass
    return block, scratch_input


#: Each message of a bucket that carries at least this many bytes on average
#: goes straight between shard and full tensor; below it, the bucket is packed.
#: See [Note: point to point].
_POINT_TO_POINT_BYTES = 1 << 20
#: The tag of a packed bucket's messages; a direct bucket tags tensor ``i``'s
#: ``_PACKED_TAG + 1 + i``. Far from 0, the tag other code on the same group
#: most likely uses, so a receive someone else left posted never takes ours.
_PACKED_TAG = 0x46530000
#: Where buckets move point to point, a tensor whose shard carries at least
#: this many bytes gets a bucket of its own, and so is sent direct (``plan_buckets``).
_ALONE_BYTES = 1 << 20


class _AllOf:
    """Several point-to-point works, waited for as one; idempotent.

    A gloo ``isend``/``irecv`` work waited for a second time blocks forever
    (it waits for one more completion), so each work is dropped once done.
    """

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        while self._works:
            self._works[0].wait()
            del self._works[0]
        return True


class _Route(NamedTuple):
    """How one bucket moves point to point, worked out once in ``_stage_bucket``."""

    split_sizes: list[int]  # each tensor's padded shard, in elements
    dtype: torch.dtype  # what travels: the stored dtype, or the cast one
    device: torch.device  # where it travels from and lands
    receivers: range  # the group ranks that receive full tensors
    global_ranks: list[int]  # the group's ranks, by group rank
    buffers: FullBuffers  # where full tensors written in place come from


def _post_packed(bucket: list[_Batched], route: _Route) -> _InFlight:
    """Move the packed bucket point to point: one message per (sender, receiver). See [Note: point to point].

    A receiver posts its receives straight into the senders' blocks of its
    output, then packs its own block; every rank then sends its block, as it
    is, to every other receiver. The output is then copied out as an
    all-gather's would be.
    """
    first = bucket[0].layout
    group, world_size, rank = first.group, first.world_size, first.rank
    ranks = route.global_ranks
    per_rank = sum(route.split_sizes)
    works: list[dist.Work] = []
    output = block = None
    if rank in route.receivers:
        output = _bucket_output(bucket, world_size * per_rank, route.dtype, route.device, route.buffers)
        for source in range(world_size):
            if source != rank:
                piece = output.narrow(0, source * per_rank, per_rank)
                works.append(cast(dist.Work, dist.irecv(piece, src=ranks[source], group=group, tag=_PACKED_TAG)))
        block = output.narrow(0, rank * per_rank, per_rank)
    packed, scratch_input = _copy_in(bucket, route.split_sizes, route.dtype, route.device, block)
    for peer in route.receivers:
        if peer != rank:
            works.append(cast(dist.Work, dist.isend(packed, dst=ranks[peer], group=group, tag=_PACKED_TAG)))
    if block is not None and packed is not block:  # a bucket of one sent as it is: its own rows still land here
        block.copy_(packed)
    return _InFlight(bucket, output, route.split_sizes, _AllOf(works), scratch_input)


def _post_direct(bucket: list[_Batched], route: _Route) -> _InFlight:
    """Send every shard straight into the receivers' full tensors. See [Note: point to point].

    A receiver (``route.receivers``) allocates each padded full tensor and
    posts one receive per (tensor, sender) straight into that sender's rows;
    every rank sends each shard, as it is (or cast into scratch, each sent
    as soon as it is cast), to every other receiver; a receiver then copies
    its own shards into its rows, while the messages move. Rows a rank does
    not hold (an empty trailing shard) travel on neither side. Both sides
    derive every message from global metadata, so they agree; a tensor's tag
    is its place in the bucket, and messages with one tag between two ranks
    match in order.
    """
    first = bucket[0].layout
    group, world_size, rank = first.group, first.world_size, first.rank
    dtype, device = route.dtype, route.device
    works: list[dist.Work] = []
    padded_fulls: list[torch.Tensor] | None = None
    own_destinations: list[torch.Tensor] = []
    own_sources: list[torch.Tensor] = []
    if rank in route.receivers:
        padded_fulls = [route.buffers.take(world_size * padded, dtype, device) for padded in route.split_sizes]
        for tag, (b, full) in enumerate(zip(bucket, padded_fulls), start=_PACKED_TAG + 1):
            layout, rows = b.layout, b.dtensor.shape[0]
            for source in range(world_size):
                held = rows_held(rows, layout.chunk_rows, source)
                if held == 0:
                    continue
                piece = full.narrow(0, source * layout.padded_numel, held * layout.row_numel)
                if source == rank:
                    own_destinations.append(piece)
                    own_sources.append(b.dtensor._local_tensor.reshape(-1))
                else:
                    works.append(cast(dist.Work, dist.irecv(piece, src=route.global_ranks[source], group=group, tag=tag)))
    peers = [route.global_ranks[peer] for peer in route.receivers if peer != rank]
    scratch_input = None
    if peers:
        pieces = [b.dtensor._local_tensor.reshape(-1) for b in bucket]
        converted = [t.numel() > 0 and not (t.dtype == dtype and t.device == device) for t in pieces]
        if any(converted):  # cast (or moved) into scratch, given back once the sends are done
            scratch_input = _scratch.take(sum(t.numel() for t, c in zip(pieces, converted) if c), dtype, device)
        offset = 0
        for tag, (piece, convert) in enumerate(zip(pieces, converted), start=_PACKED_TAG + 1):
            if convert:  # each shard goes as soon as it is cast: the first is on the wire while the next casts
                assert scratch_input is not None
                staged = scratch_input.narrow(0, offset, piece.numel())
                staged.copy_(piece, non_blocking=True)
                piece, offset = staged, offset + piece.numel()
            if piece.numel():
                for peer in peers:
                    works.append(cast(dist.Work, dist.isend(piece, dst=peer, group=group, tag=tag)))
    if own_destinations:  # after the messages are posted, so it overlaps them
        torch._foreach_copy_(own_destinations, own_sources, non_blocking=True)  # casts and moves too
    return _InFlight(bucket, None, route.split_sizes, _AllOf(works), scratch_input, padded_fulls=padded_fulls)


def _start_alone(
    bucket: list[_Batched], split_sizes: list[int], dtype: torch.dtype, device: torch.device, buffers: FullBuffers
) -> _InFlight:
    """A shard group of one rank: each full tensor is its shard, copied once. See [Note: a group of one]."""
    padded_fulls = [buffers.take(padded, dtype, device) for padded in split_sizes]
    torch._foreach_copy_(padded_fulls, [b.dtensor._local_tensor.reshape(-1) for b in bucket])
    return _InFlight(bucket, None, split_sizes, None, padded_fulls=padded_fulls)


class _Scratch(threading.local):
    """Bucket outputs kept for reuse on the CPU, per thread. See [Note: scratch buffers]."""

    KEEP = 4  # buffers, most recently used first out

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            buffer = self.free.pop((numel, dtype), None)
            if buffer is not None:
                return buffer
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            return  # accelerators' caching allocators already reuse memory
        if buffer.is_inference():
            return  # made under inference_mode: outside it, the next copy into it would be refused
        self.free[(buffer.numel(), buffer.dtype)] = buffer
        while len(self.free) > self.KEEP:
            del self.free[next(iter(self.free))]


_scratch = _Scratch()


class FullBuffers:
    """Where a bucket's full tensors are allocated when it is staged: fresh memory, each time."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)


_FRESH = FullBuffers()


class RecycledBuffers(FullBuffers):
    """Full tensors' buffers for one batch of a stream, reusing an earlier batch's nobody holds any more.

    ``earlier`` are buffers an earlier batch took (its ``taken``), each with
    its storage's use count when it was alone. One is reused for a request
    of its exact size, dtype and device only while its use count is still
    that: no tensor, view or ``Work`` outside holds it. A request none of
    them has the size for frees them all first. See [Note: recycled
    buffers].
    """

    def __init__(self, earlier: Sequence[tuple[torch.Tensor, int]] = ()) -> None:
        self._earlier = list(earlier)
        #: Every CPU buffer this batch took, with its use count when alone: the next batches' ``earlier``.
        self.taken: list[tuple[torch.Tensor, int]] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        wanted = (numel, dtype, device)
        sized = [i for i, (b, _) in enumerate(self._earlier) if (b.numel(), b.dtype, b.device) == wanted]
        if not sized:  # another structure: the earlier buffers are freed before fresh memory is taken
            self._earlier = []
        inference = torch.is_inference_mode_enabled()
        for index in sized:
            buffer, alone = self._earlier[index]
            if buffer.is_inference() and not inference:
                continue  # made under inference_mode, which has ended: no in-place copy into it now
            if storage_use_count(buffer) == alone:  # nothing outside holds it
                del self._earlier[index]
                self.taken.append((buffer, alone))
                return buffer
        buffer = super().take(numel, dtype, device)
        count = storage_use_count(buffer) if device.type == "cpu" else None
        if count is not None:  # accelerators' caching allocators reuse memory already
            self.taken.append((buffer, count))
        return buffer

    def forget_earlier(self) -> None:
        """Free the earlier buffers no request took."""
        self._earlier = []


def _arrived(flight: _InFlight) -> None:
    """Wait for ``flight``'s collective or messages; a sender's scratch input is then free again."""
    if flight.work is not None:
        flight.work.wait()
    if flight.scratch_input is not None:
        _scratch.give(flight.scratch_input)


@torch.no_grad()
def _finish_bucket(flight: _InFlight, keep: bool, out_device: torch.device | None) -> list[torch.Tensor]:
    """Wait for the bucket's collective or messages and copy each tensor out. See [Note: bucket layout]."""
    _arrived(flight)
    if flight.padded_fulls is not None:  # point to point, or a group of one: already in place
        return [_on(full, out_device) for full in _in_place_results(flight)] if keep else []
    if not keep:
        if flight.output is not None and len(flight.bucket) > 1:
            _scratch.give(flight.output)
        return []  # rank0_only: this rank holds nothing once the gather is done
    output = flight.output
    assert output is not None, "a rank that keeps full tensors received them"
    if out_device is not None and out_device != output.device:
        # offload_to_cpu: move the whole bucket at once, pinned and
        # asynchronous on accelerators, then split on the host.
        host = torch.empty(output.shape, dtype=output.dtype, pin_memory=output.device.type != "cpu")
        host.copy_(output, non_blocking=True)
        if output.device.type != "cpu":
            getattr(torch, output.device.type).current_stream().synchronize()
        output = host
    if len(flight.bucket) == 1:  # see [Note: a bucket of one]
        only = flight.bucket[0].dtensor
        return [output[: only.numel()].view(only.shape)]
    padded_fulls = _padded_fulls(flight, output)
    _copy_out(output, flight, padded_fulls)
    return _views(padded_fulls, flight)


def _padded_fulls(flight: _InFlight, output: torch.Tensor) -> list[torch.Tensor]:
    """Fresh padded full tensors for a multi-tensor bucket's copy-out of ``output``, on its device."""
    world_size = flight.bucket[0].layout.world_size
    return [torch.empty(world_size * n, dtype=output.dtype, device=output.device) for n in flight.split_sizes]


def _copy_out(output: torch.Tensor, flight: _InFlight, padded_fulls: list[torch.Tensor]) -> None:
    """Scatter a multi-tensor bucket's output into its padded full tensors (see [Note: bucket layout])."""
    world_size = flight.bucket[0].layout.world_size
    torch.split_with_sizes_copy(
        output.view(world_size, -1),
        flight.split_sizes,
        dim=1,
        out=[buf.view(world_size, n) for buf, n in zip(padded_fulls, flight.split_sizes)],
    )
    if output is flight.output:
        _scratch.give(output)


def _views(padded_fulls: list[torch.Tensor], flight: _InFlight) -> list[torch.Tensor]:
    """Each full tensor: the first rows of its padded buffer, in its shape."""
    return [buf[: b.dtensor.numel()].view(b.dtensor.shape) for buf, b in zip(padded_fulls, flight.bucket)]


class _CopiedOut:
    """A multi-tensor bucket whose full tensors were handed out empty: waits, then copies out. Idempotent.

    See [Note: values arriving].
    """

    def __init__(self, flight: _InFlight, padded_fulls: list[torch.Tensor]) -> None:
        self._flight: _InFlight | None = flight
        self._padded_fulls = padded_fulls

    def wait(self) -> bool:
        flight, self._flight = self._flight, None
        if flight is not None:
            _arrived(flight)
            assert flight.output is not None
            _copy_out(flight.output, flight, self._padded_fulls)
        return True


def _handed_out_early(
    flight: _InFlight, keep: bool, out_device: torch.device | None
) -> tuple[list[torch.Tensor], _Waitable | None] | None:
    """``flight``'s full tensors before its values are in, and what brings them in; ``None`` if it cannot.

    Where the collective writes straight into them (``_arrives_in_place``),
    they are its destinations; a multi-tensor bucket's are allocated now and
    filled by the copy-out once it is in (``_CopiedOut``). See [Note: values arriving].
    """
    if _arrives_in_place(flight, keep, out_device):
        return _in_place_results(flight), flight.work
    output = flight.output
    if not keep or output is None or len(flight.bucket) == 1 or out_device not in (None, output.device):
        return None
    padded_fulls = _padded_fulls(flight, output)
    return _views(padded_fulls, flight), _CopiedOut(flight, padded_fulls)


def _arrives_in_place(flight: _InFlight, keep: bool, out_device: torch.device | None) -> bool:
    """Whether ``flight``'s full tensors exist before its collective is done: it writes into them.

    True for a point-to-point bucket and for a bucket of one that this rank
    receives, when the results stay where the collective puts them.
    """
    if not keep:
        return False
    if flight.padded_fulls is not None:
        buffers = flight.padded_fulls
    elif len(flight.bucket) == 1 and flight.output is not None:
        buffers = [flight.output]
    else:
        return False
    return out_device is None or all(buffer.device == out_device for buffer in buffers)


def _in_place_results(flight: _InFlight) -> list[torch.Tensor]:
    """The full tensors of a flight that ``_arrives_in_place``: views of what the messages write."""
    buffers = flight.padded_fulls if flight.padded_fulls is not None else [flight.output]
    return _views(buffers, flight)  # type: ignore[arg-type]


def _on(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return tensor if device is None or tensor.device == device else tensor.to(device)


@torch.no_grad()
def _gather_fallback(
    dtensor: DTensor, keep: bool, out_device: torch.device | None, cast_to: torch.dtype | None = None
) -> torch.Tensor | None:
    dtype = gathered_dtype(dtensor, cast_to)
    source = dtensor if dtype == dtensor.dtype else cast(DTensor, dtensor.to(dtype))  # a local, elementwise cast
    full = source.full_tensor()
    if not keep:
        return None
    local = dtensor._local_tensor
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()  # replicated: never alias the live shard
    if out_device is not None and full.device != out_device:
        full = full.to(out_device)
    return full


class Gathered(NamedTuple):
    tensors: list[torch.Tensor | None]  # full tensors, None where not kept
    layouts: list[Dim0Layout | None]  # fast-path layouts, for ``write_back_local``


def gather_full_tensors(
    dtensors: Sequence[DTensor],
    *,
    keep: bool = True,
    out_device: torch.device | None = None,
    bucket_bytes: int | None = None,
    receiver: Receiver = "all",
) -> Gathered:
    """All-gather every DTensor in ``dtensors`` to a plain full tensor.

    A collective: every rank of the meshes involved must call it with the same
    tensors in the same order. ``keep=False`` takes part in the collectives
    but returns ``None`` for every tensor (``rank0_only`` on other ranks).
    ``out_device`` moves results there bucket by bucket (``offload_to_cpu``).
    Results never alias the DTensors' local storage. With a ``receiver`` other
    than ``"all"``, ``keep`` must be False on every rank it does not name.

    Raises ``NotImplementedError`` before any collective if this torch cannot
    gather one of the placements correctly (``_compat.ungatherable_reason``).
    """
    gathered, _ = _gather_buckets(dtensors, keep, out_device, bucket_bytes, receiver, defer_last=False)
    return gathered


class Arrival:
    """The values of full tensors handed out by ``start_full_tensors`` that are still arriving."""

    def __init__(self, work: _Waitable | None = None) -> None:
        self._work = work

    def wait(self) -> None:
        """Block until every value has arrived. Idempotent; read none of the tensors before it."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()


def start_full_tensors(
    dtensors: Sequence[DTensor],
    *,
    keep: bool = True,
    out_device: torch.device | None = None,
    bucket_bytes: int | None = None,
    receiver: Receiver = "all",
) -> tuple[Gathered, Arrival]:
    """``gather_full_tensors`` that may return while the last bucket is still in flight.

    Where that bucket's collective writes straight into its full tensors (see
    ``_arrives_in_place``), they are handed out at once and their values
    arrive by ``Arrival.wait()``: the caller does its own bookkeeping (the
    swap) meanwhile, and must wait before anything reads them, also on error
    paths, so no collective is left behind. See [Note: values arriving].
    """
    return _gather_buckets(dtensors, keep, out_device, bucket_bytes, receiver, defer_last=True)


def _gather_buckets(
    dtensors: Sequence[DTensor],
    keep: bool,
    out_device: torch.device | None,
    bucket_bytes: int | None,
    receiver: Receiver,
    defer_last: bool,
) -> tuple[Gathered, Arrival]:
    _require_gatherable(dtensors)
    cap = bucket_bytes_from_env() if bucket_bytes is None else bucket_bytes
    buckets, fallback = plan_buckets(dtensors, cap)
    results: list[torch.Tensor | None] = [None] * len(dtensors)
    layouts: list[Dim0Layout | None] = [None] * len(dtensors)
    arrival = Arrival()
    # See [Note: one bucket in flight]
    in_flight: _InFlight | None = None
    for bucket in [*buckets, None]:
        started = _start_bucket(bucket, None, receiver) if bucket is not None else None
        if in_flight is not None:
            for b in in_flight.bucket:
                layouts[b.position] = b.layout
            last = started is None and not fallback
            early = _handed_out_early(in_flight, keep, out_device) if last and defer_last else None
            if early is not None:
                fulls, arrival = early[0], Arrival(early[1])
            else:
                fulls = _finish_bucket(in_flight, keep, out_device)
            for b, full in zip(in_flight.bucket, fulls):
                results[b.position] = full
        in_flight = started
    for index in fallback:
        results[index] = _gather_fallback(dtensors[index], keep, out_device)
    logger.debug(
        "gathered %d tensors: %d buckets, %d full_tensor() fallbacks",
        len(dtensors), len(buckets), len(fallback),
    )
    return Gathered(results, layouts), arrival


def _require_gatherable(dtensors: Sequence[DTensor]) -> None:
    """Refuse, before any collective, what this torch cannot gather correctly or a dead group cannot."""
    for index, dtensor in enumerate(dtensors):
        reason = ungatherable_reason(dtensor.placements)
        if reason is not None:
            raise NotImplementedError(f"cannot gather tensor {index} of shape {tuple(dtensor.shape)}: {reason}")
    _require_live_groups(dtensors)


class PendingGather:
    """A batch of DTensors, every bucket staged and, once ``launch`` ran, its collective in flight.

    See ``start_gather`` and [Note: staged, then launched].
    """

    def __init__(
        self, dtensors: Sequence[DTensor], cast_to: torch.dtype | None, bucket_bytes: int | None, receiver: Receiver,
        launch: bool = True, buffers: FullBuffers | None = None,
    ):
        _require_gatherable(dtensors)
        cap = bucket_bytes_from_env() if bucket_bytes is None else bucket_bytes
        buckets, self._fallback = plan_buckets(dtensors, cap, cast_to)
        self._dtensors = list(dtensors)
        self._cast_to = cast_to
        self._flights = [_stage_bucket(bucket, cast_to, receiver, buffers) for bucket in buckets]
        if launch:
            self.launch()

    def launch(self) -> None:
        """Launch every staged bucket's collective, in bucket order. A collective; a no-op once done."""
        self._flights = [flight.launched() for flight in self._flights]

    def finish(self, *, keep: bool, out_device: torch.device | None = None) -> list[torch.Tensor | None]:
        """Wait and copy out, bucket by bucket (each output freed as soon as it is copied), then the fallbacks.

        A collective, like the start: every rank finishes its batches in the same order.
        """
        self.launch()
        results: list[torch.Tensor | None] = [None] * len(self._dtensors)
        while self._flights:
            flight = self._flights.pop(0)
            for b, full in zip(flight.bucket, _finish_bucket(flight, keep, out_device)):
                results[b.position] = full
            del flight
        for index in self._fallback:
            results[index] = _gather_fallback(self._dtensors[index], keep, out_device, self._cast_to)
        self._fallback = []
        return results

    def abandon(self) -> None:
        """Wait for the launched collectives and drop every result; staged ones and the fallbacks never run."""
        for flight in self._flights:
            if flight.work is not None:
                flight.work.wait()
        self._flights, self._fallback = [], []


def start_gather(
    dtensors: Sequence[DTensor],
    *,
    cast_to: torch.dtype | None = None,
    bucket_bytes: int | None = None,
    receiver: Receiver = "all",
    launch: bool = True,
    buffers: FullBuffers | None = None,
) -> PendingGather:
    """Stage every bucket of ``dtensors`` and launch its all-gather now; ``finish`` collects them.

    Unlike ``gather_full_tensors`` (one bucket in flight), the whole batch is in
    flight at once, so it transfers while the caller does other work: the
    streaming sync keeps one unit in flight this way. With ``launch=False``
    the buckets are only staged (copied in, cast) and ``PendingGather.launch``
    starts their collectives later. Fallback tensors (``full_tensor()``,
    blocking) are gathered in ``finish``. ``buffers`` allocates the full
    tensors written in place at staging (fresh unless a stream recycles).
    """
    return PendingGather(dtensors, cast_to, bucket_bytes, receiver, launch, buffers)


@torch.no_grad()
def write_back_local(dtensor: DTensor, full: torch.Tensor, layout: Dim0Layout | None = None) -> None:
    """Copy this rank's slice of ``full`` into ``dtensor``'s local shard, in place.

    No collective. See [Note: writeback needs no collective]. ``layout`` is
    the one the gather used, if it took the fast path.
    """
    write_back_locals([(dtensor, full, layout)])


@torch.no_grad()
def write_back_locals(items: Sequence[tuple[DTensor, torch.Tensor, Dim0Layout | None]]) -> None:
    """``write_back_local`` for many tensors; the fast-path copies run as one foreach op.

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
        local = dtensor._local_tensor
        if layout is None:
            layout = dim0_layout(dtensor)
        if layout is None:
            destinations.append(local)
            sources.append(_local_value(dtensor, full))
        elif layout.local_rows:
            destinations.append(local)
            sources.append(full.narrow(0, layout.row_offset, layout.local_rows).to(local.device, local.dtype))
    if destinations:
        torch._foreach_copy_(destinations, sources)


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


_transport_from_env()
