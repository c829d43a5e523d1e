"""``_common``'s units and routing from public torch alone, the one predicate both modes share.

Each behaviour is checked here, where it lives; the summon's and the refusing mode's own tests check
that they use it (``test_patching``, ``test_summon``). Two gloo ranks: ``fully_shard`` needs a group.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from _helpers import build_lm, shard_lm
from fsdp_shim import _common, _scope_rule


def _names(root: nn.Module, modules: list[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in root.named_modules()}
    return [names[id(m)] for m in modules]


def rank_scope_modules_stop_at_nested_units_without_recurse():
    model = shard_lm(build_lm())
    everything = _names(model, _scope_rule.scope_modules(model, recurse=True))
    assert everything == [n for n, _ in model.named_modules()]
    alone = _names(model, _scope_rule.scope_modules(model, recurse=False))
    assert "blocks" in alone and not any(n.startswith("blocks.") for n in alone)  # the blocks are units
    block = _names(model, _scope_rule.scope_modules(model.blocks[0], recurse=False))
    assert block == [n for n in everything if n == "blocks.0" or n.startswith("blocks.0.")]


def test_scope_modules_stop_at_nested_units_without_recurse(dist_run):
    dist_run(2, rank_scope_modules_stop_at_nested_units_without_recurse)


def rank_the_distributed_predicate_sees_units_even_when_their_slots_hold_plain_tensors():
    model = fully_shard(nn.Linear(4, 4))
    parent = nn.Sequential(model)  # a plain parent of the FSDP2 root
    assert _scope_rule.route(parent, recurse=True)[0] == "dtensor"
    model(torch.ones(1, 4))  # leaves the root unsharded: its slots hold plain tensors now
    assert not isinstance(model.weight, DTensor)
    assert _scope_rule.holds_distributed(_scope_rule.scope_modules(parent, recurse=True))  # the unit, by type
    assert _scope_rule.route(parent, recurse=True)[0] == "dtensor"
    plain_parent = nn.Sequential(fully_shard(nn.Linear(4, 4)))  # its only DTensors are a nested unit's
    assert _scope_rule.route(plain_parent, recurse=False) == ("none", [plain_parent])
    assert _scope_rule.route(nn.Linear(2, 2), recurse=True)[0] == "none"


def test_the_distributed_predicate_sees_units_even_when_their_slots_hold_plain_tensors(dist_run):
    dist_run(2, rank_the_distributed_predicate_sees_units_even_when_their_slots_hold_plain_tensors)


def rank_units_and_names_outermost_first():
    model = shard_lm(build_lm())
    units = list(_common.fsdp_units(model))
    assert [n for n, _ in units] == ["", *(f"blocks.{i}" for i in range(len(model.blocks)))]
    assert all(_common.is_fsdp_module(u) for _, u in units) and not _common.is_fsdp_module(model.norm)
    assert _scope_rule.route(model.blocks[0], recurse=False) == ("dtensor", None)  # a unit: no walk needed
    tied = model.lm_head.weight  # tied to embed: the first name it is reachable under
    assert _common.param_fqn(model, tied) == "embed.weight"
    assert _common.clean_fqn("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.fc1.weight") == "blocks.0.fc1.weight"
    assert torch.equal(dict(model.named_parameters())["norm.weight"].full_tensor(), build_lm().norm.weight)


def test_units_and_names_outermost_first(dist_run):
    dist_run(2, rank_units_and_names_outermost_first)


def test_arguments_fsdp1_does_not_take_are_refused_in_its_words_or_the_shims():
    """``refuse_arguments``: FSDP1's own ``TypeError`` (binding its context-manager function runs nothing of
    its body); where an FSDP1 takes the arguments (a newer signature), the shim's, never a silent FSDP1 call."""
    import contextlib

    import pytest
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import inspect

    import wrapt

    original = inspect.getattr_static(FSDP, "summon_full_params")
    while isinstance(original, wrapt.FunctionWrapper):  # the import patched it
        original = original.__wrapped__
    original = original.__func__  # the staticmethod's function
    with pytest.raises(TypeError, match=r"^FullyShardedDataParallel\.summon_full_params\(\) got an unexpected"):
        _common.refuse_arguments(original, (nn.Linear(1, 1),), {"bucket_mb": 4})
    ran = []

    @contextlib.contextmanager
    def newer(module, *rest, **more):
        ran.append(module)
        yield

    with pytest.raises(TypeError, match=r"fsdp_shim serves FSDP1's arguments .* only, not 1 positional and \['foo'\]"):
        _common.refuse_arguments(newer, (nn.Linear(1, 1),), {"foo": 1})
    assert ran == []  # bound, never entered
