"""``_param``: one parameter's slots, to full and to sharded, what exit reads and judges, and the local
writeback, each on a real 2-rank FSDP2 unit (or on plain tensors, where no group is involved); then, through
``FSDP.summon_full_params``, the edits exit keeps or refuses whole: a parameter replaced, deleted or
reshaped, an optimizer step inside, ``requires_grad`` set inside, ``Partial`` placements."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import fsdp_shim
from _helpers import (
    LMConfig,
    assert_unchanged,
    full_state,
    mesh1d,
    patched,
    snapshot,
    tokens_for,
)
from _helpers import reference_and_sharded as _models
from fsdp_shim._param import MISSING, SummonedParam, _place, inspect_slots, same_bits, to_full, to_sharded, write_back


def test_same_bits_is_exact_about_nan_and_signed_zeros():
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits(nan, nan.clone())
    assert not torch.equal(nan, nan.clone())  # what a value compare would say
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert same_bits(torch.arange(3), torch.arange(3))


def test_place_writes_and_empties_slots():
    module = nn.Linear(2, 2)
    new = nn.Parameter(torch.zeros(2, 2))
    _place([(module._parameters, "weight", new), (module._parameters, "bias", MISSING)])
    assert module.weight is new and "bias" not in module._parameters


def rank_to_full_and_back_keeps_ties_objects_and_judges_edits():
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim._scope import collect_scope, sharded_params

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # a tie: one parameter, two slots
    reference = model[0].weight.detach().clone()
    fully_shard(model)
    originals = [model[0]._parameters["weight"], model[1]._parameters["weight"]]
    scope = collect_scope(model, True)
    (scoped,) = scope.params
    assert len(scoped.slots) == 2
    (sharded,) = sharded_params(scope)
    param = SummonedParam(scoped, sharded, None)
    to_full([param], [sharded.full_tensor()], None, writeback=True)
    assert model[0].weight is model[1].weight is param.full  # the tie is one object inside
    assert torch.equal(param.full, reference)
    with torch.no_grad():
        param.full.add_(1.0)
    inspect_slots([param])
    assert param.current is param.full
    param.judge()
    assert param.full_changed and not param.shard_changed and not param.nothing_to_write
    to_sharded([param])
    assert [model[0]._parameters["weight"], model[1]._parameters["weight"]] == originals  # the very objects
    assert model[0]._parameters["weight"] is originals[0]
    write_back([param], lambda p: "weight", with_grads=False)
    return torch.equal(sharded.full_tensor(), reference + 1.0)


def test_to_full_and_back_keeps_ties_objects_and_judges_edits(dist_run):
    assert dist_run(2, rank_to_full_and_back_keeps_ties_objects_and_judges_edits) == [True, True]


def rank_a_deleted_slot_is_missing_and_refuses_the_writeback():
    import pytest
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim._scope import collect_scope, sharded_params

    model = fully_shard(nn.Linear(4, 4))
    scope = collect_scope(model, True)
    params = [SummonedParam(s, d, None) for s, d in zip(scope.params, sharded_params(scope), strict=True)]
    to_full(params, [p.sharded.full_tensor() for p in params], None, writeback=True)
    before = [p.sharded.to_local().clone() for p in params]
    del model.weight
    inspect_slots(params)
    for p in params:
        p.judge()
    with pytest.raises(RuntimeError, match="weight: deleted"):
        write_back(params, lambda p: p.slots[0][1], with_grads=False)
    to_sharded(params)
    return all(torch.equal(p.sharded.to_local(), b) for p, b in zip(params, before, strict=True)) and \
        model._parameters["weight"] is params[0].sharded


def test_a_deleted_slot_is_missing_and_refuses_the_writeback(dist_run):
    assert dist_run(2, rank_a_deleted_slot_is_missing_and_refuses_the_writeback) == [True, True]


def rank_writeback_of_a_reshaped_parameter_fails_cleanly():
    _, model = _models()
    before = snapshot(model)
    with patched():
        with pytest.raises(RuntimeError, match="writeback keeps the original shape"):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.blocks[0].fc1.weight.add_(1.0)  # would persist, were the shapes sound
                model.blocks[1].fc2.bias.data = torch.zeros(3)
    assert_unchanged(model, before)  # nothing half-written, every object back


def test_writeback_of_a_reshaped_parameter_fails_cleanly(dist_run):
    dist_run(2, rank_writeback_of_a_reshaped_parameter_fails_cleanly)


def rank_replaced_parameters_are_written_back():
    ref, model = _models()
    new = torch.randn_like(ref.blocks[0].fc1.weight)
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            model.blocks[0].fc1.weight = nn.Parameter(new.clone())
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["norm.bias"] = torch.full_like(state["norm.bias"], 3.0)
            model.load_state_dict(state, assign=True)
    got = full_state(model)
    assert torch.equal(got["blocks.0.fc1.weight"], new)
    assert torch.all(got["norm.bias"] == 3.0)
    assert isinstance(model.blocks[0].fc1.weight, DTensor) and isinstance(model.norm.bias, DTensor)
    assert torch.equal(got["blocks.1.fc2.weight"], ref.blocks[1].fc2.weight)


def test_replaced_parameters_are_written_back_like_fsdp1(dist_run):
    dist_run(2, rank_replaced_parameters_are_written_back)


def rank_deleted_parameter_refuses_the_whole_writeback():
    _, model = _models()
    before = snapshot(model)
    with patched():
        with pytest.raises(fsdp_shim.WritebackRefusedError, match=r"nothing written(.|\n)*blocks.0.fc1.bias: deleted"):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.blocks[1].fc1.weight.add_(1.0)  # would be written, were the whole writeback sound
                del model.blocks[0].fc1.bias
    assert_unchanged(model, before)


def test_a_deleted_parameter_refuses_the_whole_writeback(dist_run):
    dist_run(2, rank_deleted_parameter_refuses_the_whole_writeback)


def rank_optimizer_step_inside_is_kept_or_refused():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    for m in (model, ref):
        m(tokens).pow(2).mean().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the sharded parameters
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            optimizer.step()  # the shards move; the full tensors hold nothing new
        ref_optimizer.step()
        got = full_state(model)
        assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())  # the step was not overwritten
        stepped = snapshot(model)
        with pytest.raises(RuntimeError, match=r"changed inside the context and, separately, in its shard"):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.blocks[0].fc1.weight.mul_(2.0)
                optimizer.step()
        ref_optimizer.step()
        assert_unchanged(model, stepped, values=False)
        got = full_state(model)  # the optimizer's update stands, the conflicting edit is refused whole
        assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())


def test_optimizer_step_inside_is_kept_or_refused(dist_run):
    dist_run(2, rank_optimizer_step_inside_is_kept_or_refused)


def rank_requires_grad_carries_over():
    _, model = _models()
    with patched(), FSDP.summon_full_params(model, writeback=False):
        model.blocks[0].fc1.weight.requires_grad_(False)
    assert isinstance(model.blocks[0].fc1.weight, DTensor)
    assert model.blocks[0].fc1.weight.requires_grad is False
    assert model.blocks[0].fc2.weight.requires_grad is True
    model(tokens_for(LMConfig())).sum().backward()
    assert model.blocks[0].fc1.weight.grad is None and model.blocks[0].fc2.weight.grad is not None


def test_requires_grad_set_inside_carries_over_as_in_fsdp1(dist_run):
    dist_run(2, rank_requires_grad_carries_over)


class Mixed(nn.Module):
    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        torch.manual_seed(0)
        self.full_partial = torch.randn(4, 3)
        self.full_shard = torch.randn(6, 2)
        local = self.full_partial / dist.get_world_size()  # a sum over ranks gives the full value
        self.p = nn.Parameter(DTensor.from_local(local, mesh, [Partial()], run_check=False))
        self.s = nn.Parameter(distribute_tensor(self.full_shard.clone(), mesh, [Shard(0)]))


def rank_partial_placements_write_back_exactly():
    mesh = mesh1d()
    model = Mixed(mesh)
    with patched():
        with FSDP.summon_full_params(model):  # writeback=True by default, no edit: no error, no change
            torch.testing.assert_close(model.p, model.full_partial)
        torch.testing.assert_close(model.p.full_tensor(), model.full_partial)
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model.p.copy_(torch.arange(12.0).view(4, 3))
                model.s.add_(1.0)
    assert tuple(model.p.placements) == (Partial(),)
    assert torch.equal(model.p.full_tensor(), torch.arange(12.0).view(4, 3))
    assert torch.equal(model.s.full_tensor(), model.full_shard + 1.0)


def test_partial_placements_write_back_exactly(dist_run):
    dist_run(2, rank_partial_placements_write_back_exactly)
