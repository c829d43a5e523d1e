"""Rank-side helpers shared by the tests (imported inside spawned ranks)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp_shim
from fsdp_shim.tools.models import LMConfig, TinyLM, build_lm, shard_lm, tokens_for

__all__ = [
    "LMConfig", "TinyLM", "build_lm", "shard_lm", "tokens_for",
    "assert_params_equal", "full_state", "mesh1d", "patched", "reference_and_sharded", "snapshot",
    "assert_unchanged", "rank", "patch_state_restored", "counting_collectives", "wrapping_dist",
]


def rank() -> int:
    return dist.get_rank()


def mesh1d():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def reference_and_sharded(**shard_kwargs) -> tuple[TinyLM, TinyLM]:
    """A reference and a ``shard_lm`` copy (``shard_kwargs``: its keywords) of one seed: equal to start."""
    return build_lm(), shard_lm(build_lm(), **shard_kwargs)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """The suite's ranks are shared: leave the patch as found."""
    was = fsdp_shim.is_patched()
    fsdp_shim.patch()
    try:
        yield
    finally:
        if not was:
            fsdp_shim.unpatch()


@contextlib.contextmanager
def patch_state_restored(env: str | None = None) -> Iterator[None]:
    """For tests that unpatch, re-patch or switch an instrumentation off: the patch (and ``env``) as found after."""
    was = fsdp_shim.is_patched()
    try:
        yield
    finally:
        if env is not None:
            os.environ.pop(env, None)
        fsdp_shim.unpatch()
        if was:
            fsdp_shim.patch()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor, through DTensor itself (not the shim)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
    return out


def assert_params_equal(model: nn.Module, reference: nn.Module, *, exact: bool = True) -> None:
    got = list(model.named_parameters())
    want = list(reference.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, p), (_, r) in zip(got, want):
        assert not isinstance(p, DTensor), f"{name} is still a DTensor"
        assert type(p) is nn.Parameter, f"{name}: {type(p)}"
        assert p.shape == r.shape and p.dtype == r.dtype, (name, p.shape, r.shape, p.dtype, r.dtype)
        if exact:
            assert torch.equal(p.detach(), r.detach()), f"{name} differs"
        else:
            torch.testing.assert_close(p.detach(), r.detach(), msg=lambda m, name=name: f"{name}: {m}")


def snapshot(model: nn.Module) -> dict[str, object]:
    """Identity and content of every slot, gradient and FSDP2 group state.

    FSDP2 initialises lazily at the first forward, and ``summon_full_params``
    at entry (as FSDP1 does); that init changes group state on some torch
    releases. A snapshot is of the initialised model, through FSDP2's own
    ``_lazy_init`` of the root.
    """
    from fsdp_shim import _fsdp2 as fsdp2

    root_state = fsdp2.fsdp_state_of(model)
    if root_state is not None and root_state._is_root is None:
        root_state._lazy_init()

    slots = {}
    for mod_name, module in model.named_modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            local = p._local_tensor if isinstance(p, DTensor) else p
            grad = p.grad
            grad_local = grad._local_tensor if isinstance(grad, DTensor) else grad
            slots[f"{mod_name}.{name}"] = (
                p, local.detach().clone(), grad, None if grad_local is None else grad_local.clone()
            )
    groups = []
    for m in model.modules():
        state = fsdp2.fsdp_state_of(m)
        if state is not None:
            for g in fsdp2.param_groups(state):
                groups.append((g, g._sharded_state, g.post_forward_mesh_info, g._training_state))
    return {"slots": slots, "groups": groups}


def assert_unchanged(model: nn.Module, before: dict[str, object], *, values: bool = True) -> None:
    after = snapshot(model)
    assert before["slots"].keys() == after["slots"].keys()
    for key, (p, local, grad, grad_local) in before["slots"].items():
        q, local2, grad2, grad_local2 = after["slots"][key]
        assert q is p, f"{key}: parameter object replaced"
        assert grad2 is grad, f"{key}: grad object replaced"
        if values:
            assert torch.equal(local, local2), f"{key}: shard values changed"
            if grad_local is not None:
                assert torch.equal(grad_local, grad_local2), f"{key}: grad values changed"
    assert [(g, s, m, t) for g, s, m, t in before["groups"]] == [
        (g, s, m, t) for g, s, m, t in after["groups"]
    ], "FSDP2 group state changed"


#: Every way the shim posts an all-gather: c10d's function (renamed in 2.13), and a launch of several
#: ([Note: one launch a group]): the process group's own method, wrapped on its class.
ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "ProcessGroup.allgather_into_tensor_coalesced")
_COLLECTIVES = (*ALL_GATHERS, "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor",
                "all_to_all_single", "barrier")


def _owner(name: str) -> tuple[object, str]:
    """Where a wrapped name lives: ``torch.distributed``, or c10d's ``ProcessGroup`` class for ``ProcessGroup.x``."""
    owner, _, attribute = name.rpartition(".")
    return (dist.ProcessGroup if owner else dist), attribute


@contextlib.contextmanager
def wrapping_dist(names, wrap) -> Iterator[None]:
    """Each of ``names`` that ``torch.distributed`` (or, for ``ProcessGroup.x``, its process groups) has,
    replaced by ``wrap(name, original)`` for the block (the shim looks each up at each call): the originals
    still run, on the real process group, and are back after the block."""
    # put back as stored: a class's raw entry (pybind's ``instancemethod``), which ``getattr`` unwraps
    stored = {name: vars(owner)[attribute] for name in names for owner, attribute in [_owner(name)]
              if attribute in vars(owner)}
    for name in stored:
        setattr(*_owner(name), wrap(name, getattr(*_owner(name))))
    try:
        yield
    finally:
        for name, original in stored.items():
            setattr(*_owner(name), original)


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Count the collectives issued through ``torch.distributed``, by name."""
    counts: dict[str, int] = {}

    def counted(name, function):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return function(*args, **kwargs)
        return call

    with wrapping_dist(_COLLECTIVES, counted):
        yield counts
