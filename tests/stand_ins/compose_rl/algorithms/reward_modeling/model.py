"""Stand-in for compose-rl's causal classifier reward model (``reward_modeling/model.py`` at ae56991).

``mask_last_embed_except_eos`` rewrites the output embedding so that only
the EOS row scores: a full tensor built with ``full_like`` and indexed, then
copied into the head, inside ``summon_full_params(writeback=True,
recurse=False)`` when ``is_model_fsdp`` says the model is sharded. On a
sharded (DTensor) head the same code fails: DTensor has no rule for it.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn
from composer.utils import is_model_fsdp


class CausalClassifierRewardModel(nn.Module):
    def __init__(self, model: nn.Module, eos_token_id: int) -> None:
        super().__init__()
        self.model = model
        self.eos_token_id = eos_token_id

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["input_ids"])[:, :, self.eos_token_id]

    def mask_last_embed_except_eos(self, fill_value: float = -100.0) -> None:
        context = nullcontext
        if is_model_fsdp(self.model):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            context = partial(FSDP.summon_full_params, self.model, writeback=True, recurse=False)
        with context():
            mask = torch.full_like(self.model.lm_head.weight.data, fill_value)
            mask[self.eos_token_id, :] = 0.0
            with torch.no_grad():
                self.model.lm_head.weight.copy_(mask)
