"""FSDP1 semantics of summon_full_params, exercised on FSDP2 models (2 gloo ranks): what the whole
context does across its rooms (values, writeback, rank0_only, offload, exits, nesting, units a forward
left unsharded). What one room decides is checked in that room's file (``test_scope``, ``test_param``,
``test_group``, ``test_grads``, ``test_refusals``, ...).

Each ``rank_*`` function runs on every rank; the ``test_*`` function names the
FSDP1 behaviour it proves.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from _helpers import (
    LMConfig,
    assert_params_equal,
    assert_unchanged,
    build_lm,
    full_state,
    patched,
    rank,
    reference_and_sharded as _models,
    shard_lm,
    snapshot,
    tokens_for,
)


# --------------------------------------------------------------------------- scope and values
def rank_recurse_true_gives_full_reference_values():
    ref, model = _models()
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        assert_params_equal(model, ref)
        assert model.lm_head.weight is model.embed.weight  # ties stay one object
        sd = model.state_dict()
        for name, value in ref.state_dict().items():
            assert not isinstance(sd[name], DTensor) and torch.equal(sd[name], value), name
    assert_unchanged(model, before)


def test_recurse_true_gives_full_reference_values(dist_run):
    dist_run(2, rank_recurse_true_gives_full_reference_values)


def rank_original_dtype_and_requires_grad_are_kept():
    ref = build_lm()
    model = build_lm()
    model.blocks[0].fc1.weight.requires_grad_(False)
    ref.blocks[0].fc1.weight.requires_grad_(False)
    shard_lm(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model(tokens_for(LMConfig()))  # root now holds bf16 unsharded tensors
    with patched(), FSDP.summon_full_params(model, writeback=False):
        assert_params_equal(model, ref)  # fp32 master weights, exact
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.requires_grad == r.requires_grad, name


def test_mixed_precision_yields_fp32_master_weights_and_requires_grad(dist_run):
    dist_run(2, rank_original_dtype_and_requires_grad_are_kept)


# --------------------------------------------------------------------------- writeback
def rank_writeback_persists_in_place():
    ref, model = _models()
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)  # tied: the embedding too
            model.blocks[1].fc2.bias.add_(1.0)
    with torch.no_grad():
        ref.lm_head.weight.mul_(0.5)
        ref.blocks[1].fc2.bias.add_(1.0)
    assert_unchanged(model, before, values=False)  # same objects, same FSDP2 state
    got = full_state(model)
    for name, value in ref.named_parameters():
        assert torch.equal(got[name], value), name


def test_writeback_persists_in_place(dist_run):
    dist_run(2, rank_writeback_persists_in_place)


def rank_writeback_false_discards_edits():
    _, model = _models()
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)
    assert_unchanged(model, before)


def test_writeback_false_discards_edits(dist_run):
    dist_run(2, rank_writeback_false_discards_edits)


def rank_tied_head_edit_with_full_like_mask():
    ref, model = _models()
    with patched(), FSDP.summon_full_params(model, writeback=True, recurse=False):
        head = model.lm_head.weight
        mask = torch.full_like(head, -1.0)  # no DTensor rule needed: plain tensors
        mask[:, ::2] = 2.0
        with torch.no_grad():
            head.copy_(mask)
    got = full_state(model)
    assert torch.equal(got["embed.weight"], mask)
    assert model.lm_head.weight is model.embed.weight
    assert isinstance(model.lm_head.weight, DTensor)


def test_writeback_of_tied_head_reaches_embedding(dist_run):
    dist_run(2, rank_tied_head_edit_with_full_like_mask)


# --------------------------------------------------------------------------- rank0_only / offload
def rank_rank0_only_other_ranks_keep_shards():
    ref, model = _models()
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        if rank() == 0:
            assert_params_equal(model, ref)
        else:
            for key, (p, *_rest) in before["slots"].items():
                mod, _, name = key.rpartition(".")
                assert model.get_submodule(mod)._parameters[name] is p
    assert_unchanged(model, before)


def test_rank0_only_other_ranks_keep_shards(dist_run):
    dist_run(2, rank_rank0_only_other_ranks_keep_shards)


def rank_offload_to_cpu_warns_like_fsdp1():
    ref, model = _models()
    with patched():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
                assert all(p.device.type == "cpu" for p in model.parameters())
                assert_params_equal(model, ref)
        # FSDP1's warning, word for word, on every rank as FSDP1 warns, pointing at the caller
        assert [str(w.message) for w in record] == [_fsdp1_offload_warning()]
        assert record[0].filename == __file__ and record[0].category is UserWarning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True, rank0_only=True):
                pass


def _fsdp1_offload_warning() -> str:
    """What FSDP1's own argument check warns (this torch's words), asked directly."""
    from types import SimpleNamespace

    from torch.distributed.fsdp._unshard_param_utils import _validate_unshard_params_args

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _validate_unshard_params_args(SimpleNamespace(_use_orig_params=True, _handle=None), writeback=False,
                                      rank0_only=False, offload_to_cpu=True, with_grads=False)
    [warning] = record
    return str(warning.message)


def test_offload_to_cpu_full_params_on_cpu_and_warning(dist_run):
    assert dist_run(2, rank_offload_to_cpu_warns_like_fsdp1) == [None, None]


# --------------------------------------------------------------------------- exits, nesting, units left unsharded
def rank_exception_in_body_restores_everything():
    ref, model = _models()
    before = snapshot(model)
    with patched():
        with pytest.raises(KeyError, match="boom"):
            with FSDP.summon_full_params(model, writeback=False):
                with torch.no_grad():
                    model.embed.weight.zero_()
                raise KeyError("boom")
    assert_unchanged(model, before)
    # writeback=True keeps edits made before the exception, as FSDP1 does
    with patched():
        with pytest.raises(KeyError):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.norm.bias.fill_(4.0)
                raise KeyError("boom")
    assert torch.all(full_state(model)["norm.bias"] == 4.0)
    assert_unchanged(model, before, values=False)


def test_exception_in_body_restores_objects_and_state(dist_run):
    dist_run(2, rank_exception_in_body_restores_everything)


def rank_unsharded_units_are_summoned_from_master_weights():
    ref, model = _models(reshard_after_forward=False)
    tokens = tokens_for(LMConfig())
    model(tokens)  # every unit now unsharded: plain tensors in the slots
    unsharded = model.blocks[0].fc1.weight
    assert not isinstance(unsharded, DTensor)
    sharded = {n: fp for n, fp in _sharded_params(model)}
    with patched(), FSDP.summon_full_params(model.blocks[0].fc1, writeback=True):
        assert model.blocks[0].fc1.weight is not unsharded  # ours, not FSDP2's copy
        assert_params_equal(model.blocks[0].fc1, ref.blocks[0].fc1)
        with torch.no_grad():
            model.blocks[0].fc1.weight.add_(1.0)
    with torch.no_grad():
        ref.blocks[0].fc1.weight.add_(1.0)
    for name, p in _sharded_params(model):
        assert p is sharded[name]
    assert torch.equal(model(tokens), ref(tokens))  # FSDP2 re-gathers the written-back shards


def _sharded_params(model):
    from fsdp_shim import _fsdp2 as fsdp2

    for m in model.modules():
        state = fsdp2.fsdp_state_of(m)
        for g in fsdp2.param_groups(state) if state else []:
            for fp in g.fsdp_params:
                yield fp._param_fqn or id(fp), fp.sharded_param


def test_units_left_unsharded_by_forward(dist_run):
    dist_run(2, rank_unsharded_units_are_summoned_from_master_weights)


def rank_a_stale_unsharded_copy_is_never_served():
    """A no_grad forward leaves units unsharded; an optimizer step then updates only the shards."""
    ref, model = _models(reshard_after_forward=False)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = tokens_for(LMConfig())
    for m in (model, ref):
        m(tokens).pow(2).mean().backward()
    with torch.no_grad():
        model(tokens)  # every unit unsharded again, holding the pre-step values
    assert not isinstance(model.embed.weight, DTensor)
    opt.step()
    ref_opt.step()
    with patched():
        with FSDP.summon_full_params(model, writeback=True):  # 0.4.3 served (and wrote back) the stale copy
            assert_params_equal(model, ref)
        with FSDP.summon_full_params(model, writeback=False):
            assert_params_equal(model, ref)


def test_a_stale_unsharded_copy_is_never_served(dist_run):
    dist_run(2, rank_a_stale_unsharded_copy_is_never_served)


def rank_parameter_replaced_before_first_forward_is_adopted(forward_inside: bool):
    from torch.distributed.tensor import Shard, distribute_tensor

    from _helpers import mesh1d

    ref, model = _models()
    new_weight = torch.randn_like(ref.blocks[0].fc1.weight)
    with torch.no_grad():
        ref.blocks[0].fc1.weight.copy_(new_weight)
    model.blocks[0].fc1.weight = nn.Parameter(distribute_tensor(new_weight, mesh1d(), [Shard(0)]))
    tokens = tokens_for(LMConfig())
    with patched(), FSDP.summon_full_params(model, writeback=False):
        assert torch.equal(model.blocks[0].fc1.weight, new_weight)
        if forward_inside:  # FSDP2's lazy init runs here, with full tensors in the slots
            assert torch.equal(model(tokens), ref(tokens))
    assert torch.equal(model(tokens), ref(tokens))
    assert torch.equal(full_state(model)["blocks.0.fc1.weight"], new_weight)


@pytest.mark.parametrize("forward_inside", [False, True])
def test_parameter_replaced_before_first_forward_is_adopted(dist_run, forward_inside):
    """FSDP2 adopts a reassigned parameter at lazy init; the context sees it first."""
    dist_run(2, rank_parameter_replaced_before_first_forward_is_adopted, forward_inside)


def rank_nesting_child_inside_parent_and_parent_inside_child():
    ref, model = _models()
    before = snapshot(model)
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            with FSDP.summon_full_params(model.blocks[0], writeback=False):
                assert_params_equal(model, ref)
            assert_params_equal(model, ref)
        assert_unchanged(model, before)
        with FSDP.summon_full_params(model.blocks[0], writeback=True):
            with FSDP.summon_full_params(model, writeback=False):
                assert_params_equal(model, ref)
                block_weight = model.blocks[0].fc1.weight
            assert model.blocks[0].fc1.weight is block_weight
            assert isinstance(model.blocks[1].fc1.weight, DTensor)
            with torch.no_grad():
                model.blocks[0].fc1.weight.zero_()
    assert_unchanged(model, before, values=False)
    assert torch.all(full_state(model)["blocks.0.fc1.weight"] == 0)


def test_nested_contexts_restore_everything(dist_run):
    dist_run(2, rank_nesting_child_inside_parent_and_parent_inside_child)


def rank_direct_api_without_patch():
    import fsdp_shim

    ref, model = _models()
    was = fsdp_shim.is_patched()
    fsdp_shim.unpatch()
    try:
        with FSDP.summon_full_params(model):  # FSDP1's own: silently nothing
            assert isinstance(model.embed.weight, DTensor)
        with fsdp_shim.summon_full_params(model, writeback=False, bucket_mb=0.001):
            assert_params_equal(model, ref)
    finally:
        if was:
            fsdp_shim.patch()


def test_direct_api_works_unpatched(dist_run):
    dist_run(2, rank_direct_api_without_patch)


def rank_plain_module_is_null_context():
    model = nn.Linear(3, 3)
    with patched(), FSDP.summon_full_params(model):
        assert type(model.weight) is nn.Parameter


def test_module_without_dtensors_is_null_context(dist_run):
    dist_run(2, rank_plain_module_is_null_context)


def rank_summon_between_forward_and_backward_copies_units_left_unsharded(writeback: bool):
    """Units a forward left unsharded are resharded on entry, as FSDP2's state_dict(), and gathered from the shards."""
    ref, model = _models(reshard_after_forward=False)
    tokens = tokens_for(LMConfig())
    loss = model(tokens).pow(2).mean()  # every unit now unsharded, fp32
    in_slots = {n: p for n, p in model.named_parameters()}
    assert not any(isinstance(p, DTensor) for p in in_slots.values())
    sharded = {n: fp for n, fp in _sharded_params(model)}
    with patched(), FSDP.summon_full_params(model, writeback=writeback):
        assert_params_equal(model, ref)
        assert all(p is not in_slots[n] for n, p in model.named_parameters())  # ours: edits stay ours
        with torch.no_grad():
            model.norm.bias.add_(1.0)
    assert all(p is sharded[n] for n, p in _sharded_params(model))
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded, as after state_dict()
    if writeback:
        with torch.no_grad():
            ref.norm.bias.add_(1.0)
        model.zero_grad(set_to_none=True)
        loss = model(tokens).pow(2).mean()  # (the old graph saw the old bias: autograd rightly refuses it)
    loss.backward()  # FSDP2 all-gathers again in pre-backward
    ref(tokens).pow(2).mean().backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad.full_tensor(), r.grad), name
    assert torch.equal(full_state(model)["norm.bias"], ref.norm.bias)


@pytest.mark.parametrize("writeback", [False, True])
def test_summon_between_forward_and_backward_copies_units_left_unsharded(dist_run, writeback):
    dist_run(2, rank_summon_between_forward_and_backward_copies_units_left_unsharded, writeback)
