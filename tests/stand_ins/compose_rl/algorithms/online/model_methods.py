"""Stand-in for compose-rl's ``online/model_methods.py`` (ae56991): the algorithm enums and the actor-critic output.

``CausalLMOutputWithPastAndValues`` has upstream's structure: a ``transformers``
``ModelOutput`` dataclass with a ``values`` field (the critic's per-token
values) beside the causal-LM fields. That field shadows ``dict.values``, which
transformers' pytree flatten calls (see ``fsdp_shim.instrumentations.forward_io``). Upstream's
``past_key_values`` field is left out: transformers 5 renames that keyword in
``ModelOutput.__init__``, which breaks FSDP1's own output walk on 5.x.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch
from transformers.utils import ModelOutput


class OnPolicyEnum(str, Enum):
    PPO = "ppo"
    GRPO = "grpo"


class ALGORITHM_TYPE:  # noqa: N801  (upstream's spelling)
    CRITIC_FREE = {OnPolicyEnum.GRPO}


@dataclass
class CausalLMOutputWithPastAndValues(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    hidden_states: Optional[tuple[torch.FloatTensor, ...]] = None
    attentions: Optional[tuple[torch.FloatTensor, ...]] = None
    values: Optional[torch.FloatTensor] = None
