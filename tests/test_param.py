"""``_param``: one parameter's slots, to full and to sharded, what exit reads and judges, and the local
writeback, each on a real 2-rank FSDP2 unit (or on plain tensors, where no group is involved)."""

from __future__ import annotations

import torch
import torch.nn as nn

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
