"""Mesh coverage: uneven/empty shards (3 ranks), HSDP (4 ranks), tensor parallel (2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_shim
from _helpers import (
    LMConfig,
    assert_params_equal,
    assert_unchanged,
    build_lm,
    full_state,
    patched,
    rank,
    shard_lm,
    snapshot,
    tokens_for,
)
from fsdp_shim._gather.layout import dim0_layout


class Odd(nn.Module):
    """Dim-0 sizes 1, 2 and 5: empty shards on 3 ranks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)  # weight (2, 4): rank 2 empty; bias (2,)
        self.b = nn.Linear(2, 5)
        self.c = nn.Linear(5, 1)  # weight (1, 5), bias (1,): ranks 1 and 2 empty

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _odd(seed=0):
    torch.manual_seed(seed)
    return Odd()


def rank_uneven_and_empty_shards():
    ref, model = _odd(), _odd()
    for layer in (model.a, model.b, model.c):
        fully_shard(layer)
    fully_shard(model)
    if rank() == 2:
        assert model.c.weight._local_tensor.numel() == 0 and model.a.weight._local_tensor.numel() == 0
    lm_ref, lm = build_lm(), shard_lm(build_lm())  # vocab 97 -> 33/33/31 rows
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False), FSDP.summon_full_params(lm, writeback=False):
            assert_params_equal(model, ref)
            assert_params_equal(lm, lm_ref)
        assert_unchanged(model, before)
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-2.0)
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            if rank() == 0:
                with torch.no_grad():
                    for p in ref.parameters():
                        p.mul_(-2.0)
                assert_params_equal(model, ref)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    got = full_state(model)
    assert all(torch.equal(got[n], p * -2.0) for n, p in _odd().named_parameters())
    assert torch.equal(model(x), _scaled(_odd(), -2.0)(x))


def _scaled(module, factor):
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(factor)
    return module


def test_uneven_and_empty_shards_three_ranks(dist_run):
    dist_run(3, rank_uneven_and_empty_shards)


def rank_hsdp_two_by_two():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    weight = model.blocks[0].fc1.weight
    assert tuple(weight.placements) == (Replicate(), Shard(0))
    layout = dim0_layout(weight)
    assert layout is not None and layout.world_size == 2  # gathered over the shard dim only
    tokens = tokens_for(LMConfig())
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            assert_params_equal(model, ref)
            with torch.no_grad():
                model.blocks[1].fc1.weight.add_(0.25)
                model.embed.weight[3].zero_()
        with torch.no_grad():
            ref.blocks[1].fc1.weight.add_(0.25)
            ref.embed.weight[3].zero_()
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
            if rank() == 0:
                assert_params_equal(model, ref)
    assert torch.equal(model(tokens), ref(tokens))
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())


def test_hsdp_on_a_2d_mesh_four_ranks(dist_run):
    dist_run(4, rank_hsdp_two_by_two)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


def _mlp():
    torch.manual_seed(3)
    return MLP()


def rank_tensor_parallel_without_fsdp():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, model = _mlp(), _mlp()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    model.scale = nn.Parameter(DTensor.from_local(model.scale.detach().clone(), mesh, [Replicate()]))
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    assert placements["up.weight"] == (Shard(0),) and placements["down.weight"] == (Shard(1),)
    assert placements["down.bias"] == (Replicate(),) and placements["scale"] == (Replicate(),)
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)
            with torch.no_grad():
                model.scale.zero_()  # a replicated parameter never aliases its shard
        assert_unchanged(model, before)
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    assert_unchanged(model, before, values=False)


def test_tensor_parallel_shard0_shard1_replicate(dist_run):
    dist_run(2, rank_tensor_parallel_without_fsdp)


def rank_fsdp_plus_tensor_parallel_2d():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref, model = _mlp(), _mlp()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: p.placements for n, p in model.named_parameters()}
    assert any(dim0_layout(p) is None for p in model.parameters()), placements  # fallback path in use
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)
        assert_unchanged(model, before)
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model.up.weight.mul_(2.0)
                model.scale.add_(1.0)
    with torch.no_grad():
        ref.up.weight.mul_(2.0)
        ref.scale.add_(1.0)
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    assert_unchanged(model, before, values=False)
    torch.testing.assert_close(model(x), ref(x))  # TP reduces in another order: close, not equal


def test_fsdp_plus_tensor_parallel_on_a_2d_mesh(dist_run):
    dist_run(4, rank_fsdp_plus_tensor_parallel_2d)


def rank_strided_shard_parameter_is_exact_or_refused_by_name():
    import pytest
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from fsdp_shim._compat import STRIDED_SHARD_FULL_TENSOR_BROKEN

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, model = _mlp(), _mlp()
    strided = distribute_tensor(model.up.weight.detach(), mesh, [_StridedShard(0, split_factor=2)])
    model.up.weight = nn.Parameter(strided)
    before = snapshot(model)
    with patched():
        if STRIDED_SHARD_FULL_TENSOR_BROKEN:
            with pytest.raises(NotImplementedError, match=r"cannot summon 'up.weight'.*_StridedShard"):
                with FSDP.summon_full_params(model, writeback=True):
                    pass
        else:
            with FSDP.summon_full_params(model, writeback=True):
                assert torch.equal(model.up.weight, ref.up.weight)
                with torch.no_grad():
                    model.up.weight.add_(1.0)
            assert torch.equal(model.up.weight.full_tensor(), ref.up.weight + 1.0)
            return
    assert_unchanged(model, before)


def test_strided_shard_parameter_is_exact_or_refused_by_name(dist_run):
    dist_run(2, rank_strided_shard_parameter_is_exact_or_refused_by_name)


# --------------------------------------------------------------------------- a shard group of one
def rank_shard_group_of_one(mesh_shape: tuple[int, ...]):
    """One rank per shard group (``engine._start_alone``): a world of one, or HSDP with one shard per replica."""
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    weight = model.blocks[0].fc1.weight
    layout = dim0_layout(weight)
    assert layout is not None and layout.world_size == 1
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)
            full = model.blocks[0].fc1.weight
            assert full.untyped_storage().data_ptr() != weight._local_tensor.untyped_storage().data_ptr()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # discarded: the full tensors are copies, never the live shards
        assert_unchanged(model, before)
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
            if rank() == 0:
                assert_params_equal(model, ref)
        with FSDP.summon_full_params(model.blocks[1], recurse=False, writeback=True):
            with torch.no_grad():
                model.blocks[1].fc2.weight.mul_(-3.0)
        with torch.no_grad():
            ref.blocks[1].fc2.weight.mul_(-3.0)
    got = full_state(model)
    assert [n for n, p in ref.named_parameters() if not torch.equal(got[n], p)] == []
    names = []
    for name, full in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16, rank0_only=False):
        assert torch.equal(full, dict(ref.named_parameters())[name].detach().to(torch.bfloat16)), name
        names.append(name)
    assert sorted(names) == sorted(n for n, _ in ref.named_parameters())  # each once, a tie under its first name
    tokens = tokens_for(LMConfig())
    assert torch.equal(model(tokens), ref(tokens))


@pytest.mark.parametrize("world_size, mesh_shape", [(1, (1,)), (2, (2, 1))])
def test_shard_group_of_one(dist_run, world_size, mesh_shape):
    dist_run(world_size, rank_shard_group_of_one, mesh_shape)
