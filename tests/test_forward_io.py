"""FSDP2's walk over forward inputs and outputs (``fsdp_shim.instrumentations.forward_io``): PPO's output, generation's KV cache.

compose-rl's actor-critic output (``CausalLMOutputWithPastAndValues``, a
``ModelOutput`` with a ``values`` field) and transformers' ``DynamicCache``
as a forward input, on FSDP2 under a ``MixedPrecisionPolicy``, compared with
FSDP1 and an unsharded model from the same seed. Where the fault is torch's
(2.7's pytree cast; 2.7 to 2.12's pytree flatten of the root output), the
test also shows it with the instrumentation switched off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_state
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils import _pytree

import fsdp_shim
from _helpers import patch_state_restored
from fsdp_shim.tools.models import Block, exact_gradients
from test_clients import STAND_INS

transformers = pytest.importorskip("transformers")

#: torch 2.7 to 2.12 flatten the root's output with pytree when grad is on (2.13 walks it by hand).
FSDP2_FLATTENS_OUTPUT = "tree_flatten" in vars(_fsdp_state)
#: torch 2.7 casts forward inputs with pytree's tree_map (2.8 and later walk only builtin containers).
FSDP2_CASTS_WITH_PYTREE = "tree_map" in vars(_fsdp_state)
#: transformers up to the 4.5x line registers DynamicCache as a pytree node that unflattens to a new object.
CACHE_IS_PYTREE_NODE = transformers.DynamicCache in _pytree.SUPPORTED_NODES


@contextlib.contextmanager
def instrumentation_switched(env: str, on: bool) -> Iterator[None]:
    """Patched afresh with the instrumentation behind ``env`` on or off; the patch as found afterwards."""
    with patch_state_restored(env):
        if not on:
            os.environ[env] = "1"
        fsdp_shim.unpatch()
        fsdp_shim.patch()
        yield


def _actor_critic_output_class():
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from compose_rl.algorithms.online.model_methods import CausalLMOutputWithPastAndValues  # noqa: PLC0415

    return CausalLMOutputWithPastAndValues


# pytree's flatten of a ModelOutput with a `values` field -----------------------
def test_model_output_with_values_field_flattens_with_the_instrumentation():
    with patch_state_restored():
        fsdp_shim.unpatch()
        before = _actor_critic_output_class()  # defined while unpatched: mended by the walk over subclasses
        out = before(logits=torch.ones(2), values=torch.zeros(2))
        with pytest.raises(TypeError, match="not callable"):
            _pytree.tree_flatten(out)  # transformers' own flatten calls out.values()
        fsdp_shim.patch()
        from dataclasses import dataclass  # noqa: PLC0415

        @dataclass
        class After(transformers.utils.ModelOutput):  # defined while patched: mended at registration
            logits: torch.Tensor | None = None
            values: torch.Tensor | None = None

        @dataclass
        class Plain(transformers.utils.ModelOutput):  # no shadowing field: transformers' flatten kept
            logits: torch.Tensor | None = None

        for value in (out, After(logits=torch.zeros(1), values=torch.ones(1))):
            leaves, spec = _pytree.tree_flatten(value)
            assert [t.tolist() for t in leaves] == [t.tolist() for t in dict.values(value)]
            rebuilt = _pytree.tree_unflatten(leaves, spec)
            assert type(rebuilt) is type(value) and dict.keys(rebuilt) == dict.keys(value)
            assert all(a is b for a, b in zip(dict.values(rebuilt), dict.values(value)))
        original = transformers.utils.generic._model_output_flatten
        assert _pytree.SUPPORTED_NODES[Plain].flatten_fn is original
        fsdp_shim.unpatch()  # undone: transformers' own flatten is back, and fails as before
        assert _pytree.SUPPORTED_NODES[before].flatten_fn is original
        with pytest.raises(TypeError, match="not callable"):
            _pytree.tree_flatten(out)


# PPO's actor-critic step ------------------------------------------------------
class ActorCritic(nn.Module):
    """compose-rl's PPO layout in small: a causal LM and a value head, one output with ``logits`` and ``values``."""

    def __init__(self, vocab: int = 37, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, 2) for _ in range(layers))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.value_head = nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        output_class = _actor_critic_output_class()
        return output_class(logits=self.lm_head(x), values=self.value_head(x).squeeze(-1))


def _ppo_loss(output, tokens: torch.Tensor) -> torch.Tensor:
    logprobs = F.log_softmax(output.logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    advantages = torch.linspace(-1.0, 1.0, logprobs.shape[1])
    policy_loss = -(logprobs * advantages).mean()
    value_loss = (output.values[:, :-1] - advantages).pow(2).mean()
    return policy_loss + 0.5 * value_loss


def _sharded(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = ActorCritic()
    if kind == "fsdp1":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                    device_id=torch.device("cpu"))
    policy = exact_gradients(MixedPrecisionPolicy(param_dtype=torch.float32))  # a policy, as Composer's FSDP2 sets
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _step(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(3))
    loss = _ppo_loss(model(tokens), tokens)
    loss.backward()
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads


def rank_actor_critic_step(instrumented: bool):
    with instrumentation_switched("FSDP_SHIM_DISABLE_MODEL_OUTPUT", instrumented):
        loss1, grads1 = _step(_sharded("fsdp1"))
        try:
            loss2, grads2 = _step(_sharded("fsdp2"))
        except TypeError as exc:
            return f"TypeError: {exc}"
    assert loss2 == loss1
    assert grads2.keys() == grads1.keys()
    for name, grad in grads1.items():
        assert torch.equal(grads2[name], grad), name
    return "equal"


def test_actor_critic_step_on_fsdp2_equals_fsdp1(dist_run):
    assert dist_run(2, rank_actor_critic_step, True) == ["equal", "equal"]


def test_actor_critic_step_without_the_instrumentation(dist_run):
    outcome = dist_run(2, rank_actor_critic_step, False)[0]
    if FSDP2_FLATTENS_OUTPUT:  # torch 2.7 to 2.12: the root's post-forward flattens the output
        assert outcome.startswith("TypeError") and "not callable" in outcome, outcome
    else:
        assert outcome == "equal"


# generate(use_cache=True) under a mixed-precision policy -----------------------
def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def _shard_llama(kind: str, shape: str) -> nn.Module:
    model = _llama()
    layer_class = type(model.model.layers[0])
    if kind == "fsdp1":
        wrap = ModuleWrapPolicy({layer_class}) if shape == "units" else None
        return FSDP(model, auto_wrap_policy=wrap, use_orig_params=True, device_id=torch.device("cpu"))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32)  # exact maths, and FSDP2 still casts
    if shape == "units":
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _generate(model: nn.Module, sampled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    prompt = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(11)
    out = model.generate(prompt, max_new_tokens=8, do_sample=sampled, pad_token_id=0, use_cache=True,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, list(out.scores)


def rank_generate_keeps_the_cache(shape: str, instrumented: bool) -> list[str]:
    mismatches = []
    with instrumentation_switched("FSDP_SHIM_DISABLE_FSDP2_CAST", instrumented):
        reference, fsdp1, fsdp2 = _llama(), _shard_llama("fsdp1", shape), _shard_llama("fsdp2", shape)
        for sampled in (False, True):
            want = _generate(reference, sampled)
            runs = {  # FSDP1's generate skips its root's forward hooks: compose-rl summons the root first
                "fsdp1 in summon(recurse=False)": (fsdp1, True),
                "fsdp2": (fsdp2, False),
                "fsdp2 in summon(recurse=False)": (fsdp2, True),
            }
            for name, (model, summon) in runs.items():
                if summon:
                    with FSDP.summon_full_params(model, writeback=False, recurse=False):
                        tokens, scores = _generate(model, sampled)
                else:
                    tokens, scores = _generate(model, sampled)
                if not (torch.equal(tokens, want[0]) and all(torch.equal(a, b) for a, b in zip(scores, want[1]))):
                    mismatches.append(f"{name}, {'sampled' if sampled else 'greedy'}")
    return mismatches


@pytest.mark.parametrize("shape", ["units", "root"])
def test_generate_with_kv_cache_under_a_policy_equals_fsdp1_and_unsharded(dist_run, shape):
    assert dist_run(2, rank_generate_keeps_the_cache, shape, True) == [[], []]


def test_generate_without_the_instrumentation(dist_run):
    mismatches = dist_run(2, rank_generate_keeps_the_cache, "units", False)[0]
    if FSDP2_CASTS_WITH_PYTREE and CACHE_IS_PYTREE_NODE:  # torch 2.7 with transformers 4.5x: the cache is lost
        assert mismatches and all(m.startswith("fsdp2") for m in mismatches), mismatches
    else:
        assert mismatches == []


# the cast itself: what it does not change, it leaves as passed -----------------
class Recorder(nn.Module):
    """Records the objects its forward receives and appends to the list it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor, box: list, table: dict, cache: object) -> torch.Tensor:
        self.seen = [x, box, table, cache]
        box.append("seen")
        return self.lin(x.to(self.lin.weight.dtype))


def rank_cast_keeps_identity(instrumented: bool) -> str:
    with instrumentation_switched("FSDP_SHIM_DISABLE_FSDP2_CAST", instrumented):
        unit = fully_shard(Recorder(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        cache = transformers.DynamicCache()
        x, box, table = torch.ones(2, 4, dtype=torch.bfloat16), [], {"k": torch.ones(1, dtype=torch.bfloat16)}
        unit(x, box, table, cache)  # nothing to cast: everything arrives as passed
        kept = [a is b for a, b in zip(unit.seen, (x, box, table, cache))]
        if not all(kept) or box != ["seen"]:
            return f"not kept: {kept}, box {box}"
        fp32 = [torch.ones(2, 4)]
        unit(fp32[0], fp32, table, cache)  # a cast that changes a dtype rebuilds the list it sits in only
        x_seen, box_seen, table_seen, cache_seen = unit.seen
        assert x_seen.dtype == torch.bfloat16 and box_seen is not fp32 and box_seen[0].dtype == torch.bfloat16
        assert table_seen is table and cache_seen is cache
        return "kept"


def test_a_cast_that_changes_nothing_leaves_inputs_as_passed(dist_run):
    assert dist_run(2, rank_cast_keeps_identity, True) == ["kept", "kept"]


def test_without_the_instrumentation_fsdp2_rebuilds_inputs(dist_run):
    outcome = dist_run(2, rank_cast_keeps_identity, False)[0]
    assert outcome.startswith("not kept"), outcome  # every torch 2.7 to 2.15 rebuilds the containers it walks
