"""``fsdp-shim bench``: the shim against FSDP2 ``unshard()``, FSDP1 and a ``full_tensor()`` loop.

All contenders run on the same architecture, interleaved within each
repetition (so machine noise hits them alike), and the report gives medians
of per-repetition ratios. Peak memory is measured in a second, fresh set of
ranks: the extra resident memory (CPU, ``/proc/self`` high-water mark, reset
before each contender) or extra allocated device memory (CUDA) above what was
live before the contender.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
import wrapt
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

import fsdp_shim
from fsdp_shim._gather.engine import all_gather_single
from fsdp_shim._gather.layout import bucket_cap
from fsdp_shim.tools.launch import rank_device, report_progress
from fsdp_shim.tools.models import LMConfig, build_lm, shard_lm, tokens_for, wrap_lm_fsdp1


@dataclass(frozen=True)
class BenchConfig:
    layers: int = 12
    width: int = 256
    vocab: int = 1000
    reps: int = 10
    warmup: int = 2
    device: str = "cpu"
    bucket_mb: tuple[float, ...] = ()  # extra shim contenders at these bucket sizes
    per_unit: bool = True  # the weight-sync loop contenders
    rank0_only: bool = False  # the full-model shim contenders with rank0_only
    fsdp1: bool = True
    between: bool = True  # summon between forward and backward (reshard_after_forward=False)
    stream: bool = True  # iter_full_params, full_tensor()+cast and the raw all-gather limit


# -- peak memory --------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _release_freed_memory(first: bool = False) -> None:
    """Hand freed heap memory back to the OS, so reusing it counts again.

    Otherwise a contender reuses memory an earlier one freed without raising
    the resident high-water mark. The first call also makes glibc mmap every
    large block: only for the memory pass, since it would distort timings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        if first:
            libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Extra memory a contender needed at its peak, in bytes."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            _release_freed_memory(first=True)

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            _release_freed_memory()
            try:
                with open("/proc/self/clear_refs", "w") as refs:
                    refs.write("5")  # reset the resident high-water mark
            except OSError:
                pass
            self._base = _rss_kib("VmRSS:") * 1024

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._base
        return max(0, _rss_kib("VmHWM:") * 1024 - self._base)


# -- contenders ---------------------------------------------------------------
def _contenders(
    cfg: BenchConfig, model: nn.Module, fsdp1_model: nn.Module | None, held: nn.Module | None,
    tokens: torch.Tensor,
) -> dict[str, Callable[[], None]]:
    units = [cast(FSDPModule, unit) for _, unit in fsdp_shim.fsdp_units(model)]

    def shim(writeback: bool, bucket_mb: float | None = None, rank0_only: bool = False) -> Callable[[], None]:
        def run() -> None:
            with fsdp_shim.summon_full_params(model, writeback=writeback, rank0_only=rank0_only, bucket_mb=bucket_mb):
                pass
        return run

    def per_parameter() -> None:
        fulls = [cast(DTensor, p).full_tensor() for p in model.parameters()]
        del fulls

    def unshard() -> None:
        for unit in units:
            unit.unshard()
        for unit in units:
            unit.reshard()

    def fsdp1() -> None:
        with FSDP.summon_full_params(cast(nn.Module, fsdp1_model), writeback=False):
            pass

    def per_unit(loop_units: list[nn.Module], rank0_only: bool) -> Callable[[], None]:
        def run() -> None:  # the RL weight sync: one recurse=False summon per unit
            for unit in loop_units:
                with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=rank0_only):
                    pass
        return run

    def per_unit_unshard() -> None:
        for unit in units:
            unit.unshard()
            unit.reshard()

    def stream(dtype: torch.dtype | None) -> Callable[[], None]:
        def run() -> None:
            for _name, full in fsdp_shim.iter_full_params(model, dtype=dtype):
                del full
        return run

    def full_tensor_then_cast() -> None:  # what verl, TRL, NeMo-RL and SkyRL do
        for p in model.parameters():
            full = cast(DTensor, p).full_tensor().to(torch.bfloat16)
            del full


    contenders: dict[str, Callable[[], None]] = {
        "shim": shim(False),
        "shim_writeback": shim(True),
        "unshard": unshard,
        "full_tensor_loop": per_parameter,
    }
    if fsdp1_model is not None:
        contenders["fsdp1"] = fsdp1
    if cfg.rank0_only:
        contenders["shim_rank0_only"] = shim(False, rank0_only=True)
    for mb in cfg.bucket_mb:
        contenders[f"shim@{mb:g}MB"] = shim(False, bucket_mb=mb)
    if cfg.per_unit:
        module_units = [cast(nn.Module, unit) for unit in units]
        contenders["per_unit_shim"] = per_unit(module_units, rank0_only=True)
        contenders["per_unit_shim_all"] = per_unit(module_units, rank0_only=False)
        contenders["per_unit_unshard"] = per_unit_unshard
        if fsdp1_model is not None:
            fsdp1_units = [unit for _, unit in fsdp_shim.fsdp_units(fsdp1_model)]
            contenders["per_unit_fsdp1"] = per_unit(fsdp1_units, rank0_only=True)
            contenders["per_unit_fsdp1_all"] = per_unit(fsdp1_units, rank0_only=False)
    if cfg.stream:
        contenders["stream_fp32"] = stream(None)
        contenders["stream_bf16"] = stream(torch.bfloat16)
        contenders["full_tensor_bf16"] = full_tensor_then_cast
        contenders["raw_all_gather"] = _RawAllGather(model, bucket_cap().bucket_bytes).run
    if held is not None:
        def forward_backward(summon: bool) -> Callable[[], None]:
            def run() -> None:
                loss = held(tokens).float().pow(2).mean()
                if summon:  # FSDP1 keeps forward's storage; the shim copies it instead of gathering
                    with fsdp_shim.summon_full_params(held, writeback=False):
                        pass
                loss.backward()
                held.zero_grad(set_to_none=True)
            return run

        contenders["fwd_bwd"] = forward_backward(False)
        contenders["fwd_summon_bwd"] = forward_backward(True)
    return contenders


class _RawAllGather:
    """The physical limit: this rank's shard bytes, all-gathered in cap-sized buckets, one in flight.

    Buffers are allocated once, outside the timing; nothing is copied in or out.
    """

    def __init__(self, model: nn.Module, bucket_bytes: int):
        mesh = cast(DTensor, next(model.parameters())).device_mesh
        self.group = mesh.get_group(mesh.ndim - 1)
        world = dist.get_world_size(self.group)
        local_numel = sum(cast(DTensor, p)._local_tensor.numel() for p in model.parameters())
        per_bucket = max(1, bucket_bytes // (4 * world))  # fp32 elements one rank sends per bucket
        sizes = [per_bucket] * (local_numel // per_bucket) + [local_numel % per_bucket]
        device = cast(DTensor, next(model.parameters()))._local_tensor.device
        self.buffers = [(torch.ones(n, device=device), torch.empty(n * world, device=device)) for n in sizes if n]

    def run(self) -> None:
        pending = None
        for local, output in self.buffers:
            work = all_gather_single(output, local, group=self.group, async_op=True)
            if pending is not None:
                pending.wait()
            pending = work
        if pending is not None:
            pending.wait()


RATIOS = [
    ("shim / unshard", "shim", "unshard"),
    ("shim / fsdp1", "shim", "fsdp1"),
    ("shim / full_tensor_loop", "shim", "full_tensor_loop"),
    ("shim / raw all-gather", "shim", "raw_all_gather"),
    ("writeback / no writeback", "shim_writeback", "shim"),
    ("per-unit loop: shim / fsdp1", "per_unit_shim", "per_unit_fsdp1"),
    ("per-unit loop: shim / unshard", "per_unit_shim", "per_unit_unshard"),
    ("per-unit, all ranks: shim / fsdp1", "per_unit_shim_all", "per_unit_fsdp1_all"),
    ("per-unit, all ranks: shim / unshard", "per_unit_shim_all", "per_unit_unshard"),
    ("stream fp32 / per-unit shim", "stream_fp32", "per_unit_shim"),
    ("stream bf16 / per-unit shim", "stream_bf16", "per_unit_shim"),
    ("stream fp32 / raw all-gather", "stream_fp32", "raw_all_gather"),
    ("full_tensor+bf16 / stream bf16", "full_tensor_bf16", "stream_bf16"),
    # vLLM's ModuleSource.iter_full() is full_tensor_loop exactly (fp32 on the wire); vllm_weight_source's
    # iter_full() is the bf16 stream, renamed
    ("ModuleSource loop / stream bf16", "full_tensor_loop", "stream_bf16"),
    ("fwd+summon+bwd / fwd+bwd", "fwd_summon_bwd", "fwd_bwd"),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _setup(cfg: BenchConfig) -> tuple[torch.device, LMConfig, dict[str, Callable[[], None]]]:
    fsdp_shim.patch()
    device = rank_device(cfg.device)
    model_cfg = LMConfig(vocab=cfg.vocab, width=cfg.width, layers=cfg.layers, heads=4)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = shard_lm(build_lm(model_cfg).to(device), mesh)
    fsdp1_model = None
    if cfg.fsdp1:
        fsdp1_model = wrap_lm_fsdp1(build_lm(model_cfg).to(device), device)
    held = None
    if cfg.between:
        held = shard_lm(build_lm(model_cfg).to(device), mesh, reshard_after_forward=False)
    tokens = tokens_for(model_cfg).to(device)
    return device, model_cfg, _contenders(cfg, model, fsdp1_model, held, tokens)


def time_on_rank(cfg: BenchConfig) -> dict[str, object]:
    """The timing run: every contender once per repetition, in an order shuffled anew each repetition.

    The shuffle is seeded, so every rank draws the same order (contenders
    are collectives). A fixed order would give each contender the same
    predecessor every time, and with it the allocator state that one leaves.
    """
    device, model_cfg, contenders = _setup(cfg)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    faults: dict[str, list[int]] = {name: [] for name in contenders}
    shuffle = random.Random(0)
    for rep in range(cfg.warmup + cfg.reps):
        label = f"warm-up {rep + 1}/{cfg.warmup}" if rep < cfg.warmup else f"rep {rep - cfg.warmup + 1}/{cfg.reps}"
        report_progress(f"fsdp-shim bench: {label}")
        for name in shuffle.sample(list(contenders), len(contenders)):
            run = contenders[name]
            dist.barrier()
            _sync(device)
            faulted = _minor_faults()
            start = time.perf_counter()
            run()
            _sync(device)
            if rep >= cfg.warmup:
                times[name].append(time.perf_counter() - start)
                faults[name].append(_minor_faults() - faulted)
    pairs = [(label, num, den) for label, num, den in RATIOS if num in times and den in times]
    pairs += [(f"{name} / unshard", name, "unshard") for name in contenders if name.startswith("shim@")]
    per_rep_ratios = {label: [a / b for a, b in zip(times[num], times[den], strict=True)] for label, num, den in pairs}
    full_bytes = sum(p.numel() * p.element_size() for p in build_lm(model_cfg).parameters())
    return {
        "config": asdict(cfg),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "versions": {"torch": torch.__version__, "wrapt": getattr(wrapt, "__version__", "?"),
                     "fsdp_shim": fsdp_shim.__version__, "python": platform.python_version()},
        "torch": torch.__version__,
        "bucket_mb": bucket_cap().bucket_bytes / 2**20,  # the cap the plain "shim" contenders used
        "model_bytes": full_bytes,
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "iqr_ms": {name: _iqr(t) * 1e3 for name, t in times.items()},
        "samples_ms": {name: [x * 1e3 for x in t] for name, t in times.items()},
        "median_minor_faults": {name: statistics.median(f) for name, f in faults.items()},
        "ratios": {label: statistics.median(r) for label, r in per_rep_ratios.items()},
        "ratio_iqr": {label: _iqr(r) for label, r in per_rep_ratios.items()},
    }


def _minor_faults() -> int:
    """This process's minor page faults so far: fresh memory touched for the first time.

    A contender's time moves with them, by as much as twice, depending on
    what the allocator kept from earlier work (``docs/troubleshooting.md``
    has a case). Reported so a reader can tell.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _iqr(values: list[float]) -> float:
    """Interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[2] - quartiles[0]


def memory_on_rank(cfg: BenchConfig) -> dict[str, int]:
    """The memory run, in fresh processes (its allocator settings would skew timings).

    Each contender runs once to settle lazy buffers, then once measured.
    """
    device, _, contenders = _setup(cfg)
    memory = PeakMemory(device)
    peaks: dict[str, int] = {}
    for name, run in contenders.items():
        dist.barrier()
        run()
        dist.barrier()
        memory.start()
        run()
        peaks[name] = memory.stop()
    return peaks
