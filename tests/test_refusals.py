"""``_refusals``: what a call refuses, with which type and words, before it changes anything.

Checked here, where it lives: the argument checks against FSDP1's own, combination by combination;
the refusals before anything (a forward in progress, an untracked parameter, the meta device) leave
the model as it was; a nested writeback inside a context that would discard it. The summon's and the
stream's tests check that both run this one set (``test_misuse``, ``test_faults``). Two gloo ranks.
"""

from __future__ import annotations

import itertools
import types
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import _unshard_param_utils

from _helpers import assert_unchanged, build_lm, shard_lm, snapshot
from fsdp_shim import _refusals, _scope


def _outcome(check, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check(*args)
        except Exception as error:  # noqa: BLE001  # the outcome compared, whatever it is
            return type(error), str(error), [str(w.message) for w in caught]
    return None, None, [str(w.message) for w in caught]


def test_the_argument_checks_are_fsdp1s_for_every_combination():
    # FSDP1's check reads two fields of its state: an FSDP1 model with use_orig_params and a sharded handle.
    fsdp1_state = types.SimpleNamespace(_use_orig_params=True, _handle=None)
    for writeback, rank0_only, offload, grads in itertools.product((False, True), repeat=4):
        ours = _outcome(_refusals.validate_args, writeback, rank0_only, offload, grads)
        theirs = _outcome(_unshard_param_utils._validate_unshard_params_args, fsdp1_state, writeback, rank0_only,
                          offload, grads)
        assert ours[0] is theirs[0] and ours[2] == theirs[2], (writeback, rank0_only, offload, grads)
        if theirs[0] is not None:  # FSDP1 names use_orig_params, which FSDP2 has not; the rest alike
            assert ours[1].replace(" ", "") in theirs[1].replace("use_orig_params=True, ", "").replace(" ", "")


def rank_refusals_before_anything_leave_the_model_as_it_was():
    model = shard_lm(build_lm())
    before = snapshot(model)
    busy = []

    def summon_inside_forward(module, args):
        scope = _scope.collect_scope(model, recurse=True)
        with pytest.raises(AssertionError, match=f"^{_refusals.FORWARD_BACKWARD_ERROR}"):
            _refusals.refuse_before_anything(model, scope, writeback=False, thread=0)
        busy.append(True)

    hook = model.blocks[0].register_forward_pre_hook(summon_inside_forward)
    model(torch.zeros(1, 4, dtype=torch.long))
    hook.remove()
    assert busy == [True]
    model.reshard()
    assert_unchanged(model, before)
    fc1 = model.blocks[0].fc1
    shard = fc1.weight
    fc1.weight = nn.Parameter(torch.zeros(shard.shape))  # assigned after fully_shard: FSDP2 does not track it
    with pytest.raises(RuntimeError, match="'blocks.0.fc1.weight' holds a parameter assigned after fully_shard"):
        _refusals.refuse_before_anything(model, _scope.collect_scope(model, recurse=True), False, thread=0)
    fc1.weight = shard
    assert_unchanged(model, before)


def test_refusals_before_anything_leave_the_model_as_it_was(dist_run):
    dist_run(2, rank_refusals_before_anything_leave_the_model_as_it_was)


def test_a_nested_writeback_is_refused_inside_a_context_that_would_discard_it():
    outer = types.SimpleNamespace(writeback=False)  # the registry's record of an enclosing context
    with pytest.raises(RuntimeError, match=r"summon_full_params\(Linear, writeback=True\) inside an enclosing "):
        _refusals.refuse_writeback_inside_no_writeback(nn.Linear(2, 2), [types.SimpleNamespace(writeback=True), outer])
    _refusals.refuse_writeback_inside_no_writeback(nn.Linear(2, 2), [types.SimpleNamespace(writeback=True)])
