"""The RL loop as it runs: generation under ``torch.inference_mode()`` (2 gloo ranks).
See ``_param.SummonedParam.may_hold_edits``.

0.2 to 0.4.3 raised "Inference tensors do not track version counter" on every
rank for any summon entered under inference mode; FSDP1 has no such failure.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy

from _helpers import assert_params_equal, build_lm, full_state, patched, shard_lm, tokens_for


def _train_step(model, ref, tokens):
    for m in (model, ref):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        m(tokens).float().pow(2).mean().backward()
        optimizer.step()


def rank_summon_under_inference_mode(writeback: bool, recurse: bool):
    ref, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(ref.config)
    with patched(), torch.inference_mode():
        with FSDP.summon_full_params(model, writeback=writeback, recurse=recurse):
            assert torch.equal(model(tokens), ref(tokens))  # a forward inside
            assert torch.equal(model.generate(tokens, 4), ref.generate(tokens, 4))
            model.norm.weight.mul_(2.0)  # an edit of an inference tensor: no version counter to see it by
            model.lm_head.weight[3] = 0.0  # tied to embed: one object
    if writeback:
        with torch.no_grad():
            ref.norm.weight.mul_(2.0)
            ref.lm_head.weight[3] = 0.0
    state = full_state(model)
    for name, value in ref.named_parameters():
        assert torch.equal(state[name], value.detach()), name
    if not recurse:
        # The blocks ran FSDP2's own forward under inference mode, which leaves FSDP2's all-gather
        # buffers inference tensors: plain FSDP2 (2.13, 2.15) cannot train after that, shim or not.
        return
    _train_step(model, ref, tokens)  # training goes on exactly, outside inference mode
    for name, value in full_state(model).items():
        assert torch.equal(value, dict(ref.named_parameters())[name].detach()), name


@pytest.mark.parametrize("recurse", [True, False], ids=["recurse", "no-recurse"])
@pytest.mark.parametrize("writeback", [True, False], ids=["writeback", "no-writeback"])
def test_summon_under_inference_mode(dist_run, writeback, recurse):
    dist_run(2, rank_summon_under_inference_mode, writeback, recurse)


def rank_inference_mode_with_mixed_precision_forward():
    """A forward inside runs in param_dtype, cast afresh each time (no version to cache the cast by)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = shard_lm(build_lm(), mp_policy=policy)
    tokens = tokens_for(model.config)
    with torch.no_grad():  # FSDP2's own forward (a cold one under inference_mode would, on torch 2.7,
        outside = model(tokens)  # lazily init FSDP2 there and make its shards inference tensors)
    model.reshard()
    with patched(), torch.inference_mode(), FSDP.summon_full_params(model, writeback=True):
        first = model(tokens)
        model.norm.bias.add_(1.0)  # an edit between two forwards must reach the second one
        second = model(tokens)
    assert torch.equal(first, outside) and not torch.equal(second, first)
    want = build_lm()  # the edit written back into the fp32 masters, and nothing else: no bf16 cast of a forward
    with torch.no_grad():
        want.norm.bias.add_(1.0)
    state = full_state(model)
    for name, value in want.named_parameters():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value.detach()), name


def test_inference_mode_with_mixed_precision_forward(dist_run):
    dist_run(2, rank_inference_mode_with_mixed_precision_forward)


def rank_grad_modes_inside_a_context():
    """inference_mode, no_grad and enable_grad entered inside a context: edits are seen and written back."""
    ref, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(ref.config)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        with torch.inference_mode():
            model.norm.weight.mul_(2.0)  # a normal tensor edited in inference mode: its version moves
        with torch.no_grad():
            model.norm.bias.add_(1.0)
        with torch.enable_grad():
            logits = model(tokens)
            assert logits.requires_grad
    with torch.no_grad():
        ref.norm.weight.mul_(2.0)
        ref.norm.bias.add_(1.0)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        assert_params_equal(model, ref)


def test_grad_modes_inside_a_context(dist_run):
    dist_run(2, rank_grad_modes_inside_a_context)


def rank_a_summon_after_one_under_inference_mode_edits_and_writes_back():
    """Nothing a summon under ``inference_mode`` made (inference tensors) serves a later summon.

    A later ``writeback=True`` summon edits its full parameters in place
    outside inference mode, which an inference tensor refuses.
    """
    ref, model = build_lm(), shard_lm(build_lm())
    with patched():  # multi-tensor buckets, copied out of one all-gather output
        with torch.inference_mode(), FSDP.summon_full_params(model, writeback=False):
            pass
        with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
            assert_params_equal(model, ref)
            model.norm.weight.mul_(2.0)
        with torch.no_grad():
            ref.norm.weight.mul_(2.0)
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)


def test_a_summon_after_one_under_inference_mode_edits_and_writes_back(dist_run):
    dist_run(2, rank_a_summon_after_one_under_inference_mode_edits_and_writes_back)
