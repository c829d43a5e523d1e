"""Planning a gather, for the summon and the stream alike: each DTensor's dim-0 layout, the bucket cap (``bucket_cap``),
the bucket plan (``bucket_plan``), who receives (``Delivery``), with caches of layouts and mesh dims keyed weakly by
spec and mesh. Reads global metadata only, so every rank plans the same buckets in the same order; moves no data."""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Collection, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim._compat import coalesces_all_gathers, is_dim0_shard, is_replicate


BUCKET_ENV = "FSDP_SHIM_BUCKET_MB"
#: Default cap on one bucket's gathered (full, padded) size, chosen with ``fsdp-shim bench --bucket-mb``
#: (docs/performance.md).
DEFAULT_BUCKET_MB = 4.0


#: A single unit's summon with no bucket size chosen packs its tensors in one bucket a dtype, as FSDP2's ``unshard()``
#: does: a collective's fixed cost grows with the world size (``docs/host-cost.md``). Tensors above the cap still get
#: their own, gathered into their full tensor: the unit is held once (FSDP2's flat buffer holds it twice).
UNCAPPED = 1 << 62


class BucketCap(NamedTuple):
    """One call's bucket cap, and what a single unit's summon may move in one collective (``bucket_cap``)."""

    bucket_bytes: int
    #: One unit's summon's cap: ``UNCAPPED`` where no size was chosen (see ``UNCAPPED``); else ``None``.
    one_unit_bytes: int | None


def bucket_cap(explicit_mb: float | None = None, default_mb: float = DEFAULT_BUCKET_MB) -> BucketCap:
    """``explicit_mb`` MiB, else ``$FSDP_SHIM_BUCKET_MB``, else ``default_mb`` (the summon's 4, the stream's 6).
    Raises ``ValueError`` for a size that is not a positive number: at the call, before anything moves."""
    explicit = explicit_mb
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
    return BucketCap(int(mib * 1024 * 1024), UNCAPPED if explicit is None else None)


class Dim0Layout(NamedTuple):
    """Where one rank's local shard sits in the full tensor.

    FSDP2 and ``Shard(0)`` split dim 0 as ``torch.chunk`` does: ``W`` ranks, ``n`` rows, chunks of ``c = ceil(n / W)``
    rows, the trailing ones shorter or empty; rank ``r`` holds rows ``[r * c, min(n, (r + 1) * c))``. Padded to ``c``
    rows, every rank's part has one size, so one all-gather gathers a bucket of parameters."""

    group: dist.ProcessGroup
    world_size: int  # W: ranks on the shard mesh dim
    rank: int  # r: this rank's coordinate on it
    chunk_rows: int  # c = ceil(n / W)
    row_numel: int  # elements per dim-0 row
    local_rows: int  # rows this rank holds, c or fewer
    shape: torch.Size  # the full tensor's
    padded_shape: tuple[int, ...]  # the full tensor's with ``W * c`` rows: a bucket of one's output
    blocks_with_rows: int  # ``ceil(n / c)``: the ranks whose blocks hold rows, ``W`` or fewer

    @property
    def padded_numel(self) -> int:  # one rank's padded contribution
        return self.chunk_rows * self.row_numel

    @property
    def row_offset(self) -> int:  # first full-tensor row of this rank's shard
        return self.rank * self.chunk_rows


_mesh_dims: dict[tuple[int, int], tuple[weakref.ref[DeviceMesh], tuple[dist.ProcessGroup, int, int]]] = {}


def _mesh_dim(mesh: DeviceMesh, mesh_dim: int) -> tuple[dist.ProcessGroup, int, int]:
    """(group, size, local rank) of one mesh dim, cached: DeviceMesh's own lookups are slow Python."""
    key = (id(mesh), mesh_dim)
    cached = _mesh_dims.get(key)
    if cached is None or cached[0]() is not mesh:
        info = (mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
        cached = _mesh_dims[key] = (weakref.ref(mesh), info)
    return cached[1]


def mesh_dim_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """The process group of every dim of ``mesh`` (what gathering a DTensor on it may use)."""
    return [_mesh_dim(mesh, dim)[0] for dim in range(mesh.ndim)]


#: ``id(spec)`` -> (the DTensorSpec, weakly; the local shape seen; its layout; the mesh it was worked out on,
#: weakly). See ``dim0_layout``.
_layouts: dict[int, tuple[weakref.ref[Any], torch.Size, Dim0Layout | None, weakref.ref[DeviceMesh]]] = {}


def rows_held(rows: int, chunk_rows: int, coordinate: int) -> int:
    """Rows of a ``rows``-row tensor that shard ``coordinate`` holds under ``Shard(0)`` (``Dim0Layout``)."""
    return max(0, min(chunk_rows, rows - coordinate * chunk_rows))


def dim0_layout(dtensor: DTensor, mesh: DeviceMesh | None = None) -> Dim0Layout | None:
    """The batched-gather layout of ``dtensor`` on ``mesh`` (its owner's, else its own: [Note: the group is FSDP2's]
    in ``_fsdp2``), or ``None`` if only ``full_tensor()`` applies. Cached by spec (held weakly: a DTensor never
    changes it), local shape and mesh."""
    spec = dtensor._spec
    if mesh is None:
        mesh = spec.mesh
    local_shape = dtensor._local_tensor.shape
    cached = _layouts.get(id(spec))
    if cached is not None and cached[0]() is spec and cached[1] == local_shape and cached[3]() is mesh:
        return cached[2]
    layout = _work_out_dim0_layout(dtensor, mesh)
    key = id(spec)

    def forget(_: object) -> None:  # the spec is gone, and so is its entry
        _layouts.pop(key, None)

    _layouts[key] = (weakref.ref(spec, forget), local_shape, layout, weakref.ref(mesh))
    return layout


def _work_out_dim0_layout(dtensor: DTensor, mesh: DeviceMesh) -> Dim0Layout | None:
    """``dim0_layout``, uncached: one plain ``Shard(0)`` and ``Replicate`` elsewhere, by exact type (FSDP, HSDP, dim-0
    tensor parallel); anything else falls back. Placements only, never the local tensor, so every rank chooses alike."""
    placements = dtensor.placements
    shard_dims = [i for i, p in enumerate(placements) if is_dim0_shard(p)]
    if len(shard_dims) != 1 or dtensor.ndim == 0:
        return None
    if not all(is_replicate(p) for i, p in enumerate(placements) if i != shard_dims[0]):
        return None
    group, world_size, rank = _mesh_dim(mesh, shard_dims[0])
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
    shape = torch.Size(dtensor.shape)
    return Dim0Layout(group, world_size, rank, chunk_rows, row_numel, expected_rows, shape,
                      (world_size * chunk_rows, *shape[1:]), -(-rows // chunk_rows) if chunk_rows else 0)


#: The mesh each DTensor of a gather is gathered over, by position, where its owner says (an FSDP2
#: parameter: ``_fsdp2.gather_mesh``); None, or a None entry: the DTensor's own mesh.
Meshes = Sequence["DeviceMesh | None"] | None


class BucketEntry(NamedTuple):
    """One DTensor of a bucket: where it sits in the caller's list, and its layout."""

    position: int
    dtensor: DTensor
    layout: Dim0Layout


def gathered_dtype(tensor: torch.Tensor, cast_to: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``cast_to`` for floating tensors, else its own."""
    if cast_to is not None and tensor.is_floating_point():
        return cast_to
    return tensor.dtype


def fills_padding(bucket: Sequence[BucketEntry]) -> bool:
    """Whether every shard of ``bucket`` on this rank fills its padded size (nothing to zero on copy-in)."""
    return all(b.layout.local_rows == b.layout.chunk_rows for b in bucket)


class BucketShape(NamedTuple):
    """What staging one planned bucket needs, worked out with its plan rather than per call.

    [Note: bucket layout]
    A bucket shares one process group, dtype and device. Each rank's input is its padded shards back to back (``S``
    elements), written into its own block of the output; viewed as ``(W, S)``, one ``split_with_sizes_copy``
    scatters each parameter into its padded buffer. Only the first ``R`` rank blocks hold rows
    (``R = max ceil(n_i / c_i)``: fewer than ``W`` where a tensor has fewer rows than ranks), so only they are
    copied, and each buffer has ``R * c_i`` rows; the full tensor is its first ``n_i`` rows."""

    split_sizes: list[int]  # each tensor's padded shard, in elements
    dtype: torch.dtype  # what travels: the stored dtype, or the cast one
    unpadded: bool  # every shard on this rank fills its padded size: the copy-in is one cat
    blocks: int  # the rank blocks that hold rows of some tensor: what the copy-out reads


class BucketPlan(NamedTuple):
    """``split_into_buckets``' answer by position, reused while ``key`` matches (a unit's cached summon keeps
    it: [Note: summon cache] in ``_scope``)."""

    key: tuple[Any, ...]
    buckets: list[list[tuple[int, Dim0Layout]]]  # (position in the caller's list, layout)
    fallback: list[int]
    specs: list[Any]  # held, so that the ids in ``key`` stay theirs
    shapes: list[BucketShape]  # by bucket
    #: The last ``bind``: the DTensors it held and its buckets, reused while the very same objects come.
    bound: list[Any]
    #: What a summon allocates before its first collective, by receiver and ``Reserve`` (``engine.reservation``).
    reservations: dict[Any, Any]
    launches: list[int]  # buckets a launch, in bucket order ([Note: one launch a group] in ``engine``)

    def bind(self, dtensors: Sequence[DTensor]) -> list[list[BucketEntry]]:
        """The buckets, holding this call's DTensors (the last call's buckets, if they are the same objects:
        a weight-sync loop gathers FSDP2's same sharded parameters at every step)."""
        bound = self.bound
        if bound and len(bound[0]) == len(dtensors) and all(map(operator.is_, bound[0], dtensors)):
            return bound[1]
        buckets = [[BucketEntry(p, dtensors[p], layout) for p, layout in bucket] for bucket in self.buckets]
        bound[:] = (list(dtensors), buckets)
        return buckets


def bucket_plan(
    dtensors: Sequence[DTensor], bucket_bytes: int, cast_to: torch.dtype | None = None,
    reuse: BucketPlan | None = None, collective_bytes: int | None = None, meshes: Meshes = None,
    together: bool = False,
) -> BucketPlan:
    """The plan for ``dtensors``: ``reuse`` if made for the same key (each spec by identity, local shape, dtype,
    device; the caps, the cast, ``together``: buckets may share launches), else a new one. ``meshes``, fixed for
    given tensors, is not in the key."""
    key = (bucket_bytes, collective_bytes, cast_to, together,
           *[(id(d._spec), t.shape, t.dtype, t.device) for d in dtensors for t in (d._local_tensor,)])
    if reuse is not None and reuse.key == key:
        return reuse
    buckets, fallback = split_into_buckets(dtensors, bucket_bytes, cast_to, collective_bytes, meshes)
    buckets = _side_by_side(buckets, cast_to) if together else buckets
    shapes = [
        BucketShape([b.layout.padded_numel for b in bucket], gathered_dtype(bucket[0].dtensor, cast_to),
                    fills_padding(bucket), max(b.layout.blocks_with_rows for b in bucket))
        for bucket in buckets
    ]
    return BucketPlan(key, [[(b.position, b.layout) for b in bucket] for bucket in buckets], fallback,
                      [d._spec for d in dtensors], shapes, [], {}, _launches(buckets, shapes, together))


def _side_by_side(buckets: list[list[BucketEntry]], cast_to: torch.dtype | None) -> list[list[BucketEntry]]:
    """Buckets that may share a launch (one group, dtype and device) side by side, in first-seen order."""
    by_key: dict[tuple[object, torch.dtype, str], list[list[BucketEntry]]] = {}
    for bucket in buckets:
        first = bucket[0]
        by_key.setdefault((first.layout.group, gathered_dtype(first.dtensor, cast_to),
                           first.dtensor.device_mesh.device_type), []).append(bucket)
    return [bucket for run in by_key.values() for bucket in run]


def _launches(buckets: list[list[BucketEntry]], shapes: list[BucketShape], together: bool) -> list[int]:
    """Buckets a launch, in order: with ``together``, each run on one group, dtype and device whose backend
    coalesces them; else one each. From global metadata: every rank launches alike."""
    sizes: list[int] = []
    last, coalesces = None, False
    for bucket, shape in zip(buckets, shapes, strict=True):
        layout, device = bucket[0].layout, torch.device(bucket[0].dtensor.device_mesh.device_type)
        key = (layout.group, shape.dtype, device)
        if together and key == last and coalesces:
            sizes[-1] += 1
            continue
        if key != last:
            last, coalesces = key, together and coalesces_all_gathers(layout.group, device, shape.dtype)
        sizes.append(1)
    return sizes


def split_into_buckets(
    dtensors: Sequence[DTensor], bucket_bytes: int, cast_to: torch.dtype | None = None,
    collective_bytes: int | None = None, meshes: Meshes = None,
) -> tuple[list[list[BucketEntry]], list[int]]:
    """Split ``dtensors`` into fast-path buckets and fallback indices, from global metadata only.

    Buckets hold one (process group, dtype, device) in the caller's order and close at ``bucket_bytes``
    (``collective_bytes``, if given: see ``UNCAPPED``). A tensor above ``bucket_bytes`` gets its own and leaves
    the open bucket open: its output is its full tensor ([Note: a bucket of one] in ``engine``), and the small
    tensors around it still share one collective. ``cast_to``: the dtype floating tensors travel in.
    """
    buckets: list[list[BucketEntry]] = []
    fallback: list[int] = []
    open_buckets: dict[tuple[object, torch.dtype, torch.device], tuple[list[BucketEntry], list[int]]] = {}
    for index, dtensor in enumerate(dtensors):
        layout = dim0_layout(dtensor, None if meshes is None else meshes[index])
        if layout is None:
            fallback.append(index)
            continue
        dtype = gathered_dtype(dtensor, cast_to)
        key = (layout.group, dtype, dtensor._local_tensor.device)
        nbytes = layout.world_size * layout.padded_numel * dtype.itemsize
        if nbytes > bucket_bytes:
            buckets.append([BucketEntry(index, dtensor, layout)])
            continue
        cap = bucket_bytes if collective_bytes is None else collective_bytes
        bucket, size = open_buckets.get(key, (None, [0]))
        if bucket is None or size[0] + nbytes > cap:
            bucket, size = [], [0]
            buckets.append(bucket)
            open_buckets[key] = (bucket, size)
        bucket.append(BucketEntry(index, dtensor, layout))
        size[0] += nbytes
    return buckets, fallback


# -- who receives ---------------------------------------------------------

#: Which ranks a gather delivers full tensors to. ``"all"``: every rank. ``"group_rank0"``: rank 0 of each process
#: group gathered over (FSDP1's ``rank0_only``: each shard group's). ``"global_rank0"``: global rank 0 alone; buckets
#: over groups without it are skipped (``delivers_over``). Every rank of a gathered group takes part in its
#: all-gather; the others drop what they received.
Receiver = Literal["all", "group_rank0", "global_rank0"]


class Delivery(NamedTuple):
    """Who receives a call's full tensors, and whether this rank holds them afterwards.

    Decided here for the summon and the stream; the engine is told. FSDP1's ``rank0_only`` means rank 0 of the shard
    group (of every replica, under HSDP); with no FSDP2 unit to name one (tensor parallel alone, the stream), global
    rank 0. Delivering to more ranks than hold the results is correct; to fewer, never."""

    receiver: Receiver  # which ranks the gather delivers to
    holds_fulls: bool  # whether this rank holds the full tensors once gathered


_EVERY_RANK = Delivery("all", True)


def receivers_for_summon(rank0_only: bool, groups: Collection[fsdp2.FSDPParamGroup], fsdp2_only: bool) -> Delivery:
    """Who receives a summon's full tensors: ``groups`` are the FSDP2 groups in its scope, ``fsdp2_only``
    whether FSDP2 manages everything in it (``Delivery``)."""
    if not rank0_only:
        return _EVERY_RANK
    if not groups:
        return Delivery("global_rank0", dist.get_rank() == 0)
    holds = True
    for group in groups:  # a per-unit summon's path: a loop, not a generator
        if fsdp2.shard_rank(group) != 0:
            holds = False
            break
    if fsdp2_only:  # each shard group's rank 0 holds, and is rank 0 of the group the gather runs over
        return Delivery("group_rank0", holds)
    return Delivery("all", holds)  # FSDP2 units and other DTensors in one call: the simple, safe answer


def receivers_for_stream(rank0_only: bool) -> Delivery:
    """Who receives ``iter_full_params``' tensors: every rank, or global rank 0 alone."""
    if not rank0_only:
        return _EVERY_RANK
    return Delivery("global_rank0", not dist.is_initialized() or dist.get_rank() == 0)


def delivers_over(receiver: Receiver, group: dist.ProcessGroup) -> bool:
    """Whether a gather over ``group`` delivers to anyone (a group's own rank 0 always receives)."""
    return receiver != "global_rank0" or 0 in dist.get_process_group_ranks(group)
