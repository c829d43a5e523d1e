"""``_fsdp2``: the one room that touches FSDP2's and c10d's private state, and the probe of it.

Checked here, where it lives: the probe finds everything it lists on this torch and names what it
lacks on one without it; the liveness of a process group; the records of a unit read alike on every
rank. (``test_house`` checks that no other room names a private name.)
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from _helpers import build_lm, shard_lm
from fsdp_shim import _fsdp2


def test_the_internals_probe_lists_what_it_reads_and_finds_it_all_here():
    assert _fsdp2.missing_internals() == []
    assert "FSDPParamGroup._to_sharded" in _fsdp2.READS and "FSDPParam.param_dtype or mp_policy" in _fsdp2.READS


def test_the_probe_names_a_method_this_torch_lacks(monkeypatch):
    monkeypatch.delattr(FSDPParamGroup, "_to_sharded")
    assert _fsdp2.missing_internals() == ["FSDPParamGroup._to_sharded"]


def rank_a_group_is_live_until_destroyed():
    group = dist.new_group(list(range(dist.get_world_size())))
    dist.barrier(group=group)  # every rank connected before the destroy (see test_every_rank_alike)
    live = _fsdp2.is_live_group(group) and _fsdp2.is_live_group(dist.group.WORLD)
    dist.destroy_process_group(group)
    return live, _fsdp2.is_live_group(group)


def test_a_group_is_live_until_destroyed(dist_run):
    assert dist_run(2, rank_a_group_is_live_until_destroyed) == [(True, False)] * 2


def rank_a_units_records_are_its_parameters():
    model = shard_lm(build_lm())
    state = _fsdp2.fsdp_state_of(model.blocks[0])
    assert state is not None and _fsdp2.fsdp_state_of(nn.Linear(2, 2)) is None
    (group,) = _fsdp2.param_groups(state)
    fsdp_params = _fsdp2.group_params(group)
    assert _fsdp2.sharded_params(fsdp_params) == list(model.blocks[0].parameters())  # the very objects
    assert set(_fsdp2.group_modules(group)) == {model.blocks[0]}
    assert _fsdp2.shard_rank(group) == dist.get_rank()
    alone = fully_shard(nn.Linear(4, 4))
    assert _fsdp2.param_slots(_fsdp2.group_params(_fsdp2.param_groups(_fsdp2.fsdp_state_of(alone))[0])[0]) \
        == [(alone, "weight")]


def test_a_units_records_are_its_parameters(dist_run):
    dist_run(2, rank_a_units_records_are_its_parameters)
