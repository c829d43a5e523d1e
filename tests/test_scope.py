"""``_scope``: what a call covers, and the cached summon of a unit.

Checked here, where it lives: every parameter once in tree order (a tie once, with both slots), the
FSDP2 groups it touches and whether each is summoned whole, and the cache's validity. The summon's
own tests check that it uses them (``test_summon``, ``test_summon_cache``). Two gloo ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from _helpers import build_lm, shard_lm
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
