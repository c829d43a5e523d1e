#!/usr/bin/env python3
"""The multi-rank code paths on one device: torch's ``fake`` process group, one process per world size.

    python scripts/device_fake.py --device cuda --world 8 64 1024      # on the GPU machine (device_check.sh)
    python scripts/device_fake.py --device cpu --world 8 --reps 2      # anywhere (tests/test_device_check.py)

With one GPU, ``--ranks 1`` only ever takes the shim's "a group of one" path.
Here a single process joins a ``fake`` group of ``W`` ranks as rank 0
(``FakeStore``), builds ``fsdp-shim bench``'s model on ``--device`` and
``fully_shard``s it on a flat mesh ``(W,)`` and on an HSDP mesh
``(2, W/2)`` (``("replicate", "shard")``), so every path below runs the
all-gather code a W-rank NCCL job runs. Fake collectives return at once and
move no data, so VALUES are meaningless across ranks: what is checked is the
path taken (the shim's all-gathers are counted), shapes, devices, pinning,
memory and host time. One exception: a ``writeback=True`` edit is copied into
rank 0's own shard locally, so rank 0's shard values are checked.

Each world size runs in a fresh process (``--one W``: a fake group can be
initialised once per process). Every row names its world size, mesh and path:

- ``summon_unit r0 loop`` and ``unshard loop``: ``summon_full_params(unit,
  recurse=False, writeback=False, rank0_only=True)`` over
  ``fsdp_shim.fsdp_units(model)`` against FSDP2's ``unit.unshard();
  unit.reshard()``, interleaved (seeded shuffle, an untimed pass before each
  timed one, as in ``scripts/host_cost.py``): median host ms per unit, and the
  median per-repetition ratio;
- ``iter_full_params(rank0_only=False, device=...)``: ``None``, ``"cpu"``
  (the offload path, also with small buckets: buckets of one tensor), and on
  CUDA ``"cuda"`` and ``"cuda:<current>"``: every tensor full-shaped, on the
  device asked ("cuda" meaning the current one), CPU results not pinned;
- ``summon(offload_to_cpu=True)``, ``rank0_only`` off and on: parameters
  plain, full-shaped, on the CPU (not pinned) inside, sharded on exit;
- ``summon(with_grads=True)`` after a forward and backward;
- ``summon(writeback=True)`` with an in-place edit;
- memory, on CUDA: peak allocated and reserved above what was live before
  (``empty_cache`` and a peak reset before each path), and the pinned host
  allocator's bytes (``torch.cuda.host_memory_stats``, where this torch has
  it): peak during the path, still held (cached) and still checked out after
  it. On CPU: n/a.

Exit status 1 if any check failed (every path still runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
import warnings

#: The fake backend cannot be wrapped by TORCH_DISTRIBUTED_DEBUG=DETAIL's checks (see scripts/host_cost.py).
_FAKE_ENV = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}

#: Every path a run reports, in order; the CUDA-only ones are reported as skipped on the CPU.
PATHS = (
    "summon_unit r0 loop",
    "unshard loop",
    "iter_full_params(device=None)",
    "iter_full_params(device='cpu')",
    "iter_full_params(device='cpu', bucket_mb=0.25)",
    "iter_full_params(device='cuda')",
    "iter_full_params(device='cuda:<current>')",
    "summon(offload_to_cpu=True, rank0_only=False)",
    "summon(offload_to_cpu=True, rank0_only=True)",
    "summon(with_grads=True)",
    "summon(writeback=True) edit",
)
CUDA_ONLY = ("iter_full_params(device='cuda')", "iter_full_params(device='cuda:<current>')")


def _mib(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:+.1f}M" if abs(n) >= 2**16 else f"{n:+d}B"


def _delta(after: dict, after_key: str, before: dict, before_key: str) -> int | None:
    """``after[after_key] - before[before_key]``; ``None`` where this torch's stats lack a key."""
    return after[after_key] - before[before_key] if after_key in after and before_key in before else None


# ----------------------------------------------------------------------------- one world size, in its own process
def _hsdp_backward_needs_an_event() -> bool:
    """Whether this torch's FSDP2 HSDP backward asserts on the CPU (2.7: a CPU stream records no event)."""
    try:
        import inspect

        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        return "assert all_reduce_event is not None" in inspect.getsource(FSDPParamGroup.post_backward)
    except Exception:  # noqa: BLE001  (a torch without that file or source: assume fixed)
        return False


def make_grads(model, tokens, hsdp: bool) -> str:
    """Sharded gradients on every parameter: a forward and backward, or (where torch's HSDP backward cannot
    run on the CPU) a clone of each shard assigned as its gradient. Says which."""
    import torch

    if hsdp and tokens.device.type == "cpu" and _hsdp_backward_needs_an_event():
        with torch.no_grad():
            for p in model.parameters():
                p.grad = p.detach().clone()
        return (f"assigned, not from backward: torch {torch.__version__}'s HSDP backward asserts on the CPU "
                "(no all-reduce event)")
    model(tokens).float().sum().backward()
    return "from a forward and backward"


def _one(world: int, reps: int, device_type: str, width: int, layers: int, time_limit: float) -> list[dict]:
    """Every path on both meshes; timing stops early (after one repetition at least) past ``time_limit`` s."""
    began = time.perf_counter()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_shim
    from fsdp_shim._compat import _ALL_GATHER
    from fsdp_shim.tools.models import LMConfig, build_lm, shard_lm, tokens_for

    def progress(text: str) -> None:
        print(f"[W={world}] {text}", file=sys.stderr, flush=True)

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        here = torch.device("cuda", torch.cuda.current_device())
    else:
        here = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    assert fsdp_shim.is_patched(), "the shim did not patch FSDP.summon_full_params"
    host_stats = getattr(torch.cuda, "host_memory_stats", None) if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    gathers = {"n": 0}  # the shim's (and FSDP2's) all-gathers, counted in the check passes only
    real_gather = getattr(dist, _ALL_GATHER)

    def counting_gather(*args, **kwargs):
        gathers["n"] += 1
        return real_gather(*args, **kwargs)

    meshes = [(str(world), (world,), None)]
    if world >= 4 and world % 2 == 0:
        meshes.append((f"2x{world // 2}", (2, world // 2), ("replicate", "shard")))
    rows: list[dict] = []
    if len(meshes) == 1:
        rows.append({"world": world, "mesh": "2x?", "device": device_type, "path": "(HSDP mesh)",
                     "status": "skipped", "detail": "HSDP needs an even world size >= 4"})

    config = LMConfig(vocab=1000, width=width, layers=layers, heads=4)

    def run_mesh(mesh_name: str, dims: tuple[int, ...], dim_names: tuple[str, str] | None) -> None:
        """Build, shard and run every path on one mesh; its rows go to ``rows``."""
        mesh = init_device_mesh(device_type, dims, mesh_dim_names=dim_names)
        model = shard_lm(build_lm(config).to(here), mesh)
        units = [unit for _, unit in fsdp_shim.fsdp_units(model)]
        full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        local_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters(remove_duplicate=False)}
        n_params = len(list(model.named_parameters()))
        objects = [id(p) for p in model.parameters()]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        tokens = tokens_for(config).to(here)

        def still_sharded(where: str) -> None:
            for n, p in model.named_parameters(remove_duplicate=False):
                assert isinstance(p, DTensor), f"{where}: {n} is not a DTensor after exit"
                assert tuple(p.shape) == full_shapes[n] and tuple(p.to_local().shape) == local_shapes[n], \
                    f"{where}: {n} changed shape: {tuple(p.shape)} local {tuple(p.to_local().shape)}"
                assert p.to_local().device == here, f"{where}: {n}'s shard moved to {p.to_local().device}"
            assert [id(p) for p in model.parameters()] == objects, f"{where}: parameter objects changed"

        def check_full(name: str, t: torch.Tensor, want: torch.device, where: str) -> None:
            assert t is not None, f"{where}: {name} is None on rank 0"
            assert not isinstance(t, DTensor), f"{where}: {name} is still a DTensor"
            assert tuple(t.shape) == full_shapes[name], f"{where}: {name} has shape {tuple(t.shape)}"
            assert t.device == want, f"{where}: {name} is on {t.device}, asked {want}"
            if cuda and want.type == "cpu":
                assert not t.is_pinned(), f"{where}: {name} is pinned host memory"

        # -- the paths: (check, run) -- check once, counting gathers; run is what is timed
        def unit_loop(check: bool) -> None:
            seen = 0
            for fqn, unit in fsdp_shim.fsdp_units(model):
                with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                    if check:
                        for n, p in unit.named_parameters():
                            if not isinstance(p, DTensor):  # nested units stay sharded
                                check_full(f"{fqn}.{n}" if fqn else n, p, here, "summon_unit")
                                seen += 1
            if check:
                assert seen == n_params, f"summon_unit: {seen} full parameters over the units, model has {n_params}"

        def unshard_loop(check: bool) -> None:
            for unit in units:
                unit.unshard()
                unit.reshard()

        def stream(device, want: torch.device, bucket_mb=None):
            def run(check: bool) -> None:
                count = 0
                for n, t in fsdp_shim.iter_full_params(model, rank0_only=False, device=device, bucket_mb=bucket_mb):
                    if check:
                        check_full(n, t, want, f"iter_full_params(device={device!r})")
                    count += 1
                if check:
                    assert count == n_params, f"iter_full_params: {count} tensors, model has {n_params}"
            return run

        def offload(rank0_only: bool):
            def run(check: bool) -> None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # FSDP1's warning for offload without rank0_only
                    with fsdp_shim.summon_full_params(model, rank0_only=rank0_only, offload_to_cpu=True,
                                                      writeback=False):
                        if check:
                            for n, p in model.named_parameters(remove_duplicate=False):
                                check_full(n, p, torch.device("cpu"), "summon(offload_to_cpu=True)")
                if check:
                    still_sharded("summon(offload_to_cpu=True)")
            return run

        def with_grads(check: bool) -> None:
            with fsdp_shim.summon_full_params(model, with_grads=True, writeback=False):
                if check:
                    for n, p in model.named_parameters(remove_duplicate=False):
                        check_full(n, p, here, "summon(with_grads=True)")
                        assert p.grad is not None, f"summon(with_grads=True): {n} has no gradient"
                        check_full(n, p.grad, here, "summon(with_grads=True) grad")
            if check:
                still_sharded("summon(with_grads=True)")
                for n, p in model.named_parameters():
                    assert isinstance(p.grad, DTensor) and tuple(p.grad.to_local().shape) == local_shapes[n], \
                        f"summon(with_grads=True): {n}'s sharded gradient did not come back"

        def writeback(check: bool) -> None:
            with fsdp_shim.summon_full_params(model, writeback=True):
                if check:
                    for n, p in model.named_parameters(remove_duplicate=False):
                        check_full(n, p, here, "summon(writeback=True)")
                with torch.no_grad():
                    model.lm_head.weight.fill_(0.5)  # tied: the embedding too
                    model.blocks[0].fc1.bias.fill_(-1.0)
            if check:
                still_sharded("summon(writeback=True)")
                # rank 0's slice is copied into rank 0's shard locally: these values are real
                for n, value in (("lm_head.weight", 0.5), ("embed.weight", 0.5), ("blocks.0.fc1.bias", -1.0)):
                    local = dict(model.named_parameters(remove_duplicate=False))[n].to_local()
                    assert bool((local == value).all()), f"summon(writeback=True): rank 0's shard of {n} lost the edit"

        paths = {
            "summon_unit r0 loop": unit_loop,
            "unshard loop": unshard_loop,
            "iter_full_params(device=None)": stream(None, here),
            "iter_full_params(device='cpu')": stream("cpu", torch.device("cpu")),
            "iter_full_params(device='cpu', bucket_mb=0.25)": stream("cpu", torch.device("cpu"), 0.25),
            "summon(offload_to_cpu=True, rank0_only=False)": offload(False),
            "summon(offload_to_cpu=True, rank0_only=True)": offload(True),
            "summon(with_grads=True)": with_grads,
            "summon(writeback=True) edit": writeback,
        }
        if cuda:
            paths["iter_full_params(device='cuda')"] = stream("cuda", here)
            paths["iter_full_params(device='cuda:<current>')"] = stream(f"cuda:{torch.cuda.current_device()}", here)

        results: dict[str, dict] = {}
        for path in PATHS:
            row = {"world": world, "mesh": mesh_name, "device": device_type, "path": path}
            results[path] = row
            rows.append(row)
            if path not in paths:
                row.update(status="skipped", detail="CUDA only")
                continue
            progress(f"mesh {mesh_name}: {path}")
            try:
                if path == "summon(with_grads=True)":  # gradients to gather: a forward and backward first
                    how = make_grads(model, tokens, hsdp=len(dims) == 2)
                    sync()
                setattr(dist, _ALL_GATHER, counting_gather)
                gathers["n"] = 0
                try:
                    paths[path](True)
                    sync()
                finally:
                    setattr(dist, _ALL_GATHER, real_gather)
                row.update(status="ok", all_gathers=gathers["n"])
                if path != "unshard loop" and gathers["n"] == 0:
                    raise AssertionError(f"{path}: no all-gather was posted (the group-of-one path?)")
                row["detail"] = f"{gathers['n']} all-gathers"
                if path == "summon(with_grads=True)":
                    row["detail"] += f"; gradients {how}"
                if cuda:  # memory, on a fresh cache
                    gc.collect()
                    sync()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                    if host_stats is not None and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
                        torch.cuda.reset_peak_host_memory_stats()
                    host0 = host_stats() if host_stats is not None else {}
                    paths[path](False)
                    sync()
                    row["peak_allocated"] = torch.cuda.max_memory_allocated() - alloc0
                    row["peak_reserved"] = torch.cuda.max_memory_reserved() - reserved0
                    row["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                    row["max_memory_reserved"] = torch.cuda.max_memory_reserved()
                    gc.collect()
                    if host_stats is not None:
                        host1 = host_stats()
                        row["pinned_peak"] = _delta(host1, "allocated_bytes.peak", host0, "allocated_bytes.current")
                        row["pinned_held"] = _delta(host1, "allocated_bytes.current", host0, "allocated_bytes.current")
                        row["pinned_active"] = _delta(host1, "active_bytes.current", host0, "active_bytes.current")
                    else:
                        row["detail"] += "; no torch.cuda.host_memory_stats in this torch"
            except Exception as error:  # noqa: BLE001  (report, go on with the other paths)
                row.update(status="FAILED", detail=f"{type(error).__name__}: {error}"[:300])
                progress(traceback.format_exc())
                setattr(dist, _ALL_GATHER, real_gather)
            if path == "summon(with_grads=True)":
                model.zero_grad(set_to_none=True)

        # -- host time: every working path, interleaved in a seeded shuffle, an untimed pass before each
        timed = [p for p in paths if results[p]["status"] == "ok"]
        for path in timed:  # warm-up
            paths[path](False)
        samples: dict[str, list[float]] = {p: [] for p in timed}
        shuffle = random.Random(0)
        if timed:
            progress(f"mesh {mesh_name}: timing {len(timed)} paths x {reps}")
        done = 0
        # both meshes share the time left: the first mesh may use half of it
        limit = began + (time_limit if mesh_name != meshes[0][0] or len(meshes) == 1
                         else (time_limit + time.perf_counter() - began) / 2)
        for _ in range(reps):
            if done and time.perf_counter() > limit:
                break
            done += 1
            for path in shuffle.sample(timed, len(timed)):
                paths[path](False)
                sync()
                start = time.perf_counter()
                paths[path](False)
                sync()
                samples[path].append((time.perf_counter() - start) * 1e3)
        for path in timed:
            per = len(units) if path.endswith("loop") else 1
            results[path]["ms"] = statistics.median(samples[path]) / per
            results[path]["per"] = "unit" if per > 1 else "call"
            results[path]["reps"] = done
            if done < reps:
                results[path]["detail"] += f"; {done} of {reps} reps (time limit)"
        loops = ("summon_unit r0 loop", "unshard loop")
        if all(p in samples for p in loops):
            ratios = [s / u for s, u in zip(*(samples[p] for p in loops))]
            results["summon_unit r0 loop"]["ratio_to_unshard"] = statistics.median(ratios)
        for row in results.values():
            row["units"] = len(units)

    for mesh_name, dims, dim_names in meshes:
        run_mesh(mesh_name, dims, dim_names)
        gc.collect()
    dist.destroy_process_group()
    return rows


# ----------------------------------------------------------------------------- the report
def _print_rows(rows: list[dict]) -> None:
    print(f"  {'W':>5} {'mesh':>7}  {'path':<47} {'status':<7} {'host ms':>13} {'/unshard':>8} "
          f"{'peak alloc':>10} {'peak resv':>9} {'pinned pk':>9} {'held':>7} {'active':>7}  detail")
    for row in rows:
        ms = f"{row['ms']:.3f}/{row['per']}" if "ms" in row else "-"
        ratio = f"{row['ratio_to_unshard']:.2f}" if "ratio_to_unshard" in row else "-"
        if row["device"] == "cuda" and row["status"] == "ok":
            mem = [_mib(row.get(k)) for k in ("peak_allocated", "peak_reserved", "pinned_peak", "pinned_held",
                                               "pinned_active")]
        else:
            mem = ["n/a"] * 5 if row["status"] == "ok" else ["-"] * 5
        print(f"  {row['world']:>5} {row['mesh']:>7}  {row['path']:<47} {row['status']:<7} {ms:>13} {ratio:>8} "
              f"{mem[0]:>10} {mem[1]:>9} {mem[2]:>9} {mem[3]:>7} {mem[4]:>7}  {row.get('detail', '')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", nargs="+", type=int, default=[8, 64, 1024])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--width", type=int, default=256, help="the model's width (default: fsdp-shim bench's 256)")
    parser.add_argument("--layers", type=int, default=12, help="its blocks (default: 12, 13 units)")
    parser.add_argument("--timeout", type=float, default=150,
                        help="seconds for each world size's process; its timing stops taking repetitions at 70%%")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--time-limit", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--one", type=int, metavar="W", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        limit = args.time_limit if args.time_limit is not None else 0.7 * args.timeout
        print(json.dumps(_one(args.one, args.reps, args.device, args.width, args.layers, limit)))
        return 0

    import torch  # only for the header

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device_fake: torch {torch.__version__}, {where}, fake process group in one process per world size, "
          f"model width {args.width} x {args.layers} blocks, {args.reps} reps; values are not meaningful across "
          "ranks (fake collectives move no data): paths, shapes, devices, memory and host time are", flush=True)
    print("cuda:gloo 2-process run (real values across 2 ranks on one GPU): skipped, not implemented here "
          "(`fsdp-shim check --device cuda` checks values at world size 1)", flush=True)
    rows: list[dict] = []
    status = 0
    for world in args.world:
        started = time.perf_counter()
        command = [sys.executable, os.path.abspath(__file__), "--one", str(world), "--reps", str(args.reps),
                   "--device", args.device, "--width", str(args.width), "--layers", str(args.layers),
                   "--time-limit", str(0.7 * args.timeout)]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, env=_FAKE_ENV, timeout=args.timeout,
                                  check=False)
            failure = None if proc.returncode == 0 else f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
        except subprocess.TimeoutExpired as expired:
            stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
            proc, failure = None, f"timed out after {args.timeout:g} s\n{(stderr or '')[-3000:]}"
        if failure is not None:
            print(f"\nW={world} ({args.device}): FAILED, {failure}", flush=True)
            rows.append({"world": world, "mesh": "-", "device": args.device, "path": "(process)", "status": "FAILED",
                         "detail": failure.splitlines()[0]})
            status = 1
            continue
        assert proc is not None
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.extend(got)
        print(f"\nW={world}, {args.device}, {got[-1].get('units', '?')} units ({time.perf_counter() - started:.0f} s)",
              flush=True)
        _print_rows(got)
        if any(row["status"] == "FAILED" for row in got):
            status = 1
            print(proc.stderr[-4000:], file=sys.stderr, flush=True)
    failed = [r for r in rows if r["status"] == "FAILED"]
    print(f"\ndevice_fake: {len(failed)} failed of {sum(r['status'] != 'skipped' for r in rows)} checks"
          + "".join(f"\n  FAILED W={r['world']} mesh={r['mesh']} {r['path']}: {r['detail']}" for r in failed),
          flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
