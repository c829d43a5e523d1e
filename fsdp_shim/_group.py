"""One FSDP2 parameter group of a summon (``SummonedGroup``): everything a context changes on FSDP2's
state and on its units' modules, made by ``summon`` and undone by ``release``, as one pair.

For a group whose every parameter is summoned (by this call or an
enclosing one), on a rank whose slots hold the full parameters: FSDP2's
state is marked so that FSDP2 leaves the slots alone (see [Note: summoned
groups] in ``_fsdp2``), its state-dict and load hooks are suspended, its
units' ``_apply`` converts the full parameters (see [Note: conversions
inside]), and its forward hooks run a forward inside on the full
parameters, cast to FSDP2's ``param_dtype`` as FSDP2 would
(``_ForwardInParamDtype``), and refuse a backward through its outputs
before FSDP2's own hooks run (FSDP1 forbids it too). A forward that cannot
be right (``rank0_only``, or a unit only partly summoned) is refused before
FSDP2's pre-forward changes any state (``refuse_forwards``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim._param import SummonedParam
from fsdp_shim._scope import module_label

#: A conversion made inside a context through a unit's ``_apply``: the unit and the call's arguments.
Conversion = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


class _RaiseOnForward:
    """A global forward pre-hook that refuses a forward through any of its modules (by identity);
    its message is written when it does."""

    __slots__ = ("_modules", "_message")

    def __init__(self, modules: Iterable[nn.Module], message: Callable[[], str]) -> None:
        self._modules = {id(m) for m in modules}
        self._message = message

    def __call__(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._modules:
            raise RuntimeError(self._message())


def refuse_forwards(modules: Iterable[nn.Module], message: Callable[[], str]) -> RemovableHandle:
    """Make a forward through any of ``modules`` raise before their own hooks (FSDP2's) run.

    One global forward pre-hook, for the context's duration: global hooks run
    before every module's own, and one registration serves every module (a
    weight-sync loop makes one a unit). The FSDP2 root is among ``modules``,
    so a forward through the whole model is refused before the root's
    pre-forward changes any state.
    """
    return register_module_forward_pre_hook(_RaiseOnForward(modules, message))


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

    __slots__ = ("_items", "_depth", "_held")

    def __init__(self, items: list[tuple[SummonedParam, torch.dtype]]) -> None:
        self._items = items
        self._depth = 0
        self._held: list[list[Any]] = []

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            casts: dict[int, nn.Parameter] = {}  # one cast per object: a tie stays one parameter
            self._held = [param.cast_for_forward(dtype, casts) for param, dtype in self._items]

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            held, self._held = self._held, []
            for (param, _), slots_held in zip(self._items, held, strict=False):  # held: as far as pre reached
                param.put_back(slots_held)


class SummonedGroup:
    """One FSDP2 parameter group with a parameter in a context's scope.

    ``fully_summoned``: every parameter of the group is summoned, by this
    call or an enclosing one. ``prepare`` runs before the gather, ``summon``
    once this call's parameters are in their slots; ``release`` undoes whatever ``summon`` reached, each step
    even if another raised. Conversions made through the group's units are
    appended to the context's ``journal``, one list for the context, so that
    exit replays them in the order they were made, across groups.
    """

    __slots__ = ("group", "fully_summoned", "units", "_mark", "_suspended", "_converting", "_hooks")

    def __init__(self, group: fsdp2.FSDPParamGroup, fully_summoned: bool) -> None:
        self.group = group
        self.fully_summoned = fully_summoned
        self.units = fsdp2.group_modules(group)
        self._mark: fsdp2.GroupMark | None = None
        self._suspended: fsdp2.Suspended = []
        self._converting: list[nn.Module] = []  # units whose ``_apply`` is ours for the context
        self._hooks: list[RemovableHandle] = []

    def prepare(self) -> bool:
        """FSDP2's group in a known state before anything is gathered, all local, nothing to undo:
        parameter resets adopted, and resharded if a forward left it unsharded (see [Note: units left
        unsharded] in ``_summon``). Whether FSDP2 adopted a parameter (the DTensors to gather changed)."""
        adopted = fsdp2.adopt_module_params(self.group)
        fsdp2.reshard_group(self.group)
        return adopted

    def summon(self, params: list[SummonedParam], holds_fulls: bool, forwards: bool, journal: list[Conversion],
               roots: Callable[[], list[nn.Module]]) -> None:
        """Mark, suspend, redirect ``_apply`` and hook the forwards, for this call's ``params`` of the group.

        ``holds_fulls``: this rank's slots hold full parameters (only then is
        FSDP2's state marked and are forwards hooked); ``forwards``: a forward
        inside may run (not under ``rank0_only``, whose refusal is the
        context's); ``roots``: the FSDP2 roots above, guarded too where a
        forward is refused."""
        if holds_fulls:
            if self.fully_summoned:
                self._mark = fsdp2.mark_summoned(self.group)
                fsdp2.suspend_hooks(fsdp2.group_hook_sites(self.group), self._suspended)
            else:
                fsdp2.suspend_hooks(fsdp2.load_post_hook_sites(p.scoped.fsdp_param for p in params),  # type: ignore[misc]  # a group's parameters have an FSDPParam
                                    self._suspended)
        if self.fully_summoned:
            self._convert_inside(holds_fulls, journal)
        if holds_fulls and forwards:
            self._hook_forwards(params, roots)

    def _convert_inside(self, holds_fulls: bool, journal: list[Conversion]) -> None:
        """Point the units' ``_apply`` at the full parameters.

        [Note: conversions inside]
        ``model.to(...)``, ``.cpu()``, ``.float()`` and friends end in ``_apply``.
        FSDP2's ``_apply`` reshards first, which would put the shards back into the
        slots mid-context (verl's LoRA collection calls ``model.to("cpu")`` there).
        For the context's duration each fully summoned unit gets an instance-level
        ``_apply`` that converts the full parameters in place instead and records the
        call; on exit the same call is replayed through FSDP2's own ``_apply`` on the
        restored shards, before writeback. So inside, the slots keep full tensors
        (``state_dict()`` stays full), and after exit the module is as the same call
        outside would have left it, plus the writeback rule. A rank that holds no
        full tensors (``rank0_only``) records the call too and converts nothing until
        exit: every rank's shards change at the same point, so a stream or a nested
        summon inside gathers the same dtypes everywhere.
        """
        for unit in self.units:
            def apply_to_full(*args: Any, _unit: nn.Module = unit, **kwargs: Any) -> nn.Module:
                journal.append((_unit, args, kwargs))
                if not holds_fulls:
                    return _unit  # deferred to exit, where the holders' shards change too
                return nn.Module._apply(_unit, *args, **kwargs)  # not FSDP2's: it would reshard

            if fsdp2.redirect_apply(unit, apply_to_full):  # else an enclosing context converts it
                self._converting.append(unit)

    def _hook_forwards(self, params: list[SummonedParam], roots: Callable[[], list[nn.Module]]) -> None:
        """Each hook goes into ``_hooks`` as it is made: ``release`` removes those made before a raise."""
        units, hooks = self.units, self._hooks
        if not self.fully_summoned:
            hooks.append(refuse_forwards([*units, *roots()], lambda: (
                f"forward through FSDP unit {', '.join(module_label(m) for m in units)} while only some "
                "of its parameters are summoned is not supported: summon the unit itself"
            )))
            return
        no_backward = _RaiseOnBackward(units)
        for module in units:
            hooks.append(module.register_forward_hook(no_backward))
        items = []
        for param in params:
            dtype = fsdp2.param_dtype_for_forward(self.group, param.scoped.fsdp_param)  # type: ignore[arg-type]  # a group's params have an FSDPParam
            if dtype is not None:
                items.append((param, dtype))
        if items:
            switch = _ForwardInParamDtype(items)
            for module in units:
                hooks.append(module.register_forward_pre_hook(switch.pre_forward))
                hooks.append(module.register_forward_hook(switch.post_forward, always_call=True))

    def converted(self, journal: Iterable[Conversion]) -> bool:
        """Whether a conversion in ``journal`` went through one of the group's units."""
        units = {id(unit) for unit in self.units}
        return any(id(unit) in units for unit, _, _ in journal)

    def release(self) -> None:
        """Undo ``summon``: ``_apply`` overrides dropped, the mark undone, hooks resumed and removed.
        Each step runs even if another raised; the first error is raised after all of them."""
        converting, self._converting = self._converting, []
        for unit in converting:
            fsdp2.restore_apply(unit)
        mark, self._mark = self._mark, None
        first: BaseException | None = None
        for step in (mark.unmark if mark is not None else None, self._resume, self.remove_hooks):
            if step is None:
                continue
            try:
                step()
            except BaseException as error:  # noqa: BLE001  # the rest still run; the first is raised
                first = first or error
        if first is not None:
            raise first

    def _resume(self) -> None:
        fsdp2.resume_hooks(self._suspended)

    def remove_hooks(self) -> None:
        """Take the forward hooks off; one at a time, so that an interrupted removal leaves the rest
        to ``release``."""
        hooks = self._hooks
        while hooks:
            hooks[-1].remove()
            hooks.pop()
