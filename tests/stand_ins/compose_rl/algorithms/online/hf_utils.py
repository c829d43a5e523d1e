"""Stand-in for compose-rl's policy (``online/hf_utils.py`` at ae56991): the backbone's gated generate.

The policy holds ``lm_backbone`` and a critic head; generation summons the
backbone's own parameters when ``composer.utils.is_model_fsdp`` says so.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from composer.utils import is_model_fsdp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class PolicyWithBackbone(nn.Module):
    def __init__(self, lm_backbone: nn.Module, width: int) -> None:
        super().__init__()
        self.lm_backbone = lm_backbone
        self.critic_head = nn.Linear(width, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_backbone(input_ids)

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        if is_model_fsdp(self.lm_backbone):
            with FSDP.summon_full_params(self.lm_backbone, writeback=False, recurse=False):
                return self.lm_backbone.generate(input_ids, **kwargs)
        return self.lm_backbone.generate(input_ids, **kwargs)
