"""Never silently wrong: threads, misuse inside the context, odd placements, dead groups, buffers.

Each case once lost data with no error. Each test shows that nothing is lost,
or that a clear error came before anything changed.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import fsdp_shim
from _helpers import (
    LMConfig,
    assert_unchanged,
    build_lm,
    full_state,
    mesh1d,
    patch_state_restored,
    patched,
    shard_lm,
    snapshot,
    tokens_for,
)


def _models():
    return build_lm(), shard_lm(build_lm())


# -- 1. threads --------------------------------------------------------------------------------
def rank_threads_never_share_a_context():
    ref, model = _models()
    before = snapshot(model)
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def outer():
        try:
            with FSDP.summon_full_params(model, writeback=False):
                entered.set()
                release.wait(30)
                assert torch.equal(model.blocks[0].fc1.weight, ref.blocks[0].fc1.weight)
        except BaseException as exc:  # noqa: BLE001  (an assert in a thread only reaches threading.excepthook)
            errors.append(exc)

    with patched():
        holder = threading.Thread(target=outer)
        holder.start()
        assert entered.wait(30)
        try:
            for unit in (model.blocks[0], model.blocks[1]):  # held by the other thread: refused, no collective
                with pytest.raises(RuntimeError, match="another thread"):
                    with FSDP.summon_full_params(unit, writeback=True):
                        pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        release.set()
        holder.join(30)
        assert not holder.is_alive(), "the holder thread never left its context"
        assert not errors, errors
        # afterwards, this thread summons as usual, and nothing was lost or changed
        with FSDP.summon_full_params(model.blocks[0], writeback=True):
            with torch.no_grad():
                model.blocks[0].fc1.weight.add_(1.0)
    assert_unchanged(model, before, values=False)
    assert torch.equal(full_state(model)["blocks.0.fc1.weight"], ref.blocks[0].fc1.weight + 1.0)


def test_threads_never_share_a_context(dist_run):
    dist_run(2, rank_threads_never_share_a_context)


def rank_another_thread_on_the_same_group_is_refused():
    _, model = _models()
    entered, release = threading.Event(), threading.Event()

    errors: list[BaseException] = []

    def unit_zero():
        try:
            with FSDP.summon_full_params(model.blocks[0], writeback=False):
                entered.set()
                release.wait(30)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with patched():
        holder = threading.Thread(target=unit_zero)
        holder.start()
        assert entered.wait(30)
        try:
            with pytest.raises(RuntimeError, match="same process group"):
                with FSDP.summon_full_params(model.blocks[1], writeback=False):  # disjoint slots, same group
                    pass
        finally:
            release.set()
            holder.join(30)
    assert not holder.is_alive() and not errors, errors


def test_another_thread_on_the_same_process_group_is_refused(dist_run):
    dist_run(2, rank_another_thread_on_the_same_group_is_refused)


# -- 2. fully_shard inside ------------------------------------------------------------------------
def rank_fully_shard_inside_is_refused():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=True):
        with pytest.raises(RuntimeError, match=r"fully_shard\(\) inside summon_full_params"):
            fully_shard(model.embed)
        assert not hasattr(model.embed, "_get_fsdp_state")  # untouched: no state, no class swap
    assert_unchanged(model, before)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(2):
        for m, optimizer in zip((model, ref), optimizers):
            m(tokens).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    got = full_state(model)
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    fully_shard(nn.Linear(2, 2))  # outside, fully_shard works
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # noqa: PLC0415

    with patch_state_restored():  # the guard is part of the patch: in with patch(), out with unpatch()
        fsdp_shim.unpatch()
        assert not hasattr(FSDPState.__init__, "__wrapped__")
        fsdp_shim.patch()
        assert hasattr(FSDPState.__init__, "__wrapped__")


def test_fully_shard_inside_the_context_is_refused(dist_run):
    dist_run(2, rank_fully_shard_inside_is_refused)


# -- 3. edits that used to vanish --------------------------------------------------------------
def rank_replaced_parameters_are_written_back():
    ref, model = _models()
    new = torch.randn_like(ref.blocks[0].fc1.weight)
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            model.blocks[0].fc1.weight = nn.Parameter(new.clone())
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["norm.bias"] = torch.full_like(state["norm.bias"], 3.0)
            model.load_state_dict(state, assign=True)
    got = full_state(model)
    assert torch.equal(got["blocks.0.fc1.weight"], new)
    assert torch.all(got["norm.bias"] == 3.0)
    assert isinstance(model.blocks[0].fc1.weight, DTensor) and isinstance(model.norm.bias, DTensor)
    assert torch.equal(got["blocks.1.fc2.weight"], ref.blocks[1].fc2.weight)


def test_replaced_parameters_are_written_back_like_fsdp1(dist_run):
    dist_run(2, rank_replaced_parameters_are_written_back)


def rank_deleted_parameter_refuses_the_whole_writeback():
    _, model = _models()
    before = snapshot(model)
    with patched():
        with pytest.raises(fsdp_shim.WritebackRefusedError, match=r"nothing written(.|\n)*blocks.0.fc1.bias: deleted"):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.blocks[1].fc1.weight.add_(1.0)  # would be written, were the whole writeback sound
                del model.blocks[0].fc1.bias
    assert_unchanged(model, before)


def test_a_deleted_parameter_refuses_the_whole_writeback(dist_run):
    dist_run(2, rank_deleted_parameter_refuses_the_whole_writeback)


def rank_optimizer_step_inside_is_kept_or_refused():
    ref, model = _models()
    tokens = tokens_for(LMConfig())
    for m in (model, ref):
        m(tokens).pow(2).mean().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the sharded parameters
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            optimizer.step()  # the shards move; the full tensors hold nothing new
        ref_optimizer.step()
        got = full_state(model)
        assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())  # the step was not overwritten
        stepped = snapshot(model)
        with pytest.raises(RuntimeError, match=r"changed inside the context and, separately, in its shard"):
            with FSDP.summon_full_params(model, writeback=True):
                with torch.no_grad():
                    model.blocks[0].fc1.weight.mul_(2.0)
                optimizer.step()
        ref_optimizer.step()
        assert_unchanged(model, stepped, values=False)
        got = full_state(model)  # the optimizer's update stands, the conflicting edit is refused whole
        assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())


def test_optimizer_step_inside_is_kept_or_refused(dist_run):
    dist_run(2, rank_optimizer_step_inside_is_kept_or_refused)


def rank_requires_grad_carries_over():
    _, model = _models()
    with patched(), FSDP.summon_full_params(model, writeback=False):
        model.blocks[0].fc1.weight.requires_grad_(False)
    assert isinstance(model.blocks[0].fc1.weight, DTensor)
    assert model.blocks[0].fc1.weight.requires_grad is False
    assert model.blocks[0].fc2.weight.requires_grad is True
    model(tokens_for(LMConfig())).sum().backward()
    assert model.blocks[0].fc1.weight.grad is None and model.blocks[0].fc2.weight.grad is not None


def test_requires_grad_set_inside_carries_over_as_in_fsdp1(dist_run):
    dist_run(2, rank_requires_grad_carries_over)


def rank_inner_writeback_under_outer_discard_is_refused():
    _, model = _models()
    before = snapshot(model)
    with patched(), FSDP.summon_full_params(model, writeback=False):
        with pytest.raises(RuntimeError, match="enclosing writeback=False"):
            with FSDP.summon_full_params(model.blocks[0], writeback=True):
                pass
        with FSDP.summon_full_params(model.blocks[0], writeback=False):  # the same nesting, no writeback: fine
            pass
    assert_unchanged(model, before)


def test_writeback_inside_a_discarding_context_is_refused_at_entry(dist_run):
    dist_run(2, rank_inner_writeback_under_outer_discard_is_refused)


# -- 4. Partial placements ---------------------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        torch.manual_seed(0)
        self.full_partial = torch.randn(4, 3)
        self.full_shard = torch.randn(6, 2)
        local = self.full_partial / dist.get_world_size()  # a sum over ranks gives the full value
        self.p = nn.Parameter(DTensor.from_local(local, mesh, [Partial()], run_check=False))
        self.s = nn.Parameter(distribute_tensor(self.full_shard.clone(), mesh, [Shard(0)]))


def rank_partial_placements_write_back_exactly():
    mesh = mesh1d()
    model = Mixed(mesh)
    with patched():
        with FSDP.summon_full_params(model):  # writeback=True by default, no edit: no error, no change
            torch.testing.assert_close(model.p, model.full_partial)
        torch.testing.assert_close(model.p.full_tensor(), model.full_partial)
        with FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model.p.copy_(torch.arange(12.0).view(4, 3))
                model.s.add_(1.0)
    assert tuple(model.p.placements) == (Partial(),)
    assert torch.equal(model.p.full_tensor(), torch.arange(12.0).view(4, 3))
    assert torch.equal(model.s.full_tensor(), model.full_shard + 1.0)


def test_partial_placements_write_back_exactly(dist_run):
    dist_run(2, rank_partial_placements_write_back_exactly)


# -- 5. destroyed process group ----------------------------------------------------------------
def rank_destroyed_group_fails_clearly():
    group = dist.new_group(list(range(dist.get_world_size())))
    # a dim name of its own: torch maps nameless meshes over the same ranks to the first one made
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("destroyed",))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach().clone(), mesh, [Shard(0)]))
    with patched():
        with FSDP.summon_full_params(model, writeback=False):
            assert model.weight.shape == (4, 4)
        dist.destroy_process_group(group)
        with pytest.raises(fsdp_shim.DestroyedGroupError, match="destroyed"):
            with FSDP.summon_full_params(model, writeback=False):
                pass
    assert isinstance(model.weight, DTensor)


def test_a_destroyed_process_group_fails_clearly(dist_run):
    dist_run(2, rank_destroyed_group_fails_clearly)


# -- 6. DTensor buffers ------------------------------------------------------------------------
class Scaled(nn.Module):
    def __init__(self, mesh: DeviceMesh | None):
        super().__init__()
        torch.manual_seed(2)
        self.linear = nn.Linear(4, 6)
        self.register_buffer("scale", torch.randn(6))
        if mesh is not None:
            self.linear.weight = nn.Parameter(distribute_tensor(self.linear.weight.detach(), mesh, [Shard(0)]))
            self.linear.bias = nn.Parameter(distribute_tensor(self.linear.bias.detach(), mesh, [Replicate()]))
            self.scale = distribute_tensor(self.scale, mesh, [Shard(0)])

    def forward(self, x):
        return self.linear(x) * self.scale


def rank_dtensor_buffers_are_gathered_like_parameters():
    ref, model = Scaled(None), Scaled(mesh1d())
    buffer = model.scale
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with patched():
        with FSDP.summon_full_params(model, writeback=True):
            assert not isinstance(model.scale, DTensor) and torch.equal(model.scale, ref.scale)
            assert torch.equal(model(x), ref(x))  # used to fail: mixed torch.Tensor and DTensor
            model.scale.mul_(2.0)
    assert model.scale is buffer
    assert torch.equal(buffer.full_tensor(), ref.scale * 2.0)


def test_dtensor_buffers_are_gathered_like_parameters(dist_run):
    dist_run(2, rank_dtensor_buffers_are_gathered_like_parameters)


# -- 7. FSDP1 parity ---------------------------------------------------------------------------
def rank_forward_backward_error_starts_with_fsdp1s_sentence():
    _, model = _models()
    seen = []

    def hook(module, args):
        with pytest.raises(AssertionError, match="^Cannot manually unshard parameters during forward/backward"):
            with FSDP.summon_full_params(model):
                pass
        seen.append(True)

    with patched():
        handle = model.blocks[0].register_forward_pre_hook(hook)
        model(tokens_for(LMConfig()))
        handle.remove()
    assert seen


def test_forward_backward_error_starts_with_fsdp1s_sentence(dist_run):
    dist_run(2, rank_forward_backward_error_starts_with_fsdp1s_sentence)


def rank_hsdp_rank0_only_is_rank0_of_every_shard_group():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model = build_lm(), shard_lm(build_lm(), mesh)
    with patched(), FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        full = not isinstance(model.embed.weight, DTensor)
        if full:
            assert torch.equal(model.embed.weight, ref.embed.weight)
    return full


def test_hsdp_rank0_only_matches_fsdp1(dist_run):
    assert dist_run(4, rank_hsdp_rank0_only_is_rank0_of_every_shard_group) == [True, False, True, False]
