"""Every rank decides alike: where ranks hold different things, the collectives a call runs do not differ.

Under ``rank0_only`` only some ranks hold full tensors; gradients may exist
on some ranks only. Each case here hung, aborted or lost a value silently on
0.10.0 (issue 43). Run under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``.ci/run``'s
newest torch row does), a rank whose collectives diverge fails within a second instead
of waiting for the group's timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_shim
from _helpers import (
    assert_params_equal,
    assert_unchanged,
    build_lm,
    full_state,
    patched,
    rank,
    shard_lm,
    snapshot,
)

def _mesh(kind: str) -> DeviceMesh:
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _holds(mesh: DeviceMesh) -> bool:
    """Whether this rank sees full parameters under ``rank0_only``: rank 0 of its shard group."""
    return mesh.get_local_rank(mesh.ndim - 1) == 0


def _is_full(module: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in module.parameters())


def _is_sharded(module: nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in module.parameters())


# --------------------------------------------------------------------------- nesting under rank0_only
def rank_nested_inside_rank0_only_is_served_alike(kind: str):
    mesh = _mesh(kind)
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    holds = _holds(mesh)
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            # served by the outer call, without a collective: holders see full values, the others shards
            for inner in (model.blocks[0], model, model.blocks):
                with FSDP.summon_full_params(inner, writeback=False):
                    if holds:
                        assert_params_equal(model, ref)
                    else:
                        assert _is_sharded(model)
            with FSDP.summon_full_params(model.blocks[1], recurse=False, writeback=False, rank0_only=True):
                assert _is_full(model.blocks[1]) if holds else _is_sharded(model.blocks[1])
            # writeback=True would be discarded by the outer call: refused on every rank, before any collective
            with pytest.raises(RuntimeError, match="enclosing writeback=False"):
                with FSDP.summon_full_params(model.blocks[0], writeback=True):
                    raise AssertionError("the body ran")
            assert_params_equal(model, ref) if holds else assert_unchanged(model, before)
        assert_unchanged(model, before)
        # and the group is still in step: a summon after it gathers on every rank
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)
    assert_unchanged(model, before)


@pytest.mark.parametrize("world_size,kind", [(2, "1d"), (4, "1d"), (4, "hsdp")])
def test_nested_inside_rank0_only_is_served_alike(dist_run, world_size, kind):
    dist_run(world_size, rank_nested_inside_rank0_only_is_served_alike, kind)


def rank_a_summon_outside_inside_rank0_only_gathers_the_rest_alike():
    """Part of the inner scope is the outer call's, the rest is gathered: the same rest on every rank."""
    ref, model = build_lm(), shard_lm(build_lm())
    with patched():
        with FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False, rank0_only=True):
            with FSDP.summon_full_params(model, writeback=False):
                assert_params_equal(model.blocks[1], ref.blocks[1])
                assert torch.equal(model.embed.weight, ref.embed.weight)
                assert _is_full(model.blocks[0]) if rank() == 0 else _is_sharded(model.blocks[0])
        assert all(isinstance(p, DTensor) for p in model.parameters())


def test_a_summon_outside_inside_rank0_only_gathers_the_rest_alike(dist_run):
    dist_run(2, rank_a_summon_outside_inside_rank0_only_gathers_the_rest_alike)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)


def _tensor_parallel():
    torch.manual_seed(5)
    ref = _MLP()
    torch.manual_seed(5)
    model = _MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return ref, model


def rank_stream_and_summon_inside_rank0_only_tensor_parallel():
    ref, model = _tensor_parallel()
    want = dict(ref.named_parameters())
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            streamed = dict(fsdp_shim.iter_full_params(model, rank0_only=False))
            assert streamed.keys() == want.keys()
            assert all(torch.equal(streamed[n], p) for n, p in want.items())
            ranked = dict(fsdp_shim.iter_full_params(model))
            assert all((ranked[n] is None) != (rank() == 0) for n in want)
            with FSDP.summon_full_params(model.up, writeback=False):
                assert _is_full(model.up) if rank() == 0 else _is_sharded(model.up)
            with pytest.raises(RuntimeError, match="enclosing writeback=False"):
                with FSDP.summon_full_params(model, writeback=True):
                    raise AssertionError("the body ran")
        assert_unchanged(model, before)
    # FSDP2 units inside rank0_only: the stream reads FSDP2's shards on every rank
    ref, sharded = build_lm(), shard_lm(build_lm())
    with patched(), FSDP.summon_full_params(sharded, writeback=False, rank0_only=True):
        streamed = dict(fsdp_shim.iter_full_params(sharded, rank0_only=False))
        assert all(torch.equal(streamed[n], p) for n, p in ref.named_parameters())


@pytest.mark.parametrize("world_size", [2, 4])
def test_stream_and_summon_inside_rank0_only_tensor_parallel(dist_run, world_size):
    dist_run(world_size, rank_stream_and_summon_inside_rank0_only_tensor_parallel)


# --------------------------------------------------------------------------- gradients on some ranks only
def _rows_of(param: DTensor, coordinate: int) -> slice:
    world = param.device_mesh.size(param.device_mesh.ndim - 1)
    chunk = -(-param.shape[0] // world)
    return slice(coordinate * chunk, min(param.shape[0], (coordinate + 1) * chunk))


def _grads_from_seed(model: nn.Module) -> dict[str, torch.Tensor]:
    """A full gradient for every parameter, the same on every rank, set as each rank's sharded ``.grad``
    (by DTensor itself, not the shim): exact expectations, and no backward (torch 2.7's HSDP backward
    fails on the CPU)."""
    torch.manual_seed(11)
    fulls = {}
    for name, p in model.named_parameters():
        fulls[name] = full = torch.randn(p.shape)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
    return fulls


def rank_gradients_on_some_ranks_only(kind: str, writeback: bool):
    mesh = _mesh(kind)
    model = shard_lm(build_lm(), mesh)
    fulls = _grads_from_seed(model)
    fc1, bias = model.blocks[0].fc1.weight, model.norm.bias
    coordinate = mesh.get_local_rank(mesh.ndim - 1)
    expected = fulls["blocks.0.fc1.weight"].clone()
    expected[_rows_of(fc1, 1)] = 0.0  # shard coordinate 1 has none: FSDP1 gathers zeros there
    if coordinate == 1:
        fc1.grad = None
    bias.grad = None  # no rank has one: stays None
    kept = None if fc1.grad is None else fc1.grad._local_tensor.clone()
    with patched():
        with FSDP.summon_full_params(model, writeback=writeback, with_grads=True):
            assert torch.equal(model.blocks[0].fc1.weight.grad, expected)
            assert model.norm.bias.grad is None
            assert torch.equal(model.blocks[0].fc2.weight.grad, fulls["blocks.0.fc2.weight"])  # everywhere: as is
            if writeback:
                with torch.no_grad():
                    model.blocks[0].fc1.weight.grad.add_(1.0)
    assert isinstance(fc1, DTensor) and bias.grad is None
    if coordinate == 1:
        assert fc1.grad is None  # FSDP1 restores the missing gradient as None
    else:
        assert torch.equal(fc1.grad._local_tensor, kept + 1.0 if writeback else kept)


@pytest.mark.parametrize("world_size,kind,writeback",
                         [(2, "1d", False), (2, "1d", True), (4, "1d", True), (4, "hsdp", False)])
def test_gradients_on_some_ranks_only(dist_run, world_size, kind, writeback):
    dist_run(world_size, rank_gradients_on_some_ranks_only, kind, writeback)


# --------------------------------------------------------------------------- values never lost or aliased
def rank_streamed_ignored_parameter_is_fresh_memory():
    ref = build_lm()
    model = build_lm()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, ignored_params={model.norm.weight})
    assert not isinstance(model.norm.weight, DTensor)
    kept = dict(fsdp_shim.iter_full_params(model, rank0_only=False))
    norm = kept["norm.weight"]
    assert norm.untyped_storage().data_ptr() != model.norm.weight.untyped_storage().data_ptr()
    assert torch.equal(norm, ref.norm.weight)
    with torch.no_grad():
        norm.zero_()  # a write to a kept tensor never reaches the model
        model.norm.weight.add_(1.0)  # and a kept tensor keeps its values through training
    assert torch.equal(model.norm.weight, ref.norm.weight + 1.0)
    assert torch.equal(norm, torch.zeros_like(norm))
    cast = dict(fsdp_shim.iter_full_params(model, rank0_only=False, dtype=torch.float32))["norm.weight"]
    assert cast.untyped_storage().data_ptr() != model.norm.weight.untyped_storage().data_ptr()


def test_streamed_ignored_parameter_is_fresh_memory(dist_run):
    dist_run(2, rank_streamed_ignored_parameter_is_fresh_memory)


def rank_an_edit_after_a_conversion_inside_is_written_back():
    ref, model = build_lm(), shard_lm(build_lm())
    tiny = 2.0 ** -40  # below fp32's resolution at these magnitudes, well inside fp64's
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            model.double()
            with torch.no_grad():
                model.blocks[0].fc1.weight.add_(tiny)
                model.norm.weight.add_(tiny)
    ref.double()
    with torch.no_grad():
        ref.blocks[0].fc1.weight.add_(tiny)
        ref.norm.weight.add_(tiny)
    got = full_state(model)
    for name, want in ref.named_parameters():
        assert got[name].dtype == torch.float64, name
        assert torch.equal(got[name], want), name
    assert not torch.equal(got["norm.weight"], build_lm().norm.weight.double())


def test_an_edit_after_a_conversion_inside_is_written_back(dist_run):
    dist_run(2, rank_an_edit_after_a_conversion_inside_is_written_back)


# --------------------------------------------------------------------------- messages
def rank_a_group_destroyed_before_the_first_summon_is_named():
    group = dist.new_group(list(range(dist.get_world_size())))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("destroyed_early",))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach().clone(), mesh, [Shard(0)]))
    model.bias = nn.Parameter(distribute_tensor(model.bias.detach().clone(), mesh, [Replicate()]))
    # torch 2.7's gloo: destroying a group a peer is still connecting hangs that peer (once in a full suite run);
    # a barrier on it first (not the shim's: no summon has run) has every rank connected
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    with patched():
        with pytest.raises(fsdp_shim.DestroyedGroupError, match="destroyed"):
            with FSDP.summon_full_params(model, writeback=False):
                raise AssertionError("the body ran")
        with pytest.raises(fsdp_shim.DestroyedGroupError, match="destroyed"):
            next(fsdp_shim.iter_full_params(model))
    assert isinstance(model.weight, DTensor)


def test_a_group_destroyed_before_the_first_summon_is_named(dist_run):
    dist_run(2, rank_a_group_destroyed_before_the_first_summon_is_named)


# --------------------------------------------------------------------------- found by a hostile read
def rank_a_dtensor_buffer_held_under_rank0_only_refuses_a_nested_writeback_alike():
    mesh = _mesh("1d")
    root = nn.Module()
    root.a, root.b = nn.Module(), nn.Linear(4, 4)
    root.a.register_buffer("table", distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
    root.b.weight = nn.Parameter(distribute_tensor(root.b.weight.detach().clone(), mesh, [Shard(0)]))
    with patched():
        with FSDP.summon_full_params(root.a, writeback=False, rank0_only=True):
            with pytest.raises(RuntimeError, match="enclosing writeback=False"):
                with FSDP.summon_full_params(root, writeback=True):
                    raise AssertionError("the body ran")
    assert isinstance(root.a.table, DTensor)


def test_a_dtensor_buffer_held_under_rank0_only_refuses_a_nested_writeback_alike(dist_run):
    dist_run(2, rank_a_dtensor_buffer_held_under_rank0_only_refuses_a_nested_writeback_alike)


def rank_gradients_laid_out_otherwise_on_some_ranks_are_refused_alike(how: str):
    model = shard_lm(build_lm())
    _grads_from_seed(model)
    param = model.norm.weight
    other = param.grad.full_tensor() if how == "plain" else param.grad.redistribute(  # a collective: every rank
        param.device_mesh, [Replicate()])
    if rank() == 1:
        param.grad = other
    with patched():
        with pytest.raises(RuntimeError, match="norm.weight.grad"):
            with FSDP.summon_full_params(model, writeback=False, with_grads=True):
                raise AssertionError("the body ran")
        param.grad = None
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):  # the group is still in step
            assert model.norm.weight.grad is None
    return rank()


@pytest.mark.parametrize("how", ["plain", "replicate"])
def test_gradients_laid_out_otherwise_on_some_ranks_are_refused_alike(dist_run, how):
    assert dist_run(2, rank_gradients_laid_out_otherwise_on_some_ranks_are_refused_alike, how) == [0, 1]


def rank_a_conversion_inside_rank0_only_lands_alike(kind: str):
    mesh = _mesh(kind)
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            model.double()
            streamed = dict(fsdp_shim.iter_full_params(model, rank0_only=False))  # every rank alike
            assert all(torch.equal(streamed[n], p) for n, p in ref.named_parameters())
    got = full_state(model)  # at exit the conversion lands on every rank's shards
    assert all(got[n].dtype == torch.float64 and torch.equal(got[n], p.double()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("world_size,kind", [(2, "1d"), (4, "hsdp")])
def test_a_conversion_inside_rank0_only_lands_alike(dist_run, world_size, kind):
    dist_run(world_size, rank_a_conversion_inside_rank0_only_lands_alike, kind)


def rank_a_tensor_parallel_forward_inside_rank0_only_is_refused_alike():
    ref, model = _tensor_parallel()
    with patched():
        with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
            with pytest.raises(RuntimeError, match="rank0_only=True"):
                model.down(torch.ones(2, 16))
    return rank()


def test_a_tensor_parallel_forward_inside_rank0_only_is_refused_alike(dist_run):
    assert dist_run(2, rank_a_tensor_parallel_forward_inside_rank0_only_is_refused_alike) == [0, 1]
