"""``_group``: what a summoned group changes on FSDP2's state and its units, undone exactly by
``release``; and ``refuse_forwards``, on a real 2-rank FSDP2 model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


def _fsdp2_view(unit: nn.Module, group) -> tuple:
    """What a summon may touch of a unit: its group's state and the unit's hooks and ``_apply``."""
    return (group._sharded_state, group.post_forward_mesh_info, "_apply" in unit.__dict__,
            [(k, v) for k, v in unit._state_dict_pre_hooks.items()],
            [(k, v) for k, v in unit._load_state_dict_pre_hooks.items()],
            [(k, v) for k, v in unit._load_state_dict_post_hooks.items()],
            list(unit._forward_hooks.items()), list(unit._forward_pre_hooks.items()),
            [getattr(p, "_unsharded_param", None) for p in group.fsdp_params])


def rank_summon_then_release_leaves_fsdp2_as_it_was():
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim import _fsdp2 as fsdp2
    from fsdp_shim._group import Conversions, SummonedGroup
    from fsdp_shim._param import SummonedParam, to_full, to_sharded
    from fsdp_shim._scope import collect_scope, sharded_params, slot_owners

    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    (state,) = [fsdp2.fsdp_state_of(model)]
    (group,) = fsdp2.param_groups(state)
    before = _fsdp2_view(model, group)
    scope = collect_scope(model, True)
    params = [SummonedParam(s, d, None) for s, d in zip(scope.params, sharded_params(scope), strict=True)]
    to_full(params, [p.sharded.full_tensor() for p in params], None, writeback=False)
    conversions = Conversions()
    summoned = SummonedGroup(group, fully_summoned=True)
    summoned.summon(params, holds_fulls=True, forwards=True, roots=lambda: [model])
    conversions.redirect(summoned.units, slot_owners(scope), holds_fulls=True)
    during = _fsdp2_view(model, group)
    model.to(torch.float64)  # through the redirected ``_apply``: the full parameters convert, recorded once
    converted = model[0].weight.dtype == torch.float64 and [m for m, _, _ in conversions.made] == [model]
    summoned.release()
    conversions.release()
    to_sharded(params)
    return during != before, converted, _fsdp2_view(model, group) == before


def test_summon_then_release_leaves_fsdp2_as_it_was(dist_run):
    assert dist_run(2, rank_summon_then_release_leaves_fsdp2_as_it_was) == [(True, True, True)] * 2


def test_refuse_forwards_refuses_only_its_modules_and_comes_off():
    from fsdp_shim._group import refuse_forwards

    guarded, free = nn.Linear(2, 2), nn.Linear(2, 2)
    handle = refuse_forwards([guarded], lambda: "refused here")
    try:
        free(torch.ones(2))
        with pytest.raises(RuntimeError, match="refused here"):
            guarded(torch.ones(2))
    finally:
        handle.remove()
    guarded(torch.ones(2))


def rank_hook_sites_are_kept_only_once_fsdp2_registered_them():
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim import _fsdp2 as fsdp2

    model = fully_shard(nn.Linear(4, 4))
    (group,) = fsdp2.param_groups(fsdp2.fsdp_state_of(model))
    before_init = len(fsdp2.group_hook_sites(group))  # load post-hooks only: FSDP2 has not initialised
    kept_before = "_fsdp_shim_hook_sites" in group.__dict__
    model(torch.ones(1, 4))  # FSDP2's lazy init registers the group's state-dict hooks
    after_init = len(fsdp2.group_hook_sites(group))
    return before_init, kept_before, after_init, "_fsdp_shim_hook_sites" in group.__dict__


def test_hook_sites_are_kept_only_once_fsdp2_registered_them(dist_run):
    # two parameters' load post-hooks; then the module's state-dict save and load pre-hooks too
    assert dist_run(2, rank_hook_sites_are_kept_only_once_fsdp2_registered_them) == [(2, False, 4, True)] * 2
