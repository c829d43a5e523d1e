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
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy

from _helpers import LMConfig, build_lm, full_state, patched, shard_lm, tokens_for

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
