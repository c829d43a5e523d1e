"""A small transformer LM for ``fsdp-shim check``/``bench`` and the tests.

Tied input and output embeddings, pre-norm blocks, greedy ``generate``. Built
from a seed so an unsharded reference and a sharded copy start bit-identical.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 97  # prime: uneven shards on every world size
    width: int = 32
    layers: int = 2
    heads: int = 4
    tie: bool = True


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.ffn(x)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus causal self-attention over it (pre-norm)."""
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return x + self.proj(att.transpose(1, 2).reshape(b, t, w))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward branch (pre-norm), without the residual."""
        return self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        if config.tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            logits = self(tokens)
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens


def build_lm(config: LMConfig = LMConfig(), seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(config)
    with torch.no_grad():  # LayerNorm starts at ones/zeros; make every value distinct
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@functools.lru_cache(maxsize=None)
def gloo_average_sums() -> bool:
    """Whether this torch's gloo reduce-scatter with ``ReduceOp.AVG`` sums instead.

    A torch bug on CPU in 2.7 and 2.8, not ours: FSDP2's gradients then come
    out multiplied by the world size. A collective probe on the default group
    (every rank calls it, once per process), so the workaround follows the
    behaviour, not a version list.
    """
    if not dist.is_initialized() or dist.get_backend() != "gloo" or dist.get_world_size() == 1:
        return False
    world_size = dist.get_world_size()
    out = torch.zeros(1, device="cpu")  # on the host also under ``with torch.device("meta")``
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.13
    try:
        reduce_scatter(out, torch.ones(world_size, device="cpu"), op=dist.ReduceOp.AVG)
    except RuntimeError:
        return True
    return out.item() != 1.0


def exact_gradients(policy: MixedPrecisionPolicy | None = None) -> MixedPrecisionPolicy:
    """``policy``, made to average gradients correctly on every torch this runs on.

    Where gloo's AVG sums (``gloo_average_sums``), reduce in float64: FSDP2
    then divides by the world size itself around a plain SUM (its
    overflow-safe path), which gloo gets right. With identical inputs on every
    rank the result is still exactly the single-model gradient. Used only by
    the tests and ``fsdp-shim check``, never by the shim.
    """
    policy = policy if policy is not None else MixedPrecisionPolicy()
    if gloo_average_sums():
        return replace(policy, reduce_dtype=torch.float64)
    return policy


def shard_lm(
    model: TinyLM,
    mesh: DeviceMesh | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> TinyLM:
    """``fully_shard`` each block, then the root (which owns the tied embedding)."""
    policy = exact_gradients(mp_policy)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def wrap_lm_fsdp1(model: nn.Module, device: torch.device) -> FullyShardedDataParallel:
    """FSDP1's twin of ``shard_lm``: one unit per block, the rest on the root, original parameters exposed."""
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=device
    )


def tokens_for(config: LMConfig, batch: int = 2, length: int = 8, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab, (batch, length), generator=generator)

