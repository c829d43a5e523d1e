"""Never silently stale: what a summon's forward and exit see after edits no version counter records (2 gloo ranks).

Edits through ``.data`` (``p.data.zero_()``, ``p.data.copy_(new)``,
``p.data = new``, the weight loaders' idiom) move no version counter. A
forward inside the context must compute with what the slots hold now, under
a mixed-precision policy as without one, and a parameter replaced inside
must be the one the forward uses and the one exit writes back. The
reference is FSDP2's own forward of a model that holds the same values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import LMConfig, assert_unchanged, build_lm, full_state, patched, shard_lm, snapshot, tokens_for

IDIOMS = ["data.zero_", "data.copy_", "data ="]
POLICIES = {"bf16-policy": torch.bfloat16, "no-policy": None}


def _sharded(seed: int, dtype: torch.dtype | None) -> nn.Module:
    return shard_lm(build_lm(seed=seed), mp_policy=MixedPrecisionPolicy(param_dtype=dtype) if dtype else None)


def _edit(model: nn.Module, idiom: str, new: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if idiom == "data.zero_":
            p.data.zero_()
        elif idiom == "data.copy_":
            p.data.copy_(new[name])
        else:
            p.data = new[name].clone()


def rank_data_edits_reach_a_forward_inside(idiom: str, policy: str) -> None:
    dtype = POLICIES[policy]
    model, tokens = _sharded(0, dtype), tokens_for(LMConfig())
    new = {n: p.detach().clone() for n, p in build_lm(seed=1).named_parameters()}
    want_new = _sharded(1, dtype)(tokens)  # FSDP2's own forward on the new values
    with patched(), torch.no_grad():
        with FSDP.summon_full_params(model, writeback=False):
            before = model(tokens)  # a forward first: any cast of the old values exists now
            _edit(model, idiom, new)
            after = model(tokens)
    assert not torch.equal(before, after)
    if idiom == "data.zero_":
        zeros = _sharded(0, dtype)
        with patched(), torch.no_grad(), FSDP.summon_full_params(zeros, writeback=True):
            for p in zeros.parameters():
                p.zero_()
        assert torch.equal(after, zeros(tokens))
    else:
        assert torch.equal(after, want_new)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("idiom", IDIOMS)
def test_an_edit_through_data_reaches_the_next_forward_inside(dist_run, idiom, policy):
    dist_run(2, rank_data_edits_reach_a_forward_inside, idiom, policy)


def rank_a_parameter_replaced_inside_is_used_and_written_back(policy: str) -> None:
    dtype = POLICIES[policy]
    model, tokens = _sharded(0, dtype), tokens_for(LMConfig())
    replacement = build_lm(seed=1).blocks[0].fc1.weight.detach().clone()
    reference = build_lm(seed=0)
    with torch.no_grad():
        reference.blocks[0].fc1.weight.copy_(replacement)
    want = shard_lm(reference, mp_policy=MixedPrecisionPolicy(param_dtype=dtype) if dtype else None)(tokens)
    with patched(), torch.no_grad():
        with FSDP.summon_full_params(model, writeback=True):
            model(tokens)
            model.blocks[0].fc1.weight = nn.Parameter(replacement.clone())
            got = model(tokens)
            assert model.blocks[0].fc1.weight.dtype == torch.float32  # the replacement is back after the forward
            assert torch.equal(model.blocks[0].fc1.weight, replacement)
    assert torch.equal(got, want)
    assert torch.equal(full_state(model)["blocks.0.fc1.weight"], replacement)  # written back into the shards


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_parameter_replaced_inside_is_used_by_the_forward_and_written_back(dist_run, policy):
    dist_run(2, rank_a_parameter_replaced_inside_is_used_and_written_back, policy)


# the stream reads the shards, whatever a forward left in the slots ----------------
def rank_the_stream_reads_the_shards_after_a_partial_reshard() -> None:
    reference, model, tokens = build_lm(), shard_lm(build_lm(), reshard_after_forward=2), tokens_for(LMConfig())
    sharded = list(model.parameters())  # FSDP2's (and an optimizer's) objects, before any forward
    with torch.no_grad():
        model(tokens)  # 4 ranks, reshard_after_forward=2: the blocks keep post-forward DTensors
    post_forward = [p for p in model.blocks[0].parameters() if not any(p is s for s in sharded)]
    assert post_forward and all(isinstance(p, DTensor) for p in post_forward), "no partial reshard to test"
    with torch.no_grad():  # an optimizer step on the real shards, after that forward
        for p in (*sharded, *reference.parameters()):
            p.add_(1.0)
    want = dict(reference.named_parameters())
    streamed = dict(fsdp_shim.iter_full_params(model, rank0_only=False))
    assert streamed.keys() <= want.keys() and len(streamed) == len(want)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, want[name]), name
    with patched(), FSDP.summon_full_params(model, writeback=False):  # the summon says the same
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), name


def test_the_stream_reads_the_shards_after_a_partial_reshard(dist_run):
    dist_run(4, rank_the_stream_reads_the_shards_after_a_partial_reshard)


# a slot FSDP2 manages, replaced after fully_shard: both APIs refuse alike ---------
REPLACEMENTS = ["new parameter, same shape", "new parameter, other shape", "tie made", "tie undone"]


def _replace(model: nn.Module, how: str) -> str:
    """Assign after FSDP2 adopted the attributes (a forward ran); returns the slot's name."""
    block = model.blocks[0]
    if how == "new parameter, same shape":
        block.fc1.weight = nn.Parameter(torch.zeros(4 * 32, 32))
        return "blocks.0.fc1.weight"
    if how == "new parameter, other shape":
        block.fc1.weight = nn.Parameter(torch.zeros(16, 32))
        return "blocks.0.fc1.weight"
    if how == "tie made":
        model.lm_head.weight = model.embed.weight
        return "lm_head.weight"
    model.lm_head.weight = nn.Parameter(torch.zeros(97, 32))  # the model was built tied
    return "lm_head.weight"


def rank_replaced_after_fully_shard_is_refused(how: str) -> list[str]:
    tie = how != "tie made"
    model, tokens = shard_lm(build_lm(LMConfig(tie=tie))), tokens_for(LMConfig())
    model(tokens)  # FSDP2 has adopted its parameters
    name = _replace(model, how)
    before = snapshot(model)
    said = []
    for api in ("summon", "stream"):
        with pytest.raises(RuntimeError, match="assigned after fully_shard") as caught:
            if api == "summon":
                with patched(), FSDP.summon_full_params(model, writeback=False):
                    pass
            else:
                list(fsdp_shim.iter_full_params(model))
        message = str(caught.value)
        assert repr(name) in message and "copy new values into the existing parameter" in message
        said.append(message)
        assert_unchanged(model, before)
        total = torch.ones(1)
        dist.all_reduce(total)  # no collective was started: the ranks are still in step
        assert total.item() == dist.get_world_size()
    assert said[0] == said[1]  # the two APIs say the same thing
    return said


@pytest.mark.parametrize("how", REPLACEMENTS)
def test_a_parameter_assigned_after_fully_shard_is_refused_by_both_apis(dist_run, how):
    said = dist_run(2, rank_replaced_after_fully_shard_is_refused, how)
    assert said[0] == said[1]  # on every rank, alike


# writeback against shards edited through .data --------------------------------
def rank_writeback_sees_edits_through_data(case: str) -> None:
    model = shard_lm(build_lm())
    weight = model.blocks[0].fc1.weight  # FSDP2's sharded parameter, as an optimizer holds it
    start = weight.full_tensor()
    with patched(), torch.no_grad():
        if case == "shard only":  # an optimizer that steps p.data, inside the context
            with FSDP.summon_full_params(model, writeback=True):
                fsdp_shim.sharded_param(model.blocks[0].fc1.weight).data.add_(1.0)
            assert torch.equal(weight.full_tensor(), start + 1.0)  # the shard's change stands
        elif case == "full only":
            with FSDP.summon_full_params(model, writeback=True):
                model.blocks[0].fc1.weight.data.copy_(torch.full_like(start, 3.0))
            assert torch.equal(weight.full_tensor(), torch.full_like(start, 3.0))
        else:  # both, each through .data: one change would be lost, so nothing is written
            with pytest.raises(RuntimeError, match="blocks.0.fc1.weight.*separately, in its shard"):
                with FSDP.summon_full_params(model, writeback=True):
                    fsdp_shim.sharded_param(model.blocks[0].fc1.weight).data.add_(1.0)
                    model.blocks[0].fc1.weight.data.copy_(torch.full_like(start, 3.0))
            assert torch.equal(weight.full_tensor(), start + 1.0)
    assert model.blocks[0].fc1.weight is weight


@pytest.mark.parametrize("case", ["shard only", "full only", "both"])
def test_writeback_sees_edits_through_data(dist_run, case):
    dist_run(2, rank_writeback_sees_edits_through_data, case)


def rank_the_stream_serves_a_parameter_replaced_before_fsdp2_adopts() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    from _helpers import mesh1d  # noqa: PLC0415

    model = shard_lm(build_lm())
    new_weight = torch.randn(4 * 32, 32, generator=torch.Generator().manual_seed(3))
    # before any forward: FSDP2 adopts what the slot holds (load_state_dict(assign=True) does this)
    model.blocks[0].fc1.weight = nn.Parameter(distribute_tensor(new_weight, mesh1d(), [Shard(0)]))
    streamed = dict(fsdp_shim.iter_full_params(model, rank0_only=False))
    assert torch.equal(streamed["blocks.0.fc1.weight"], new_weight)
    model(tokens_for(LMConfig()))  # FSDP2 adopts it: the stream still serves it, now through FSDP2
    assert torch.equal(dict(fsdp_shim.iter_full_params(model, rank0_only=False))["blocks.0.fc1.weight"], new_weight)


def test_the_stream_serves_a_parameter_replaced_before_fsdp2_adopts(dist_run):
    dist_run(2, rank_the_stream_serves_a_parameter_replaced_before_fsdp2_adopts)
