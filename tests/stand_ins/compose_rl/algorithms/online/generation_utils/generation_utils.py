"""Stand-in for compose-rl's ``hf_generate`` (``online/generation_utils/generation_utils.py`` at ae56991).

Written for the fsdp_shim tests, no upstream code. The structure the
``compose_rl_mpt`` instrumentation depends on: the two MPT helpers bound by
name (``from compose_rl.utils import ...``), the flag flipped on before
generating inside ``FSDP.summon_full_params(model, writeback=False,
recurse=False)``, and flipped back after.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from compose_rl.utils import flip_pad_token_usage_for_generate, flip_pad_token_usage_in_ffn


def hf_generate(model: nn.Module, prompt: torch.Tensor, max_gen_len: int) -> torch.Tensor:
    with torch.no_grad(), FSDP.summon_full_params(model, writeback=False, recurse=False):
        flipped = flip_pad_token_usage_for_generate(model)
        sequences = model.generate(prompt, max_gen_len)
        if flipped:
            flip_pad_token_usage_in_ffn(model)
    return sequences
