"""Unmodified client code on FSDP2 + ``import fsdp_shim``: what it does must equal what it does on FSDP1.

compose-rl's layouts (PPO: a policy with ``lm_backbone`` and a critic head;
GRPO) and FSDP1 behaviours its code leans on. Its weight sync itself, on
three ranks with an engine on a second process group, is in
``test_weight_sync.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import patched, rank
from fsdp_shim.tools.models import Block, exact_gradients

STAND_INS = str(Path(__file__).parent / "stand_ins")
WEIGHT_SYNC = "compose_rl.algorithms.online.generation_utils.vllm_utils"


class Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, 4) for _ in range(layers))
        self.norm = nn.LayerNorm(width, bias=False)  # RMSNorm-like: upstream sends "model.norm.weight" only

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLM(nn.Module):
    """Hugging Face's layout: ``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head``."""

    def __init__(self, tie: bool, vocab: int = 53, width: int = 32, layers: int = 2):
        super().__init__()
        self.model = Decoder(vocab, width, layers)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            tokens = torch.cat([tokens, self(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens


class PolicyWithCritic(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.lm_backbone = CausalLM(tie)
        self.critic_head = nn.Linear(32, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_backbone(tokens)


class ComposerModel(nn.Module):
    """The trainer's wrapper: ``model.model`` is the sharded policy."""

    def __init__(self, layout: str, tie: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = PolicyWithCritic(tie) if layout == "ppo" else CausalLM(tie)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["obs"])


def fsdp1_model(
    layout: str, tie: bool, process_group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu"
) -> ComposerModel:
    """compose-rl's FSDP1 policy: one unit per block (and the PPO backbone), the policy the root."""
    wrapper = ComposerModel(layout, tie)
    units = {Block, CausalLM} if layout == "ppo" else {Block}
    wrapper.model = FSDP(wrapper.model, auto_wrap_policy=ModuleWrapPolicy(units), use_orig_params=True,
                         device_id=torch.device(device), process_group=process_group)
    return wrapper


def fsdp2_model(layout: str, tie: bool, mesh: DeviceMesh | None = None) -> ComposerModel:
    """The same units with ``fully_shard`` (on ``mesh``, default every rank; on its device)."""
    wrapper = ComposerModel(layout, tie)
    if mesh is not None and mesh.device_type != "cpu":
        wrapper.to(torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device()))
    policy = exact_gradients()
    lm = wrapper.model.lm_backbone if layout == "ppo" else wrapper.model
    for layer in lm.model.layers:
        fully_shard(layer, mp_policy=policy, mesh=mesh)
    if layout == "ppo":
        fully_shard(lm, mp_policy=policy, mesh=mesh)
    fully_shard(wrapper.model, mp_policy=policy, mesh=mesh)
    return wrapper


def weight_sync_module():
    """The stand-in ``vllm_utils``, imported from its upstream path."""
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    import importlib  # noqa: PLC0415

    return importlib.import_module(WEIGHT_SYNC)


def rank_instrumentation_round_trip():
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415

    from fsdp_shim.instrumentations import statuses  # noqa: PLC0415
    from fsdp_shim.instrumentations.compose_rl import FSDPUnitGate, NamesOfSummonedParams  # noqa: PLC0415

    vllm_utils = weight_sync_module()
    model = fsdp2_model("grpo", False)
    with patched():
        assert isinstance(vllm_utils.FSDP, FSDPUnitGate) and isinstance(model.model, vllm_utils.FSDP)
        assert not isinstance(model.model, FullyShardedDataParallel)  # only inside that module
        assert vllm_utils.FSDP.__wrapped__ is FullyShardedDataParallel  # everything else is the real class
        assert type(vllm_utils.build_param_fullnames(model)) is NamesOfSummonedParams
        assert statuses()[WEIGHT_SYNC].startswith("instrumented (databricks/compose-rl@")
        fsdp_shim.unpatch()
        assert vllm_utils.FSDP is FullyShardedDataParallel
        assert type(vllm_utils.build_param_fullnames(model)) is dict
        assert statuses()[WEIGHT_SYNC] == "not instrumented"
        fsdp_shim.patch()
        assert isinstance(vllm_utils.FSDP, FSDPUnitGate)


def test_instrumentation_is_undone_by_unpatch_and_redone_by_patch(dist_run):
    dist_run(2, rank_instrumentation_round_trip)


def test_instrumentation_leaves_an_unexpected_module_alone(tmp_path, monkeypatch):
    """A module at the instrumented path that does not look as read: logged, unchanged."""
    from fsdp_shim.instrumentations.compose_rl import ComposeRLWeightSync  # noqa: PLC0415

    package = tmp_path / "fake"
    package.mkdir()
    (package / "vllm_utils.py").write_text("FSDP = object()\ndef broadcast_to_vllm(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Fake(ComposeRLWeightSync):
        module = "fake.vllm_utils"

    fake = Fake()
    fake.instrument()
    import fake.vllm_utils as module  # noqa: PLC0415

    try:
        assert fake.status.startswith("skipped: it has no is_fsdp_leaf, build_param_fullnames")
        assert type(module.FSDP) is object
    finally:
        fake.uninstrument()


# -- FSDP1 behaviours real clients lean on -------------------------------------------------------
def rank_cold_generate_then_training_matches_reference():
    """compose-rl's first call: generate() under summon(root) before any forward ever ran."""
    reference = ComposerModel("ppo", False)
    model = fsdp2_model("ppo", False)
    prompt = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(3))
    with patched(), FSDP.summon_full_params(model.model, writeback=False, recurse=False):
        got = model.model.lm_backbone.generate(prompt, 4)  # an inner unit's forward comes first
    assert torch.equal(got, reference.model.lm_backbone.generate(prompt, 4))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(2):
        for m, optimizer in zip((model, reference), optimizers):
            m({"obs": prompt}).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    with fsdp_shim.summon_full_params(model, writeback=False):
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(p, r), name


def test_cold_generate_lazily_initialises_the_real_root(dist_run):
    dist_run(2, rank_cold_generate_then_training_matches_reference)


def rank_instance_form_matches_class_form():
    reference = ComposerModel("grpo", True)
    model = fsdp2_model("grpo", True)
    unit = model.model
    with patched():
        with unit.summon_full_params(unit, writeback=False, recurse=False):
            assert not isinstance(unit.lm_head.weight, DTensor)
            assert torch.equal(unit.lm_head.weight, reference.model.lm_head.weight)
            assert isinstance(unit.model.layers[0].fc1.weight, DTensor)  # recurse=False, as the class form
        with unit.model.layers[1].summon_full_params(unit.model.layers[1], rank0_only=True, writeback=False):
            if rank() == 0:
                assert torch.equal(unit.model.layers[1].fc2.weight, reference.model.model.layers[1].fc2.weight)
        assert isinstance(unit.lm_head.weight, DTensor)
    fsdp_shim.unpatch()
    try:
        assert not hasattr(unit, "summon_full_params")  # removed with the patch
    finally:
        fsdp_shim.patch()


def test_instance_form_works_on_fsdp2_units(dist_run):
    dist_run(2, rank_instance_form_matches_class_form)


def rank_sharded_param_names_a_full_parameter():
    model = fsdp2_model("grpo", True)
    names = {p: n for n, p in model.named_parameters()}
    with patched(), FSDP.summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():
            assert p not in names
            assert names[fsdp_shim.sharded_param(p)] == name
    assert fsdp_shim.sharded_param(model.model.lm_head.weight) is None  # outside: not a full parameter


def test_sharded_param_maps_full_parameters_back(dist_run):
    dist_run(2, rank_sharded_param_names_a_full_parameter)


def rank_conversions_inside_keep_full_tensors_and_land_on_exit():
    """verl's LoRA collection calls ``model = model.to("cpu")`` inside; code that trusts the result must work."""
    reference = ComposerModel("grpo", True)
    model = fsdp2_model("grpo", True)
    sharded = {n: p for n, p in model.named_parameters()}
    with patched(), FSDP.summon_full_params(model, writeback=False):
        model = model.to("cpu")
        state = model.state_dict()  # no full_tensor(): it must already be full
        for name, want in reference.state_dict().items():
            assert not isinstance(state[name], DTensor) and torch.equal(state[name], want), name
    assert all(p is sharded[n] for n, p in model.named_parameters())
    # a cast inside: inside full and float64; after exit as the same cast outside, plus writeback
    with patched(), FSDP.summon_full_params(model, writeback=True):
        model.double()
        assert model.model.lm_head.weight.dtype == torch.float64
        assert not isinstance(model.model.lm_head.weight, DTensor)
        with torch.no_grad():
            model.model.lm_head.weight.add_(0.5)  # an edit after the cast is kept, not overwritten
    reference.double()
    with torch.no_grad():
        reference.model.lm_head.weight.add_(0.5)
    assert all(p is sharded[n] for n, p in model.named_parameters())
    assert all(p.dtype == torch.float64 for p in model.parameters())
    with fsdp_shim.summon_full_params(model, writeback=False):
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
            assert p.dtype == r.dtype and torch.equal(p, r), name
    prompt = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model({"obs": prompt}), reference({"obs": prompt}))  # FSDP2 runs on the cast shards


def test_to_and_casts_inside_the_context(dist_run):
    dist_run(2, rank_conversions_inside_keep_full_tensors_and_land_on_exit)
