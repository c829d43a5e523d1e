"""Tensor subclasses with FSDP2's all-gather extension (issue 50, item 7): refused by name, alike, before any collective.

QLoRA keeps its frozen base weights as torchao ``NF4Tensor``s under
``fully_shard``; FSDP2 gathers them through ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``. A plain all-gather of their local tensor fails
inside torchao with a message that names no parameter. The summon and the
stream refuse them in their shared words (``_refusals.gather_extension``),
naming the parameter and the subclass, on every rank, before any
collective, leaving everything as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import counting_collectives, mesh1d, patched
from fsdp_shim import _fsdp2 as fsdp2


def _state(model: nn.Module) -> list[object]:
    """Every slot's object and local bits (an NF4 shard's inner tensors: torchao has no ``equal``),
    and every FSDP2 group's states."""
    out: list[object] = []
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        inner = [local.quantized_data, local.quantized_scalers] if hasattr(local, "quantized_data") else [local]
        out.append((name, id(p), [t.detach().clone().view(torch.uint8).tolist() for t in inner]))
    for module in model.modules():
        state = fsdp2.fsdp_state_of(module)
        for group in fsdp2.param_groups(state) if state is not None else []:
            out.append((group._sharded_state, group._training_state))
    return out


def _qlora_block() -> nn.Module:
    from torchao.quantization import to_nf4  # noqa: PLC0415  # only where torchao imports (0.18: here)

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 512, bias=False), nn.Linear(512, 64))
    base = block[0]
    base.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)  # QLoRA's frozen base
    return block


def rank_nf4_base_weights_are_refused_by_name_before_any_collective():
    model = nn.Sequential(_qlora_block())
    fully_shard(model[0], mesh=mesh1d())
    fully_shard(model, mesh=mesh1d())
    local = model[0][0].weight._local_tensor
    assert isinstance(model[0][0].weight, DTensor) and hasattr(local, "fsdp_pre_all_gather"), type(local)
    before = _state(model)
    with patched(), counting_collectives() as counts:
        for call in (
            lambda: FSDP.summon_full_params(model, writeback=False),
            lambda: FSDP.summon_full_params(model[0], recurse=False, writeback=True),
            lambda: FSDP.summon_full_params(model[0], recurse=False, writeback=False, rank0_only=True),
        ):
            with pytest.raises(NotImplementedError, match=r"'0\.0\.weight'|'0\.weight'") as refused:
                with call():
                    raise AssertionError("the body ran")
            assert type(local).__name__ in str(refused.value) and "all-gather extension" in str(refused.value)
        with pytest.raises(NotImplementedError, match=r"'0\.0\.weight'.*NF4Tensor"):
            next(iter(fsdp_shim.iter_full_params(model)))
    assert counts == {}, counts
    assert _state(model) == before, "a slot, a shard or FSDP2's state changed"
    # the units around it still summon: the plain Linear's parameters
    with patched(), FSDP.summon_full_params(model[0][1], writeback=False):
        assert not isinstance(model[0][1].weight, DTensor)


def test_nf4_base_weights_are_refused_by_name_before_any_collective(dist_run):
    pytest.importorskip("torchao.quantization", exc_type=ImportError)
    dist_run(2, rank_nf4_base_weights_are_refused_by_name_before_any_collective)
