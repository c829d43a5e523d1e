"""Stand-in for compose-rl's MPT generation helpers (``compose_rl/utils/utils.py`` at ae56991).

Written for the fsdp_shim tests, with the structure the ``compose_rl_mpt``
instrumentation depends on and none of upstream's code: both helpers assume
an FSDP1 model, reach every decoder block of ``model.transformer.blocks``
through ``block._fsdp_wrapped_module`` (and, under activation checkpointing,
``._checkpoint_wrapped_module`` below it), and toggle the block's
``use_pad_tok_in_ffn``. ``flip_pad_token_usage_for_generate`` asks the first
block whether the flag is off, turns it on everywhere (through
``flip_pad_token_usage_in_ffn``) if so, and says whether it flipped; the
caller flips back after generating.
"""

from __future__ import annotations

import torch.nn as nn


def _flag_module(block: nn.Module) -> nn.Module:
    inner = block._fsdp_wrapped_module  # an FSDP2 unit has no such attribute: AttributeError there
    if hasattr(inner, "_checkpoint_wrapped_module"):
        return inner._checkpoint_wrapped_module
    return inner


def flip_pad_token_usage_for_generate(model: nn.Module) -> bool:
    if not hasattr(model, "transformer"):
        return False
    blocks = model.transformer.blocks
    assert len(blocks) > 0
    flip = not _flag_module(blocks[0]).use_pad_tok_in_ffn
    if flip:
        flip_pad_token_usage_in_ffn(model)
    return flip


def flip_pad_token_usage_in_ffn(model: nn.Module) -> None:
    for block in model.transformer.blocks:
        holder = _flag_module(block)
        holder.use_pad_tok_in_ffn = not holder.use_pad_tok_in_ffn
