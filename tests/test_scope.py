"""``_scope``: what a call covers, and the cached summon of a unit.

Checked here, where it lives: every parameter once in tree order (a tie once, with both slots), the
FSDP2 groups it touches and whether each is summoned whole, and the cache's validity; through
``FSDP.summon_full_params``, what ``recurse=False`` covers, ``ignored_params`` left out, DTensor buffers
taken in. The summon's own tests check that it uses them (``test_summon``, ``test_summon_cache``). Two
gloo ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from _helpers import assert_params_equal, assert_unchanged, build_lm, mesh1d, patched, shard_lm, snapshot
from _helpers import reference_and_sharded as _models
from fsdp_shim import _fsdp2, _scope


def _names(scope: _scope.Scope) -> list[str]:
    return [_scope.slot_fqn(scope.root, entry.slots[0]) for entry in scope.params]


def rank_a_scope_holds_every_parameter_once_in_tree_order():
    model = shard_lm(build_lm())
    whole = _scope.collect_scope(model, recurse=True)
    assert _names(whole) == [n for n, _ in model.named_parameters()]  # a tie once, under its first name
    tied = [e for e in whole.params if len(e.slots) == 2]
    assert [_scope.slot_fqn(model, s) for e in tied for s in e.slots] == ["embed.weight", "lm_head.weight"]
    units = [m for m in model.modules() if _fsdp2.fsdp_state_of(m) is not None]
    assert len(whole.groups) == len(units) and all(whole.groups.values())  # every group summoned whole
    assert whole.fsdp2_only and not whole.owned_outside
    root_only = _scope.collect_scope(model, recurse=False)
    assert not any(n.startswith("blocks.") for n in _names(root_only)) and len(root_only.groups) == 1
    part = _scope.collect_scope(model.blocks[0].fc1, recurse=True)  # a submodule of a unit
    assert _names(part) == ["weight", "bias"] and list(part.groups.values()) == [False]  # the group in part
    assert part.owned_outside  # its owner is the unit above it


def test_a_scope_holds_every_parameter_once_in_tree_order(dist_run):
    dist_run(2, rank_a_scope_holds_every_parameter_once_in_tree_order)


def rank_a_cached_summon_serves_while_the_unit_is_unchanged():
    model = shard_lm(build_lm())
    block = model.blocks[0]
    scope, cached = _scope.cached_scope(block, True, None)
    assert cached is not None and cached.matches(block, True) and not cached.matches(block, False)
    again, same = _scope.cached_scope(block, True, None)
    assert again is scope and same is cached  # served from the cache
    block.register_buffer("extra", torch.zeros(1))  # the unit's tree changed
    assert not cached.matches(block, True)
    fresh, replaced = _scope.cached_scope(block, True, None)
    assert fresh is not scope and replaced is not cached and replaced is not None
    other, none = _scope.cached_scope(block.fc1, True, None)  # not a unit: nowhere to keep one
    assert none is None and _names(other) == ["weight", "bias"]
    model.blocks[1].fc1 = nn.Linear(4, 4)  # another unit's change leaves this one's cache valid
    assert replaced.matches(block, True)


def test_a_cached_summon_serves_while_the_unit_is_unchanged(dist_run):
    dist_run(2, rank_a_cached_summon_serves_while_the_unit_is_unchanged)


def rank_recurse_false_is_the_units_own_parameters():
    ref, model = _models()
    with patched():
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            full = {n for n, p in model.named_parameters() if not isinstance(p, DTensor)}
            assert full == {"embed.weight", "norm.weight", "norm.bias"}  # lm_head is tied
            assert isinstance(model.blocks[0].qkv.weight, DTensor)
            assert torch.equal(model.embed.weight, ref.embed.weight)
        with FSDP.summon_full_params(model.blocks[1], recurse=False, writeback=False):
            full = {n for n, p in model.named_parameters() if not isinstance(p, DTensor)}
            assert full == {f"blocks.1.{n}" for n, _ in ref.blocks[1].named_parameters()}
            assert_params_equal(model.blocks[1], ref.blocks[1])
        # a plain container: recurse=True covers its sharded blocks ...
        with FSDP.summon_full_params(model.blocks, writeback=False):
            assert_params_equal(model.blocks, ref.blocks)
            assert isinstance(model.embed.weight, DTensor)
        # ... and recurse=False does not descend into them (FSDP1: null context)
        with FSDP.summon_full_params(model.blocks, recurse=False, writeback=False):
            assert all(isinstance(p, DTensor) for p in model.blocks.parameters())
        # a plain submodule inside a unit
        with FSDP.summon_full_params(model.blocks[0].fc1, writeback=False):
            assert_params_equal(model.blocks[0].fc1, ref.blocks[0].fc1)
            assert isinstance(model.blocks[0].fc2.weight, DTensor)


def test_recurse_false_is_the_units_own_parameters(dist_run):
    dist_run(2, rank_recurse_false_is_the_units_own_parameters)


def rank_ignored_params_stay_plain_and_untouched():
    ref = build_lm()
    model = build_lm()
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, ignored_params={block.norm1.weight})
    fully_shard(model)
    ignored = model.blocks[0].norm1.weight
    assert type(ignored) is nn.Parameter
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        assert model.blocks[0].norm1.weight is ignored  # not ours to swap
        assert_params_equal(model, ref)
    assert_unchanged(model, before)


def test_ignored_params_stay_plain_and_untouched(dist_run):
    dist_run(2, rank_ignored_params_stay_plain_and_untouched)


class Scaled(nn.Module):
    def __init__(self, mesh: DeviceMesh | None):
        super().__init__()
        torch.manual_seed(2)
        self.linear = nn.Linear(4, 6)
        self.register_buffer("scale", torch.randn(6))
        if mesh is not None:
            self.linear.weight = nn.Parameter(distribute_tensor(self.linear.weight.detach(), mesh, [Shard(0)]))
            self.linear.bias = nn.Parameter(distribute_tensor(self.linear.bias.detach(), mesh, [Replicate()]))
            self.scale = distribute_tensor(self.scale, mesh, [Shard(0)])

    def forward(self, x):
        return self.linear(x) * self.scale


def rank_dtensor_buffers_are_gathered_like_parameters():
    ref, model = Scaled(None), Scaled(mesh1d())
    buffer = model.scale
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            assert not isinstance(model.scale, DTensor) and torch.equal(model.scale, ref.scale)
            assert torch.equal(model(x), ref(x))  # used to fail: mixed torch.Tensor and DTensor
            model.scale.mul_(2.0)
    assert model.scale is buffer
    assert torch.equal(buffer.full_tensor(), ref.scale * 2.0)


def test_dtensor_buffers_are_gathered_like_parameters(dist_run):
    dist_run(2, rank_dtensor_buffers_are_gathered_like_parameters)
