"""The gather engine: bucket boundaries, fast and fallback paths, local writeback; who receives under
``rank0_only`` on HSDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from _helpers import build_lm, mesh1d, patched, shard_lm
from fsdp_shim._compat import STRIDED_SHARD_FULL_TENSOR_BROKEN
from fsdp_shim._param import write_back_locals
from fsdp_shim._gather import engine
from fsdp_shim._gather.engine import AllGatherFlight, InPlace
from fsdp_shim._health import Call
from fsdp_shim._gather.layout import (
    BUCKET_ENV,
    DEFAULT_BUCKET_MB,
    UNCAPPED,
    bucket_cap,
    dim0_layout,
    split_into_buckets,
)
from fsdp_shim._refusals import refuse_placements


def gather_full_tensors(dtensors, **kwargs):
    """The engine's summon gather, as a call of its own (its record: ``_health.Call``)."""
    return engine.gather_full_tensors(dtensors, posted=Call(), **kwargs)


def start_gather(dtensors, **kwargs):
    """The engine's stream gather, as a call of its own."""
    return engine.start_gather(dtensors, posted=Call(), **kwargs)


DEFAULT = bucket_cap().bucket_bytes


def _tensors(specs, seed=0):
    """Same full tensors on every rank, then distributed."""
    torch.manual_seed(seed)
    mesh = mesh1d()
    fulls, dtensors = [], []
    for shape, dtype, placements in specs:
        full = (torch.randn(shape) * 100).to(dtype)
        fulls.append(full)
        dtensors.append(distribute_tensor(full.clone(), mesh, placements))  # Replicate keeps its input
    return fulls, dtensors


def _check_roundtrip(specs, bucket_bytes):
    fulls, dtensors = _tensors(specs)
    got, layouts, _ = gather_full_tensors(dtensors, bucket_bytes=bucket_bytes)
    for full, out, d in zip(fulls, got, dtensors):
        assert out is not None and out.dtype == full.dtype and torch.equal(out, full)
        if out.numel():  # an empty tensor has no storage to alias
            assert out.untyped_storage().data_ptr() != d._local_tensor.untyped_storage().data_ptr()
    # writeback: edit every full tensor, write back locally, gather again
    for out in got:
        out.add_(1)
    for d, out, layout in zip(dtensors, got, layouts):
        assert layout == dim0_layout(d)
        write_back_locals([(d, out, layout)])
    again = gather_full_tensors(dtensors, bucket_bytes=bucket_bytes).tensors
    for full, out in zip(fulls, again):
        assert torch.equal(out, full + 1)
    buckets, fallback = split_into_buckets(dtensors, bucket_bytes)
    return [[b.position for b in bucket] for bucket in buckets], fallback


def rank_bucket_boundaries():
    s0 = [Shard(0)]
    world = dist.get_world_size()
    # many tiny parameters share one bucket
    tiny = [((3,), torch.float32, s0)] * 20
    assert _check_roundtrip(tiny, 1 << 20) == ([list(range(20))], [])
    # a parameter larger than the cap gets a bucket of its own and leaves the open one open for the
    # small tensors around it; the cap splits the rest
    big = [((4,), torch.float32, s0), ((64, 64), torch.float32, s0), ((4,), torch.float32, s0),
           ((4,), torch.float32, s0)]
    cap = 2 * world * -(-4 // world) * 4  # room for two small tensors' padded full size
    assert _check_roundtrip(big, cap) == ([[0, 2], [1], [3]], [])
    # mixed dtypes never share a bucket
    mixed = [((6, 2), torch.float32, s0), ((6, 2), torch.bfloat16, s0), ((5,), torch.int64, s0),
             ((6, 2), torch.float32, s0)]
    assert _check_roundtrip(mixed, 1 << 20) == ([[0, 3], [1], [2]], [])
    # uneven and empty shards (dim 0 smaller than the world size)
    uneven = [((1, 3), torch.float32, s0), ((world + 1,), torch.float32, s0), ((97, 5), torch.float32, s0)]
    assert _check_roundtrip(uneven, 1 << 20) == ([[0, 1, 2]], [])
    # fewer rows than ranks in every tensor of a bucket: the copy-out reads only the blocks with rows
    # ([Note: bucket layout]); and a bucket of empty tensors only
    few = [((world - 1, 3), torch.float32, s0), ((1,), torch.float32, s0)]
    assert _check_roundtrip(few, 1 << 20) == ([[0, 1]], [])
    empty = [((0,), torch.float32, s0), ((0, 2), torch.float32, s0)]
    assert _check_roundtrip(empty, 1 << 20) == ([[0, 1]], [])
    # a tensor with 1 MiB of shard a rank stays with the small ones under the cap: one all-gather, one output
    alone = [((4,), torch.float32, s0), ((world * 256, 1024), torch.float32, s0), ((4,), torch.float32, s0)]
    assert _check_roundtrip(alone, 64 << 20) == ([[0, 1, 2]], [])
    fulls, dtensors = _tensors(alone)
    pending = start_gather(dtensors, bucket_bytes=64 << 20)
    assert [type(f) for f in pending._flights] == [AllGatherFlight]
    assert all(torch.equal(got, full) for got, full in zip(pending.finish(holds_fulls=True).tensors, fulls))


def rank_fallback_placements_are_bit_identical():
    specs = [
        ((4, 6), torch.float32, [Shard(1)]),
        ((5, 3), torch.float32, [Replicate()]),
        ((7, 3), torch.float32, [Shard(0)]),  # the fast path, alongside
    ]
    buckets, fallback = _check_roundtrip(specs, 1 << 20)
    assert buckets == [[2]] and fallback == [0, 1]


def rank_strided_shard_never_takes_the_fast_path():
    """On torch <= 2.9 ``_StridedShard(0).is_shard(0)`` is True; the fast path must not believe it."""
    specs = [((8, 2), torch.float32, [_StridedShard(0, split_factor=2)]), ((7, 3), torch.float32, [Shard(0)])]
    fulls, dtensors = _tensors(specs)
    assert dim0_layout(dtensors[0]) is None
    if STRIDED_SHARD_FULL_TENSOR_BROKEN:  # torch 2.10, 2.11: refused before any collective, never wrong
        with pytest.raises(NotImplementedError, match=r"_StridedShard that no other mesh dim completes"):
            refuse_placements([(lambda: "strided", dtensors[0])], writeback=False)
        return "refused"
    buckets, fallback = _check_roundtrip(specs, 1 << 20)
    assert buckets == [[1]] and fallback == [0]
    return "exact"


def test_strided_shard_is_exact_or_refused(dist_run):
    assert dist_run(2, rank_strided_shard_never_takes_the_fast_path) == [
        "refused" if STRIDED_SHARD_FULL_TENSOR_BROKEN else "exact"] * 2


def rank_partial_falls_back_and_keep_false_returns_nothing():
    mesh = mesh1d()
    local = torch.full((3,), float(dist.get_rank() + 1))
    from torch.distributed.tensor import DTensor

    partial = DTensor.from_local(local, mesh, [Partial()])
    assert dim0_layout(partial) is None
    expected = sum(range(1, dist.get_world_size() + 1))
    (full,) = gather_full_tensors([partial], bucket_bytes=DEFAULT).tensors
    assert torch.equal(full, torch.full((3,), float(expected)))
    _, dtensors = _tensors([((5, 2), torch.float32, [Shard(0)])])
    assert gather_full_tensors(dtensors, holds_fulls=False, bucket_bytes=DEFAULT).tensors == [None]


def rank_offload_moves_results_to_cpu():
    fulls, dtensors = _tensors([((9, 3), torch.float32, [Shard(0)]), ((4, 4), torch.float32, [Shard(1)])])
    got = gather_full_tensors(dtensors, out_device=torch.device("cpu"), bucket_bytes=DEFAULT).tensors
    assert all(g.device.type == "cpu" and torch.equal(g, f) for g, f in zip(got, fulls))


def rank_non_contiguous_shards_and_broken_layouts():
    from torch.distributed.tensor import DTensor

    mesh = mesh1d()
    world, me = dist.get_world_size(), dist.get_rank()
    full = torch.arange(4.0 * world * 3).view(4 * world, 3)
    local = full[4 * me: 4 * me + 4].t().contiguous().t()  # same values, column-major
    assert not local.is_contiguous()
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    assert dim0_layout(dtensor) is not None
    got, layouts, _ = gather_full_tensors([dtensor], bucket_bytes=DEFAULT)
    assert torch.equal(got[0], full)
    write_back_locals([(dtensor, got[0] * 2, layouts[0])])
    assert torch.equal(dtensor._local_tensor, full[4 * me: 4 * me + 4] * 2)
    # a Shard(0) DTensor whose shards are not torch.chunk slices: refused on every rank
    shape = (2 * world + 1, 2)  # torch.chunk gives the first ranks 3 rows; here the last has them
    rows = 2 if me < world - 1 else 3
    odd = DTensor.from_local(torch.ones(rows, 2), mesh, [Shard(0)], run_check=False, shape=shape,
                             stride=(2, 1))
    with pytest.raises(ValueError, match="not the torch.chunk slice"):
        gather_full_tensors([odd], bucket_bytes=DEFAULT)


def test_non_contiguous_shards_and_broken_layouts(dist_run):
    dist_run(2, rank_non_contiguous_shards_and_broken_layouts)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_boundaries(dist_run, world_size):
    dist_run(world_size, rank_bucket_boundaries)


def test_fallback_placements_are_bit_identical(dist_run):
    dist_run(2, rank_fallback_placements_are_bit_identical)


def test_partial_and_keep_false(dist_run):
    dist_run(2, rank_partial_falls_back_and_keep_false_returns_nothing)


def test_offload_moves_results_to_cpu(dist_run):
    dist_run(2, rank_offload_moves_results_to_cpu)


def test_bucket_size_from_keyword_env_and_default(monkeypatch):
    monkeypatch.delenv(BUCKET_ENV, raising=False)
    assert bucket_cap() == (int(DEFAULT_BUCKET_MB * 2**20), UNCAPPED)  # ``layout.UNCAPPED``
    monkeypatch.setenv(BUCKET_ENV, "0.5")
    assert bucket_cap() == (2**19, None)  # a chosen size holds for one unit too
    assert bucket_cap(2).bucket_bytes == 2 * 2**20  # the keyword wins
    monkeypatch.setenv(BUCKET_ENV, "lots")
    with pytest.raises(ValueError, match=BUCKET_ENV):
        bucket_cap()
    with pytest.raises(ValueError, match="positive"):
        bucket_cap(0)


def rank_receivers_deliver_to_exactly_the_ranks_named():
    """Group rank 0 of each shard group, or global rank 0 alone (others skip). See ``Receiver`` in ``_gather.layout``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    fulls = [torch.randn(shape) for shape in ((5, 3), (4,), (64, 8), (1, 2))]  # uneven, tiny, solo-sized
    dtensors = [distribute_tensor(f.clone(), mesh, [Replicate(), Shard(0)]) for f in fulls]
    shard_rank = mesh.get_local_rank("shard")
    _deliver_to_exactly_the_ranks_named(mesh, fulls, dtensors, shard_rank)


def _deliver_to_exactly_the_ranks_named(mesh, fulls, dtensors, shard_rank):
    for receiver, keeps in (("all", True), ("group_rank0", shard_rank == 0), ("global_rank0", dist.get_rank() == 0)):
        got, _, _ = gather_full_tensors(dtensors, holds_fulls=keeps, receiver=receiver, bucket_bytes=300)
        for full, out in zip(fulls, got):
            assert (out is not None) == keeps, receiver
            assert out is None or torch.equal(out, full), receiver
        pending = start_gather(dtensors, receiver=receiver, bucket_bytes=300)
        flights = list(pending._flights)
        received = [(flight.padded_fulls if isinstance(flight, InPlace) else flight.output) is not None
                    for flight in flights]
        moved = [flight.work is not None for flight in flights]
        # small tensors share a bucket: one all-gather into one output, copied out
        assert any(len(flight.bucket) > 1 for flight in flights)
        assert all(isinstance(flight, AllGatherFlight) for flight in flights if flight.work is not None)  # what moves
        if receiver in ("all", "group_rank0"):  # every rank of a gathered group takes part, and receives
            assert all(received) and all(moved)
            assert all(isinstance(flight, AllGatherFlight) and flight.output is not None for flight in flights)
        else:  # rank 0's shard group takes part (rank 1 drops what it got); ranks 2 and 3 move nothing at all
            assert all(r == (dist.get_rank() < 2) for r in received)
            assert all(m == (dist.get_rank() < 2) for m in moved)
        got = pending.finish(holds_fulls=keeps).tensors
        assert all(out is None or torch.equal(out, f) for out, f in zip(got, fulls))
    for receiver, keeps in (("global_rank0", dist.get_rank() == 0), ("all", True)):
        cast = start_gather(dtensors, cast_to=torch.bfloat16, receiver=receiver, bucket_bytes=300).finish(holds_fulls=keeps).tensors
        for full, out in zip(fulls, cast):
            assert (out is not None) == keeps
            assert out is None or (out.dtype == torch.bfloat16 and torch.equal(out, full.to(torch.bfloat16)))


def test_receivers_deliver_to_exactly_the_ranks_named(dist_run):
    dist_run(4, rank_receivers_deliver_to_exactly_the_ranks_named)


# --------------------------------------------------------------------------- staged, then launched
def rank_staged_buckets_launch_later_and_in_order():
    """``start_gather``'s staged, then launched: a staged gather moves nothing until launched; order and values hold."""
    specs = [((37, 5), torch.float32, [Shard(0)]), ((64, 3), torch.float32, [Shard(0)]), ((9,), torch.float32, [Shard(0)])]
    fulls, dtensors = _tensors(specs)
    for receiver in ("all", "global_rank0"):
        first = start_gather(dtensors[:2], cast_to=torch.bfloat16, bucket_bytes=64, receiver=receiver)
        staged = start_gather(dtensors[1:], bucket_bytes=1 << 20, receiver=receiver, launch=False)
        # staged: every bucket's collective waits for launch(), none posted
        assert all(f.launch is not None and f.work is None for f in staged._flights)
        keeps = receiver == "all" or dist.get_rank() == 0
        got_first = first.finish(holds_fulls=keeps).tensors
        staged.launch()
        assert all(getattr(f, "launch", None) is None and f.work is not None for f in staged._flights)
        got_staged = staged.finish(holds_fulls=keeps).tensors
        if keeps:
            for full, got in zip(fulls[:2], got_first):
                assert torch.equal(got, full.to(torch.bfloat16))
            for full, got in zip(fulls[1:], got_staged):
                assert torch.equal(got, full)
        else:
            assert got_first == [None, None] and got_staged == [None, None]
    _launched_then_dropped(dtensors, fulls)


def _launched_then_dropped(dtensors, fulls):
    again = start_gather(dtensors, receiver="all", bucket_bytes=DEFAULT)
    for flight in again._flights:  # each bucket's all-gather launched; waited for here (twice), finish still copies out
        assert flight.work is not None and flight.work.wait() and flight.work.wait()
    assert all(torch.equal(g, f) for g, f in zip(again.finish(holds_fulls=True).tensors, fulls))
    dropped = start_gather(dtensors, receiver="all", launch=False, bucket_bytes=DEFAULT)
    dropped.abandon()  # never launched on any rank: nothing to wait for, and nothing left behind
    assert [torch.equal(g, f) for g, f in zip(gather_full_tensors(dtensors, bucket_bytes=DEFAULT).tensors, fulls)] == [True] * 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_staged_buckets_launch_later_and_in_order(dist_run, world_size):
    dist_run(world_size, rank_staged_buckets_launch_later_and_in_order)


# --------------------------------------------------------------------------- the summon's window
def rank_summon_window_holds_two_buckets_at_most():
    """[Note: one bucket in flight]: the summon's driver stages one bucket beyond the one it copies out."""
    from fsdp_shim._gather import engine as _engine

    specs = [((13, 7), torch.float32, [Shard(0)])] * 6
    fulls, dtensors = _tensors(specs)
    alive: list[int] = []
    original = _engine._finish_bucket

    def recording(flight, keep, out_device):
        alive.append(len(gather._flights))  # the one being finished (held there until it is in) and those beyond it
        return original(flight, keep, out_device)

    _engine._finish_bucket = recording
    try:
        gather = _engine.BucketGather(dtensors, bucket_bytes=64, ahead=1, posted=Call())  # one tensor a bucket
        assert len(gather._flights) == 1
        got = gather.finish(holds_fulls=True).tensors
        whole = _engine.BucketGather(dtensors, bucket_bytes=64, posted=Call())  # the stream's: every bucket at once
        assert len(whole._flights) == len(specs)
        whole.finish(holds_fulls=True)
    finally:
        _engine._finish_bucket = original
    assert alive[: len(specs)] == [2] * (len(specs) - 1) + [1]
    assert all(torch.equal(g, f) for g, f in zip(got, fulls))


def test_summon_window_holds_two_buckets_at_most(dist_run):
    dist_run(2, rank_summon_window_holds_two_buckets_at_most)


def rank_one_unit_takes_one_collective():
    """``layout.UNCAPPED``: on the all-gather path a per-unit summon packs its unit's
    tensors below the cap in one collective, as FSDP2's unshard() does, even where they add up to more
    than the cap, unless a bucket size is chosen; a tensor above the cap gets a bucket of its own, whose
    output is its full tensor (held once, never copied out of a flat buffer), in the unit's one launch
    ([Note: one launch a group]); a summon of several units keeps the cap, a launch a bucket."""
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    import fsdp_shim
    from _faults import inject
    from _helpers import patched

    def build(make):
        torch.manual_seed(0)
        ref = nn.Sequential(*[make() for _ in range(2)])
        model = nn.Sequential(*[make() for _ in range(2)])
        model.load_state_dict(ref.state_dict())
        mesh = mesh1d()
        for unit in model:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return ref, model

    cap = DEFAULT_BUCKET_MB * 2**20
    small_ref, small = build(lambda: nn.Sequential(*[nn.Linear(512, 640) for _ in range(4)]))
    big_ref, big = build(lambda: nn.Sequential(nn.Linear(1024, 1280), nn.LayerNorm(1280)))
    assert all(p.numel() * 4 < cap for p in small_ref.parameters())
    assert sum(p.numel() * 4 for p in small_ref[0].parameters()) > cap
    assert big_ref[0][0].weight.numel() * 4 > cap
    never = 10**9

    def collectives(summon) -> int:
        with inject("all_gather", after=never) as gathers:
            summon()
        return gathers[0]

    def check(module, reference, **kwargs):
        def summon():
            with fsdp_shim.summon_full_params(module, writeback=False, **kwargs):
                for (name, full), want in zip(module.named_parameters(), reference.parameters()):
                    assert not isinstance(full, DTensor) and torch.equal(full, want), name
        return summon

    with patched():
        assert collectives(check(small[0], small_ref[0], recurse=False)) == 1  # small ones: one, past the cap
        assert collectives(check(small[0], small_ref[0], recurse=False, bucket_mb=1)) > 1  # chosen: the cap holds
        assert collectives(check(big[0], big_ref[0], recurse=False)) == 1  # the weight in its own, one launch
        assert collectives(check(small, small_ref)) > 2  # several units: capped, more than one a unit
        with FSDP.summon_full_params(small[1], recurse=False, writeback=False):  # the patched call site too
            assert torch.equal(small[1][0].weight, small_ref[1][0].weight)


def test_one_unit_takes_one_collective(dist_run):
    dist_run(2, rank_one_unit_takes_one_collective)


def rank_hsdp_rank0_only_is_rank0_of_every_shard_group():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    with patched(), FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        full = not isinstance(model.embed.weight, DTensor)
        if full:
            assert torch.equal(model.embed.weight, ref.embed.weight)
    return full


def test_hsdp_rank0_only_matches_fsdp1(dist_run):
    assert dist_run(4, rank_hsdp_rank0_only_is_rank0_of_every_shard_group) == [True, False, True, False]


# --------------------------------------------------------------------------- one launch a group
def rank_buckets_of_several_dtypes_launch_a_dtype_each_exactly():
    """[Note: one launch a group]: a unit's buckets of several dtypes, interleaved, go out a launch a dtype (gloo's
    coalesced all-gather is wrong across dtypes), each exact; tensors above the cap share their dtype's launch."""
    big = DEFAULT // (4 * 1024) + 8  # rows of 1,024 fp32: above the cap
    specs = [((9, 5), torch.float32, [Shard(0)]), ((7, 3), torch.bfloat16, [Shard(0)]),
             ((big, 1024), torch.float32, [Shard(0)]), ((2 * big, 1024), torch.bfloat16, [Shard(0)]),
             ((5, 4), torch.float32, [Shard(0)])]
    fulls, dtensors = _tensors(specs)
    got = gather_full_tensors(dtensors, bucket_bytes=DEFAULT, collective_bytes=UNCAPPED)
    for full, out in zip(fulls, got.tensors, strict=True):
        assert out is not None and out.dtype == full.dtype and torch.equal(out, full)
    launches, dtypes = got.plan.launches, [shape.dtype for shape in got.plan.shapes]
    runs = [dtypes[sum(launches[:i]):sum(launches[:i + 1])] for i in range(len(launches))]
    assert runs == [[torch.float32] * 2, [torch.bfloat16] * 2], runs


def test_buckets_of_several_dtypes_launch_a_dtype_each_exactly(dist_run):
    dist_run(2, rank_buckets_of_several_dtypes_launch_a_dtype_each_exactly)


def rank_complex_parameters_are_gathered_one_by_one():
    """c10d's all-gather views a complex tensor as real; the process group's launch of several refuses it: a
    unit of complex parameters (one above the cap) still summons exactly, and the next summon too."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    import fsdp_shim

    torch.manual_seed(0)
    unit = nn.Module()
    unit.a = nn.Parameter(torch.randn(DEFAULT // (8 * 256) + 8, 256, dtype=torch.complex64))
    unit.b = nn.Parameter(torch.randn(8, dtype=torch.complex64))
    want = {name: p.detach().clone() for name, p in unit.named_parameters()}
    fully_shard(unit, mesh=mesh1d())
    for _ in range(2):
        with fsdp_shim.summon_full_params(unit, recurse=False, writeback=False):
            for name, p in unit.named_parameters():
                assert not isinstance(p, DTensor) and torch.equal(p, want[name]), name


def test_complex_parameters_are_gathered_one_by_one(dist_run):
    dist_run(2, rank_complex_parameters_are_gathered_one_by_one)


_OVERLAPS = r'''
import random, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from fsdp_shim._gather.engine import Reserve, _Turn, reservation
from fsdp_shim._gather.layout import UNCAPPED, bucket_plan
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
mesh, rng, overlaps = init_device_mesh("cpu", (4,)), random.Random(0), 0
for trial in range(300):
    dtensors = []
    for _ in range(rng.randint(1, 9)):
        rows, cols = rng.choice([1, 3, 8, 40, 300, 1000]), rng.choice([1, 7, 64])
        chunk = -(-rows // 4)
        local = torch.zeros(max(0, min(chunk, rows - chunk)), cols, dtype=rng.choice([torch.float32, torch.bfloat16]))
        dtensors.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)),
                                           stride=(cols, 1)))
    plan = bucket_plan(dtensors, rng.choice([256, 4096, 65536]), collective_bytes=UNCAPPED, together=True)
    launch_of = [launch for launch, n in enumerate(plan.launches) for _ in range(n)]
    for keep in (Reserve(False, None), Reserve(True, torch.device("meta"))):  # keeps nothing; offloads
        made = reservation(plan, plan.bind(dtensors), "group_rank0", keep, dtensors, None)
        turns = [(launch, out.buffer, out.offset, out.offset + out.numel * out.dtype.itemsize)
                 for (out, _, _), launch in zip(made.buckets, launch_of) if isinstance(out, _Turn)]
        assert all(end <= made.shared[b][0] and start % 256 == 0 for _, b, start, end in turns), turns
        overlaps += sum(abs(l1 - l2) <= 1 and b1 == b2 and s1 < e2 and s2 < e1
                        for i, (l1, b1, s1, e1) in enumerate(turns) for l2, b2, s2, e2 in turns[i + 1:])
print(overlaps)
'''


def test_outputs_in_flight_together_never_overlap():
    """A launch's outputs, and those of the launch beside it, are in flight together: ``reservation`` gives them
    disjoint, aligned places in the shared buffer, for a rank that keeps nothing and for an offloading one (300
    random plans on the fake backend, W = 4). On gloo an overlap would not show (it stages a launch's inputs);
    on NCCL a launch's all-gathers run at once."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}  # DETAIL's wrapper needs a real store
    proc = subprocess.run([sys.executable, "-c", _OVERLAPS], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stdout + proc.stderr
