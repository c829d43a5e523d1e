"""``_refusals``: what a call refuses, with which type and words, before it changes anything.

Checked here, where it lives: the argument checks against FSDP1's own, combination by combination;
the refusals before anything (a forward in progress, an untracked parameter, the meta device) leave
the model as it was; a nested writeback inside a context that would discard it. That the summon runs
them is checked here too, through ``FSDP.summon_full_params`` (FSDP1's types and sentence, another
thread's parameters, the nested writeback); that the stream does, in ``test_faults``. Two gloo ranks.
"""

from __future__ import annotations

import itertools
import threading
import types
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import _unshard_param_utils

from _helpers import LMConfig, assert_unchanged, build_lm, full_state, patched, shard_lm, snapshot, tokens_for
from _helpers import reference_and_sharded as _models
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
    def live(writeback: bool) -> types.SimpleNamespace:  # the registry's record of an enclosing context
        return types.SimpleNamespace(call=types.SimpleNamespace(writeback=writeback))

    outer = live(writeback=False)
    with pytest.raises(RuntimeError, match=r"summon_full_params\(Linear, writeback=True\) inside an enclosing "):
        _refusals.refuse_writeback_inside_no_writeback(nn.Linear(2, 2), [live(writeback=True), outer])
    _refusals.refuse_writeback_inside_no_writeback(nn.Linear(2, 2), [live(writeback=True)])


def rank_misuse_raises_fsdp1_types_before_any_swap():
    _, model = _models()
    before = snapshot(model)
    with patched():
        with pytest.raises(NotImplementedError, match="rank0_only"):
            with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                pass
        with pytest.raises(NotImplementedError, match="with_grads"):
            with FSDP.summon_full_params(model, with_grads=True, offload_to_cpu=True):
                pass
        with pytest.raises(TypeError, match="nn.Module"):
            FSDP.summon_full_params("model")
        seen = []

        def hook(module, args):
            with pytest.raises(AssertionError, match="TinyLM.*forward/backward"):
                with FSDP.summon_full_params(model):
                    pass
            with pytest.raises(AssertionError, match="FSDPBlock.*forward/backward.*FORWARD"):
                with FSDP.summon_full_params(model.blocks[1]):  # idle itself, but its root is not
                    pass
            seen.append(True)

        handle = model.blocks[0].register_forward_pre_hook(hook)
        model(tokens_for(LMConfig()))
        handle.remove()
        assert seen

        def backward_hook(module, grad_output):
            with pytest.raises(AssertionError, match="FSDPBlock.*forward/backward.*BACKWARD"):
                with FSDP.summon_full_params(model.blocks[1]):
                    pass
            seen.append(True)

        handle = model.blocks[1].register_full_backward_pre_hook(backward_hook)
        model(tokens_for(LMConfig())).sum().backward()
        handle.remove()
        assert len(seen) == 2
        model.zero_grad(set_to_none=True)
    model.reshard()
    assert_unchanged(model, before)


def test_misuse_raises_what_fsdp1_raises(dist_run):
    dist_run(2, rank_misuse_raises_fsdp1_types_before_any_swap)


def rank_threads_never_share_a_context():
    ref, model = _models()
    before = snapshot(model)
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def outer():
        try:
            with FSDP.summon_full_params(model, writeback=False):
                entered.set()
                release.wait(30)
                assert torch.equal(model.blocks[0].fc1.weight, ref.blocks[0].fc1.weight)
        except BaseException as exc:  # noqa: BLE001  (an assert in a thread only reaches threading.excepthook)
            errors.append(exc)

    with patched():
        holder = threading.Thread(target=outer)
        holder.start()
        assert entered.wait(30)
        try:
            for unit in (model.blocks[0], model.blocks[1]):  # held by the other thread: refused, no collective
                with pytest.raises(RuntimeError, match="another thread"):
                    with FSDP.summon_full_params(unit, writeback=True):
                        pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        release.set()
        holder.join(30)
        assert not holder.is_alive(), "the holder thread never left its context"
        assert not errors, errors
        # afterwards, this thread summons as usual, and nothing was lost or changed
        with FSDP.summon_full_params(model.blocks[0], writeback=True):
            with torch.no_grad():
                model.blocks[0].fc1.weight.add_(1.0)
    assert_unchanged(model, before, values=False)
    assert torch.equal(full_state(model)["blocks.0.fc1.weight"], ref.blocks[0].fc1.weight + 1.0)


def test_threads_never_share_a_context(dist_run):
    dist_run(2, rank_threads_never_share_a_context)


def rank_inner_writeback_under_outer_discard_is_refused():
    _, model = _models()
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        with pytest.raises(RuntimeError, match="enclosing writeback=False"):
            with FSDP.summon_full_params(model.blocks[0], writeback=True):
                pass
        with FSDP.summon_full_params(model.blocks[0], writeback=False):  # the same nesting, no writeback: fine
            pass
    assert_unchanged(model, before)


def test_writeback_inside_a_discarding_context_is_refused_at_entry(dist_run):
    dist_run(2, rank_inner_writeback_under_outer_discard_is_refused)


def rank_forward_backward_error_starts_with_fsdp1s_sentence():
    _, model = _models()
    seen = []

    def hook(module, args):
        with pytest.raises(AssertionError, match="^Cannot manually unshard parameters during forward/backward"):
            with FSDP.summon_full_params(model):
                pass
        seen.append(True)

    with patched():
        handle = model.blocks[0].register_forward_pre_hook(hook)
        model(tokens_for(LMConfig()))
        handle.remove()
    assert seen


def test_forward_backward_error_starts_with_fsdp1s_sentence(dist_run):
    dist_run(2, rank_forward_backward_error_starts_with_fsdp1s_sentence)
