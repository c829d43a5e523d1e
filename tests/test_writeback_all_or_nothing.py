"""Writeback is all or nothing, gradients included (issue 58, D7): a failure while the gradients' part of a
``with_grads=True, writeback=True`` exit is prepared writes nothing, not the parameters (2 gloo ranks).

On 0.16.0 the parameters were written before the gradients' values were made: an allocation failure
there left the parameters' edits in their shards and the gradients' edits lost.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from _faults import assert_untouched, inject_call, local_shards
from _helpers import LMConfig, assert_unchanged, build_lm, full_state, patched, shard_lm, snapshot, tokens_for


def _edit(model) -> None:
    """One weight and one gradient edited, as a caller inside the context (or on the reference) does."""
    with torch.no_grad():
        model.blocks[0].fc1.weight.add_(1.0)
        model.blocks[1].fc2.weight.grad.fill_(5.0)


def _assert_exact(model, ref) -> None:
    """Inside a summon with gradients: every parameter and gradient equal to the reference's, bit for bit."""
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, r), name
        assert (p.grad is None) == (r.grad is None), name
        assert p.grad is None or torch.equal(p.grad, r.grad), f"{name}.grad"


def rank_an_allocation_failure_in_the_gradients_writeback_writes_nothing():
    ref, model = build_lm(), shard_lm(build_lm())
    tokens = tokens_for(LMConfig())
    for m in (model, ref):
        m(tokens).float().pow(2).mean().backward()
    before, shards = snapshot(model), local_shards(model)
    gradients: set[int] = set()  # the storages of the full gradients, known once the body runs

    def of_a_gradient(tensor, *args, **kwargs) -> bool:
        return not isinstance(tensor, DTensor) and tensor.untyped_storage().data_ptr() in gradients

    with patched():
        with inject_call(torch.Tensor.to, when=of_a_gradient, exception=torch.OutOfMemoryError) as calls:
            with pytest.raises(torch.OutOfMemoryError, match="injected allocation failure") as caught:
                with FSDP.summon_full_params(model, with_grads=True, writeback=True):
                    gradients.update(p.grad.untyped_storage().data_ptr() for p in model.parameters())
                    assert gradients.isdisjoint(p.untyped_storage().data_ptr() for p in model.parameters())
                    _edit(model)
        assert calls[0] == 1, calls  # the first gradient's local value failed, on this rank
        assert "(call 1)" in str(caught.value)
        assert_unchanged(model, before)  # the weight's shard and every gradient as they were, same objects
        assert_untouched(model, shards)  # ... and FSDP2 idle, no registry entry left
        with FSDP.summon_full_params(model, with_grads=True, writeback=False):  # the same group, in step
            _assert_exact(model, ref)
        with FSDP.summon_full_params(model, with_grads=True, writeback=True):  # no fault: both edits land
            _edit(model)
    _edit(ref)
    state = full_state(model)
    for name, r in ref.named_parameters():
        assert torch.equal(state[name], r.detach()), name
        grad = dict(model.named_parameters())[name].grad
        assert isinstance(grad, DTensor) and torch.equal(grad.full_tensor(), r.grad), f"{name}.grad"
    return True


def test_an_allocation_failure_in_the_gradients_writeback_writes_nothing(dist_run):
    assert dist_run(2, rank_an_allocation_failure_in_the_gradients_writeback_writes_nothing) == [True, True]
