#!/usr/bin/env python3
"""Weight sync on torch's ``fake`` process group: host time, Python calls and peak memory a unit, any W.

    python scripts/fake_bench.py                          # bench and units96 at W = 8 64 1024 and HSDP 8x128
    python scripts/fake_bench.py --model llama70b         # 1 block + root, vocab 32064, W = 64 256 1024 8x8 8x32 8x128
    python scripts/fake_bench.py --check --world 8 2x4 64 2x32 --device cuda   # every multi-rank path, checked

One process joins a ``fake`` group of W ranks as rank 0 (``FakeStore``): the shim takes a W-rank job's all-gather
path, collectives move no data, and what is measured is host cost. Each configuration (a model; a world ``W``, or
``RxS``: HSDP) runs in a fresh process, ``--runs`` times. Models: ``bench`` (``fsdp-shim bench``'s, 13 units),
``units96`` (96 units of ``Linear(64, 64)`` + ``LayerNorm(64)``), ``llama70b`` (``tests/_models.py``;
refused where the estimated peak does not fit the memory available, unless ``--force``). Contenders: ``MODELS``.
Figures: median ms and calls a unit, the ratio to ``unshard`` (interleaved in a seeded shuffle), peak bytes beyond
the shards (glibc's ``mallinfo2()`` or CUDA's); the method: docs/host-cost.md, docs/performance.md ("Scale").

``--check`` takes the bench model through every path in ``PATHS`` once, checked (all-gathers posted, full
shapes, devices, not pinned, sharded after exit, rank 0's shard edited by ``writeback``), then times those that
passed; on CUDA, their peak allocated and reserved bytes and pinned host bytes. Exit 1 if anything failed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable

#: TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper needs a real store (and would time its own work): removed.
_BASE_ENV = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
_MALLOC_ENV = {"plain": {}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
               "heap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
                        "MALLOC_TOP_PAD_": str(64 << 20), "THP_MEM_ALLOC_ENABLE": "1"}}
_SMALL = {"contenders": ("summon_unit", "summon_unit_rank0", "unshard", "summon_model", "stream_fp32",
                         "stream_bf16", "full_tensor_loop"),
          "world": ["8", "64", "1024", "8x128"], "reps": 11, "malloc": "plain", "threads": None, "calls": "cprofile",
          "warmups": 2}
#: Each model's defaults (threads None: torch's own); contenders in the order the shuffle draws from.
MODELS = {"bench": _SMALL, "units96": _SMALL,
          "llama70b": {"contenders": ("summon_unit_rank0", "stream_fp32", "stream_bf16", "unshard", "full_tensor_loop",
                                      "module_source", "summon_model"),
                       "world": ["64", "256", "1024", "8x8", "8x32", "8x128"], "reps": 3, "malloc": "heap",
                       "threads": 1, "calls": "events", "warmups": 1}}
CONTENDERS = (*_SMALL["contenders"], "module_source")
#: --check's paths, in order; the CUDA-only ones are reported as skipped on the CPU.
PATHS = ("summon_unit r0 loop", "unshard loop", "iter_full_params(device=None)", "iter_full_params(device='cpu')",
         "iter_full_params(device='cpu', bucket_mb=0.25)", "iter_full_params(device='cuda')",
         "iter_full_params(device='cuda:<current>')", "summon(offload_to_cpu=True, rank0_only=False)",
         "summon(offload_to_cpu=True, rank0_only=True)", "summon(with_grads=True)", "summon(writeback=True) edit")
CUDA_ONLY = PATHS[5:7]
HIDDEN, FFN, KV, VOCAB, LAYERS, REDUCED_VOCAB = 8192, 28672, 1024, 128256, 80, 32064  # Llama-3-70B


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


class _Peaks:
    """Bytes in use, and the peak of each window (from one ``window(key)`` to the next). On the CPU a thread
    samples too, reading which window is open *before* the bytes: a reading counts for the window it began in."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self._cuda = torch.cuda if cuda else None
        if not cuda:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallinfo2.restype = _MallInfo2
            self._mallinfo2 = libc.mallinfo2
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def in_use(self) -> int:
        if self._cuda is not None:
            return self._cuda.memory_allocated()
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def _note(self, key: object, value: int) -> None:
        with self._lock:
            self.peaks[key] = max(self.peaks.get(key, 0), value)

    def probe(self) -> None:
        if self._cuda is None:  # max_memory_allocated sees every allocation
            key = self._open  # before the reading: see the class docstring
            self._note(key, self.in_use())

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.probe()

    def start(self) -> int:
        """Open no window, and return the bytes in use, the base of every peak."""
        gc.collect()
        if self._cuda is not None:
            self._cuda.synchronize()
            self._cuda.reset_peak_memory_stats()
        self._open, self.peaks = None, {}
        if self._cuda is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self.in_use()

    def window(self, key: object) -> None:
        """Close the open window (its peak includes now) and open ``key``'s."""
        if self._cuda is not None:
            self._cuda.synchronize()
            high = self._cuda.max_memory_allocated()
            self._cuda.reset_peak_memory_stats()
        else:
            high = self.in_use()
        self._note(self._open, high)
        self._open = key
        self._note(key, self.in_use())

    def stop(self) -> dict[object, int]:
        """Each window's peak, by key."""
        self.window(None)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return {key: peak for key, peak in self.peaks.items() if key is not None}


def _quantiles(values: list[float]) -> tuple[float, ...]:
    """(first quartile, median, third quartile); (min, median, max) under four values."""
    few = len(values) < 4
    return (min(values), statistics.median(values), max(values)) if few else tuple(statistics.quantiles(values, n=4))


def _interleaved(runs: dict[str, Callable], reps: int, sync: Callable, deadline: float) -> dict[str, list[float]]:
    """Seconds of each timed pass, in a seeded shuffle a repetition, each after an untimed pass; none past deadline."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    shuffle = random.Random(0)
    for rep in range(reps):
        if rep and time.perf_counter() > deadline:
            break
        for name in shuffle.sample(list(runs), len(runs)):
            runs[name](None)
            sync()
            start = time.perf_counter()
            runs[name](None)
            sync()
            samples[name].append(time.perf_counter() - start)
    return samples


def _calls(run: Callable, how: str) -> int:
    """Calls of one pass: cProfile's total, or ``sys.setprofile``'s 'call' and 'c_call' events."""
    if how == "cprofile":
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        run(None)
        profile.disable()
        return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    count = [0]

    def hook(frame: object, event: str, arg: object) -> None:
        count[0] += event == "call" or event == "c_call"

    sys.setprofile(hook)
    run(None)
    sys.setprofile(None)
    return count[0] - 1  # less the c_call of sys.setprofile(None) itself


def _build(config: dict, mesh, device: str) -> tuple:
    """The model on ``device``, ``fully_shard``ed unit by unit, then at the root; and its units, blocks first."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_shim.tools.models import LMConfig, build_lm, shard_lm

    if config["model"] == "bench":
        model = build_lm(LMConfig(vocab=1000, width=256, layers=12, heads=4)).to(device)
        if config["check"]:  # shard_lm's policy: exact gradients, for with_grads
            return shard_lm(model, mesh), [*model.blocks, model]
        blocks = list(model.blocks)
    elif config["model"] == "units96":
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(96)]).to(device)
        blocks = list(model)
    else:  # a benchmark's model, not shipped: with the tests' helpers, as stress.py takes its faults
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from _models import llama_shapes
        model = llama_shapes(layers=config["layers"], **config["shapes"])
        blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, [*blocks, model]


def _one(config: dict) -> list[dict]:
    """Run in a fresh process: one model on one mesh, every contender (or every path); its rows."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_shim

    started = time.perf_counter()
    deadline = started + config["time_limit"] if config["time_limit"] else float("inf")
    if config["threads"]:
        torch.set_num_threads(config["threads"])
    device, world = config["device"], config["world"]
    dims = tuple(int(d) for d in world.split("x"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(dims))
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(device, dims, mesh_dim_names=("replicate", "shard") if len(dims) == 2 else None)
    memory = _Peaks(device == "cuda")
    before = memory.in_use()
    model, units = _build(config, mesh, device)
    if config["model"] == "llama70b":
        model.to_empty(device=device)  # the shards, uninitialised: no value is ever read
    shard_bytes = memory.in_use() - before
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if config["check"]:
        return _check(config, model, units, sync, deadline)

    owner = {id(p): i for i, unit in enumerate(units[:-1]) for p in unit.parameters()}
    params = list(model.named_parameters())
    unit_of = {name: owner.get(id(p), len(units) - 1) for name, p in params}
    unit_bytes = [0] * len(units)
    for name, p in params:
        unit_bytes[unit_of[name]] += p.numel() * p.element_size()  # the full (global) shape

    def summon(windows: list[tuple[object, torch.nn.Module]], **kwargs: bool) -> Callable:
        def run(m: _Peaks | None) -> None:
            for key, unit in windows:
                if m is not None:
                    m.window(key)
                with FSDP.summon_full_params(unit, writeback=False, **kwargs):
                    if m is not None:
                        m.probe()
        return run

    def unshard(m: _Peaks | None) -> None:
        for index, unit in enumerate(units):
            if m is not None:
                m.window(index)
            unit.unshard()
            if m is not None:
                m.probe()
            unit.reshard()

    def each_tensor(pairs: Callable[[], Iterable], gather: bool, dtype: torch.dtype | None = None) -> Callable:
        """One full tensor at a time (a stream's, or ``full_tensor()``), cast to ``dtype`` if given; a window a unit."""
        def run(m: _Peaks | None) -> None:
            last = None
            for name, x in pairs():
                if m is not None and unit_of[name] != last:
                    last = unit_of[name]
                    m.window(last)
                tensor = x.full_tensor() if gather else x
                if dtype is not None:
                    tensor = tensor.to(dtype)
                if m is not None:
                    m.probe()
                del tensor, x
        return run

    each = list(enumerate(units))
    runs = {"summon_unit": summon(each, recurse=False, rank0_only=False), "summon_model": summon([("model", model)]),
            "summon_unit_rank0": summon(each, recurse=False, rank0_only=True), "unshard": unshard,
            "stream_fp32": each_tensor(lambda: fsdp_shim.iter_full_params(model), False),
            "stream_bf16": each_tensor(lambda: fsdp_shim.iter_full_params(model, dtype=torch.bfloat16), False),
            "full_tensor_loop": each_tensor(lambda: params, True),
            "module_source": each_tensor(lambda: params, True, torch.bfloat16)}
    runs = {name: runs[name] for name in config["contenders"]}
    timed = {n: run for n, run in runs.items() if not (n == "summon_model" and config["model"] == "llama70b")}
    for _ in range(config["warmups"]):  # lazy init, caches, the allocator's high-water mark
        for run in runs.values():
            run(None)
            sync()
    peaks: dict[str, dict] = {}
    for name, run in runs.items():  # bytes in use do not depend on the pass before: no untimed pass
        base = memory.start()
        run(memory)
        sync()
        windows = memory.stop()
        peaks[name] = {"per_unit": [windows.get(i, base) - base for i in range(len(units))],
                       "whole": max(windows.values(), default=base) - base}
    calls = {name: _calls(run, config["calls"]) / len(units) for name, run in timed.items()}
    samples = _interleaved(timed, config["reps"], sync, deadline)
    ratios = {name: [s / u for s, u in zip(samples[name], samples["unshard"], strict=True)] for name in timed}
    return [{"model": config["model"], "world": world, "device": device, "torch": torch.__version__,
             "shim": fsdp_shim.__version__, "units": len(units), "reps": len(samples["unshard"]),
             "shapes": config.get("shapes"), "threads": torch.get_num_threads(), "unit_bytes": unit_bytes,
             "shard_bytes": shard_bytes, "calls_per_unit": calls, "peaks": peaks,
             "median_ms_per_unit": {n: statistics.median(s) * 1e3 / len(units) for n, s in samples.items()},
             "ratio_to_unshard": {n: _quantiles(r) for n, r in ratios.items()},
             "wire_bytes": {"stream_bf16": sum(2 * p.numel() for _, p in params),
                            "module_source": sum(p.numel() * p.element_size() for _, p in params)},
             "seconds": time.perf_counter() - started}]


def _check(config: dict, model, units: list, sync: Callable, deadline: float) -> list[dict]:
    """``--check``'s rows, one a path: each checked once (all-gathers counted; on CUDA its memory), then timed."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    import fsdp_shim
    from fsdp_shim._gather.engine import _ALL_GATHER
    from fsdp_shim.tools.models import LMConfig, tokens_for

    cuda, cpu = config["device"] == "cuda", torch.device("cpu")
    here = torch.device("cuda", torch.cuda.current_device()) if cuda else cpu
    assert fsdp_shim.is_patched(), "the shim did not patch FSDP.summon_full_params"
    full = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters(remove_duplicate=False)}
    objects = [id(p) for p in model.parameters()]

    def check_full(name: str, t: torch.Tensor | None, want: torch.device, where: str) -> None:
        assert t is not None and not isinstance(t, DTensor), f"{where}: {name} is {type(t).__name__} on rank 0"
        assert tuple(t.shape) == full[name], f"{where}: {name} has shape {tuple(t.shape)}"
        assert t.device == want, f"{where}: {name} is on {t.device}, asked {want}"
        assert not (cuda and want == cpu and t.is_pinned()), f"{where}: {name} is pinned host memory"

    def still_sharded(where: str) -> None:
        for n, p in model.named_parameters(remove_duplicate=False):
            assert isinstance(p, DTensor) and tuple(p.shape) == full[n] and tuple(p.to_local().shape) == local[n] \
                and p.to_local().device == here, f"{where}: {n} is not the same shard after exit"
        assert [id(p) for p in model.parameters()] == objects, f"{where}: parameter objects changed"

    def summon(want: torch.device, **kwargs: bool) -> Callable:
        where = "summon(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"
        edit = kwargs.pop("writeback", False)

        def run(check: bool | None) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FSDP1's warning for offload without rank0_only
                with fsdp_shim.summon_full_params(model, writeback=edit, **kwargs):
                    for n, p in model.named_parameters(remove_duplicate=False) if check else ():
                        check_full(n, p, want, where)
                        if kwargs.get("with_grads"):
                            check_full(n, p.grad, want, f"{where} grad")
                    if edit:
                        with torch.no_grad():
                            model.lm_head.weight.fill_(0.5)  # tied: the embedding too
                            model.blocks[0].fc1.bias.fill_(-1.0)
            if check:
                still_sharded(where)
                for n, p in model.named_parameters() if kwargs.get("with_grads") else ():
                    assert isinstance(p.grad, DTensor) and tuple(p.grad.to_local().shape) == local[n], \
                        f"{where}: {n}'s sharded gradient did not come back"
                shards = dict(model.named_parameters(remove_duplicate=False))
                for n, value in (("lm_head.weight", 0.5), ("embed.weight", 0.5), ("blocks.0.fc1.bias", -1.0)):
                    # rank 0's slice is copied into rank 0's own shard locally: these values are real
                    assert not edit or bool((shards[n].to_local() == value).all()), f"{where}: {n} lost the edit"
        return run

    def unit_loop(check: bool | None) -> None:
        seen = 0
        for fqn, unit in fsdp_shim.fsdp_units(model):
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                for n, p in unit.named_parameters() if check else ():
                    if not isinstance(p, DTensor):  # nested units stay sharded
                        check_full(f"{fqn}.{n}" if fqn else n, p, here, "summon_unit")
                        seen += 1
        assert not check or seen == len(objects), f"summon_unit: {seen} full parameters, the model has {len(objects)}"

    def unshard_loop(check: bool | None) -> None:
        for unit in units:
            unit.unshard()
            unit.reshard()

    def stream(device: str | None, want: torch.device, bucket_mb: float | None = None) -> Callable:
        def run(check: bool | None) -> None:
            count = 0
            for n, t in fsdp_shim.iter_full_params(model, rank0_only=False, device=device, bucket_mb=bucket_mb):
                if check:
                    check_full(n, t, want, f"iter_full_params(device={device!r})")
                count += 1
            assert not check or count == len(objects), f"iter_full_params: {count} tensors of {len(objects)}"
        return run

    paths: dict[str, Callable] = dict(zip(PATHS[:5] + PATHS[7:], (
        unit_loop, unshard_loop, stream(None, here), stream("cpu", cpu), stream("cpu", cpu, 0.25),
        summon(cpu, offload_to_cpu=True, rank0_only=False), summon(cpu, offload_to_cpu=True, rank0_only=True),
        summon(here, with_grads=True), summon(here, writeback=True)), strict=True))
    if cuda:
        paths.update(zip(CUDA_ONLY, (stream("cuda", here), stream(f"cuda:{here.index}", here)), strict=True))
    gathers, real_gather = [0], getattr(dist, _ALL_GATHER)  # the name the engine posts by
    launch = vars(dist.ProcessGroup)["allgather_into_tensor_coalesced"]  # a launch of several: put back as is

    def counting_gather(*args, **kwargs):  # (output, input), or a launch's (group, outputs, inputs)
        several = len(args) > 2 and isinstance(args[1], list)  # FSDP2 passes keywords
        gathers[0] += len(args[1]) if several else 1
        return (launch.__func__ if several else real_gather)(*args, **kwargs)

    base = {"world": math.prod(int(d) for d in config["world"].split("x")), "mesh": config["world"],
            "device": config["device"], "units": len(units)}
    rows = {path: {**base, "path": path, "status": "skipped", "detail": "CUDA only"} for path in PATHS}
    for path, run in ((p, paths[p]) for p in PATHS if p in paths):
        print(f"[{config['world']}] {path}", file=sys.stderr, flush=True)
        try:
            if path == PATHS[9]:  # gradients to gather first
                how = _make_grads(model, tokens_for(LMConfig(vocab=1000, width=256, layers=12, heads=4)).to(here),
                                  hsdp="x" in config["world"])
            setattr(dist, _ALL_GATHER, counting_gather)
            dist.ProcessGroup.allgather_into_tensor_coalesced = counting_gather
            gathers[0] = 0
            try:
                run(True)
                sync()
            finally:
                setattr(dist, _ALL_GATHER, real_gather)
                dist.ProcessGroup.allgather_into_tensor_coalesced = launch
            if path != PATHS[1] and gathers[0] == 0:
                raise AssertionError(f"{path}: no all-gather was posted (the group-of-one path?)")
            rows[path].update(status="ok", all_gathers=gathers[0], detail=f"{gathers[0]} all-gathers"
                              + (f"; gradients {how}" if path == PATHS[9] else ""))
            if cuda:
                rows[path].update(_cuda_memory(lambda run=run: run(None)))
        except Exception as error:  # noqa: BLE001  (report, go on with the other paths)
            rows[path].update(status="FAILED", detail=f"{type(error).__name__}: {error}"[:300])
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        if path == PATHS[9]:
            model.zero_grad(set_to_none=True)
    timed = {p: paths[p] for p in paths if rows[p]["status"] == "ok"}
    for run in timed.values():  # warm-up
        run(None)
    samples = _interleaved(timed, config["reps"], sync, deadline)
    for path, seconds in samples.items():
        per = len(units) if path.endswith("loop") else 1
        rows[path].update(ms=statistics.median(seconds) * 1e3 / per, per="unit" if per > 1 else "call",
                          reps=len(seconds))
        if len(seconds) < config["reps"]:
            rows[path]["detail"] += f"; {len(seconds)} of {config['reps']} reps (time limit)"
    if PATHS[0] in samples and PATHS[1] in samples:
        rows[PATHS[0]]["ratio_to_unshard"] = statistics.median(
            s / u for s, u in zip(samples[PATHS[0]], samples[PATHS[1]], strict=True))
    return list(rows.values())


def _make_grads(model, tokens, hsdp: bool) -> str:
    """Gradients from a backward, or (torch 2.7's HSDP backward asserts on the CPU) clones of the shards; says which."""
    import inspect

    import torch

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        broken = "assert all_reduce_event is not None" in inspect.getsource(FSDPParamGroup.post_backward)
    except Exception:  # noqa: BLE001  (a torch without that file or source: assume fixed)
        broken = False
    if hsdp and broken and tokens.device.type == "cpu":
        with torch.no_grad():
            for p in model.parameters():
                p.grad = p.detach().clone()
        return f"assigned, not from backward: torch {torch.__version__}'s HSDP backward asserts on the CPU"
    model(tokens).float().sum().backward()
    return "from a forward and backward"


def _cuda_memory(run: Callable[[], None]) -> dict[str, int | None]:
    """``run``'s peak device bytes allocated and reserved (a fresh cache), and pinned host bytes where counted."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
    host = stats()
    run()
    torch.cuda.synchronize()
    got: dict[str, int | None] = {"peak_allocated": torch.cuda.max_memory_allocated() - allocated,
                                  "peak_reserved": torch.cuda.max_memory_reserved() - reserved}
    gc.collect()
    after = stats()
    for key, now, then in (("pinned_peak", "allocated_bytes.peak", "allocated_bytes.current"),
                           ("pinned_held", "allocated_bytes.current", "allocated_bytes.current"),
                           ("pinned_active", "active_bytes.current", "active_bytes.current")):
        got[key] = after[now] - host[then] if now in after and then in host else None
    return got


def _size(n: float | None, full: int = 0, what: str = "") -> str:
    """Bytes, and as a multiple of ``full`` where given (a unit with no parameters of its own: bytes only)."""
    if n is None:
        return ""
    text = f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.2f} MB"
    return f"{text} (x{n / full:.2f}{what})" if full else text


def _print_runs(runs: list[dict]) -> None:
    """One configuration's table: a row a contender, the first run's IQR and each run's median ratio."""
    row, unit_bytes = runs[0], runs[0]["unit_bytes"]
    block, root = unit_bytes[0], unit_bytes[-1]
    shapes = "".join(f", {k} {v}" for k, v in (row["shapes"] or {}).items())
    print(f"\n#### {row['model']}, W = {row['world']}: {row['units']} units (block {_size(block)}, root {_size(root)}"
          f"{shapes}; shards {_size(row['shard_bytes'])} on this rank), {row['device']}, torch {row['torch']}, "
          f"fsdp_shim {row['shim']}, {row['threads']} thread(s), {len(runs)} run(s) of {row['reps']} repetitions, "
          f"{sum(r['seconds'] for r in runs):.0f} s\n")
    print("| contender | ms/unit | / unshard | IQR (run 1) | each run | calls/unit | calls / unshard's "
          "| block peak (x block) | root peak (x root) | whole-sync peak (x largest unit) |\n" + "|---" * 10 + "|")
    for name, peak in row["peaks"].items():
        cells = [name, "(peak only)", "", "", "", "", ""]
        if name in row["median_ms_per_unit"]:
            medians = [r["ratio_to_unshard"][name][1] for r in runs]
            q1, _, q3 = row["ratio_to_unshard"][name]
            calls = row["calls_per_unit"][name]
            cells[1:] = [f"{statistics.median(r['median_ms_per_unit'][name] for r in runs):.3f}",
                         f"{statistics.median(medians):.2f}", f"{q1:.2f}-{q3:.2f}",
                         " ".join(f"{m:.2f}" for m in medians) if len(runs) > 1 else "", f"{calls:.0f}",
                         f"{calls / row['calls_per_unit']['unshard']:.2f}"]
        if name == "summon_model":
            cells += ["", "", _size(peak["whole"], sum(unit_bytes), " of the whole model")]
        else:
            cells += [_size(max(peak["per_unit"][:-1], default=None), block), _size(peak["per_unit"][-1], root),
                      _size(peak["whole"], max(unit_bytes))]
        print("| " + " | ".join(cells) + " |")
    wire = row["wire_bytes"]
    if {"stream_bf16", "module_source"} <= set(row["peaks"]):
        print(f"\nAll-gathered per bf16 sync: stream_bf16 {_size(wire['stream_bf16'])} (cast before the gather), "
              f"module_source {_size(wire['module_source'])} (gathered as stored, then cast): "
              f"x{wire['module_source'] / wire['stream_bf16']:.2f}.")


def _print_checks(rows: list[dict]) -> None:
    """``--check``'s rows: world size, mesh, path, status, host time, ratio, memory (CUDA), detail."""
    def mib(n: int | None) -> str:
        return "n/a" if n is None else f"{n / 2**20:+.1f}M" if abs(n) >= 2**16 else f"{n:+d}B"

    print(f"  {'W':>5} {'mesh':>7}  {'path':<47} {'status':<7} {'host ms':>13} {'/unshard':>8} "
          f"{'peak alloc':>10} {'peak resv':>9} {'pinned pk':>9} {'held':>7} {'active':>7}  detail")
    for row in rows:
        ms = f"{row['ms']:.3f}/{row['per']}" if "ms" in row else "-"
        ratio = f"{row['ratio_to_unshard']:.2f}" if "ratio_to_unshard" in row else "-"
        mem = [mib(row.get(k)) if row["status"] == "ok" else "-" for k in
               ("peak_allocated", "peak_reserved", "pinned_peak", "pinned_held", "pinned_active")]
        print(f"  {row['world']:>5} {row['mesh']:>7}  {row['path']:<47} {row['status']:<7} {ms:>13} {ratio:>8} "
              f"{mem[0]:>10} {mem[1]:>9} {mem[2]:>9} {mem[3]:>7} {mem[4]:>7}  {row.get('detail', '')}", flush=True)


def _llama(args: argparse.Namespace, config: dict, malloc: str) -> None:
    """Set llama70b's shapes and layers in ``config``; refuse (exit 2) where its estimated peak does not fit the
    memory available. (Its peaks at the full vocabulary are measured with ``--vocab 128256``, never scaled.)"""
    divisor = args.structure_divisor
    for name, size in (("hidden", HIDDEN), ("ffn", FFN), ("kv", KV), ("vocab", VOCAB)):
        if size % divisor:
            raise SystemExit(f"--structure-divisor {divisor} does not divide the {name} size {size}")
    h, f, kv = HIDDEN // divisor, FFN // divisor, KV // divisor
    v = args.vocab or (VOCAB // divisor if divisor > 1 else REDUCED_VOCAB)
    config.update(shapes={"hidden": h, "ffn": f, "kv": kv, "vocab": v}, layers=args.layers or (LAYERS, 1)[divisor == 1])
    block, root = (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) * 4, (2 * v * h + h) * 4
    # unshard holds a unit twice (all-gather output + parameters); summon_model the whole model
    need = max(2 * max(block, root), config["layers"] * block + root if "summon_model" in config["contenders"] else 0)
    need = int(need * (1.25 if malloc == "heap" else 1.05)) + (1 << 30)  # heap: room for fragmentation
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = None
    if args.device == "cpu" and available is not None and need > available and not args.force:
        print(f"llama70b needs about {_size(need)} (a unit held twice, or the whole model, and headroom), "
              f"{_size(available)} available: a smaller --vocab or --layers, --malloc plain, or --force",
              file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), help="(default: bench units96)")
    parser.add_argument("--world", nargs="+", help="W, or RxS for HSDP (default: the model's, in MODELS)")
    parser.add_argument("--reps", type=int, help="timed repetitions (default 11; llama70b 3, 11 with -D)")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per configuration")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="(default: the model's)")
    parser.add_argument("--calls", choices=["cprofile", "events"], help="how calls are counted (default: the model's)")
    parser.add_argument("--malloc", choices=sorted(_MALLOC_ENV), help="glibc's setting on the CPU: heap keeps freed "
                        "memory (as CUDA's allocator), thp gives it back, plain (default: the model's)")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: the model's)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--check", action="store_true", help="every multi-rank path of the bench model, checked")
    parser.add_argument("--timeout", type=float, help="seconds a process; no new repetition after 70%% of them")
    llama = parser.add_argument_group("llama70b")
    llama.add_argument("--layers", type=int, help="decoder layers (default 1; 80 with --structure-divisor)")
    llama.add_argument("--vocab", type=int, help=f"(default {REDUCED_VOCAB}, or {VOCAB} / D with -D)")
    llama.add_argument("--structure-divisor", "-D", type=int, default=1, help="divide every width and the vocabulary")
    llama.add_argument("--quick", action="store_true", help="a smoke check: -D 64 --layers 4 --world 8 8x4 --reps 2")
    llama.add_argument("--force", action="store_true", help="run even where the memory estimate does not fit")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(json.loads(args.one))))
        return 0
    models = args.model or (["bench"] if args.check else ["bench", "units96"])
    if args.check and models != ["bench"]:
        parser.error("--check runs the bench model")
    if args.quick:
        args.structure_divisor = max(args.structure_divisor, 64)
        args.layers, args.world, args.reps = args.layers or 4, args.world or ["8", "8x4"], args.reps or 2
    tree = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe", "--always", "--dirty"],
                          capture_output=True, text=True, check=False).stdout.strip()
    print(f"fake_bench: fsdp_shim tree {tree or 'unknown'}, {args.device}; values are not meaningful across ranks "
          "(fake collectives move no data): paths, shapes, devices, calls, memory and host time are", flush=True)
    if args.check:
        print("cuda:gloo 2-process run (real values across 2 ranks on one GPU): skipped, scripts/device_late.py "
              "runs it", flush=True)
    rows: list[dict] = []
    failed = 0
    for model in models:
        spec, malloc = MODELS[model], args.malloc or MODELS[model]["malloc"]
        config = {"model": model, "device": args.device, "check": args.check, "calls": args.calls or spec["calls"],
                  "reps": args.reps or (11 if args.structure_divisor > 1 else spec["reps"]),
                  "contenders": list(args.contenders or spec["contenders"]), "warmups": spec["warmups"],
                  "threads": args.threads or spec["threads"], "time_limit": 0.7 * args.timeout if args.timeout else 0}
        if "unshard" not in config["contenders"]:
            config["contenders"].append("unshard")  # the yardstick of every ratio
        if model == "llama70b":
            _llama(args, config, malloc)
        env = {**_BASE_ENV, **(_MALLOC_ENV[malloc] if args.device == "cpu" else {})}
        for world in args.world or (["8", "8x4"] if args.check else spec["world"]):
            runs: list[dict] = []
            for _ in range(args.runs):
                command = [sys.executable, os.path.abspath(__file__), "--one", json.dumps({**config, "world": world})]
                try:
                    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
                    failure = None if proc.returncode == 0 else f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
                except subprocess.TimeoutExpired as expired:
                    failure = f"timed out after {args.timeout:g} s\n{str(expired.stderr or '')[-3000:]}"
                if failure is not None:
                    print(f"\n{model} W={world} ({args.device}): FAILED, {failure}", flush=True)
                    rows.append({"world": world, "mesh": world, "path": "(process)", "status": "FAILED",
                                 "detail": failure.splitlines()[0]})
                    failed += 1
                    break
                runs.extend(json.loads(proc.stdout.strip().splitlines()[-1]))
            rows.extend(runs)
            if runs and args.check:
                _print_checks(runs)
                failed += sum(row["status"] == "FAILED" for row in runs)
            elif runs:
                _print_runs(runs)
    if args.check:
        bad = [r for r in rows if r["status"] == "FAILED"]
        print(f"\nfake_bench --check: {len(bad)} failed of {sum(r['status'] != 'skipped' for r in rows)} checks"
              + "".join(f"\n  FAILED W={r['world']} mesh={r['mesh']} {r['path']}: {r['detail']}" for r in bad))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
