"""The GPU path's logic, where the CPU reaches it (issue 46); the rest runs on CUDA when there is one.

Devices as users name them, where offloaded results live, the stream's
launch order, the NCCL fault rule's bookkeeping, FSDP2's post-optimizer
event after a writeback, and ``CPUOffloadPolicy`` shards. The tests marked
``cuda`` need a GPU and are what ``scripts/device_check.sh`` confirms there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

import fsdp_shim
from _helpers import assert_params_equal, build_lm, full_state, patched, rank, shard_lm
from fsdp_shim._gather.engine import resolve_device
from fsdp_shim._health import nccl_fault_rule

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# --------------------------------------------------------------------------- devices as users name them
def test_devices_as_users_name_them():
    host = torch.device("cpu")
    for named in ("cpu", "cpu:0", torch.device("cpu", 0), torch.device("cpu")):
        assert resolve_device(named) == host, named
    assert resolve_device(None) is None
    with pytest.raises(RuntimeError):
        resolve_device("nonsense")


@cuda
def test_cuda_devices_mean_the_current_one():
    current = torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("cuda") == current
    assert resolve_device(torch.device("cuda")) == current
    assert resolve_device(f"cuda:{current.index}") == current


def rank_stream_to_a_named_host_device():
    ref, model = build_lm(), shard_lm(build_lm())
    for device in ("cpu:0", torch.device("cpu", 0)):
        got = dict(fsdp_shim.iter_full_params(model, rank0_only=False, device=device, bucket_mb=0.002))
        assert all(t.device == torch.device("cpu") for t in got.values())
        assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    with pytest.raises(RuntimeError):
        fsdp_shim.iter_full_params(model, device="nonsense")  # at the call, before any collective


def test_stream_to_a_named_host_device(dist_run):
    dist_run(2, rank_stream_to_a_named_host_device)


# --------------------------------------------------------------------------- the stream's launch order
def rank_the_stream_launches_the_next_batch_before_copying_out():
    """Batch k + 1's all-gathers are on the wire while batch k is copied out (and moved to the host)."""
    from fsdp_shim._gather import engine

    events: list[str] = []
    launched, finish_bucket = engine.AllGatherFlight.launched, engine._finish_bucket

    def launch(self, posted):
        if self.launch is not None:
            events.append("launch")
        return launched(self, posted)

    def finish(flight, holds_fulls, out_device):
        events.append("copy-out")
        return finish_bucket(flight, holds_fulls, out_device)

    ref, model = build_lm(), shard_lm(build_lm())
    engine.AllGatherFlight.launched, engine._finish_bucket = launch, finish
    try:
        got = dict(fsdp_shim.iter_full_params(model, rank0_only=False, bucket_mb=0.06))  # a bucket a unit
    finally:
        engine.AllGatherFlight.launched, engine._finish_bucket = launched, finish_bucket
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    batches = events.count("launch")
    assert batches >= 2 and events.count("copy-out") == batches
    # launch 0, launch 1, copy-out 0, launch 2, copy-out 1, ...: never a copy-out before the next launch
    assert events == ["launch"] + ["launch", "copy-out"] * (batches - 1) + ["copy-out"], events


def test_the_stream_launches_the_next_batch_before_copying_out(dist_run):
    dist_run(2, rank_the_stream_launches_the_next_batch_before_copying_out)


# --------------------------------------------------------------------------- the NCCL fault rule
@pytest.mark.parametrize("env,rule", [
    ({}, "watchdog"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "watchdog"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "watchdog"),
    ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, "blocking_wait"),
    ({"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "blocking_wait"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, "unguarded"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, "unguarded"),
    ({"NCCL_ASYNC_ERROR_HANDLING": "0"}, "unguarded"),  # torch's older spelling
])
def test_nccl_fault_rule(env, rule):
    assert nccl_fault_rule(env) == rule


# --------------------------------------------------------------------------- FSDP2's post-optimizer event
class _RecordingEvent:
    """Stands in for a ``torch.Event`` (the CPU has none): counts where it was recorded, and the order of calls."""

    def __init__(self):
        self.records = 0
        self.calls: list[str] = []

    def wait(self, stream=None):
        self.calls.append("wait")

    def record(self, stream=None):
        self.records += 1
        self.calls.append("record")


def rank_a_writeback_moves_the_post_optim_event_after_it():
    ref, model = build_lm(), shard_lm(build_lm())
    event = _RecordingEvent()
    model.set_post_optim_event(event)  # FSDP2's next root forward waits on it, not on the current stream
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            pass
        assert event.records == 0  # nothing written: nothing to order
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model.norm.weight.add_(1.0)
    assert event.records == 1  # re-recorded after the writeback: FSDP2's all-gather waits for it
    # waited on first (issue 51): the user's recording (an optimizer step on a side stream) still ordered before
    assert event.calls == ["wait", "record"], event.calls
    with torch.no_grad():
        ref.norm.weight.add_(1.0)
    assert torch.equal(full_state(model)["norm.weight"], ref.norm.weight)
    model._get_fsdp_state()._state_ctx.post_optim_event = None


def test_a_writeback_moves_the_post_optim_event_after_it(dist_run):
    dist_run(2, rank_a_writeback_moves_the_post_optim_event_after_it)


# --------------------------------------------------------------------------- CPUOffloadPolicy shards
def rank_cpu_offload_policy_shards_gather_and_write_back():
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    ref, model = build_lm(), build_lm()
    for block in model.blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            assert_params_equal(model, ref)
            with torch.no_grad():
                model.blocks[1].fc2.weight.mul_(2.0)
    with torch.no_grad():
        ref.blocks[1].fc2.weight.mul_(2.0)
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    assert all(isinstance(p, DTensor) and p._local_tensor.device.type == "cpu" for p in model.parameters())


def test_cpu_offload_policy_shards_gather_and_write_back(dist_run):
    dist_run(2, rank_cpu_offload_policy_shards_gather_and_write_back)


# --------------------------------------------------------------------------- on a GPU
@cuda
def test_offloaded_results_are_pageable_and_devices_are_kept():
    """One process, torch's fake backend on a CUDA mesh: the all-gather path with real CUDA tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cuda", (8,))
        model = build_lm().cuda()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for device in ("cuda", f"cuda:{torch.cuda.current_device()}", torch.device("cuda")):
            for _, tensor in fsdp_shim.iter_full_params(model, rank0_only=False, device=device):
                assert tensor.device == torch.device("cuda", torch.cuda.current_device())
        for _, tensor in fsdp_shim.iter_full_params(model, rank0_only=False, device="cpu"):
            assert tensor.device.type == "cpu" and not tensor.is_pinned()
        with fsdp_shim.summon_full_params(model, rank0_only=True, offload_to_cpu=True, writeback=False):
            assert all(p.device.type == "cpu" and not p.is_pinned() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert rank is not None
