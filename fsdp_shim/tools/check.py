"""``fsdp-shim check``: the call-site patterns of RL stacks, verified on this machine.

Each scenario runs on every rank through the *patched*
``FullyShardedDataParallel.summon_full_params`` on a small transformer
(tied embeddings, ``MixedPrecisionPolicy(param_dtype=bf16)``) and compares
against an unsharded reference built from the same seed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_shim
from fsdp_shim.tools.launch import rank_device, report_progress
from fsdp_shim.tools.models import LMConfig, TinyLM, build_lm, shard_lm, tokens_for


@dataclass
class Outcome:
    name: str
    ok: bool
    ms: float
    detail: str = ""
    paths: list[str] = field(default_factory=list)


class _PathRecorder(logging.Handler):
    """Collects fsdp_shim's debug lines: which route and gather path each call took."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _mismatches(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    bad = []
    got = dict(model.named_parameters())
    for name, want in reference.named_parameters():
        have = got.get(name)
        if have is None or isinstance(have, DTensor) or have.dtype != want.dtype or not torch.equal(have, want):
            bad.append(name)
    return bad


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class Scenarios:
    def __init__(self, device: torch.device):
        self.device = device
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        self.mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.config = LMConfig(vocab=211, width=64, layers=3)
        self.tokens = tokens_for(self.config).to(device)

    def models(self, mixed: bool = True) -> tuple[TinyLM, TinyLM]:
        reference = build_lm(self.config).to(self.device)
        model = shard_lm(build_lm(self.config).to(self.device), self.mesh, mp_policy=self.mp if mixed else None)
        return reference, model

    def full_gather(self) -> str:
        reference, model = self.models()
        before = [p for _, p in model.named_parameters()]
        with FSDP.summon_full_params(model, writeback=False):
            bad = _mismatches(model, reference)
            _require(not bad, f"differs from reference: {bad[:3]}")
            _require(model.lm_head.weight is model.embed.weight, "tie broken inside")
        _require(all(a is b for a, b in zip(before, (p for _, p in model.named_parameters()))),
                 "parameter objects replaced")
        return f"{len(before)} params exact, fp32 master weights under a bf16 policy"

    def generate(self) -> str:
        _, model = self.models()
        _, plain = self.models()
        model(self.tokens)  # leaves the root unsharded, as after any forward
        with FSDP.summon_full_params(model, writeback=False, recurse=False):
            got = model.generate(self.tokens, 6)
        want = plain.generate(self.tokens, 6)  # FSDP2's own numerics, no context
        _require(torch.equal(got, want), "tokens differ from FSDP2's generate()")
        reference, fp32 = self.models(mixed=False)
        with FSDP.summon_full_params(fp32, writeback=False, recurse=False):
            got = fp32.generate(self.tokens, 6)
        _require(torch.equal(got, reference.generate(self.tokens, 6)), "fp32 tokens differ from reference")
        return "greedy tokens identical (bf16 vs FSDP2, fp32 vs unsharded)"

    def generate_inference_mode(self) -> str:
        reference, model = self.models(mixed=False)
        with torch.inference_mode(), FSDP.summon_full_params(model, writeback=False):
            got = model.generate(self.tokens, 6)
        _require(torch.equal(got, reference.generate(self.tokens, 6)), "tokens differ from reference")
        loss = model(self.tokens).float().pow(2).mean()  # FSDP2 trains on after it
        loss.backward()
        return "greedy tokens identical to the unsharded model's; training after works"

    def weight_sync(self) -> str:
        reference, model = self.models()
        collected: dict[str, torch.Tensor] = {}
        for unit_name, unit in fsdp_shim.fsdp_units(model):
            with FSDP.summon_full_params(unit, writeback=False, rank0_only=True, recurse=False):
                if dist.get_rank() == 0:
                    for name, param in unit.named_parameters():
                        if not isinstance(param, DTensor):
                            fqn = f"{unit_name}.{name}" if unit_name else name
                            _require(fqn not in collected, f"{fqn} sent twice")
                            collected[fqn] = param.detach().to("cpu", copy=True)
        if dist.get_rank() == 0:
            want = {n: p.detach().cpu() for n, p in reference.named_parameters()}
            _require(collected.keys() == want.keys(), f"names differ: {set(collected) ^ set(want)}")
            _require(all(torch.equal(collected[n], want[n]) for n in want), "values differ")
        return f"{len(collected) if dist.get_rank() == 0 else 'n/a'} tensors on rank 0, each name once"

    def tied_head_edit(self) -> str:
        _, model = self.models()
        with FSDP.summon_full_params(model, writeback=True, recurse=False):
            mask = torch.full_like(model.lm_head.weight, -5.0)
            mask[:, 1::3] = 5.0
            with torch.no_grad():
                model.lm_head.weight.copy_(mask)
        with FSDP.summon_full_params(model, writeback=False):
            _require(torch.equal(model.lm_head.weight, mask), "head lost the mask")
            _require(torch.equal(model.embed.weight, mask), "tied embedding lost the mask")
        _require(isinstance(model.lm_head.weight, DTensor), "head not sharded after exit")
        return "mask persisted into both tied names"

    def training(self) -> str:
        reference, model = self.models(mixed=False)
        # SGD, not Adam: Adam turns the last-bit differences of averaging over a
        # world size that is not a power of two into sign flips of tiny updates.
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(3):
            with FSDP.summon_full_params(model, writeback=True):
                pass
            with FSDP.summon_full_params(model, writeback=False, recurse=False):
                model.generate(self.tokens, 2)
            for m, o in ((model, optim), (reference, ref_optim)):
                m(self.tokens).float().pow(2).mean().backward()
                o.step()
                o.zero_grad()
        with FSDP.summon_full_params(model, writeback=False):
            bad = _mismatches(model, reference)
        tolerance_note = "exact"
        if bad and dist.get_world_size() & (dist.get_world_size() - 1):
            # gradient averaging over a world size that is not a power of two rounds
            with FSDP.summon_full_params(model, writeback=False):
                for (_, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
                    torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            bad, tolerance_note = [], "within 1e-5 (non power-of-two world size)"
        _require(not bad, f"differs after 3 SGD steps: {bad[:3]}")
        return f"3 SGD steps after summons match the reference, {tolerance_note}"

    def misuse(self) -> str:
        _, model = self.models()
        for kwargs in (dict(writeback=True, rank0_only=True), dict(with_grads=True, offload_to_cpu=True)):
            try:
                with FSDP.summon_full_params(model, **kwargs):
                    pass
            except NotImplementedError:
                continue
            raise AssertionError(f"{kwargs} did not raise NotImplementedError")
        return "NotImplementedError, as FSDP1"

    def all(self) -> list[tuple[str, Callable[[], str]]]:
        return [
            ("full gather, recurse=True", self.full_gather),
            ("generate() under summon(root, recurse=False)", self.generate),
            ("generate() under torch.inference_mode()", self.generate_inference_mode),
            ("weight sync per unit, rank0_only", self.weight_sync),
            ("tied lm_head edit, writeback=True", self.tied_head_edit),
            ("training continues after summons", self.training),
            ("misuse raises FSDP1's errors", self.misuse),
        ]


def _runs(lines: list[str]) -> list[str]:
    """The lines in order, each run of identical lines once with its count."""
    out: list[str] = []
    count = 0
    for index, line in enumerate(lines):
        count += 1
        if index + 1 == len(lines) or lines[index + 1] != line:
            out.append(line if count == 1 else f"{line}  (x{count})")
            count = 0
    return out


def check_on_rank(device_type: str) -> list[Outcome]:
    """Run every scenario on this rank (a collective: all ranks call it)."""
    fsdp_shim.patch()
    device = rank_device(device_type)
    recorder = _PathRecorder()
    logger = logging.getLogger("fsdp_shim")
    logger.addHandler(recorder)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    outcomes = []
    try:
        scenarios = Scenarios(device).all()
        for number, (name, scenario) in enumerate(scenarios, 1):
            recorder.lines.clear()
            dist.barrier()
            start = time.perf_counter()
            try:
                detail, ok = scenario(), True
            except Exception as exc:  # noqa: BLE001  (reported in the table)
                detail, ok = f"{type(exc).__name__}: {exc}", False
            ms = (time.perf_counter() - start) * 1e3
            outcomes.append(Outcome(name, ok, ms, detail, _runs(recorder.lines)))
            report_progress(f"fsdp-shim check: {number}/{len(scenarios)} {name} {'ok' if ok else 'FAILED'} "
                            f"({ms:.0f} ms on rank 0)")
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(old_level)
    return outcomes
