"""The forward hooks a summon installs on the units in scope: refusals, and FSDP2's ``param_dtype``.

Inside a context a fully summoned unit's forward runs on the full
parameters, cast to FSDP2's ``param_dtype`` as FSDP2 would
(``_ForwardInParamDtype``); a backward through its outputs is refused
before FSDP2's own hooks run (FSDP1 forbids it too); a forward that cannot
be right (``rank0_only``, or a unit only partly summoned) is refused before
FSDP2's pre-forward changes any state. Every hook goes into the swap's
list and comes off at exit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim._scope import Scope, module_label, states_of

if TYPE_CHECKING:
    from fsdp_shim._exit import SwappedParam


class _RaiseOnForward:
    """A forward pre-hook that refuses the forward; its message is written when it does."""

    __slots__ = ("_message",)

    def __init__(self, message: Callable[[], str]) -> None:
        self._message = message

    def __call__(self, module: nn.Module, args: Any) -> None:
        raise RuntimeError(self._message())


class _RefuseBackward(torch.autograd.Function):
    """Identity in forward; raises in backward, before any hook of the tensors it wraps."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, message: str) -> torch.Tensor:
        ctx.message = message
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise RuntimeError(ctx.message)


class _RaiseOnBackward:
    """A forward hook that makes any backward through the unit's outputs fail clearly.

    FSDP2's post-backward would reduce-scatter gradients of unsharded
    parameters that a summoned unit never had, and fail deep inside. The
    outputs FSDP2 returns are wrapped once more, so the refusal comes before
    FSDP2's own pre-backward hooks and leaves its state untouched. The
    message is written when a forward needs it: every summon of a unit
    installs this hook, and few run a forward inside.
    """

    __slots__ = ("_modules",)

    def __init__(self, modules: tuple[nn.Module, ...]) -> None:
        self._modules = modules

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None
        message = (f"backward through outputs of FSDP unit {', '.join(module_label(m) for m in self._modules)} "
                   "computed inside summon_full_params is not supported (FSDP1 forbids it too)")

        def refuse(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                return _RefuseBackward.apply(leaf, message)
            return leaf

        return tree_map(refuse, output)


_ABSENT = object()  # a slot the body deleted


class _ForwardInParamDtype:
    """Runs a summoned unit's forward in FSDP2's ``param_dtype``, as FSDP2 would.

    Inside the context the unit's slots hold the full parameters in their
    stored dtype (fp32 master weights), or whatever the body put there. FSDP2
    casts the unit's inputs to ``param_dtype``, so for the forward each slot
    holds a cast of what it holds now, and afterwards exactly what it held
    before, also when the forward raised: a parameter replaced inside the
    context is the one the forward uses and the one exit writes back.

    The cast is made afresh for every forward, never cached: an edit through
    ``.data`` (``p.data.copy_(new)``, the weight loaders' idiom) moves no
    version counter and no data pointer, so no cache of a cast can be proven
    valid. FSDP2's own forward casts on every all-gather too.
    """

    __slots__ = ("_slots", "_depth", "_held")

    def __init__(self, items: list[tuple[SwappedParam, torch.dtype]]):
        self._slots = [(module, name, dtype) for item, dtype in items for module, name in item.entry.slots]
        self._depth = 0
        self._held: list[Any] = []

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth != 1:
            return
        self._held = held = []
        casts: dict[int, nn.Parameter] = {}  # one cast per object: a tie stays one parameter
        for slot_module, name, dtype in self._slots:
            current = slot_module._parameters.get(name, _ABSENT)
            held.append(current)
            if not isinstance(current, torch.Tensor) or not current.is_floating_point() or current.dtype == dtype:
                continue
            cast = casts.get(id(current))
            if cast is None:
                with torch.no_grad():
                    cast = casts[id(current)] = nn.Parameter(current.detach().to(dtype),
                                                             requires_grad=current.requires_grad)
            slot_module._parameters[name] = cast

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            for (slot_module, name, _), held in zip(self._slots, self._held):
                if held is _ABSENT:  # deleted inside the context: stays deleted
                    slot_module._parameters.pop(name, None)
                else:
                    slot_module._parameters[name] = held
            self._held = []


def _refuse_forwards(hooks: list[RemovableHandle], modules: list[nn.Module], message: Callable[[], str]) -> None:
    """Make a forward through any of ``modules`` raise before FSDP2's own hooks run.

    The FSDP2 root is among them, so a forward through the whole model is
    refused before the root's pre-forward changes any state.
    """
    hook = _RaiseOnForward(message)
    unique = {id(m): m for m in modules}
    for module in unique.values():
        hooks.append(module.register_forward_pre_hook(hook, prepend=True))


def _holds_unmanaged_dtensor(module: nn.Module, scope: Scope) -> bool:
    """Whether ``module`` owns a slot of a scoped DTensor that FSDP2 does not manage (tensor parallel)."""
    return any(entry.fsdp_param is None and any(m is module for m, _ in entry.slots) for entry in scope.params)


def install_forward_hooks(
    scope: Scope, swapped: list[SwappedParam], hooks: list[RemovableHandle], rank0_only: bool, holds_fulls: bool
) -> None:
    """The hooks for a context over ``scope`` that summoned ``swapped`` (empty where this rank keeps
    nothing, ``holds_fulls=False``), each appended to ``hooks`` as it is made: the caller removes them at exit,
    also those made before one of these calls raised."""
    if rank0_only or (holds_fulls and not all(scope.groups.values())):  # only the refusals need the roots
        roots = fsdp2.root_modules(states_of(scope))
    if rank0_only:
        # Ranks would disagree on which units need an all-gather: refuse on
        # every rank, before FSDP2's own pre-forward runs.
        root = scope.root
        guarded = [*(m for g in scope.groups for m in fsdp2.group_modules(g)), root, *roots]
        if not scope.fsdp2_only:  # tensor-parallel modules run collectives of their own in forward
            guarded += [m for m in scope.modules if _holds_unmanaged_dtensor(m, scope)]
        _refuse_forwards(hooks, guarded, lambda: (
            f"forward inside summon_full_params({module_label(root)}, rank0_only=True) "
            "is not supported: only rank 0 (of each FSDP shard group) holds full parameters"
        ))
        return
    if not holds_fulls:
        return
    by_group: dict[fsdp2.FSDPParamGroup, list[tuple[SwappedParam, torch.dtype]]] = {}
    for item in swapped:
        group = item.entry.group
        if group is None:
            continue
        if not scope.groups[group]:
            continue
        dtype = fsdp2.param_dtype_for_forward(group, item.entry.fsdp_param)  # type: ignore[arg-type]
        if dtype is not None:
            by_group.setdefault(group, []).append((item, dtype))
    for group, fully_summoned in scope.groups.items():
        modules = fsdp2.group_modules(group)
        if not fully_summoned:
            _refuse_forwards(hooks, [*modules, *roots], lambda modules=modules: (
                f"forward through FSDP unit {', '.join(module_label(m) for m in modules)} while only some "
                "of its parameters are summoned is not supported: summon the unit itself"
            ))
            continue
        no_backward = _RaiseOnBackward(modules)
        for module in modules:
            hooks.append(module.register_forward_hook(no_backward))
        if group in by_group:
            switch = _ForwardInParamDtype(by_group[group])
            for module in modules:
                hooks.append(module.register_forward_pre_hook(switch.pre_forward))
                hooks.append(module.register_forward_hook(switch.post_forward, always_call=True))
