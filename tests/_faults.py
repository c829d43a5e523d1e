"""Fault injection at the ``torch.distributed`` boundary, for the tests (imported inside spawned ranks).

Faults are injected where any caller meets c10d, never in the shim's own
functions, so they survive refactors of the gather engine: the all-gather
every bucket moves by (``all_gather_single``, ``all_gather_into_tensor``
before torch 2.13) is wrapped on ``torch.distributed`` for the duration of
a ``with inject(...)`` block. The shim looks both names up there at each call.

Also here: a process group with a short timeout (so a one-sided fault ends in
seconds, not the pool's minutes), a ``with_grads`` case on one, and the checks
every fault test makes.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from _helpers import ALL_GATHERS, LMConfig, build_lm, shard_lm, wrapping_dist
from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _health, _registry

#: The operations ``inject`` can fail, each the names it wraps on ``torch.distributed``.
OPERATIONS = {
    "all_gather": ALL_GATHERS,
}


class InjectedFault(RuntimeError):
    """What an injected fault raises (unless the test asks for another exception)."""


@contextlib.contextmanager
def inject(operation: str, *, after: int = 0, exception: type[BaseException] = InjectedFault) -> Iterator[list[int]]:
    """Make the ``after + 1``-th call of ``operation`` on this rank raise ``exception``, before it reaches c10d.

    Yields a one-element list: how many calls of ``operation`` were made.
    """
    calls = [0]

    def wrap(name, original):
        def faulty(*args, **kwargs):
            calls[0] += 1
            if calls[0] == after + 1:
                raise exception(f"injected fault in {operation} (call {calls[0]})")
            return original(*args, **kwargs)

        return faulty

    with wrapping_dist(OPERATIONS[operation], wrap):
        yield calls


def outputs_before_first_launch(model: nn.Module, bucket_mb: float) -> int:
    """The allocations ``iter_full_params(model, bucket_mb=...)`` makes before its first launch: an output a
    bucket of its first batch's first launch, all staged before it posts."""
    from fsdp_shim._gather.layout import bucket_cap, bucket_plan
    from fsdp_shim._stream import batch_params

    cap = bucket_cap(bucket_mb).bucket_bytes
    first = batch_params(model, cap, None)[0]
    return bucket_plan([t for t in first.tensors if isinstance(t, DTensor)], cap, together=True).launches[0]


@contextlib.contextmanager
def inject_allocation(*, after: int = 0) -> Iterator[list[int]]:
    """Make the ``after + 1``-th ``torch.empty`` the shim itself calls raise, as an allocation failure would.

    Only calls made from ``fsdp_shim``'s own code count (torch's internals allocate too). Yields a
    one-element list: how many such calls were made.
    """
    calls = [0]
    original = torch.empty

    def empty(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("fsdp_shim."):
            calls[0] += 1
            if calls[0] == after + 1:
                raise InjectedFault(f"injected allocation failure (call {calls[0]})")
        return original(*args, **kwargs)

    torch.empty = empty
    try:
        yield calls
    finally:
        torch.empty = original


class _FailShimCall(TorchFunctionMode):
    """``inject_call``'s mode: counts the calls of one torch function that fsdp_shim's own frames make."""

    def __init__(self, function, after: int, when, exception: type[BaseException]) -> None:
        super().__init__()
        self.function, self.after, self.when, self.exception, self.calls = function, after, when, exception, [0]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is self.function and sys._getframe(1).f_globals.get("__name__", "").startswith("fsdp_shim.")
                and (self.when is None or self.when(*args, **kwargs))):
            self.calls[0] += 1
            if self.calls[0] == self.after + 1:
                raise self.exception(f"injected allocation failure in {func.__name__} (call {self.calls[0]})")
        return func(*args, **kwargs)


@contextlib.contextmanager
def inject_call(function, *, after: int = 0, when=None,
                exception: type[BaseException] = InjectedFault) -> Iterator[list[int]]:
    """Make the ``after + 1``-th call of ``function`` (a torch function or ``torch.Tensor`` method, such as
    ``torch.Tensor.to``, which allocates when it converts) that fsdp_shim's own code makes, and that
    ``when(*args, **kwargs)`` accepts (every call, by default), raise ``exception``, as an allocation
    failure there would. A ``TorchFunctionMode``: it sees calls that never pass through ``torch.empty``
    (``inject_allocation``). Yields a one-element list: how many such calls were made.
    """
    mode = _FailShimCall(function, after, when, exception)
    with mode:
        yield mode.calls


_meshes_made = itertools.count()


def short_timeout_mesh(seconds: float = 3.0) -> DeviceMesh:
    """A 1-D CPU mesh on a fresh process group of every rank whose collectives time out after ``seconds``.

    A collective: every rank calls it. A fault leaves its group out of step,
    so each test takes a new one and never uses it again. Each gets a dim
    name of its own: torch maps meshes that compare equal (same ranks and
    shape, no names) to one another, so a second nameless mesh's DTensors
    ended up on the first mesh's (broken) group.
    """
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=seconds))
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"faults{next(_meshes_made)}",))


def with_grads_on_a_short_timeout(config: LMConfig) -> tuple[nn.Module, dict, bool]:
    """A ``with_grads`` fault case: ``build_lm(config)`` sharded on a ``short_timeout_mesh(3.0)``, every
    gradient ones; its ``local_shards``, for ``assert_untouched``; and whether this rank faults (rank 0)."""
    model = shard_lm(build_lm(config), short_timeout_mesh(3.0))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return model, local_shards(model), dist.get_rank() == 0


def local_shards(model: nn.Module) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Every parameter object and a copy of its local shard (of its value, for plain tensors).

    A slot a forward left unsharded (the root on torch 2.7) holds FSDP2's unsharded copy; what counts
    is FSDP2's sharded parameter behind it, which a summon puts back on entry, as ``reshard()`` does.
    """
    sharded = {}
    for module in model.modules():
        state = fsdp2.fsdp_state_of(module)
        for group in fsdp2.param_groups(state) if state is not None else []:
            for fsdp_param in group.fsdp_params:
                for slot_module, name in fsdp2.param_slots(fsdp_param):
                    sharded[(id(slot_module), name)] = fsdp_param.sharded_param
    out = {}
    for module_name, module in model.named_modules():
        for name, p in module._parameters.items():
            fqn = f"{module_name}.{name}" if module_name else name
            if p is None or fqn in out or any(p is q for q, _ in out.values()):
                continue
            p = sharded.get((id(module), name), p)
            out[fqn] = (p, (p._local_tensor if isinstance(p, DTensor) else p).detach().clone())
    names = dict(model.named_parameters())
    return {name: value for name, value in out.items() if name in names}


def assert_untouched(model: nn.Module, before: dict[str, tuple[nn.Parameter, torch.Tensor]]) -> None:
    """The rule of [Note: faults]: same objects, bit-identical shards, FSDP2 idle and sharded, no registry entry."""
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, shard) in before.items():
        assert after[name] is param, f"{name}: parameter object replaced"
        local = param._local_tensor if isinstance(param, DTensor) else param
        assert torch.equal(local.view(torch.uint8) if local.numel() else local,
                           shard.view(torch.uint8) if shard.numel() else shard), f"{name}: shard bits changed"
    for module in model.modules():
        state = fsdp2.fsdp_state_of(module)
        for group in fsdp2.param_groups(state) if state is not None else []:
            assert group.is_sharded, f"{type(module).__name__}: FSDP2 group not sharded"
            assert group._training_state == TrainingState.IDLE, f"{type(module).__name__}: FSDP2 group busy"
    assert not _registry._live and not _health._claims, (
        "registry entries left behind")
