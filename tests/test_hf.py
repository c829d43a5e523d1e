"""Real clients: tiny Hugging Face models sharded with FSDP2, used the way RL stacks use them.

Models are built from configs (no downloads), one decoder layer per FSDP unit
plus the root, and compared with an unsharded reference from the same seed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import patched, rank
from fsdp_shim.tools.models import exact_gradients

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "gpt2"]


def _config(arch: str):
    if arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
            attn_implementation="eager",
        )
    return transformers.GPT2Config(
        vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=True,
        attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def _build(arch: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = _config(arch)
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel)(config)
    return model.eval()


def _layers(model: nn.Module) -> nn.ModuleList:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers if hasattr(inner, "model") else inner.transformer.h


def _shard(model: nn.Module, mp: MixedPrecisionPolicy | None = None) -> nn.Module:
    kwargs = {"mp_policy": exact_gradients(mp)}  # torch 2.7/2.8 gloo: AVG sums
    for layer in _layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _prompt() -> torch.Tensor:
    return torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(7))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with fsdp_shim.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# 1. generation under summon ----------------------------------------------------
def rank_generate_under_summon(arch: str):
    reference, model = _build(arch), _shard(_build(arch))
    prompt = _prompt()
    model(prompt)  # a dummy forward first, as RL stacks do
    with patched(), FSDP.summon_full_params(model, writeback=False, recurse=False):
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, want)
    # training afterwards matches the reference, exactly
    model.train()
    reference.train()
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    for _ in range(2):
        for m, optim in zip((model, reference), optims):
            m(prompt, labels=prompt).loss.backward()
            optim.step()
            optim.zero_grad()
    got = _full(model)
    assert all(torch.equal(got[n], p) for n, p in reference.named_parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_pattern1_generate_under_summon_matches_reference(dist_run, arch):
    dist_run(2, rank_generate_under_summon, arch)


def rank_generate_under_summon_mixed_precision():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model, plain = _shard(_build("llama"), mp), _shard(_build("llama"), mp)
    prompt = _prompt()
    model(prompt)
    with patched(), FSDP.summon_full_params(model, writeback=False, recurse=False):
        assert model.lm_head.weight.dtype == torch.float32
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_pattern1_generate_under_bf16_policy_matches_fsdp2(dist_run):
    dist_run(2, rank_generate_under_summon_mixed_precision)


# 2. weight-sync loop -----------------------------------------------------------
def rank_weight_sync_loop(arch: str):
    reference, model = _build(arch), _shard(_build(arch))
    model(_prompt())
    sent: dict[str, torch.Tensor] = {}
    with patched():
        for unit_name, unit in model.named_modules():
            if not fsdp_shim.is_fsdp_module(unit):
                continue
            with FSDP.summon_full_params(unit, writeback=False, rank0_only=True, recurse=False):
                if rank() == 0:
                    for name, param in unit.named_parameters():
                        if isinstance(param, DTensor):
                            continue  # another unit's, still sharded
                        fqn = f"{unit_name}.{name}" if unit_name else name
                        assert fqn not in sent, f"{fqn} sent twice"
                        assert fsdp_shim.param_fqn(model, param) == fqn
                        sent[fqn] = param.detach().clone()
    if rank() == 0:
        want = dict(reference.named_parameters())
        assert sent.keys() == want.keys()
        assert all(torch.equal(sent[n], p) for n, p in want.items())
    else:
        assert not sent


@pytest.mark.parametrize("arch", ARCHS)
def test_pattern2_weight_sync_loop_collects_every_name_once(dist_run, arch):
    dist_run(2, rank_weight_sync_loop, arch)


# 3. in-place edit of a tied head -----------------------------------------------
def rank_tied_head_edit(arch: str):
    _, model = _build(arch), _shard(_build(arch))
    head = model.get_output_embeddings()
    with patched(), FSDP.summon_full_params(model, writeback=True, recurse=False):
        mask = torch.full_like(head.weight, -100.0)
        mask[:7] = 0.0  # index assignment: no DTensor rule needed on full tensors
        with torch.no_grad():
            head.weight.copy_(mask)
    assert isinstance(head.weight, DTensor)
    assert head.weight is model.get_input_embeddings().weight
    assert torch.equal(head.weight.full_tensor(), mask)
    assert torch.equal(model.get_input_embeddings().weight.full_tensor(), mask)
    model(_prompt())  # FSDP2 runs on the edited shards


@pytest.mark.parametrize("arch", ARCHS)
def test_pattern3_tied_head_edit_persists_into_both_names(dist_run, arch):
    dist_run(2, rank_tied_head_edit, arch)


# 4. LoRA merge -----------------------------------------------------------------
def _lora(seed: int = 0) -> nn.Module:
    import peft  # the test skips without it, in the test process (a skip inside a rank reads as an error)
    base = _build("llama", seed)
    torch.manual_seed(seed + 1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, config)


def rank_lora_merge():
    reference, model = _lora(), _shard(_lora())
    model(_prompt())
    original = _full(model)
    with patched():
        # verl's round trip: merge, read the merged weights, unmerge
        with FSDP.summon_full_params(model, writeback=True):
            model.merge_adapter()
            merged = {n: p.detach().clone() for n, p in model.named_parameters()}
            model.unmerge_adapter()
        reference.merge_adapter()
        want = dict(reference.named_parameters())
        assert all(torch.equal(merged[n], want[n]) for n in want)
        after = _full(model)
        for name, value in original.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=1e-6)  # unmerge subtracts
        # a merge kept: persists through writeback into every shard
        with FSDP.summon_full_params(model, writeback=True):
            model.merge_adapter()
    merged_after = _full(model)
    fresh = _lora()
    fresh.merge_adapter()
    for name, value in fresh.named_parameters():
        if "base_layer" in name:
            torch.testing.assert_close(merged_after[name], value, rtol=0, atol=1e-6)
    assert not torch.equal(merged_after[next(n for n in want if "q_proj.base_layer" in n)],
                           original[next(n for n in want if "q_proj.base_layer" in n)])


def test_pattern4_lora_merge_and_unmerge(dist_run):
    pytest.importorskip("peft")
    dist_run(2, rank_lora_merge)


def rank_lora_adapter_calls_inside():
    reference, model = _lora(), _shard(_lora())
    model(_prompt())
    lora = [n for n, _ in model.named_parameters() if "lora_" in n]
    with patched():
        with FSDP.summon_full_params(model, writeback=True):  # peft 0.22 reshards every unit in each call
            with model.disable_adapter():
                base_only = model(_prompt()).logits
            model.set_requires_grad("default", requires_grad=False)
        with reference.disable_adapter():
            assert torch.equal(base_only, reference(_prompt()).logits)
        params = dict(model.named_parameters())
        assert all(isinstance(params[n], DTensor) and not params[n].requires_grad for n in lora)  # on the shards
        with FSDP.summon_full_params(model, writeback=True):
            model.set_adapter("default")
        assert all(params[n].requires_grad for n in lora)
    model(_prompt()).logits.sum().backward()
    return True


def test_lora_adapter_calls_inside_reach_the_shards(dist_run):
    """peft's ``disable_adapter()``, ``set_requires_grad()`` and ``set_adapter()`` inside a summon: the same
    logits as unsharded, and ``requires_grad`` carried to the sharded parameters."""
    if not hasattr(pytest.importorskip("peft").PeftModel, "set_requires_grad"):
        pytest.skip("PeftModel.set_requires_grad is not in this peft")
    assert dist_run(2, rank_lora_adapter_calls_inside) == [True, True]
