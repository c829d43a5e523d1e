"""Llama's parameter tree for the fake backend: ``scripts/fake_bench.py --model llama70b`` builds it.

Not shipped: a benchmark's model, not one ``fsdp-shim check``/``bench`` runs (their toy LM is
``fsdp_shim.tools.models``). It lives beside the tests' other helpers, which the scripts import from here.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class _Tree(nn.Module):
    """Named children and nothing else (``fully_shard`` refuses a ``ModuleDict``)."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for key, child in children.items():
            setattr(self, key, child)


def llama_shapes(hidden: int, ffn: int, kv: int, vocab: int, layers: int) -> nn.Module:
    """A Llama decoder's parameters on the meta device, named as Hugging Face names them (``layers``,
    ``embed_tokens``, ...): SwiGLU, grouped-query attention with ``kv`` wide keys and values, untied head.
    Shapes only (Llama-3-70B: 8192, 28672, 1024, 128256, 80); there is no forward."""
    h = hidden

    def linear(i: int, o: int) -> nn.Linear:
        return nn.Linear(i, o, bias=False)

    def layer() -> nn.Module:
        attention = _Tree(q_proj=linear(h, h), k_proj=linear(h, kv), v_proj=linear(h, kv), o_proj=linear(h, h))
        mlp = _Tree(gate_proj=linear(h, ffn), up_proj=linear(h, ffn), down_proj=linear(ffn, h))
        return _Tree(input_layernorm=nn.RMSNorm(h), self_attn=attention, post_attention_layernorm=nn.RMSNorm(h),
                     mlp=mlp)

    with torch.device("meta"):
        return _Tree(embed_tokens=nn.Embedding(vocab, h), layers=nn.ModuleList([layer() for _ in range(layers)]),
                     norm=nn.RMSNorm(h), lm_head=linear(h, vocab))
