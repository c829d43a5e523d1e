"""One FSDP2 parameter group of a summon (``SummonedGroup``): what a context changes on FSDP2's state and
units, made by ``summon`` and undone by ``release``; and the conversions made inside (``Conversions``).

A fully summoned group, where this rank holds full tensors, is marked ([Note: summoned groups] in ``_fsdp2``),
its state-dict hooks suspended; a forward inside runs in FSDP2's ``param_dtype`` and a backward through it is
refused (as FSDP1 does). A forward that cannot be right (``rank0_only``, a unit partly summoned) is refused
before FSDP2's pre-forward changes anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim import _versions
from fsdp_shim._common import run_each
from fsdp_shim._param import SummonedParam, hide_slots, put_back_slots
from fsdp_shim._scope import Scope, SlotOwner, module_label, slot_owners, states_of

#: A conversion made inside a context through a unit's ``_apply``: the unit and the call's arguments.
Conversion = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


class ForwardRefusal:
    """A forward through any of ``modules`` raises before FSDP2 runs anything for it, once ``install``ed: a global
    pre-hook (ahead of their own hooks), and the guard on forward methods registered on them
    (``_fsdp2.guard_forward_methods``), which reach FSDP2's all-gather without ``_call_impl`` (``states``: those of
    the FSDP2 units among ``modules``). Kept by its owner before it is installed; ``remove()`` takes both away,
    and first empties what it refuses, so a hook whose handle an interrupt lost refuses nothing."""

    def __init__(self, modules: Iterable[nn.Module], message: Callable[[], str],
                 states: Iterable[fsdp2.FSDPState]) -> None:
        self._refused: Collection[nn.Module] = set(modules)  # identity hashes: no call a module

        def refuse(module: nn.Module, *_: Any) -> None:  # the message is written when it raises
            if module in self._refused:
                raise RuntimeError(message())

        self._refuse, self._states = refuse, states
        self._guarded: fsdp2.Guarded = []
        self._handle: RemovableHandle | None = None

    def install(self) -> None:
        self._handle = register_module_forward_pre_hook(self._refuse)
        fsdp2.guard_forward_methods(self._states, self._refuse, self._guarded)

    def remove(self) -> None:
        self._refused = ()
        if self._handle is not None:
            self._handle.remove()
        fsdp2.unguard_forward_methods(self._guarded, self._refuse)


class _RefuseBackward(torch.autograd.Function):
    """Identity in forward; raises in backward, before any hook of the tensor it wraps. The tensor itself is
    returned, marked dirty, so in-place ops on it still work (verl scales logits in place) and hooks registered
    on it before (FSDP2's pre-backward) sit below the refusal."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, message: str) -> torch.Tensor:
        ctx.message = message
        ctx.mark_dirty(tensor)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise RuntimeError(ctx.message)


class _RefuseBackwardOfLeaf(_RefuseBackward):
    """``_RefuseBackward`` for a leaf (autograd forbids marking one dirty): a view of it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, message: str) -> torch.Tensor:
        ctx.message = message
        return tensor.view_as(tensor)


class _RaiseOnBackward:
    """A forward hook that makes any backward through the unit's outputs fail clearly, before FSDP2's own
    pre-backward hooks (its post-backward would fail deep inside, its state changed). The message is written
    only when a forward needs it: every summon installs this hook, few run a forward."""

    __slots__ = ("_modules",)

    def __init__(self, modules: tuple[nn.Module, ...]) -> None:
        self._modules = modules

    def remove(self) -> None:
        """Refuse nothing more: a hook whose handle an interrupt lost does nothing."""
        self._modules = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._modules or not torch.is_grad_enabled():
            return None
        message = (f"backward through outputs of FSDP unit {', '.join(module_label(m) for m in self._modules)} "
                   "computed inside summon_full_params is not supported (FSDP1 forbids it too)")

        def refuse(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                return (_RefuseBackwardOfLeaf if leaf.is_leaf else _RefuseBackward).apply(leaf, message)
            return leaf

        return tree_map(refuse, output)


class _ForwardInParamDtype:
    """A summoned unit's forward in FSDP2's ``param_dtype``: during it each slot holds a cast of what it holds
    now (a replacement included), afterwards exactly that again. Cast afresh every forward, as FSDP2 does: an
    edit through ``.data`` moves no version counter, so no cached cast can be proven valid.

    [Note: casts never outlive their forward]
    Put back by the post-forward hook, an ``always_call`` hook on an ``Exception``, and for any other
    ``BaseException`` (no hook runs) by ``SummonedGroup``'s guard on the unit's ``_call_impl``. A method
    ``register_fsdp_forward_method`` made a forward runs past both: ``SummonedGroup`` wraps the unit's attribute
    to cast and put back the same way (a reference taken before entry is not wrapped: the README's Limits). A
    fault part way puts back the casts placed so far (``held``), and exit ``unwind``s what a compiled forward left
    before it reads the slots: exit never takes a cast for the user's replacement.
    """

    __slots__ = ("_items", "_depth", "_held")

    def __init__(self, items: list[tuple[SummonedParam, torch.dtype]]) -> None:
        self._items = items
        self._depth = 0
        self._held: list[list[Any]] = []  # what each cast parameter's slots held, as far as the casts reached

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            casts: dict[int, nn.Parameter] = {}  # one cast per object: a tie stays one parameter
            held = self._held = []
            try:
                for param, dtype in self._items:
                    param.cast_for_forward(dtype, casts, held)  # recorded in ``held`` before it is placed
            except BaseException:
                self._put_back()
                raise

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._put_back()

    def _put_back(self) -> None:
        held = self._held
        while held:  # last first; what a put-back reached is gone from ``held``, the rest stays for ``unwind``
            self._items[len(held) - 1][0].put_back(held[-1])
            held.pop()

    def unwind(self, depth: int = 0) -> None:
        """Back to ``depth`` forwards in progress: at 0, every cast put back."""
        if self._depth > depth:
            self._depth = depth
        if self._depth == 0 and self._held:
            self._put_back()

    def retire(self) -> None:
        """Every cast put back, and nothing left to cast: a hook whose handle an interrupt lost casts nothing."""
        self.unwind()
        self._items = []


class Conversions:
    """The conversions (``.to()``, ``.double()``, ...) made inside one context, across groups in call order.

    [Note: conversions inside]
    Conversions end in ``_apply``. FSDP2's would reshard mid-context and adopt a full tensor as its shard; a
    plain module's would convert a ``rank0_only`` non-holder's shard on that rank alone. So while open, every
    unit in scope and every module holding a summoned slot runs ``nn.Module._apply`` with this rank's
    shard-holding slots hidden, and the outermost call is recorded before it runs (a fault part way is completed
    by the replay). At exit each is replayed through the module's own ``_apply`` on the restored slots, before
    writeback. Converting a plain submodule holding FSDP2 parameters is refused: FSDP2 follows whole units only.
    """

    __slots__ = ("made", "_redirected", "_depth", "_covered")

    def __init__(self) -> None:
        #: The outermost conversions made inside, in call order: ``(module, args, kwargs)``.
        self.made: list[Conversion] = []
        self._redirected: list[nn.Module] = []  # modules whose ``_apply`` is ours for the context
        self._depth = 0  # conversions in progress (a module's ``_apply`` calls its children's)
        self._covered: set[int] | None = None  # modules under a recorded conversion (``exit_dtype``)

    def redirect(self, units: Iterable[nn.Module], owners: Iterable[SlotOwner], holds_fulls: bool) -> None:
        """Redirect ``_apply`` of ``units`` and of each slot owner not redirected already (by an enclosing context).
        Keyed by identity hash: every summon runs this, so it makes no call a module."""
        plan: dict[nn.Module, tuple[Sequence[tuple[dict[str, Any], str]], nn.Module | None]] = {}
        for module, slots, fsdp2_managed in owners:
            plan[module] = (() if holds_fulls else slots, module if fsdp2_managed else None)
        for unit in units:  # a unit's conversion is FSDP2's to follow: never refused
            plan[unit] = (plan[unit][0] if unit in plan else (), None)
        fsdp2.redirect_apply(plan, self._run, self._redirected)

    def _run(self, module: nn.Module, how: tuple[Sequence[tuple[dict[str, Any], str]], nn.Module | None],
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
        """``module._apply(*args, **kwargs)`` inside the context; ``how``: the slots to hide, the module to refuse."""
        hidden, refused = how
        if self._depth == 0:
            if refused is not None:
                raise RuntimeError(
                    f"a conversion (.to(), .double(), ...) of {module_label(refused)}, a part of an FSDP "
                    "unit, inside summon_full_params is not supported: FSDP2 follows the conversion of "
                    "whole units only. Convert its unit (or the whole model) instead."
                )
            self.made.append((module, args, kwargs))  # first: a fault part way is completed at exit
            self._covered = None
        held = hide_slots(hidden) if hidden else None
        self._depth += 1
        try:
            return fsdp2.convert_bypassing_fsdp2(module, args, kwargs)
        finally:
            self._depth -= 1
            if held is not None:
                put_back_slots(held)

    def release(self) -> None:
        """Every ``_apply`` redirected by this context is the module's own again."""
        fsdp2.restore_methods(self._redirected, "_apply")

    def exit_dtype(self, param: SummonedParam) -> torch.dtype | None:
        """``param``'s full dtype where a recorded conversion covers one of its slots (its shard's after replay)."""
        full = param.full
        if not self.made or full is None or full.dtype == param.sharded.dtype:
            return None
        covered = self._covered
        if covered is None:
            covered = self._covered = {id(m) for module, _, _ in self.made for m in module.modules()}
        return full.dtype if any(id(m) in covered for m, _ in param.slots) else None

    def replay(self, summoned: Sequence[SummonedParam], name: Callable[[SummonedParam], str]) -> None:
        """Each recorded conversion again, on the restored slots; a warning for each parameter converted inside
        otherwise (its shard keeps its dtype)."""
        made, self.made = self.made, []
        for module, args, kwargs in made:
            fsdp2.convert(module, args, kwargs)
        for param in summoned:
            current = param.current
            if isinstance(current, torch.Tensor) and current.dtype != param.sharded.dtype:
                _versions.warn(
                    f"{name(param)} was converted to {current.dtype} inside summon_full_params other "
                    f"than through a module's .to() or .double(); the sharded parameter stays "
                    f"{param.sharded.dtype}. Convert its FSDP unit (or the whole model) instead.",
                    stacklevel=5,
                    mesh=param.sharded.device_mesh,
                )


class SummonedGroup:
    """One FSDP2 parameter group with a parameter in a context's scope. ``fully_summoned``: every parameter is
    summoned, by this call or an enclosing one. ``prepare`` runs before the gather, ``summon`` once the
    parameters are in their slots; ``release`` undoes whatever ``summon`` reached."""

    __slots__ = ("group", "fully_summoned", "units", "_mark", "_suspended", "_hooks", "_switch", "_wrapped",
                 "_guarded", "_roots", "_cut_short")

    def __init__(self, group: fsdp2.FSDPParamGroup, fully_summoned: bool) -> None:
        self.group = group
        self.fully_summoned = fully_summoned
        self.units = fsdp2.group_modules(group)
        self._mark: fsdp2.GroupMark | None = None
        self._suspended: fsdp2.Suspended = []
        self._hooks: list[RemovableHandle | ForwardRefusal | _RaiseOnBackward] = []
        self._switch: _ForwardInParamDtype | None = None
        self._wrapped: fsdp2.Wrapped = []  # forward methods registered on the units, while wrapped
        self._guarded: list[nn.Module] = []  # units whose ``_call_impl`` is ``_switch``'s guard
        self._roots: Callable[[], list[nn.Module]] | None = None  # set where forwards inside may run
        self._cut_short = False  # a forward through the units raised (their ``_call_impl`` guard)

    def prepare(self) -> bool:
        """Before the gather, all local, nothing to undo: parameter resets adopted, the group resharded if a
        forward left it unsharded. Whether FSDP2 adopted a parameter (the DTensors to gather changed)."""
        adopted = fsdp2.adopt_module_params(self.group)
        fsdp2.reshard_group(self.group)
        return adopted

    def summon(self, params: list[SummonedParam], holds_fulls: bool, forwards: bool,
               roots: Callable[[], list[nn.Module]]) -> None:
        """Mark, suspend and hook the forwards, for this call's ``params``. ``holds_fulls``: this rank holds full
        parameters (else nothing is marked or hooked); ``forwards``: a forward may run (not under ``rank0_only``,
        whose refusal is the context's); ``roots``: the FSDP2 roots above, refused too with the units."""
        if holds_fulls:
            if self.fully_summoned:
                mark = self._mark = fsdp2.GroupMark.of(self.group)  # kept before anything changes
                fsdp2.mark_summoned(mark)
                fsdp2.suspend_hooks(fsdp2.group_hook_sites(self.group), self._suspended)
            else:
                fsdp2.suspend_hooks(fsdp2.load_post_hook_sites(p.scoped.fsdp_param for p in params),  # type: ignore[misc]  # a group's parameters have an FSDPParam
                                    self._suspended)
        if holds_fulls and forwards:
            self._hook_forwards(params, roots)

    def _hook_forwards(self, params: list[SummonedParam], roots: Callable[[], list[nn.Module]]) -> None:
        """Each hook goes into ``_hooks`` as it is made: ``release`` removes those made before a raise."""
        units, hooks = self.units, self._hooks
        if not self.fully_summoned:
            refused = [*units, *roots()]
            refusal = ForwardRefusal(refused, lambda: (
                f"forward through FSDP unit {', '.join(module_label(m) for m in units)} while only some "
                "of its parameters are summoned is not supported: summon the unit itself"
            ), fsdp2.states_of_units(refused))
            hooks.append(refusal)
            refusal.install()
            return
        self._roots = roots
        methods = []
        for module in units:  # see [Note: casts never outlive their forward]
            call_impl = module.__class__._call_impl

            def guarded_call(*args: Any, _unit: nn.Module = module, _call_impl: Any = call_impl, **kwargs: Any) -> Any:
                """The unit's ``_call_impl``; whatever raised, the casts are put back and FSDP2's state settled."""
                switch = self._switch
                depth = 0 if switch is None else switch._depth
                try:
                    return _call_impl(_unit, *args, **kwargs)
                except BaseException:
                    self._cut_short = True  # FSDP2's post-forward may not have run: settled now and at release
                    fsdp2.settle_forward(self.group, self.units)
                    raise
                finally:
                    if switch is not None and (switch._depth != depth or (depth == 0 and switch._held)):
                        switch.unwind(depth)  # a BaseException skipped the post-forward hook, or it failed

            methods.append((module, guarded_call))
        fsdp2.override_methods("_call_impl", methods, self._guarded)
        no_backward = _RaiseOnBackward(units)
        hooks.append(no_backward)  # kept before its hooks: removed after them
        for module in units:
            hooks.append(module.register_forward_hook(no_backward))
        items = []
        for param in params:
            dtype = fsdp2.param_dtype_for_forward(self.group, param.scoped.fsdp_param)  # type: ignore[arg-type]  # a group's params have an FSDPParam
            if dtype is not None:
                items.append((param, dtype))
        if items:
            switch = self._switch = _ForwardInParamDtype(items)
            for module in units:
                hooks.append(module.register_forward_pre_hook(switch.pre_forward))
                hooks.append(module.register_forward_hook(switch.post_forward, always_call=True))
        registered = [(module, name, method) for module in units for name, method in fsdp2.forward_methods(module)]
        if registered:
            fsdp2.wrap_forward_methods([(module, name, method, self._forward_method(module, method, no_backward))
                                        for module, name, method in registered], self._wrapped)

    def _forward_method(self, unit: nn.Module, method: Callable[..., Any], no_backward: _RaiseOnBackward
                        ) -> Callable[..., Any]:
        """A method ``register_fsdp_forward_method`` made a forward, reached through the unit's attribute, as the
        unit's guarded call and its hooks treat a forward: FSDP2 calls its pre- and post-forward itself, past
        ``_call_impl`` and every hook. (A reference taken before entry, or a decorator's, is not wrapped.)"""

        @functools.wraps(method)
        def forward_method(*args: Any, **kwargs: Any) -> Any:
            if not self._wrapped:  # a reference kept past the context: FSDP2's own method
                return method(*args, **kwargs)
            switch = self._switch
            depth = 0 if switch is None else switch._depth
            try:
                if switch is not None:
                    switch.pre_forward(unit, args)
                output = method(*args, **kwargs)
            except BaseException:
                self._cut_short = True
                fsdp2.settle_forward(self.group, self.units)
                raise
            finally:
                if switch is not None:
                    try:
                        switch.unwind(depth)
                    finally:  # an interrupt part way: the put-back resumes where it stopped
                        switch.unwind(depth)
            refused = no_backward(unit, args, output)
            return output if refused is None else refused

        return forward_method

    def release(self) -> None:
        """Undo ``summon``: unmark, resume and remove hooks, settle a forward cut short. Each step runs even if
        another raised (the first error raised after) and forgets what it undid only once undone, so a second call
        finishes what the first did not reach ([Note: exit always restores] in ``_summon``)."""
        settle = self._roots is not None and (self._cut_short or fsdp2.forward_cut_short(self.group))
        first = run_each((None if self._mark is None else self._mark.unmark,
                          functools.partial(fsdp2.resume_hooks, self._suspended) if self._suspended else None,
                          self.remove_hooks, self._settle if settle else None))
        if first is not None:
            raise first  # each step runs again in a second call: unmark and settle are idempotent
        self._mark, self._roots, self._cut_short = None, None, False

    def _settle(self) -> None:
        """FSDP2's per-forward state of the group and the roots above, left set by a forward cut short."""
        roots = self._roots
        assert roots is not None
        fsdp2.settle_forward(self.group, [*self.units, *roots()])  # see fsdp2.settle_forward

    def remove_hooks(self) -> None:
        """Any cast a forward left put back, then the hooks off, one at a time (an interrupt leaves the rest)."""
        if self._switch is not None:
            self._switch.retire()
        if self._wrapped:
            fsdp2.unwrap_forward_methods(self._wrapped)
        fsdp2.restore_methods(self._guarded, "_call_impl")
        hooks = self._hooks
        while hooks:
            hooks[-1].remove()
            hooks.pop()


def summon_groups(
    groups: list[SummonedGroup], summoned: list[SummonedParam], scope: Scope, conversions: Conversions,
    holds_fulls: bool, rank0_only: bool,
) -> ForwardRefusal | None:
    """Every FSDP2 group of a call summoned, conversions redirected; under ``rank0_only`` every forward refused
    (ranks would disagree on which units need an all-gather): returns that refusal's handle."""
    by_group: dict[fsdp2.FSDPParamGroup, list[SummonedParam]] = {}
    if len(scope.groups) == 1 and scope.fsdp2_only:  # one unit: every parameter is its group's
        by_group = dict.fromkeys(scope.groups, summoned)
    else:
        for param in summoned:
            group = param.scoped.group
            if group is not None:
                by_group.setdefault(group, []).append(param)

    states = states_of(scope)
    roots = functools.partial(fsdp2.root_modules, states)  # the roots found only where a forward is refused
    units: list[nn.Module] = []
    for summoned_group in groups:
        summoned_group.summon(by_group.get(summoned_group.group, []), holds_fulls, not rank0_only, roots)
        units += summoned_group.units
    conversions.redirect(units, scope.owners or slot_owners(scope), holds_fulls)  # owners: kept on a cached scope
    if not rank0_only:
        return None
    root = scope.root  # every module whose slots differ between ranks, and the roots above
    root_states, root_modules = fsdp2.roots_of(states)
    return ForwardRefusal([root, *root_modules, *units, *scope.owner_modules], lambda: (
        f"forward inside summon_full_params({module_label(root)}, rank0_only=True) "
        "is not supported: only rank 0 (of each FSDP shard group) holds full parameters"
    ), [*root_states, *states])  # installed by the caller once it keeps it
