"""Composer's released ``is_model_fsdp`` gate on FSDP2: the summons behind it run, as on FSDP1 (2 gloo ranks).

Composer 0.32.1 (what compose-rl installs) answers the gate True for FSDP1
only, so every summon behind it is skipped on FSDP2. The ``composer``
instrumentation makes it answer as Composer main does. The client code runs
from the stand-ins (``tests/stand_ins``): Composer's ``HuggingFaceModel.generate``,
compose-rl's policy ``generate`` (two nested gated summons) and its reward
model's ``mask_last_embed_except_eos``. Each runs on FSDP1, on FSDP2 and
unsharded, with ``fsdp_shim`` imported before Composer and after it.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import wrapt
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import patch_state_restored, rank
from fsdp_shim.tools.models import Block, exact_gradients
from test_clients import STAND_INS, CausalLM

GATE = "composer.utils.misc"
CLIENTS = ("composer.models.huggingface", "compose_rl.algorithms.online.hf_utils", "compose_rl.algorithms.online.model",
           "compose_rl.algorithms.reward_modeling.model")
EOS = 3


class HeadReadingLM(CausalLM):
    """Generates as Hugging Face code can: the decoder, then the head's weight read outside any unit's forward.

    On a sharded model that weight is a DTensor unless the root unit's own
    parameters are summoned, which is why the clients summon before generating.
    """

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            logits = F.linear(self.model(tokens)[:, -1], self.lm_head.weight)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens


def _import_clients(order: str) -> dict[str, object]:
    """Composer and the clients, imported fresh, before or after the shim patches."""
    fsdp_shim.unpatch()
    for name in [n for n in sys.modules if n == "composer" or n.startswith("composer.") or n in CLIENTS]:
        del sys.modules[name]
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    if order == "shim first":
        fsdp_shim.patch()
    modules = {name: importlib.import_module(name) for name in (GATE, *CLIENTS)}
    if order == "composer first":
        fsdp_shim.patch()
    return modules


def _client(case: str, clients: dict[str, object], tie: bool) -> nn.Module:
    """The client's Composer-level model around a fresh, seeded LM."""
    torch.manual_seed(0)
    lm = HeadReadingLM(tie)
    if case == "reward":
        return clients["compose_rl.algorithms.reward_modeling.model"].CausalClassifierRewardModel(lm, EOS)
    if case == "huggingface":
        return clients["composer.models.huggingface"].HuggingFaceModel(lm)
    policy = clients["compose_rl.algorithms.online.hf_utils"].PolicyWithBackbone(lm, 32)
    return clients["compose_rl.algorithms.online.model"].ComposerPolicyModel(policy)


def _lm(client: nn.Module) -> nn.Module:
    inner = client.model
    return inner.lm_backbone if hasattr(inner, "lm_backbone") else inner


def _fsdp1(client: nn.Module) -> nn.Module:
    units = {Block, HeadReadingLM} if hasattr(client.model, "lm_backbone") else {Block}
    client.model = FSDP(client.model, auto_wrap_policy=ModuleWrapPolicy(units), use_orig_params=True,
                        device_id=torch.device("cpu"))
    return client


def _fsdp2(client: nn.Module) -> nn.Module:
    policy = exact_gradients()
    lm = _lm(client)
    for layer in lm.model.layers:
        fully_shard(layer, mp_policy=policy)
    if lm is not client.model:
        fully_shard(lm, mp_policy=policy)
    fully_shard(client.model, mp_policy=policy)
    return client


def _train_step(client: nn.Module, tokens: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(client.parameters(), lr=0.1)
    client({"input_ids": tokens}).float().pow(2).mean().backward()
    optimizer.step()


def _full(client: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in client.named_parameters()}


def _head(client: nn.Module) -> torch.Tensor:
    """The output embedding, whole, read without the shim: FSDP1's own summon, DTensor's full_tensor()."""
    if isinstance(client.model, FSDP):
        with FSDP.summon_full_params(client.model, writeback=False):
            return _lm(client).lm_head.weight.detach().clone()
    head = _lm(client).lm_head.weight
    return head.full_tensor() if isinstance(head, DTensor) else head.detach().clone()


def _gated_call(case: str, client: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The client's own code: the gate, then (if it says so) the summon and what runs inside."""
    if case == "reward":
        client.mask_last_embed_except_eos()
        return _head(client)
    return client.generate(tokens, steps=4)


def rank_gated_summon_runs_as_on_fsdp1(order: str, case: str, tie: bool, warm: bool):
    with patch_state_restored():
        clients = _import_clients(order)
        tokens = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(1))
        outputs, states = {}, {}
        for kind, shard in (("reference", lambda c: c), ("fsdp1", _fsdp1), ("fsdp2", _fsdp2)):
            client = shard(_client(case, clients, tie))
            if warm:
                _train_step(client, tokens)
            outputs[kind] = _gated_call(case, client, tokens)
            if kind != "fsdp1":
                _train_step(client, tokens)  # training goes on after the summon, exactly
                states[kind] = _full(client)
        assert torch.equal(outputs["fsdp2"], outputs["reference"])
        assert torch.equal(outputs["fsdp1"], outputs["reference"])
        assert all(isinstance(p, DTensor) for p in client.parameters())
        assert states["fsdp2"].keys() == states["reference"].keys()
        for name, value in states["reference"].items():
            assert torch.equal(states["fsdp2"][name], value), name


CASES = [
    pytest.param("reward", False, False, id="reward-mask-untied"),
    pytest.param("reward", True, False, id="reward-mask-tied"),
    pytest.param("policy", True, True, id="policy-generate-warm"),
    pytest.param("policy", True, False, id="policy-generate-cold"),
    pytest.param("huggingface", False, False, id="huggingface-generate"),
]


@pytest.mark.parametrize("order", ["shim first", "composer first"])
@pytest.mark.parametrize("case, tie, warm", CASES)
def test_gated_summon_runs_on_fsdp2_as_on_fsdp1(dist_run, order, case, tie, warm):
    dist_run(2, rank_gated_summon_runs_as_on_fsdp1, order, case, tie, warm)


def rank_without_the_instrumentation_the_clients_fail(case: str, how: str):
    with patch_state_restored('FSDP_SHIM_DISABLE_COMPOSER'):
        if how == "instrumentation off":
            os.environ["FSDP_SHIM_DISABLE_COMPOSER"] = "1"
        clients = _import_clients("shim first")
        if how == "unpatched":
            fsdp_shim.unpatch()
        client = _fsdp2(_client(case, clients, tie=True))
        tokens = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(1))
        # the gate said no, so the client's code met DTensors: the failures measured on mosaicml 0.32.1
        if case == "reward":
            try:
                _gated_call(case, client, tokens)
            except NotImplementedError as exc:  # aten.fill_.Tensor (2.13), aten.select.int (2.7), ...
                assert "does not have a sharding strategy" in str(exc)
            else:
                return "DTensor has a rule for aten.fill_.Tensor here"  # torch >= 2.15: the mask runs sharded
        else:
            with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
                _gated_call(case, client, tokens)


@pytest.mark.parametrize("how", ["instrumentation off", "unpatched"])
@pytest.mark.parametrize("case", ["reward", "policy", "huggingface"])
def test_without_the_instrumentation_the_clients_fail(dist_run, case, how):
    outcome = dist_run(2, rank_without_the_instrumentation_the_clients_fail, case, how)[0]
    if outcome is not None:
        pytest.skip(f"torch {torch.__version__}: {outcome}, so without the summon nothing fails to observe")


def rank_gate_round_trip():
    from fsdp_shim.instrumentations import statuses

    with patch_state_restored():
        clients = _import_clients("composer first")
        gate = clients[GATE].is_model_fsdp
        bound = [sys.modules["composer.utils"], *(clients[name] for name in CLIENTS)]
        assert all(m.is_model_fsdp is gate for m in bound)  # every copy of the name points at the wrapper
        assert isinstance(gate, wrapt.FunctionWrapper)
        assert statuses()[GATE].startswith("instrumented (mosaicml/composer v0.32.1")
        unit = fully_shard(nn.Linear(4, 4))
        assert gate(unit) and gate(nn.Sequential(unit)) and not gate(nn.Sequential(nn.Sequential(unit)))
        fsdp_shim.unpatch()
        original = clients[GATE].is_model_fsdp
        assert not isinstance(original, wrapt.FunctionWrapper)
        assert all(m.is_model_fsdp is original for m in bound) and not original(unit)
        assert statuses()[GATE] == "not instrumented"
        fsdp_shim.patch()
        assert all(m.is_model_fsdp is clients[GATE].is_model_fsdp for m in bound) and clients[GATE].is_model_fsdp(unit)


def test_gate_is_undone_by_unpatch_and_redone_by_patch(dist_run):
    dist_run(2, rank_gate_round_trip)


def rank_a_gate_that_knows_fsdp2_is_left_alone():
    """Composer main's gate (#3907) already answers for FSDP2: decided by asking it, nothing is wrapped."""
    from fsdp_shim.instrumentations import statuses

    with patch_state_restored():
        clients = _import_clients("composer first")
        fsdp_shim.unpatch()
        misc = clients[GATE]
        released = misc.is_model_fsdp

        def main_gate(model):
            from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
            return any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in (model, *model.children()))

        misc.is_model_fsdp = main_gate
        fsdp_shim.patch()
        assert misc.is_model_fsdp is main_gate
        assert statuses()[GATE].startswith("not needed: ")
        misc.is_model_fsdp = released
    return rank()


def test_a_gate_that_knows_fsdp2_is_left_alone(dist_run):
    assert dist_run(2, rank_a_gate_that_knows_fsdp2_is_left_alone) == [0, 1]


def test_every_copy_of_the_gate_is_the_original_again_after_unpatch():
    """[Note: binders]: Composer's importers of ``is_model_fsdp`` imported *after* the patch copy the wrapper;
    ``unpatch()`` gives them the original back too (0.9.0 restored only the ones rebound at apply)."""
    binders = ("composer.utils", "composer.models.huggingface")
    with patch_state_restored():
        fsdp_shim.unpatch()
        for name in [n for n in sys.modules if n == "composer" or n.startswith("composer.")]:
            del sys.modules[name]
        if STAND_INS not in sys.path:
            sys.path.insert(0, STAND_INS)
        importlib.import_module(GATE)  # the gate first, its importers after the patch
        fsdp_shim.patch()
        modules = [importlib.import_module(name) for name in binders]
        gate = sys.modules[GATE].is_model_fsdp
        assert isinstance(gate, wrapt.FunctionWrapper)
        assert all(m.is_model_fsdp is gate for m in modules)
        fsdp_shim.unpatch()
        original = sys.modules[GATE].is_model_fsdp
        assert not isinstance(original, wrapt.FunctionWrapper)
        assert [m.is_model_fsdp is original for m in modules] == [True, True]
