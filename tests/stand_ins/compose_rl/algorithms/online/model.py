"""Stand-in for compose-rl's Composer policy model (``online/model.py`` at ae56991): the policy's gated generate."""

from __future__ import annotations

import torch
import torch.nn as nn
from composer.utils import is_model_fsdp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class ComposerPolicyModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model  # the policy (``PolicyWithBackbone``), sharded by the trainer

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["input_ids"])

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        if is_model_fsdp(self.model):
            with FSDP.summon_full_params(self.model, writeback=False, recurse=False):
                return self.model.generate(input_ids, **kwargs)
        return self.model.generate(input_ids, **kwargs)
