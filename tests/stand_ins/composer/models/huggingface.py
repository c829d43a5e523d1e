"""Stand-in for ``composer.models.huggingface``: ``HuggingFaceModel.generate``'s gated summon.

Upstream gathers the root unit's own parameters (the tied head among them)
for generation, behind ``is_model_fsdp``: ``summon_full_params(self.model,
writeback=False, recurse=False)``. Unsharded models call ``generate`` directly.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from composer.utils import is_model_fsdp


class HuggingFaceModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["input_ids"])

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        if is_model_fsdp(self.model):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(self.model, writeback=False, recurse=False):
                return self.model.generate(input_ids, **kwargs)
        return self.model.generate(input_ids, **kwargs)
