"""``fsdp-shim check``: the call-site patterns of RL stacks, verified on this machine.

Each scenario runs on every rank through the *patched*
``FullyShardedDataParallel.summon_full_params`` on a small transformer
(tied embeddings, ``MixedPrecisionPolicy(param_dtype=bf16)``) and compares
against an unsharded reference built from the same seed.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

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
    skipped: bool = False  # not run here (``detail`` says why): neither a pass nor a failure


class Skipped(Exception):
    """Raised by a scenario this world cannot run (e.g. HSDP on fewer than 4 ranks); the message says why."""


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


def _sharded_as_before(model: torch.nn.Module, before: list[tuple[str, torch.nn.Parameter]]) -> bool:
    """The same parameter objects under the same names, every one a DTensor shard."""
    after = list(model.named_parameters())
    return [n for n, _ in after] == [n for n, _ in before] and all(
        a is b and isinstance(a, DTensor) for (_, a), (_, b) in zip(after, before, strict=True))


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
        _require(all(a is b for a, b in zip(before, (p for _, p in model.named_parameters()), strict=True)),
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
                for (_, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
                    torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            bad, tolerance_note = [], "within 1e-5 (non power-of-two world size)"
        _require(not bad, f"differs after 3 SGD steps: {bad[:3]}")
        return f"3 SGD steps after summons match the reference, {tolerance_note}"

    def stream(self) -> str:
        reference, model = self.models()
        before = list(model.named_parameters())
        want = {n: p.detach() for n, p in reference.named_parameters()}
        rank0 = dist.get_rank() == 0
        runs: list[tuple[str, dict, torch.dtype | None, torch.device]] = [
            ("rank0_only", {}, None, self.device),
            ("bf16 on every rank", dict(rank0_only=False, dtype=torch.bfloat16), torch.bfloat16, self.device),
        ]
        if self.device.type != "cpu":
            runs.append(("device='cpu'", dict(rank0_only=False, device="cpu"), None, torch.device("cpu")))
        problems: list[str] = []  # raised after every stream ended: all ranks run the same collectives
        for label, kwargs, dtype, device in runs:
            seen: list[str] = []
            for name, tensor in fsdp_shim.iter_full_params(model, **kwargs):
                seen.append(name)
                if name not in want:
                    problems.append(f"{label}: unknown name {name}")
                elif kwargs.get("rank0_only", True) and not rank0:
                    if tensor is not None:
                        problems.append(f"{label}: rank {dist.get_rank()} got a tensor for {name}")
                else:
                    expected = want[name].to(dtype) if dtype is not None else want[name]
                    if tensor is None or isinstance(tensor, DTensor):
                        problems.append(f"{label}: {name} not a full tensor")
                    elif tensor.device != device:
                        problems.append(f"{label}: {name} on {tensor.device}, not {device}")
                    elif tensor.dtype != expected.dtype or not torch.equal(tensor.cpu(), expected.cpu()):
                        problems.append(f"{label}: {name} differs from the reference")
            if sorted(seen) != sorted(want):
                problems.append(f"{label}: names differ or repeat: {sorted(set(seen) ^ set(want))}")
        _require(not problems, f"{len(problems)} problems: {problems[:3]}")
        _require(_sharded_as_before(model, before), "the stream changed the model")
        return f"{len(want)} tensors exact: {', '.join(label for label, *_ in runs)}"

    def offload_to_cpu(self) -> str:
        reference, model = self.models()
        before = list(model.named_parameters())
        rank0 = dist.get_rank() == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with FSDP.summon_full_params(model, rank0_only=True, offload_to_cpu=True, writeback=False):
                if rank0:
                    bad = _mismatches(model, reference.cpu())
                    _require(not bad, f"rank 0: differs from reference: {bad[:3]}")
                    _require(all(p.device.type == "cpu" for p in model.parameters()), "rank 0: not on CPU")
                    _require(model.lm_head.weight is model.embed.weight, "tie broken inside")
                else:
                    _require(_sharded_as_before(model, before), f"rank {dist.get_rank()}: shards not kept")
        offload_warnings = [str(w.message) for w in caught if "offload" in str(w.message)]
        _require(not offload_warnings, f"warned with rank0_only=True: {offload_warnings[:1]}")
        _require(_sharded_as_before(model, before), "not sharded as before after exit")
        return f"rank 0: {len(before)} full params on CPU, exact; other ranks kept their shards"

    def hsdp(self) -> str:
        world = dist.get_world_size()
        if world < 4 or world % 2:
            raise Skipped(f"needs an even world size of 4 or more (--ranks 4); this run has {world}")
        mesh = init_device_mesh(self.device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        reference = build_lm(self.config).to(self.device)
        model = shard_lm(build_lm(self.config).to(self.device), mesh, mp_policy=self.mp)
        before = list(model.named_parameters())
        weight = model.get_parameter("blocks.0.fc1.weight")
        placements = tuple(weight.placements) if isinstance(weight, DTensor) else None
        _require(placements == (Replicate(), Shard(0)), f"not HSDP placements: {placements}")
        with FSDP.summon_full_params(model, writeback=False, recurse=True):
            bad = _mismatches(model, reference)
            _require(not bad, f"differs from reference: {bad[:3]}")
            _require(model.lm_head.weight is model.embed.weight, "tie broken inside")
        _require(_sharded_as_before(model, before), "not sharded as before after exit")
        return f"{len(before)} params exact on a (2, {world // 2}) replicate x shard mesh"

    def with_grads(self) -> str:
        reference, model = self.models(mixed=False)
        before = list(model.named_parameters())
        for m in (model, reference):
            m(self.tokens).float().pow(2).mean().backward()
        want = dict(reference.named_parameters())
        inexact = []
        with FSDP.summon_full_params(model, with_grads=True, writeback=False):
            for name, param in model.named_parameters():
                grad, ref_grad = param.grad, want[name].grad
                if grad is None or isinstance(grad, DTensor):
                    raise AssertionError(f"{name}: no full gradient")
                if ref_grad is None:
                    raise AssertionError(f"{name}: the reference has no gradient")
                _require(grad.shape == ref_grad.shape and grad.dtype == ref_grad.dtype, f"{name}: shape or dtype")
                if not torch.equal(grad, ref_grad):
                    # averaging W equal gradients may round (W not a power of two, or a ring's order)
                    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7, msg=f"{name}: gradient differs")
                    inexact.append(name)
        _require(_sharded_as_before(model, before), "not sharded as before after exit")
        _require(all(isinstance(p.grad, DTensor) for p in model.parameters()), "gradients not sharded after exit")
        note = "exact" if not inexact else (
            f"{len(before) - len(inexact)} exact, {len(inexact)} within 1e-5 (reduce order)")
        return f"{len(before)} full gradients after forward/backward match the reference: {note}"

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
            ("iter_full_params stream (rank0_only, bf16)", self.stream),
            ("offload_to_cpu=True, rank0_only=True", self.offload_to_cpu),
            ("HSDP on a 2-D mesh, recurse=True", self.hsdp),
            ("with_grads=True after forward/backward", self.with_grads),
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
            skipped = False
            try:
                detail, ok = scenario(), True
            except Skipped as exc:
                detail, ok, skipped = f"SKIPPED, not run: {exc}", True, True
            except Exception as exc:  # noqa: BLE001  (reported in the table)
                detail, ok = f"{type(exc).__name__}: {exc}", False
            ms = (time.perf_counter() - start) * 1e3
            outcomes.append(Outcome(name, ok, ms, detail, _runs(recorder.lines), skipped))
            verdict = "skipped" if skipped else "ok" if ok else "FAILED"
            report_progress(f"fsdp-shim check: {number}/{len(scenarios)} {name} {verdict} "
                            f"({ms:.0f} ms on rank 0)")
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(old_level)
    return outcomes
