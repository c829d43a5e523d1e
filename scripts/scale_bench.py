#!/usr/bin/env python3
"""Weight sync at Llama-3-70B's shapes: host time, calls and peak memory per unit, on torch's ``fake`` backend.

    python scripts/scale_bench.py                                  # 1 block, vocab 32064: W = 64 256 1024,
                                                                   #   HSDP 8 x 8, 8 x 32, 8 x 128
    python scripts/scale_bench.py --structure-divisor 64 --world 8 64 1024 --hsdp   # 80 blocks at 1/64 of every width
    python scripts/scale_bench.py --vocab 128256 --world 64 --hsdp --malloc thp --reps 2   # the root unit at full
                                                                   #   vocabulary: needs ~19 GB free
    python scripts/scale_bench.py --quick                          # a smoke check, seconds
    python scripts/scale_bench.py --device cuda --world 8          # on a GPU: peaks from max_memory_allocated

The model has Llama-3-70B's exact shapes: hidden 8192; per decoder layer
q/o projections 8192 x 8192, k/v 8192 -> 1024 (8 KV heads of 128), a SwiGLU
MLP (gate/up 8192 -> 28672, down 28672 -> 8192) and two RMSNorm weights
(3.42 GB fp32 a layer); a 128256-token embedding, the final RMSNorm and an
untied lm_head (8.41 GB fp32: the root unit). ``--layers`` blocks (default 1)
and ``--vocab`` tokens (default 32064, so that a contender that holds a root
unit twice fits a 24 GiB machine; the root-unit figures at the full vocabulary
are then extrapolated from the measured ratio, and the table says so; the run
refuses a model whose estimated peak does not fit the memory available). It is
built on the meta device, every layer ``fully_shard``ed, then the root, then
``to_empty(device=...)`` materialises the shards, uninitialised (nothing
here reads a value). ``--structure-divisor D`` divides every width and the
vocabulary by D and defaults to all 80 layers (81 units): calls per unit on
the real structure, at a size where time is all Python (there, units fall
below the bucket cap and peaks are allocator-granularity figures: a copy-out
that lasts microseconds is caught by a probe or a sample only by chance).

As in ``scripts/host_cost.py``: the ``fake`` process group's collectives
return at once, so what is timed is host cost at any world size, on the CPU.
They are not free of data movement: torch 2.13's ``FakeProcessGroup``
copies each rank's input into every chunk of an all-gather's output
(``FakeProcessGroup.hpp``), one write of the full bytes, as a real
all-gather writes them on the device. Each configuration (a world size, or ``RxS`` for
HSDP with R replicas of S shards) runs in a fresh process; the timed
contenders are interleaved within each repetition in a new seeded shuffled
order, each timed pass right after an untimed one of the same contender,
and ratios are medians of per-repetition ratios to FSDP2's own loop.

Contenders (units are the blocks, then the root; the root unit holds the
embedding, the final norm and the lm_head):

- ``summon_unit``: ``with FSDP.summon_full_params(unit, recurse=False, writeback=False,
  rank0_only=True): pass`` for every unit (FSDP1's entry point, patched by ``import fsdp_shim``);
- ``stream``: ``for name, p in fsdp_shim.iter_full_params(model): pass`` (stored dtype, rank 0);
- ``unshard``: FSDP2's own ``unit.unshard(); unit.reshard()`` for every unit;
- ``full_tensor``: ``p.full_tensor()`` for every parameter;
- ``stream_bf16`` and ``module_source``: a weight sync to vLLM in bf16, ``vllm_weight_source``'s
  ``iter_full()`` (the stream with ``dtype=torch.bfloat16``: cast before the gather, half the bytes of
  fp32 masters) against vLLM's ``ModuleSource.iter_full()`` loop (``p.full_tensor().to(bf16)``);
- ``summon_model``: one ``summon_full_params(model, writeback=False)``: peak only, not timed.

Figures, per contender:

- host time per unit, ms (the pass over all units / the number of units), and its ratio to ``unshard``;
- Python + C calls per unit: ``'call'`` and ``'c_call'`` events of ``sys.setprofile`` over one pass,
  divided by the number of units (machine-independent);
- peak bytes beyond the shards: the highest bytes in use in the pass minus those in use just before
  it. On the CPU, glibc's ``mallinfo2()`` (``uordblks + hblkhd``: heap chunks in use plus mmap'ed
  chunks, which is where tensors above the mmap threshold live), read by a background thread about
  every millisecond and at fixed points of the loop body (inside each summon, after each
  ``unshard()``, each ``full_tensor()`` result or streamed tensor held); on CUDA,
  ``torch.cuda.max_memory_allocated``. Per unit (the window from the start of a unit to the start of
  the next), as GB and as a multiple of that unit's full bytes; per whole sync, as a multiple of the
  largest unit's full bytes (``summon_model``: of the whole model's).

On the CPU at these sizes a pass is bound by memory traffic, not Python:
every full tensor is fresh memory. ``--malloc`` says what the allocator does
with it. ``heap`` (default) turns glibc's mmap off and its trimming down
(``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_``), so freed memory is kept and
reused, as CUDA's caching allocator reuses it, and asks for 2 MiB pages
(torch's ``THP_MEM_ALLOC_ENABLE=1``) for the first touch: the time is copies
and Python, with few page faults after the first pass. It needs room for
fragmentation: a unit held twice plus a quarter. ``plain`` keeps glibc's
defaults (every large tensor a fresh mmap, page-faulted in 4 KiB at a time:
5 to 20 times slower and much noisier); ``thp`` is ``plain`` with 2 MiB pages
(memory goes back to the system after each tensor: the mode for a model
near the machine's memory). The peak figures count bytes the allocator hands
out, the same in every mode. ``--threads`` (default 1) sets torch's
intra-op threads: on a shared 2-core machine, spinning OpenMP workers made
small ops 10 to 50 times slower. The number that carries over to NCCL is
calls per unit: on a GPU the copies are kernels, and the host pays for the
Python.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

#: As in host_cost.py: the fake backend cannot be wrapped by TORCH_DISTRIBUTED_DEBUG=DETAIL's checks.
_BASE_ENV = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
_MALLOC_ENV = {
    "plain": {},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
    "heap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(64 << 20),
             "THP_MEM_ALLOC_ENABLE": "1"},
}

TIMED = ("summon_unit", "stream", "stream_bf16", "unshard", "full_tensor", "module_source")
CONTENDERS = (*TIMED, "summon_model")

# Llama-3-70B
HIDDEN, FFN, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80
REDUCED_VOCAB = 32064


def _shapes(divisor: int, vocab: int | None) -> dict[str, int]:
    for name, size in (("hidden", HIDDEN), ("ffn", FFN), ("kv", KV), ("vocab", VOCAB)):
        if size % divisor:
            raise SystemExit(f"--structure-divisor {divisor} does not divide the {name} size {size}")
    return {"hidden": HIDDEN // divisor, "ffn": FFN // divisor, "kv": KV // divisor,
            "vocab": vocab if vocab is not None else (VOCAB // divisor if divisor > 1 else REDUCED_VOCAB)}


def _unit_numels(shapes: dict[str, int]) -> tuple[int, int]:
    """Elements of one block and of the root unit (embedding + final norm + lm_head)."""
    h, f, kv, v = shapes["hidden"], shapes["ffn"], shapes["kv"], shapes["vocab"]
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    root = 2 * v * h + h
    return block, root


# --------------------------------------------------------------------------- measuring process

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class _HostMemory:
    """Bytes glibc has handed out (heap chunks in use + mmap'ed chunks), with a peak per window.

    A window is the span from one ``window()`` to the next. The sampling thread reads which window is
    open *before* it reads the bytes in use and files the reading under that window: a reading taken
    just before the main thread moved on (the thread waits for the GIL between the two) still counts
    for the window it was taken in, never for the next one.
    """

    def __init__(self) -> None:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        self._mallinfo2 = libc.mallinfo2
        self._lock = threading.Lock()
        self._open = 0  # the open window's number
        self._keys: list[object] = [None]  # each window's key, by number
        self._peaks: list[int] = [0]  # each window's peak, by number
        self.windows: dict[object, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def in_use(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def _note(self, number: int, value: int) -> None:
        with self._lock:
            if value > self._peaks[number]:
                self._peaks[number] = value

    def probe(self) -> None:
        number = self._open
        self._note(number, self.in_use())

    def _sample(self) -> None:
        while not self._stop.is_set():
            number = self._open  # before the reading: see the class docstring
            self._note(number, self.in_use())
            time.sleep(0.001)

    def start(self) -> int:
        gc.collect()
        base = self.in_use()
        self._open, self._keys, self._peaks, self.windows = 0, [None], [base], {}
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return base

    def window(self, key: object) -> None:
        """Close the open window (its peak includes now) and open ``key``'s."""
        now = self.in_use()
        with self._lock:
            if now > self._peaks[self._open]:
                self._peaks[self._open] = now
            self._keys.append(key)
            self._peaks.append(now)
            self._open = len(self._keys) - 1

    def stop(self) -> None:
        self.window(None)
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        for key, peak in zip(self._keys, self._peaks, strict=True):
            if key is not None:
                self.windows[key] = max(self.windows.get(key, 0), peak)


class _CudaMemory:
    """The same interface from the CUDA caching allocator's counters."""

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._key: object = None
        self.windows: dict[object, int] = {}

    def in_use(self) -> int:
        return self._cuda.memory_allocated()

    def probe(self) -> None:
        pass  # max_memory_allocated sees every allocation

    def start(self) -> int:
        gc.collect()
        self._cuda.synchronize()
        self.windows = {}
        self._key = None
        self._cuda.reset_peak_memory_stats()
        return self._cuda.memory_allocated()

    def window(self, key: object) -> None:
        self._cuda.synchronize()
        if self._key is not None:
            self.windows[self._key] = max(self.windows.get(self._key, 0), self._cuda.max_memory_allocated())
        self._key = key
        self._cuda.reset_peak_memory_stats()

    def stop(self) -> None:
        self.window(None)


def _one(config: dict) -> dict:
    """Run in a fresh process: one mesh, every contender; returns the row."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tree = _commit()  # the fsdp_shim/ this process imports (another process may see another tree)
    import fsdp_shim

    started = time.perf_counter()
    torch.set_num_threads(config["threads"])
    device = config["device"]
    dims = tuple(int(d) for d in config["world"].split("x"))
    size = 1
    for d in dims:
        size *= d
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    if device == "cuda":
        torch.cuda.set_device(0)
    names = ("replicate", "shard") if len(dims) == 2 else None
    mesh = init_device_mesh(device, dims, mesh_dim_names=names)
    shapes = config["shapes"]
    h, f, kv, v = shapes["hidden"], shapes["ffn"], shapes["kv"], shapes["vocab"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config["dtype"]]

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(h, h, bias=False)  # 64 query heads of 128
            self.k_proj = nn.Linear(h, kv, bias=False)  # 8 KV heads of 128
            self.v_proj = nn.Linear(h, kv, bias=False)
            self.o_proj = nn.Linear(h, h, bias=False)

    class MLP(nn.Module):  # SwiGLU
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(h, f, bias=False)
            self.up_proj = nn.Linear(h, f, bias=False)
            self.down_proj = nn.Linear(f, h, bias=False)

    class DecoderLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = nn.RMSNorm(h)
            self.self_attn = Attention()
            self.post_attention_layernorm = nn.RMSNorm(h)
            self.mlp = MLP()

    class Llama(nn.Module):  # shapes only: nothing here runs a forward
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(v, h)
            self.layers = nn.ModuleList([DecoderLayer() for _ in range(config["layers"])])
            self.norm = nn.RMSNorm(h)
            self.lm_head = nn.Linear(h, v, bias=False)  # untied

    with torch.device("meta"):
        model = Llama().to(dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    memory = _HostMemory() if device == "cpu" else _CudaMemory()
    before_shards = memory.in_use()
    model.to_empty(device=device)  # the shards, uninitialised: no value is ever read
    shard_bytes = memory.in_use() - before_shards
    units = [*model.layers, model]
    unit_of_name = {}
    unit_bytes = [0] * len(units)
    for name, param in model.named_parameters():
        parts = name.split(".")
        index = int(parts[1]) if parts[0] == "layers" else len(units) - 1
        unit_of_name[name] = index
        unit_bytes[index] += param.numel() * param.element_size()  # the full (global) shape
    params = [(unit_of_name[name], param) for name, param in model.named_parameters()]
    numel = sum(param.numel() for _, param in params)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def summon_unit(probe) -> None:
        for index, unit in enumerate(units):
            if probe is not None:
                memory.window(index)
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                if probe is not None:
                    probe()

    def stream(probe) -> None:
        last = None
        for name, tensor in fsdp_shim.iter_full_params(model):
            if probe is not None:
                index = unit_of_name[name]
                if index != last:
                    memory.window(index)
                    last = index
                probe()
            del tensor

    def stream_bf16(probe) -> None:  # vllm_weight_source's iter_full(): the stream, cast before the gather
        last = None
        for name, tensor in fsdp_shim.iter_full_params(model, dtype=torch.bfloat16):
            if probe is not None:
                index = unit_of_name[name]
                if index != last:
                    memory.window(index)
                    last = index
                probe()
            del tensor

    def module_source(probe) -> None:  # vLLM's ModuleSource.iter_full(): full_tensor() per parameter, then the cast
        last = None
        for index, param in params:
            if probe is not None and index != last:
                memory.window(index)
                last = index
            full = param.full_tensor().to(torch.bfloat16)
            if probe is not None:
                probe()
            del full

    def unshard(probe) -> None:
        for index, unit in enumerate(units):
            if probe is not None:
                memory.window(index)
            unit.unshard()
            if probe is not None:
                probe()
            unit.reshard()

    def full_tensor(probe) -> None:
        last = None
        for index, param in params:
            if probe is not None and index != last:
                memory.window(index)
                last = index
            full = param.full_tensor()
            if probe is not None:
                probe()
            del full

    def summon_model(probe) -> None:
        if probe is not None:
            memory.window("model")
        with FSDP.summon_full_params(model, writeback=False):
            if probe is not None:
                probe()

    runs = {"summon_unit": summon_unit, "stream": stream, "stream_bf16": stream_bf16, "unshard": unshard,
            "full_tensor": full_tensor, "module_source": module_source, "summon_model": summon_model}
    runs = {name: run for name, run in runs.items() if name in config["contenders"]}
    timed = [name for name in runs if name in TIMED]
    trace = config.get("trace", False)

    def run_pass(name: str, what: str, probe=None) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF) if trace else None
        start = time.perf_counter()
        runs[name](probe)
        sync()
        elapsed = time.perf_counter() - start
        if usage is not None:
            now = resource.getrusage(resource.RUSAGE_SELF)
            print(f"  [{config['world']}] {what:<7} {name:<13} {elapsed * 1e3:9.1f} ms, user "
                  f"{(now.ru_utime - usage.ru_utime) * 1e3:7.0f} ms, sys {(now.ru_stime - usage.ru_stime) * 1e3:7.0f} "
                  f"ms, {now.ru_minflt - usage.ru_minflt} minor faults", file=sys.stderr, flush=True)
        return elapsed

    for name in runs:  # warm-up: lazy init, caches, and the allocator's high-water mark
        run_pass(name, "warm-up")

    # Peak memory, each contender in a pass of its own. Bytes in use do not depend on what the
    # allocator kept from the pass before (only the time does), so no untimed pass precedes it.
    peaks: dict[str, dict] = {}
    shuffle = random.Random(0)
    for name in shuffle.sample(list(runs), len(runs)):
        base = memory.start()
        run_pass(name, "peak", memory.probe)
        memory.stop()
        windows = memory.windows
        per_unit = [windows.get(i, base) - base for i in range(len(units))]
        whole = max(windows.values()) - base if windows else 0
        peaks[name] = {"per_unit": per_unit, "whole": whole}
        del windows

    # Calls per unit: every Python call and C call of one pass (the path is the same every pass once warm).
    calls: dict[str, float] = {}
    for name in timed:
        count = [0]

        def profiler(frame, event, arg, count=count):
            if event == "call" or event == "c_call":
                count[0] += 1

        sys.setprofile(profiler)
        runs[name](None)
        sys.setprofile(None)
        sync()
        calls[name] = (count[0] - 1) / len(units)  # less the c_call of sys.setprofile(None) itself

    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(config["reps"]):
        for name in shuffle.sample(timed, len(timed)):  # a rotation would keep each one's predecessor
            run_pass(name, "untimed")  # what the last contender left in the allocator is not this one's cost
            samples[name].append(run_pass(name, "timed") * 1e3 / len(units))
    ratios = ({name: [s / u for s, u in zip(samples[name], samples["unshard"], strict=True)] for name in timed}
              if "unshard" in samples else {})
    dist.destroy_process_group()
    return {
        "world": config["world"], "layers": config["layers"], "shapes": shapes, "dtype": config["dtype"],
        "device": device, "torch": torch.__version__, "shim": fsdp_shim.__version__, "units": len(units),
        "threads": config["threads"], "unit_bytes": unit_bytes, "shard_bytes": shard_bytes, "reps": config["reps"],
        "median_ms_per_unit": {n: statistics.median(s) for n, s in samples.items() if s},
        "ratio_to_unshard": {n: statistics.median(r) for n, r in ratios.items() if r},
        "ratio_range": {n: (min(r), max(r)) for n, r in ratios.items() if r},
        "calls_per_unit": calls, "peaks": peaks, "seconds": time.perf_counter() - started, "tree": tree,
        "wire_bytes": {"stream_bf16": 2 * numel, "module_source": sum(p.numel() * p.element_size() for _, p in params)},
    }


# --------------------------------------------------------------------------- driver

def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.2f} MB"


def _commit() -> str:
    """HEAD, and a fingerprint of uncommitted changes under fsdp_shim/ where there are any."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        diff = git("diff", "HEAD", "--", "../fsdp_shim")
        untracked = git("ls-files", "--others", "--exclude-standard", "--", "../fsdp_shim")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if not diff and not untracked:
        return head
    import hashlib

    digest = hashlib.sha1((diff + untracked).encode()).hexdigest()[:8]
    return f"{head} + uncommitted changes under fsdp_shim/ (diff fingerprint {digest})"


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _print_row(row: dict, full_root_bytes: int | None, tree: str) -> None:
    block_bytes = row["unit_bytes"][0] if row["units"] > 1 else None
    root_bytes = row["unit_bytes"][-1]
    largest = max(row["unit_bytes"])
    model_bytes = sum(row["unit_bytes"])
    s = row["shapes"]
    kind = "HSDP " + row["world"].replace("x", " x ") if "x" in row["world"] else f"W = {row['world']}"
    print(f"\n#### {kind}: {row['layers']} block(s), hidden {s['hidden']}, ffn {s['ffn']}, kv {s['kv']}, vocab "
          f"{s['vocab']}, {row['dtype']}, {row['units']} units (block {_size(block_bytes or 0)}, root "
          f"{_size(root_bytes)}, shards {_size(row['shard_bytes'])} on this rank); {row['device']}, "
          f"torch {row['torch']}, fsdp_shim {row['shim']}, {row['threads']} thread(s), {row['reps']} repetitions, "
          f"{row['seconds']:.0f} s" + ("" if row["tree"] == tree else f"; **tree {row['tree']}**") + "\n")
    print("| contender | ms/unit | / unshard (min-max) | calls/unit | calls / unshard's | block peak (x block) "
          "| root peak (x root) | whole-sync peak (x largest unit) |")
    print("|---|---|---|---|---|---|---|---|")
    unshard_calls = row["calls_per_unit"].get("unshard")
    for name in CONTENDERS:
        if name not in row["peaks"]:
            continue
        ms = row["median_ms_per_unit"].get(name)
        ratio = row["ratio_to_unshard"].get(name)
        lo, hi = row["ratio_range"].get(name, (None, None))
        calls = row["calls_per_unit"].get(name)
        peak = row["peaks"][name]
        cells = [name, f"{ms:.1f}" if ms is not None else "(peak only)",
                 f"{ratio:.2f} ({lo:.2f}-{hi:.2f})" if ratio is not None else "",
                 f"{calls:.0f}" if calls is not None else "",
                 f"{calls / unshard_calls:.2f}" if calls is not None and unshard_calls else ""]
        if name == "summon_model":
            cells += ["", "", f"{_size(peak['whole'])} (x{peak['whole'] / model_bytes:.2f} of the whole model)"]
        else:
            blocks = peak["per_unit"][:-1]
            worst = max(blocks) if blocks else None
            cells += [f"{_size(worst)} (x{worst / block_bytes:.2f})" if worst is not None else "",
                      f"{_size(peak['per_unit'][-1])} (x{peak['per_unit'][-1] / root_bytes:.2f})",
                      f"{_size(peak['whole'])} (x{peak['whole'] / largest:.2f})"]
        print("| " + " | ".join(cells) + " |")
    if "stream_bf16" in row["peaks"] and "module_source" in row["peaks"]:
        wire = row["wire_bytes"]
        print(f"\nAll-gathered per bf16 sync: stream_bf16 {_size(wire['stream_bf16'])} (cast before the gather), "
              f"module_source {_size(wire['module_source'])} ({row['dtype']} masters gathered, then cast): "
              f"x{wire['module_source'] / wire['stream_bf16']:.2f}.")
    if full_root_bytes and full_root_bytes != root_bytes:
        held = [name for name in ("summon_unit", "unshard", "full_tensor") if name in row["peaks"]]
        print(f"\nAt the full vocabulary the root unit is {_gb(full_root_bytes)} GB; **extrapolated** from the "
              f"ratios measured here at vocab {s['vocab']} ({_gb(root_bytes)} GB), its peak would be: "
              + ", ".join(f"{name} {_gb(row['peaks'][name]['per_unit'][-1] / root_bytes * full_root_bytes)} GB"
                          for name in held)
              + (". The stream's is not extrapolated: its root window also holds the next unit's gather."
                 if "stream" in row["peaks"] else "."))


def _print_summary(rows: list[dict]) -> None:
    print("\n#### Across meshes\n")
    print("| mesh | unshard ms/unit | summon_unit / unshard, time | calls | summon_unit peak x block | x root "
          "| unshard peak x block | x root | stream / unshard | full_tensor / unshard | summon_model peak x model "
          "| ModuleSource loop / stream bf16, time | x root, peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        p, r, c = row["peaks"], row["ratio_to_unshard"], row["calls_per_unit"]
        block, root = (row["unit_bytes"][0] if row["units"] > 1 else None), row["unit_bytes"][-1]

        def unit_ratio(name: str, index: int, full: int | None, p: dict = p) -> str:
            if name not in p or full is None:
                return ""
            values = p[name]["per_unit"][:-1] if index == 0 else [p[name]["per_unit"][-1]]
            return f"{max(values) / full:.2f}"

        cells = [row["world"], f"{row['median_ms_per_unit'].get('unshard', float('nan')):.1f}",
                 f"{r['summon_unit']:.2f}" if "summon_unit" in r else "",
                 f"{c['summon_unit'] / c['unshard']:.2f}" if "summon_unit" in c and "unshard" in c else "",
                 unit_ratio("summon_unit", 0, block), unit_ratio("summon_unit", 1, root),
                 unit_ratio("unshard", 0, block), unit_ratio("unshard", 1, root),
                 f"{r['stream']:.2f}" if "stream" in r else "", f"{r['full_tensor']:.2f}" if "full_tensor" in r else "",
                 f"{p['summon_model']['whole'] / sum(row['unit_bytes']):.2f}" if "summon_model" in p else "",
                 f"{r['module_source'] / r['stream_bf16']:.2f}" if "module_source" in r and "stream_bf16" in r else "",
                 f"{p['module_source']['per_unit'][-1] / root:.2f} / {p['stream_bf16']['per_unit'][-1] / root:.2f}"
                 if "module_source" in p and "stream_bf16" in p else ""]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="decoder layers (default 1; 80 with --structure-divisor)")
    parser.add_argument("--vocab", type=int,
                        help=f"vocabulary (default {REDUCED_VOCAB}, or {VOCAB} / D with --structure-divisor D; "
                             f"Llama-3's is {VOCAB})")
    parser.add_argument("--world", nargs="*", help="1-D world sizes (default 64 256 1024)")
    parser.add_argument("--hsdp", nargs="*", type=int,
                        help="HSDP shard sizes S, each with 8 replicas: mesh (8, S) (default 8 32 128; "
                             "none: --hsdp alone)")
    parser.add_argument("--reps", type=int, help="timed repetitions (default 3; 11 with --structure-divisor)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--malloc", default="heap", choices=sorted(_MALLOC_ENV),
                        help="glibc allocator setting of each measuring process (CPU; see the docstring)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of each measuring process (default 1: on a shared small machine, "
                             "spinning OpenMP workers make small ops 10 to 50 times slower)")
    parser.add_argument("--structure-divisor", type=int, default=1, metavar="D",
                        help="divide every width and the vocabulary by D; 80 layers unless --layers")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: --structure-divisor 64 --layers 4 --world 8 --hsdp 4 --reps 2 "
                             "(each where not given)")
    parser.add_argument("--force", action="store_true", help="run even where the memory estimate does not fit")
    parser.add_argument("--trace", action="store_true",
                        help="each measuring process reports every pass (time, user/sys CPU, page faults) on stderr")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(json.loads(args.one))))
        return 0
    if args.quick:
        args.structure_divisor = args.structure_divisor if args.structure_divisor > 1 else 64
        args.layers = args.layers if args.layers is not None else 4
        args.world = args.world if args.world is not None else ["8"]
        args.hsdp = args.hsdp if args.hsdp is not None else [4]
        args.reps = args.reps if args.reps is not None else 2
    args.world = args.world if args.world is not None else ["64", "256", "1024"]
    args.hsdp = args.hsdp if args.hsdp is not None else [8, 32, 128]
    divisor = args.structure_divisor
    layers = args.layers if args.layers is not None else (LAYERS if divisor > 1 else 1)
    reps = args.reps if args.reps is not None else (11 if divisor > 1 else 3)
    if "unshard" not in args.contenders:
        args.contenders.append("unshard")  # the yardstick of every ratio
    shapes = _shapes(divisor, args.vocab)
    block_numel, root_numel = _unit_numels(shapes)
    element = 4 if args.dtype == "fp32" else 2
    block_bytes, root_bytes = block_numel * element, root_numel * element
    model_bytes = layers * block_bytes + root_bytes
    full_root_bytes = None if divisor > 1 else (2 * VOCAB * HIDDEN + HIDDEN) * element
    # unshard holds a unit twice (all-gather buffer + parameters); the whole-model summon holds the model
    need = max(2 * max(block_bytes, root_bytes), model_bytes if "summon_model" in args.contenders else 0)
    need = int(need * (1.25 if args.malloc == "heap" else 1.05)) + (1 << 30)  # heap: room for fragmentation
    available = _available_bytes() if args.device == "cpu" else None
    if available is not None and need > available and not args.force:
        print(f"needs about {_gb(need)} GB (a unit held twice, or the whole model, plus headroom), "
              f"{_gb(available)} GB available: use a smaller --vocab or --layers, --malloc plain "
              f"(less headroom), or --force", file=sys.stderr)
        return 2
    meshes = [*args.world, *(f"8x{s}" for s in args.hsdp)]
    env = {**_BASE_ENV, **(_MALLOC_ENV[args.malloc] if args.device == "cpu" else {})}
    tree = _commit()
    print(f"scale_bench: commit {tree}; Llama-3-70B shapes / {divisor}, {layers} block(s), vocab "
          f"{shapes['vocab']}, {args.dtype}, {args.device}, malloc {args.malloc}, {args.threads} thread(s), {reps} "
          f"repetitions; meshes "
          f"{' '.join(meshes)}", flush=True)
    rows = []
    started = time.perf_counter()
    for world in meshes:
        config = {"world": world, "layers": layers, "shapes": shapes, "dtype": args.dtype, "device": args.device,
                  "reps": reps, "contenders": args.contenders, "threads": args.threads, "trace": args.trace}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(config)],
                              stdout=subprocess.PIPE, stderr=None if args.trace else subprocess.PIPE, text=True,
                              env=env)
        if proc.returncode != 0:
            print(f"mesh {world}: FAILED (exit {proc.returncode})\n{(proc.stderr or '')[-3000:]}", flush=True)
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        _print_row(row, full_root_bytes, tree)
        sys.stdout.flush()
    _print_summary(rows)
    print(f"\n{len(rows)} configurations in {time.perf_counter() - started:.0f} s", flush=True)
    if any(row["tree"] != tree for row in rows):
        print("**fsdp_shim/ changed during the run**: rows name the tree they measured", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
