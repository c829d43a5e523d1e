"""``iter_full_params``: the streaming weight sync (names, values, ties, memory, meshes)."""

from __future__ import annotations

import fnmatch
import gc
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_shim
from _helpers import (
    ALL_GATHERS,
    wrapping_dist,
    LMConfig,
    assert_unchanged,
    build_lm,
    rank,
    shard_lm,
    snapshot,
    tokens_for,
)
from fsdp_shim._gather import layout as _layout
from fsdp_shim._stream import batch_params


def _reference_names(ref: nn.Module) -> list[str]:
    return [name for name, _ in ref.named_parameters()]  # a tie once, under its first name


def _units_in_order(model: nn.Module) -> list[list[str]]:
    """What a stream must yield, unit by unit: the root's own parameters, then each block's."""
    root = [n for n, _ in model.named_parameters() if not n.startswith("blocks.")]
    blocks = [[f"blocks.{i}.{n}" for n, _ in block.named_parameters()] for i, block in enumerate(model.blocks)]
    return [root, *blocks]


def _check_stream(model: nn.Module, ref: nn.Module, *, dtype=None, rank0_only=True, **kwargs) -> list[str]:
    keeps = not rank0_only or rank() == 0
    reference = dict(ref.named_parameters())
    names = []
    for name, full in fsdp_shim.iter_full_params(model, dtype=dtype, rank0_only=rank0_only, **kwargs):
        names.append(name)
        if not keeps:
            assert full is None, name
            continue
        expected = reference[name].detach()
        expected = expected if dtype is None else expected.to(dtype)
        assert full is not None and not isinstance(full, DTensor), name
        assert full.dtype == expected.dtype and torch.equal(full, expected), f"{name} differs"
    assert sorted(names) == sorted(_reference_names(ref)) and len(set(names)) == len(names)
    return names


# --------------------------------------------------------------------------- names, values, ties
def rank_stream_names_values_and_ties():
    ref, model = build_lm(), shard_lm(build_lm())
    before = snapshot(model)
    names = _check_stream(model, ref)  # fp32, rank0_only: exact on rank 0, None elsewhere
    assert names == [n for unit in _units_in_order(ref) for n in unit]  # unit by unit
    assert "embed.weight" in names and "lm_head.weight" not in names  # the tie, once, by its first name
    _check_stream(model, ref, rank0_only=False)  # every rank
    _check_stream(model, ref, dtype=torch.bfloat16, rank0_only=False)  # == full.to(bf16)
    _check_stream(model, ref, bucket_mb=0.01)  # many small buckets: same answer
    _check_stream(model, ref, device="cpu")
    _check_stream(model, ref, dtype=torch.bfloat16)  # rank0_only and cast
    assert_unchanged(model, before)
    model.double()  # FSDP2 swaps parameters (swap_tensors): the stream must leave no weakref on them
    _check_stream(model, ref.double(), rank0_only=False)
    units = _units_in_order(ref)  # a batch per unit under a tiny cap; all in one when they fit one bucket
    assert [b.names for b in batch_params(model, 1, None)] == units
    assert [b.names for b in batch_params(model, 2**22, None)] == [[n for unit in units for n in unit]]


def test_stream_names_values_and_ties_on_two_ranks(dist_run):
    dist_run(2, rank_stream_names_values_and_ties)


def test_stream_names_values_and_ties_on_three_ranks(dist_run):
    dist_run(3, rank_stream_names_values_and_ties)  # vocab 97: uneven shards


def rank_stream_on_hsdp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    assert tuple(model.blocks[0].fc1.weight.placements) == (Replicate(), Shard(0))
    before = snapshot(model)
    _check_stream(model, ref)  # only global rank 0 receives
    _check_stream(model, ref, rank0_only=False, dtype=torch.bfloat16)
    _check_stream(model, ref, dtype=torch.bfloat16)
    _check_stream(model, ref, rank0_only=False)
    assert_unchanged(model, before)


def test_stream_on_hsdp_four_ranks(dist_run):
    dist_run(4, rank_stream_on_hsdp)


class _TP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.scale = nn.Parameter(torch.randn(6))  # stays a plain tensor


def rank_stream_tensor_parallel_and_plain():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, model = _TP(), _TP()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert isinstance(model.down.weight, DTensor) and not isinstance(model.scale, DTensor)
    for bucket_mb in (None, 1e-4):  # one batch; or a batch per tensor
        names = _check_stream(model, ref, rank0_only=False, bucket_mb=bucket_mb)
        assert names == _reference_names(ref)  # named_parameters() order: no units here
        _check_stream(model, ref, dtype=torch.float16, bucket_mb=bucket_mb)


def test_stream_tensor_parallel_and_plain_parameters(dist_run):
    dist_run(2, rank_stream_tensor_parallel_and_plain)


# --------------------------------------------------------------------------- what is read
def rank_stream_reads_fp32_masters_of_units_left_unsharded():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ref, model = build_lm(), shard_lm(build_lm(), mp_policy=policy, reshard_after_forward=False)
    with torch.no_grad():
        model(tokens_for(LMConfig()))  # every unit now holds bf16 unsharded parameters
    assert not isinstance(model.blocks[0].fc1.weight, DTensor)
    _check_stream(model, ref, rank0_only=False)  # fp32 masters, exact
    assert not isinstance(model.blocks[0].fc1.weight, DTensor)  # and nothing was resharded


def test_stream_reads_fp32_masters_of_units_left_unsharded(dist_run):
    dist_run(2, rank_stream_reads_fp32_masters_of_units_left_unsharded)


# --------------------------------------------------------------------------- cast before gather
def rank_cast_before_gather_moves_half_the_bytes():
    """What each rank hands c10d: its shard, all-gathered."""
    model = shard_lm(build_lm())
    moved: list[tuple[torch.dtype, int]] = []
    names = ALL_GATHERS

    def recording(name, original):
        def record(*args, **kwargs):
            # (output, input), or a launch of several: (group, outputs, inputs)
            for tensor in args[2] if name.startswith("ProcessGroup.") else args[1:2]:
                moved.append((tensor.dtype, tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)
        return record

    by_dtype = {}
    with wrapping_dist(names, recording):
        for dtype in (None, torch.bfloat16):
            moved.clear()
            for _ in fsdp_shim.iter_full_params(model, dtype=dtype, rank0_only=False):  # every rank receives
                pass
            by_dtype[dtype] = list(moved)
    assert {d for d, _ in by_dtype[None]} == {torch.float32}
    assert {d for d, _ in by_dtype[torch.bfloat16]} == {torch.bfloat16}
    assert sum(n for _, n in by_dtype[torch.bfloat16]) * 2 == sum(n for _, n in by_dtype[None]) > 0


def test_cast_before_gather_moves_half_the_bytes(dist_run):
    dist_run(2, rank_cast_before_gather_moves_half_the_bytes)


# --------------------------------------------------------------------------- fp32 exceptions
def rank_stream_keeps_chosen_params_uncast():
    """``keep_dtype``: chosen parameters travel in their stored fp32, exact; the rest as ``full.to(bf16)``."""
    ref, model = build_lm(), shard_lm(build_lm())
    reference = dict(ref.named_parameters())
    fc1 = {n for n in reference if fnmatch.fnmatchcase(n, "blocks.*.fc1.weight")}
    assert fc1 and "lm_head.weight" not in reference  # lm_head is tied to embed: named embed.weight
    kept = fc1 | {"embed.weight"}  # kept through the tie's other name
    order = [name for name, _ in fsdp_shim.iter_full_params(model)]
    choices = (
        ["blocks.*.fc1.weight", "lm_head.weight"],
        lambda name: name.endswith(".fc1.weight") or name == "lm_head.weight",
    )
    for keep_dtype in choices:
        for rank0_only in (True, False):
            names = []
            for name, full in fsdp_shim.iter_full_params(
                model, dtype=torch.bfloat16, keep_dtype=keep_dtype, rank0_only=rank0_only
            ):
                names.append(name)
                if rank0_only and rank() != 0:
                    assert full is None, name
                    continue
                want = reference[name].detach()
                want = want if name in kept else want.to(torch.bfloat16)
                assert full is not None and full.dtype == want.dtype, (name, full)
                assert torch.equal(full, want), f"{name} differs"
            assert names == order  # the same names in the same order as without exceptions
    for name, full in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, keep_dtype="*.fc1.weight"):
        if rank() == 0:  # one pattern, no tie named: embed goes bf16
            assert full is not None and full.dtype == (torch.float32 if name in fc1 else torch.bfloat16), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_stream_keeps_chosen_params_uncast(dist_run, world_size):
    dist_run(world_size, rank_stream_keeps_chosen_params_uncast)


def test_keep_dtype_takes_patterns_or_a_predicate():
    from fsdp_shim._stream import name_matcher  # noqa: PLC0415

    assert name_matcher(None) is None
    assert name_matcher("a.*")("a.b") and not name_matcher("a.*")("b.a")
    assert name_matcher(("x", "y.?"))("y.z") and not name_matcher(["x"])("X")  # case-sensitive
    assert name_matcher(str.isupper)("AB")
    for bad in ([], [1], 3, b"a.*"):
        with pytest.raises(TypeError, match="keep_dtype"):
            name_matcher(bad)


def rank_keep_dtype_matching_nothing_warns():
    model = shard_lm(build_lm())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("fsdp_shim").addHandler(handler)
    try:
        for _ in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, keep_dtype="*.router.weight"):
            pass
    finally:
        logging.getLogger("fsdp_shim").removeHandler(handler)
    assert any("keep_dtype matched no parameter" in r.getMessage() for r in records)


def test_keep_dtype_matching_nothing_warns(dist_run):
    dist_run(2, rank_keep_dtype_matching_nothing_warns)


# --------------------------------------------------------------------------- memory bound
def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage reachable from a live Python tensor on this rank."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor):
            try:  # torch 2.7 can leave a Python object whose tensor is gone ("does not have a device"): no storage
                if obj.device.type != "cpu":
                    continue
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def rank_stream_memory_is_bounded_by_two_units(hsdp: bool):
    config = LMConfig(vocab=64, width=64, layers=8)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = shard_lm(build_lm(config), mesh)
    unit_bytes = [sum(p.numel() * 4 for p in block.parameters()) for block in model.blocks]
    root_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest_two = sum(sorted([*unit_bytes, root_bytes])[-2:])
    bucket_mb = 0.05
    padding = 64 * 64 * 4  # at most W - 1 rows a tensor, a few tensors: generous
    firsts = {unit[0] for unit in _units_in_order(model)}  # the peak: a unit just handed out, the next in flight
    base = _live_tensor_bytes()
    peak = 0
    count = 0
    for name, full in fsdp_shim.iter_full_params(model, rank0_only=False, bucket_mb=bucket_mb):
        count += 1
        if name in firsts:
            peak = max(peak, _live_tensor_bytes() - base)
        del full
    assert count == len(list(model.parameters()))
    assert model_bytes > 3 * largest_two  # the bound says something
    assert peak <= largest_two + 2 * bucket_mb * 2**20 + padding, (peak, largest_two, model_bytes)


@pytest.mark.parametrize("world_size, hsdp", [(2, False), (3, False), (4, True)])
def test_stream_memory_is_bounded_by_two_units(dist_run, world_size, hsdp):
    dist_run(world_size, rank_stream_memory_is_bounded_by_two_units, hsdp)


# --------------------------------------------------------------------------- stopping early, misuse
def rank_stream_stopped_early_leaves_collectives_aligned():
    ref, model = build_lm(), shard_lm(build_lm())
    for step, _ in enumerate(fsdp_shim.iter_full_params(model)):
        if step == 2:
            break  # every rank alike: the next unit's all-gather was in flight
    _check_stream(model, ref, rank0_only=False)  # the next collectives still match
    fsdp_shim.patch()
    with FSDP.summon_full_params(model, writeback=False):
        assert torch.equal(model.embed.weight, ref.embed.weight)


def test_stream_stopped_early_leaves_collectives_aligned(dist_run):
    dist_run(2, rank_stream_stopped_early_leaves_collectives_aligned)


def rank_stream_refuses_bad_input():
    from _helpers import counting_collectives

    model = shard_lm(build_lm())
    fsdp1 = FSDP(build_lm(), device_id=torch.device("cpu"))
    with counting_collectives() as counts:
        with pytest.raises(TypeError, match="nn.Module"):
            fsdp_shim.iter_full_params(object())
        with pytest.raises(TypeError, match="floating"):
            fsdp_shim.iter_full_params(model, dtype=torch.int32)
        with pytest.raises(ValueError, match="bucket size must be positive"):
            fsdp_shim.iter_full_params(model, bucket_mb=0)
        with pytest.raises(TypeError, match="keep_dtype"):
            fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, keep_dtype=[torch.float32])
        with pytest.raises(TypeError, match="FSDP1"):
            fsdp_shim.iter_full_params(fsdp1)
        refused = dict(counts)
        for _ in fsdp_shim.iter_full_params(model):  # the counter sees the stream's own all-gathers
            pass
    assert refused == {}
    assert counts.get("all_gather_single", 0) + counts.get("all_gather_into_tensor", 0) > 0


def test_stream_refuses_bad_input_before_any_collective(dist_run):
    dist_run(2, rank_stream_refuses_bad_input)


def rank_stream_bucket_cap_defaults_to_its_own():
    """The stream's cap: ``bucket_mb``, else ``$FSDP_SHIM_BUCKET_MB``, else ``STREAM_BUCKET_MB`` (not the summon's)."""
    import os

    from fsdp_shim import _stream

    model = shard_lm(build_lm())
    caps: list[int] = []
    original = _stream.batch_params

    def recording(model, bucket_bytes, *args):
        caps.append(bucket_bytes)
        return original(model, bucket_bytes, *args)

    _stream.batch_params = recording
    try:
        list(fsdp_shim.iter_full_params(model))
        os.environ[_layout.BUCKET_ENV] = "1.5"
        list(fsdp_shim.iter_full_params(model))
        list(fsdp_shim.iter_full_params(model, bucket_mb=2))
    finally:
        _stream.batch_params = original
        os.environ.pop(_layout.BUCKET_ENV, None)
    assert _stream.STREAM_BUCKET_MB != _layout.DEFAULT_BUCKET_MB
    assert caps == [int(_stream.STREAM_BUCKET_MB * 2**20), int(1.5 * 2**20), 2 * 2**20]


def test_stream_bucket_cap_defaults_to_its_own(dist_run):
    dist_run(2, rank_stream_bucket_cap_defaults_to_its_own)
