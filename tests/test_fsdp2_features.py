"""FSDP2 features newer torch releases add, each skipped by name where the release lacks it (2 gloo ranks).

- per-parameter mixed precision (``MixedPrecisionPolicy.param_dtype_override_fn``, torch >= 2.15);
- ``FSDPModule.set_keep_unsharded_storage`` (torch >= 2.15): ``reshard()`` keeps stale unsharded storage;
- several parameter groups on one module (``shard_placement_fn`` returning ``ShardPlacementResult``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Shard

from _helpers import assert_params_equal, assert_unchanged, build_lm, patched, snapshot, tokens_for
from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim.tools.models import exact_gradients

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
except ImportError:  # torch releases without per-parameter meshes
    ShardPlacementResult = None  # type: ignore[assignment,misc]

HAS_PER_PARAM_MP = "param_dtype_override_fn" in {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
HAS_KEEP_UNSHARDED_STORAGE = hasattr(FSDPModule, "set_keep_unsharded_storage")


class Router(nn.Linear):
    """An MoE-style gate: computes in its own parameters' dtype (kept fp32), returns the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 33)  # 33 rows: uneven shards
        self.router = Router(33, 33)
        self.down = nn.Linear(33, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.router(self.up(x))))


def _gated(seed: int = 0) -> Gated:
    torch.manual_seed(seed)
    return Gated()


def rank_per_parameter_mixed_precision_forward_inside_matches_fsdp2():
    ref, model = _gated(), _gated()
    router = {id(p) for p in model.router.parameters()}
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float32 if id(p) in router else None)
    fully_shard(model, mp_policy=exact_gradients(policy))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outside = model(x)  # FSDP2's own forward, each parameter in its own dtype
    model.reshard()
    # FSDP2 resolved the policy per parameter: the router stays fp32, the rest computes in bf16
    dtypes = {p._module_info.module: p.param_dtype for g in fsdp2.param_groups(fsdp2.fsdp_state_of(model))
              for p in g.fsdp_params}
    assert dtypes[model.router] is None and dtypes[model.up] == dtypes[model.down] == torch.bfloat16
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        assert_params_equal(model, ref)  # gathered in the stored dtype, exact
        inside = model(x)
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # back to the full fp32 values after
    assert outside.dtype == torch.bfloat16 and torch.equal(inside, outside)
    assert_unchanged(model, before)


@pytest.mark.skipif(not HAS_PER_PARAM_MP, reason="MixedPrecisionPolicy.param_dtype_override_fn needs torch >= 2.15")
def test_per_parameter_mixed_precision_forward_inside_matches_fsdp2(dist_run):
    dist_run(2, rank_per_parameter_mixed_precision_forward_inside_matches_fsdp2)


def _train_step(model, ref, opt, ref_opt, tokens):
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(tokens).float().pow(2).mean().backward()
        o.step()


def rank_keep_unsharded_storage_never_serves_stale_values():
    ref = build_lm()
    model = build_lm()
    for block in model.blocks:
        fully_shard(block, mp_policy=exact_gradients())
    fully_shard(model, mp_policy=exact_gradients())
    model.set_keep_unsharded_storage(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = tokens_for(ref.config)
    with patched():
        _train_step(model, ref, opt, ref_opt, tokens)
        # After backward every unit is resharded but keeps its (now stale, pre-step) unsharded storage.
        kept = fsdp2.unsharded_param_if_any(fsdp2.param_groups(fsdp2.fsdp_state_of(model.blocks[0]))[0].fsdp_params[0])
        assert kept is not None and kept.untyped_storage().size() > 0
        before = snapshot(model)
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)
        assert_unchanged(model, before)
        # a no_grad forward leaves the root unsharded; an explicit reshard, then a step: still exact
        with torch.no_grad():
            model(tokens)
        model.reshard()
        _train_step(model, ref, opt, ref_opt, tokens)
        with FSDP.summon_full_params(model, writeback=True):
            assert_params_equal(model, ref)
        _train_step(model, ref, opt, ref_opt, tokens)  # training goes on exactly
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)


@pytest.mark.skipif(not HAS_KEEP_UNSHARDED_STORAGE, reason="FSDPModule.set_keep_unsharded_storage needs torch >= 2.15")
def test_keep_unsharded_storage_never_serves_stale_values(dist_run):
    dist_run(2, rank_keep_unsharded_storage_never_serves_stale_values)


def rank_several_parameter_groups_on_one_module():
    ref = build_lm()
    model = build_lm()
    # A second process group over the same ranks: FSDP2 makes one parameter group per process group.
    other = DeviceMesh.from_group(dist.new_group(list(range(dist.get_world_size()))), "cpu")
    other_info = FSDPMeshInfo(other, shard_mesh_dim=0)

    def placement(param):
        return ShardPlacementResult(Shard(0), other_info) if param.ndim == 2 else None

    for block in model.blocks:
        fully_shard(block, shard_placement_fn=placement, mp_policy=exact_gradients())
    fully_shard(model, mp_policy=exact_gradients())
    groups = fsdp2.param_groups(fsdp2.fsdp_state_of(model.blocks[0]))
    assert len(groups) == 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = tokens_for(ref.config)
    with patched():
        before = snapshot(model)
        with FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False):
            assert_params_equal(model.blocks[0], ref.blocks[0])
        assert_unchanged(model, before)
        with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
            model.blocks[1].fc1.weight.mul_(0.5)  # a 2-D parameter, in the second group
            ref.blocks[1].fc1.weight.mul_(0.5)
            assert torch.equal(model(tokens), ref(tokens))  # a forward inside, both groups summoned
        _train_step(model, ref, opt, ref_opt, tokens)
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref, exact=False)  # two reduce-scatters: summation order may differ
        model.blocks[0].unshard()  # both groups unsharded
        with FSDP.summon_full_params(model.blocks[0].norm1, writeback=False):  # in the first group only
            held = model.blocks[0].norm1.weight
            assert model.blocks[0].reshard() is None  # the first group left to the context, the second FSDP2's
            assert model.blocks[0].norm1.weight is held and groups[1].is_sharded
        assert all(group.is_sharded for group in groups)
        _train_step(model, ref, opt, ref_opt, tokens)
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref, exact=False)
    assert isinstance(model.blocks[1].fc1.weight, DTensor)


@pytest.mark.skipif(ShardPlacementResult is None, reason="ShardPlacementResult (per-parameter meshes) is not in this torch")
def test_several_parameter_groups_on_one_module(dist_run):
    dist_run(2, rank_several_parameter_groups_on_one_module)
