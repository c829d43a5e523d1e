"""compose-rl's MPT generation helpers on FSDP2, with no code change: the ``compose_rl_mpt`` instrumentation.

compose-rl's ``hf_generate`` flips llm-foundry MPT's ``use_pad_tok_in_ffn`` on
every decoder block before generating and back after, reaching each block
through ``block._fsdp_wrapped_module`` (FSDP1's wrapper), which an FSDP2 unit
does not have. The stand-ins (``tests/stand_ins/compose_rl/utils``, the
``hf_generate`` in ``online/generation_utils/generation_utils.py``) carry that
structure; ``MPTLike`` below is an llm-foundry-style model whose blocks hold
the flag and whose FFN skips pad tokens unless it is on, so the flag changes
the generated tokens. Each case runs with and without activation
checkpointing, on FSDP1 (the reference), on FSDP2 with the instrumentation,
and on FSDP2 with it switched off (the control: ``AttributeError``). The real
Composer's FSDP2 runs it in ``tests/composer_mpt_job.py`` on the matrix's 2.7.0
row (``test_composer_real.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _helpers import patch_state_restored, patched
from fsdp_shim.tools.models import Block, exact_gradients

STAND_INS = str(Path(__file__).parent / "stand_ins")
HELPERS = "compose_rl.utils.utils"
GENERATION = "compose_rl.algorithms.online.generation_utils.generation_utils"
PAD, VOCAB, WIDTH, LAYERS = 0, 61, 32, 3


class MPTBlock(Block):
    """An llm-foundry-style decoder block: attention, then an FFN that skips pad tokens unless ``use_pad_tok_in_ffn``."""

    def __init__(self) -> None:
        super().__init__(WIDTH, 4)
        self.use_pad_tok_in_ffn = False

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.attend(x)
        ffn = self.ffn(x)
        if not self.use_pad_tok_in_ffn:  # as llm-foundry's unpadding: pad tokens skip the FFN
            ffn = ffn.masked_fill(pad.unsqueeze(-1), 0.0)
        return x + ffn


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MPTBlock() for _ in range(LAYERS))
        self.norm_f = nn.LayerNorm(WIDTH)


class MPTLike(nn.Module):
    """``model.transformer.blocks``, a tied output head, greedy ``generate`` over left-padded prompts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = Transformer()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == PAD
        x = self.transformer.wte(tokens)
        for block in self.transformer.blocks:
            x = block(x, pad)
        return F.linear(self.transformer.norm_f(x), self.transformer.wte.weight)

    def generate(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        tokens = prompt
        for _ in range(steps):
            logits = self(tokens)[:, -1]
            logits[:, PAD] = float("-inf")
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens


def _prompt() -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (2, 7), generator=generator)
    prompt[0, :3] = PAD  # left padding: pad tokens reach later ones through attention, so the flag matters
    return prompt


def _checkpointed(model: MPTLike) -> MPTLike:
    for i, block in enumerate(model.transformer.blocks):
        model.transformer.blocks[i] = checkpoint_wrapper(block)
    return model


def _flag_holders(model: nn.Module) -> list[nn.Module]:
    """The ``MPTBlock``s themselves, whatever wraps them: where the flag lives."""
    return [m for m in model.modules() if isinstance(m, MPTBlock)]


def _generate_recording(model: nn.Module) -> tuple[torch.Tensor, list[list[bool]], list[bool], torch.Tensor]:
    """``hf_generate`` through the stand-in helpers: tokens, the flags every block saw during each forward, the
    flags after, and every step's last-position logits."""
    generation = sys.modules[GENERATION]
    seen: list[list[bool]] = []
    logits: list[torch.Tensor] = []
    holders = _flag_holders(model)
    inner = next(m for m in model.modules() if isinstance(m, MPTLike))  # FSDP1's root calls the inner generate
    handles = [inner.register_forward_pre_hook(lambda *_: seen.append([h.use_pad_tok_in_ffn for h in holders])),
               inner.register_forward_hook(lambda _m, _i, out: logits.append(out[:, -1].detach().clone()))]
    try:
        tokens = generation.hf_generate(model, _prompt(), 4)
    finally:
        for handle in handles:
            handle.remove()
    return tokens, seen, [h.use_pad_tok_in_ffn for h in holders], torch.stack(logits)


def _import_stand_ins() -> None:
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    __import__(GENERATION)


def rank_mpt_generation_through_the_helpers(checkpointing: bool):
    reference = MPTLike()
    if checkpointing:
        _checkpointed(reference)
    results = {}
    with patch_state_restored():
        fsdp_shim_patched = patched()
        with fsdp_shim_patched:
            _import_stand_ins()
            unsharded = _generate_recording(reference)
            # FSDP1: each block its own unit (under checkpointing: FSDP(CheckpointWrapper(MPTBlock)), as llm-foundry)
            fsdp1_model = MPTLike()
            if checkpointing:
                _checkpointed(fsdp1_model)
            fsdp1 = FSDP(fsdp1_model, auto_wrap_policy=ModuleWrapPolicy({CheckpointWrapper if checkpointing else MPTBlock}),
                         use_orig_params=True, device_id=torch.device("cpu"))
            results["fsdp1"] = _generate_recording(fsdp1)
            # FSDP2: each block (or its checkpoint wrapper) a unit, then the root
            fsdp2 = MPTLike()
            if checkpointing:
                _checkpointed(fsdp2)
            for block in fsdp2.transformer.blocks:
                fully_shard(block, mp_policy=exact_gradients(None))
            fully_shard(fsdp2, mp_policy=exact_gradients(None))
            results["fsdp2"] = _generate_recording(fsdp2)
    for how, (tokens, seen, after, logits) in results.items():
        assert torch.equal(tokens, unsharded[0]), f"{how}: tokens differ from the unsharded model's"
        assert torch.equal(logits, unsharded[3]), f"{how}: logits differ from the unsharded model's"
        assert seen == [[True] * LAYERS] * 4, f"{how}: the flag was not on in every block while generating: {seen}"
        assert after == [False] * LAYERS, f"{how}: the flag was not restored: {after}"
    assert unsharded[1] == results["fsdp1"][1]
    # the flag matters: without the flip the same model computes other logits
    with torch.no_grad():
        assert not torch.equal(reference(_prompt())[:, -1], unsharded[3][0])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_mpt_generation_through_the_helpers_flips_like_fsdp1(dist_run, checkpointing):
    dist_run(2, rank_mpt_generation_through_the_helpers, checkpointing)


def rank_without_the_instrumentation_the_helpers_fail():
    import os

    model = MPTLike()
    for block in model.transformer.blocks:
        fully_shard(block)
    fully_shard(model)
    with patch_state_restored("FSDP_SHIM_DISABLE_COMPOSE_RL_MPT"):
        os.environ["FSDP_SHIM_DISABLE_COMPOSE_RL_MPT"] = "1"
        import fsdp_shim

        fsdp_shim.unpatch()
        fsdp_shim.patch()
        _import_stand_ins()
        with pytest.raises(AttributeError, match="_fsdp_wrapped_module"):
            _generate_recording(model)
        assert [h.use_pad_tok_in_ffn for h in _flag_holders(model)] == [False] * LAYERS
    # and back on: the same model generates
    with patched():
        _import_stand_ins()
        _, seen, after, _ = _generate_recording(model)
    assert seen == [[True] * LAYERS] * 4 and after == [False] * LAYERS
    assert dist.get_world_size() == 2


def test_without_the_instrumentation_the_helpers_fail(dist_run):
    dist_run(2, rank_without_the_instrumentation_the_helpers_fail)


def test_the_instrumentation_reaches_every_copy_of_the_names_and_unpatches():
    """Whichever module is imported first, every ``from compose_rl.utils import ...`` copy is the adapted
    helper while patched, and the installed one again after ``unpatch()``."""
    import fsdp_shim

    for first in (HELPERS, GENERATION):
        with patch_state_restored():
            fsdp_shim.unpatch()
            if STAND_INS not in sys.path:
                sys.path.insert(0, STAND_INS)
            for name in [n for n in sys.modules if n == "compose_rl" or n.startswith("compose_rl.")]:
                del sys.modules[name]
            __import__(first)
            fsdp_shim.patch()
            __import__(GENERATION)
            helpers, utils, generation = (sys.modules[n] for n in (HELPERS, "compose_rl.utils", GENERATION))
            for name in ("flip_pad_token_usage_for_generate", "flip_pad_token_usage_in_ffn"):
                adapted = getattr(helpers, name)
                assert hasattr(adapted, "__wrapped__"), f"{name} not instrumented ({first} first)"
                assert getattr(utils, name) is adapted and getattr(generation, name) is adapted, (first, name)
            fsdp_shim.unpatch()
            for name in ("flip_pad_token_usage_for_generate", "flip_pad_token_usage_in_ffn"):
                original = getattr(helpers, name)
                assert not hasattr(original, "__wrapped__"), name
                assert getattr(utils, name) is original and getattr(generation, name) is original, (first, name)
