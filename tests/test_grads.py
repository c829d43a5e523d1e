"""``_grads``: gradients under ``with_grads``, through ``FSDP.summon_full_params`` on 2 gloo ranks: a
missing one stays None (every rank agrees which exist), the others are gathered in full, and written
back to the sharded gradients under ``writeback=True``, left untouched under ``writeback=False``."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from _helpers import LMConfig, assert_unchanged, patched, snapshot, tokens_for
from _helpers import reference_and_sharded as _models


def rank_with_grads():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    with patched():
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            assert all(p.grad is None for p in model.parameters())  # missing stays None
        model(tokens).sum().backward()
        ref(tokens).sum().backward()
        model.blocks[0].fc1.bias.grad = None  # one missing gradient among present ones
        ref.blocks[0].fc1.bias.grad = None
        before = snapshot(model)
        with FSDP.summon_full_params(model, writeback=False, with_grads=True):
            for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
                if r.grad is None:
                    assert p.grad is None, name
                else:
                    assert p.grad is not None and not isinstance(p.grad, DTensor), name
                    torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-6)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.fill_(3.0)
        assert_unchanged(model, before)  # writeback=False: gradients untouched
        with FSDP.summon_full_params(model, writeback=True, with_grads=True):
            model.blocks[1].fc2.weight.grad.fill_(5.0)
        grad = model.blocks[1].fc2.weight.grad
        assert isinstance(grad, DTensor) and torch.all(grad.full_tensor() == 5.0)


def test_with_grads_gathers_and_writes_back_gradients(dist_run):
    dist_run(2, rank_with_grads)
