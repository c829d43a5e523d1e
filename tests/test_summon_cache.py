"""A unit's summon plan is reused only while the tree it was made from is unchanged (2 gloo ranks).

See [Note: summon cache] in ``fsdp_shim/_scope.py``. Each test makes a plan
(a first summon of the unit), changes what the plan was worked out from,
and checks that the next summon serves the changed tree, exactly, against
an unsharded reference built from the same seed. A plan reused past the
change would serve the old tree: a parameter left sharded, a stale value
or dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from _helpers import LMConfig, assert_params_equal, build_lm, mesh1d, patched, shard_lm, tokens_for
from fsdp_shim import _scope, _summon


@contextlib.contextmanager
def scopes_collected() -> Iterator[list[nn.Module]]:
    """Record the root of every scope worked out afresh (a summon that did not reuse a plan)."""
    roots: list[nn.Module] = []
    original = _scope.collect_scope

    def counting(root: nn.Module, *args, **kwargs):
        roots.append(root)
        return original(root, *args, **kwargs)

    _scope.collect_scope = _summon.collect_scope = counting  # cached_scope uses the first, nested calls the second
    try:
        yield roots
    finally:
        _scope.collect_scope = _summon.collect_scope = original


def _summon_block(model: nn.Module, ref: nn.Module, index: int = 0) -> None:
    with FSDP.summon_full_params(model.blocks[index], recurse=False, writeback=False):
        assert_params_equal(model.blocks[index], ref.blocks[index])


def rank_a_plan_is_reused_while_the_tree_is_unchanged():
    ref, model = build_lm(), shard_lm(build_lm())
    with patched(), scopes_collected() as fresh:
        for _ in range(3):
            _summon_block(model, ref)
        with FSDP.summon_full_params(model.blocks[1], recurse=False, writeback=False):
            pass
        with FSDP.summon_full_params(model.blocks[0], recurse=True, writeback=False):  # another plan
            pass
        with FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False):
            with FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False):  # nested: no plan
                pass
        assert fresh == [model.blocks[0], model.blocks[1], model.blocks[0], model.blocks[0]], fresh


def test_a_plan_is_reused_while_the_tree_is_unchanged(dist_run):
    dist_run(2, rank_a_plan_is_reused_while_the_tree_is_unchanged)


def rank_a_parameter_added_to_a_unit_is_summoned():
    ref, model = build_lm(), shard_lm(build_lm())
    mesh = mesh1d()
    torch.manual_seed(1)
    extra = torch.randn(6, 3)
    with patched():
        _summon_block(model, ref)  # the plan, made without it
        block = model.blocks[0]
        block.fc1.extra = nn.Parameter(distribute_tensor(extra.clone(), mesh, [Shard(0)]))
        with FSDP.summon_full_params(block, recurse=False, writeback=False):
            assert not isinstance(block.fc1.extra, DTensor), "served the plan made before the parameter existed"
            assert torch.equal(block.fc1.extra, extra)
            assert_params_equal(block.fc2, ref.blocks[0].fc2)
        assert isinstance(block.fc1.extra, DTensor)
        del block.fc1.extra
        _summon_block(model, ref)


def test_a_parameter_added_to_a_unit_is_summoned(dist_run):
    dist_run(2, rank_a_parameter_added_to_a_unit_is_summoned)


def rank_a_submodule_added_to_a_unit_is_summoned():
    ref, model = build_lm(), shard_lm(build_lm())
    mesh = mesh1d()
    torch.manual_seed(2)
    head = nn.Linear(4, 6)
    expected = {n: p.detach().clone() for n, p in head.named_parameters()}
    with patched():
        _summon_block(model, ref)
        block = model.blocks[0]
        for name, param in list(head.named_parameters()):
            setattr(head, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        block.head = head
        with FSDP.summon_full_params(block, recurse=False, writeback=False):
            for name, want in expected.items():
                got = getattr(block.head, name)
                assert not isinstance(got, DTensor), f"head.{name}: served the plan made before the submodule"
                assert torch.equal(got, want), name
        del block.head
        _summon_block(model, ref)


def test_a_submodule_added_to_a_unit_is_summoned(dist_run):
    dist_run(2, rank_a_submodule_added_to_a_unit_is_summoned)


def rank_values_changed_between_summons_are_served():
    """A forward that leaves the root unsharded, then an update of the shards: the plan made
    before both must not serve the unsharded copy (see ``_summon._prepare``)."""
    ref, model = build_lm(), shard_lm(build_lm(), reshard_after_forward=False)
    shards = list(model.parameters())
    with patched():
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            assert_params_equal(model.embed, ref.embed)
        _summon_block(model, ref)
        with torch.no_grad():
            model(tokens_for(LMConfig()))  # leaves every unit unsharded: the slots hold other tensors
            for param in shards:
                param.add_(1.0)
            for param in ref.parameters():
                param.add_(1.0)
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            assert_params_equal(model.embed, ref.embed)
            assert_params_equal(model.norm, ref.norm)
        _summon_block(model, ref)
        _summon_block(model, ref, index=1)


def test_values_changed_between_summons_are_served(dist_run):
    dist_run(2, rank_values_changed_between_summons_are_served)


def rank_a_dtype_conversion_between_summons_is_served():
    ref, model = build_lm(), shard_lm(build_lm())
    with patched():
        _summon_block(model, ref)
        model.double()
        ref.double()
        with FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False):
            assert model.blocks[0].fc1.weight.dtype == torch.float64
            assert_params_equal(model.blocks[0], ref.blocks[0])


def test_a_dtype_conversion_between_summons_is_served(dist_run):
    dist_run(2, rank_a_dtype_conversion_between_summons_is_served)


def rank_a_destroyed_group_after_a_plan_fails_clearly():
    group = dist.new_group(list(range(dist.get_world_size())))
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("planned",))
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    with patched():
        _summon_block(model, ref)  # the plan, with the group alive
        dist.destroy_process_group(group)
        with pytest.raises(RuntimeError, match="destroyed"):
            with FSDP.summon_full_params(model.blocks[0], recurse=False, writeback=False):
                pass
    assert all(isinstance(p, DTensor) for p in model.blocks[0].parameters())


def test_a_destroyed_group_after_a_plan_fails_clearly(dist_run):
    dist_run(2, rank_a_destroyed_group_after_a_plan_fails_clearly)


def _kept(unit: nn.Module) -> dict:
    from fsdp_shim import _fsdp2 as fsdp2

    return fsdp2.unit_summon_cache(unit)


def rank_a_scope_owned_outside_evicts_the_stale_plan():
    """A plain parameter added to a unit makes its scope unplannable: the stored plan goes, not stays."""
    ref, model = build_lm(), shard_lm(build_lm())
    block = model.blocks[0]
    with patched(), scopes_collected() as fresh:
        _summon_block(model, ref)
        assert (id(block), False) in _kept(block)
        block.plain = nn.Parameter(torch.ones(3))  # no FSDP2 state owns it: its owner is looked for everywhere
        for _ in range(2):
            with FSDP.summon_full_params(block, recurse=False, writeback=False):
                assert_params_equal(block.fc1, ref.blocks[0].fc1)
                assert torch.equal(block.plain, torch.ones(3))
            assert (id(block), False) not in _kept(block), "the plan made before the change was kept"
        del block.plain
        _summon_block(model, ref)
        _summon_block(model, ref)
        assert (id(block), False) in _kept(block)
        assert fresh == [block] * 4, fresh  # planned, twice unplannable, planned again, then reused


def test_a_scope_owned_outside_evicts_the_stale_plan(dist_run):
    dist_run(2, rank_a_scope_owned_outside_evicts_the_stale_plan)


def rank_a_plan_pins_nothing_removed_from_its_unit():
    """A buffer the plan names by identity is freed once removed (the plan holds it weakly), and the
    plan that named it is not reused: the freed id could belong to another object next time."""
    import gc
    import weakref

    ref, model = build_lm(), shard_lm(build_lm())
    block = model.blocks[0]
    block.register_buffer("scratch", torch.zeros(4))
    gone = weakref.ref(block.scratch)
    with patched(), scopes_collected() as fresh:
        _summon_block(model, ref)
        plan = _kept(block)[(id(block), False)]
        del block.scratch
        gc.collect()
        assert gone() is None, "the plan kept a removed buffer alive"
        assert plan.stale
        _summon_block(model, ref)
        assert fresh == [block, block], fresh
        assert _kept(block)[(id(block), False)] is not plan


def test_a_plan_pins_nothing_removed_from_its_unit(dist_run):
    dist_run(2, rank_a_plan_pins_nothing_removed_from_its_unit)


def rank_a_module_that_is_not_a_unit_gets_no_plan():
    """A submodule inside a unit has no FSDP2 state to keep a plan on: no plan is made or stored."""
    from fsdp_shim import _fsdp2 as fsdp2

    ref, model = build_lm(), shard_lm(build_lm())
    fc1 = model.blocks[0].fc1
    with patched(), scopes_collected() as fresh:
        for _ in range(2):
            with FSDP.summon_full_params(fc1, writeback=False):
                assert_params_equal(fc1, ref.blocks[0].fc1)
    assert fresh == [fc1, fc1], fresh
    assert not any(key[0] == id(fc1) for state in fsdp2.all_fsdp_states()
                   for key in vars(state).get(fsdp2._CACHE_ATTR, {}))


def test_a_module_that_is_not_a_unit_gets_no_plan(dist_run):
    dist_run(2, rank_a_module_that_is_not_a_unit_gets_no_plan)
