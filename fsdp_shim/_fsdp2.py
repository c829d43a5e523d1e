"""Every touch of FSDP2's (and c10d's) private state, and every write on FSDP2's classes, in one place, and the
probe of it.

FSDP2 exposes ``unshard()`` and ``reshard()``, not the per-parameter bookkeeping ``summon_full_params``
needs. This module reads and changes that bookkeeping, FSDP2's forward-cast globals, its classes (methods
wrapped, the instance form added), and, for a context, its units' ``_apply``, ``_call_impl`` and methods made
forwards by ``register_fsdp_forward_method``, its states' ``_pre_forward`` and its groups' ``_to_sharded``
(overridden on the instance), and c10d's world of live groups; nothing else does (``tests/test_house.py``).
``READS`` names each; past the verified torch range ``missing_internals`` checks them at activation ([Note:
version policy] in ``_versions``).
Release differences are handled where they matter: ``param_groups`` (2.12), ``lazy_init_root`` (2.7),
``mark_summoned`` (2.14), ``param_dtype_for_forward`` (2.15), all read against 2.7.0 through 2.15.0; 2.15's
``set_keep_unsharded_storage`` needs nothing (the shim always gathers from the shards).
``docs/fsdp2-seam.md`` drafts the public seam that would replace them.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
import wrapt
from torch.distributed import distributed_c10d
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ParamModuleInfo, ShardedState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, FSDPStateContext, _get_module_fsdp_state

__all__ = [
    "CAST_FN",
    "CAST_MODULE",
    "CAST_WALKS",
    "FSDPParam",
    "FSDPParamGroup",
    "FSDPState",
    "GroupMark",
    "Guarded",
    "READS",
    "Suspended",
    "Wrapped",
    "add_instance_form",
    "adopt_module_params",
    "all_fsdp_states",
    "busy_training_state",
    "cast_fn",
    "convert",
    "convert_bypassing_fsdp2",
    "cuda_backend_name",
    "forward_cut_short",
    "forward_methods",
    "fsdp_state_of",
    "gather_mesh",
    "group_hook_sites",
    "group_modules",
    "group_params",
    "guard_forward_methods",
    "groups_of_call",
    "has_cast_walk",
    "is_live_group",
    "lazy_init_root",
    "load_post_hook_sites",
    "mark_summoned",
    "missing_internals",
    "order_after_writeback",
    "override_methods",
    "param_dtype_for_forward",
    "param_groups",
    "param_slots",
    "redirect_apply",
    "remove_instance_form",
    "reshard_group",
    "reshard_groups",
    "restore_methods",
    "resume_hooks",
    "root_modules",
    "roots_of",
    "settle_forward",
    "shard_rank",
    "sharded_behind",
    "sharded_param",
    "sharded_params",
    "states_of_units",
    "suspend_hooks",
    "unguard_forward_methods",
    "unwrap_forward_methods",
    "unit_summon_cache",
    "unsharded_param_if_any",
    "unwrap_cast_walks",
    "unwrap_guarded_calls",
    "unwrap_state_init",
    "wrap_cast_walks",
    "wrap_forward_methods",
    "wrap_guarded_calls",
    "wrap_state_init",
]

Slot = tuple[nn.Module, str]


def fsdp_state_of(module: nn.Module) -> FSDPState | None:
    return _get_module_fsdp_state(module)


def states_of_units(modules: Iterable[nn.Module]) -> list[FSDPState]:
    """The FSDP2 states of the units among ``modules``, each once."""
    states: dict[int, FSDPState] = {}
    for module in modules:
        state = _get_module_fsdp_state(module) if isinstance(module, FSDPModule) else None
        if state is not None:
            states.setdefault(id(state), state)
    return list(states.values())


def all_fsdp_states() -> list[FSDPState]:
    """Every live FSDP2 state in the process, each once (grouped states map several modules)."""
    seen: dict[int, FSDPState] = {}
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState):
            seen.setdefault(id(state), state)
    return list(seen.values())


def param_groups(state: FSDPState) -> list[FSDPParamGroup]:
    """The state's param groups: the list ``_fsdp_param_groups`` from torch 2.12 (the singular then a property),
    one ``_fsdp_param_group`` before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def param_slots(fsdp_param: FSDPParam) -> list[Slot]:
    """Every (module, attribute name) through which the parameter is reachable."""
    info = fsdp_param._module_info
    slots: list[Slot] = [(info.module, info.param_name)]
    slots.extend(zip(info.shared_modules, info.shared_param_names, strict=True))  # FSDP2 appends them in pairs
    return slots


def sharded_param(fsdp_param: FSDPParam) -> nn.Parameter:
    """The DTensor parameter FSDP2, and every optimizer, hold for this slot."""
    return fsdp_param.sharded_param


def sharded_params(fsdp_params: Iterable[FSDPParam]) -> list[nn.Parameter]:
    """``sharded_param`` of each, in one call: every summon asks it of every parameter in scope."""
    return [fsdp_param.sharded_param for fsdp_param in fsdp_params]


def sharded_behind(fsdp_param: FSDPParam, group: FSDPParamGroup, value: Any) -> Any:
    """The sharded parameter a slot FSDP2 manages stands for, given ``value`` (what it holds now), or None.
    Behind FSDP2's three forms (sharded, unsharded, post-forward) stands ``sharded_param``; until FSDP2 adopts
    the module attributes, the slot's own value is what it will adopt."""
    if not group._reset_sharded_params:
        return value
    sharded = fsdp_param.sharded_param
    if (value is sharded or value is getattr(fsdp_param, "_unsharded_param", None)
            or value is getattr(fsdp_param, "_sharded_post_forward_param", None)):
        return sharded
    return None


#: Where fsdp_shim keeps a unit's cached summons on its FSDP2 state (see [Note: summon cache] in ``_scope``).
_CACHE_ATTR = "_fsdp_shim_summon_cache"


def unit_summon_cache(module: nn.Module) -> dict[Any, Any] | None:
    """The dict of cached summons on ``module``'s FSDP2 state (made on first use: [Note: summon cache]), or None
    if ``module`` is not an FSDP2 unit."""
    if not isinstance(module, FSDPModule):
        return None
    state = _get_module_fsdp_state(module)
    if state is None:
        return None
    cache = state.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = state.__dict__[_CACHE_ATTR] = {}
    return cache


def unsharded_param_if_any(fsdp_param: FSDPParam) -> nn.Parameter | None:
    """FSDP2's unsharded parameter object (what a slot holds after forward), if one was ever made."""
    return getattr(fsdp_param, "_unsharded_param", None)


def busy_training_state(states: list[FSDPState], groups: list[FSDPParamGroup]) -> str | None:
    """Why summoning now would race FSDP2, or None: a forward or backward of the unit, or any forward through
    its root (the root stays FORWARD for the whole forward), or any running autograd graph (FSDP2's ``is_bw()``
    test). Stricter than FSDP1. Checking the root, the first state after lazy init, is O(1)."""
    if torch._C._current_graph_task_id() != -1:
        return "BACKWARD (autograd is running)"
    idle = TrainingState.IDLE
    for state in states:
        if state._training_state != idle:
            return state._training_state.name
        all_states = getattr(state._state_ctx, "all_states", None)
        if not all_states:
            continue  # not initialised yet: no forward ran, nothing shares its state
        root = all_states[0]
        if root._training_state != idle:
            return root._training_state.name
        if not root._is_root:
            busy = next((s._training_state.name for s in all_states if s._training_state != idle), None)
            if busy is not None:
                return busy
    for group in groups:
        if group._training_state != idle:
            return group._training_state.name
    return None



def _roots_by_module() -> dict[int, FSDPState]:
    """For each module below a live FSDP2 state, the topmost state above it (by ``id(module)``)."""
    states = [s for s in all_fsdp_states() if len(s._modules) == 1]
    trees = sorted(((s, list(s._modules[0].modules())) for s in states), key=lambda t: -len(t[1]))
    roots: dict[int, FSDPState] = {}
    for state, modules in trees:
        if id(state._modules[0]) in roots:
            continue
        for module in modules:
            roots.setdefault(id(module), state)
    return roots


def lazy_init_root(states: list[FSDPState]) -> bool:
    """Lazily initialise the FSDP2 root above ``states``, as a first forward would; whether it did (local).

    A context marks FSDP2's post-init group state (2.7's root init sets ``post_forward_mesh_info=None``
    unconditionally: an unmark would undo it), so entry initialises, as FSDP1's summon does, the topmost state
    above the summoned module (the one a forward through the model picks), never the unit: a cold
    ``summon(model.policy)`` would make an inner unit a root, and FSDP2 refuses every later forward through the
    real one. Outside ``inference_mode`` (2.7's reset rebuilds the shards' data, which would become inference
    tensors). A tree where a unit already became a root is left for FSDP2 to refuse; groups whose root cannot be
    initialised (``fully_shard([a, b])`` at the top) are adopted instead (``adopt_module_params``).
    """
    if all(s._is_root is not None for s in states):
        return False
    initialised = False
    live = [s for s in all_fsdp_states() if len(s._modules) == 1]
    roots = _roots_by_module()
    for state in states:
        if state._is_root is not None or len(state._modules) != 1:
            continue
        root = roots.get(id(state._modules[0]), state)
        tree = [s for s in live if roots.get(id(s._modules[0])) is root]
        if all(s._is_root is None for s in tree):
            with torch.inference_mode(False):
                root._lazy_init()
            initialised = True
    return initialised


def adopt_module_params(group: FSDPParamGroup) -> bool:
    """Run the parameter reset FSDP2's lazy init would, if it has not yet; whether it did. Until then FSDP2 adopts
    whatever the module attribute holds (``model.to()``, ``load_state_dict(assign=True)``): done now, while the
    attributes are FSDP2's, a first forward inside a context cannot adopt a full tensor."""
    if group.is_sharded and not group._reset_sharded_params:  # every summon asks: no decorator on the way
        with torch.no_grad(), torch.inference_mode(False):  # as ``lazy_init_root``
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()
        group._reset_sharded_params = True
        return True
    return False


def reshard_groups(groups: list[FSDPParamGroup]) -> None:
    """FSDP2's ``reshard()`` of a unit, on these of its groups."""
    for group in groups:
        group.reshard()


def reshard_group(group: FSDPParamGroup) -> None:
    """Free the unsharded copy and register the sharded parameters, as ``reshard()`` and ``state_dict()``'s
    pre-hook do, for a unit an earlier forward left unsharded (the root, or ``reshard_after_forward=False``)."""
    if not group.is_sharded:
        group._to_sharded()


def order_after_writeback(states: list[FSDPState]) -> None:
    """Make FSDP2's next all-gather wait for a writeback just made on the current stream. With the user's
    ``set_post_optim_event(event)`` FSDP2 waits on that event instead of the stream: the current stream waits on
    it as recorded (an optimizer step on a side stream), then records it again, so it covers the writeback too
    (legal until something waits on it: FSDP2 waits once, at the next root forward, and drops it)."""
    seen: set[int] = set()
    for state in states:
        context = state._state_ctx
        if id(context) in seen:
            continue
        seen.add(id(context))
        event = getattr(context, "post_optim_event", None)  # optional: torch >= 2.7 has it
        if event is not None:
            event.wait()
            event.record()


def group_params(group: FSDPParamGroup) -> list[FSDPParam]:
    """The ``FSDPParam``s of ``group``, in FSDP2's order."""
    return group.fsdp_params


# -- what the patch writes on FSDP2's classes (listed in ``READS`` too) ---------------------------

def wrap_state_init(wrapper: Any) -> Any:
    """``wrapper`` (wrapt's) around ``FSDPState.__init__``; returns the handle. ``fully_shard``'s ``contract``
    builds the state before it registers anything on the module: a wrapper that raises leaves it untouched."""
    return wrapt.wrap_function_wrapper(FSDPState, "__init__", wrapper)


def unwrap_state_init(handle: Any) -> None:
    wrapt.unwrap_object(FSDPState, "__init__", handle, missing_ok=True)


#: ``FSDPModule``'s public calls that act on a unit's group whatever marks it, guarded while a live
#: context holds one of the group's parameters: see [Note: FSDP2's calls inside] in ``_patching``.
#: ``set_reshard_after_forward`` exists from torch 2.8; the others in every release served.
GUARDED_CALLS = ("reshard", "unshard", "set_reshard_after_forward")


def wrap_guarded_calls(wrapper: Any) -> list[tuple[str, Any]]:
    """``wrapper`` (wrapt's) around each of ``GUARDED_CALLS`` this torch has; returns ``(name, handle)`` pairs."""
    return [(name, wrapt.wrap_function_wrapper(FSDPModule, name, wrapper))
            for name in GUARDED_CALLS if hasattr(FSDPModule, name)]


def unwrap_guarded_calls(handles: list[tuple[str, Any]]) -> None:
    for name, handle in handles:
        wrapt.unwrap_object(FSDPModule, name, handle, missing_ok=True)


#: The attribute the instance form takes on ``FSDPModule``: FSDP1's name.
INSTANCE_FORM = "summon_full_params"


def add_instance_form(form: staticmethod[..., Any]) -> None:
    """``form`` as ``FSDPModule.summon_full_params`` (``unit.summon_full_params(unit, ...)``, as FSDP1 code calls it),
    unless a class in its MRO defines the attribute: torch's own is never replaced."""
    if not any(INSTANCE_FORM in vars(cls) for cls in FSDPModule.__mro__):
        setattr(FSDPModule, INSTANCE_FORM, form)


def remove_instance_form(form: staticmethod[..., Any]) -> None:
    """``add_instance_form`` undone, by identity: only ``form`` is removed."""
    if vars(FSDPModule).get(INSTANCE_FORM) is form:
        delattr(FSDPModule, INSTANCE_FORM)


# -- what a context overrides on FSDP2's units (and on plain modules alike), listed in ``READS`` too ------
# ``nn.Module._apply`` (see [Note: conversions inside] in ``_group``) and ``_call_impl`` (see [Note: casts
# never outlive their forward] there), each on the instance, for the context's duration; where a forward is
# refused, ``FSDPState._pre_forward`` (``guard_forward_methods``); where it runs, each method
# ``register_fsdp_forward_method`` made a forward (``wrap_forward_methods``).

_How = TypeVar("_How")  # what a redirected ``_apply`` hands its ``run``: the caller's


def override_methods(name: str, methods: Iterable[tuple[nn.Module, Callable[..., Any]]],
                     overridden: list[nn.Module]) -> None:
    """Each ``(module, method)`` as that module's instance-level ``name`` unless it has one (an enclosing
    context's); each recorded in ``overridden`` before it is installed (``restore_methods`` finds it)."""
    for module, method in methods:
        if name not in module.__dict__:
            overridden.append(module)
            module.__dict__[name] = method


def redirect_apply(plan: Mapping[nn.Module, _How], run: Callable[[nn.Module, _How, tuple[Any, ...], dict[str, Any]],
                   nn.Module], overridden: list[nn.Module]) -> None:
    """An instance-level ``_apply`` calling ``run(module, plan[module], args, kwargs)`` for each module of ``plan``
    but one that has one (an enclosing context's); all recorded in ``overridden`` before any is installed."""
    todo = [module for module in plan if "_apply" not in module.__dict__]
    overridden += todo
    for module in todo:

        def apply_inside(*args: Any, _module: nn.Module = module, _how: _How = plan[module], **kwargs: Any
                         ) -> nn.Module:
            return run(_module, _how, args, kwargs)

        module.__dict__["_apply"] = apply_inside


def restore_methods(overridden: list[nn.Module], name: str) -> None:
    """Each of ``overridden``'s own ``name`` again, then ``overridden`` emptied (all again, if interrupted)."""
    for module in overridden:
        attrs = module.__dict__
        if name in attrs:
            del attrs[name]
    overridden.clear()


def _registered_code() -> types.CodeType | None:
    """The code of the wrapper ``register_fsdp_forward_method`` installs (a constant of its own code), or None."""
    for const in register_fsdp_forward_method.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "wrapped_method":
            return const
    return None


_REGISTERED_CODE = _registered_code()


def forward_methods(module: nn.Module) -> list[tuple[str, Callable[..., Any]]]:
    """The methods in ``module``'s instance dict that ``register_fsdp_forward_method`` made forwards (bound; on
    this module, or an alias of another's): each calls its state's ``_pre_forward`` and ``_post_forward`` itself,
    past ``_call_impl`` and its hooks."""
    code = _REGISTERED_CODE
    return [(name, value) for name, value in module.__dict__.items()
            if value.__class__ is types.MethodType and getattr(value.__func__, "__code__", None) is code]


#: Forward methods a context wrapped: each module, the method's name, FSDP2's bound wrapper it replaced, and
#: the context's wrapper.
Wrapped = list[tuple[nn.Module, str, Callable[..., Any], Callable[..., Any]]]


def wrap_forward_methods(methods: Iterable[tuple[nn.Module, str, Callable[..., Any], Callable[..., Any]]],
                         wrapped: Wrapped) -> None:
    """Each ``(module, name, registered, wrapper)``: ``wrapper`` in the registered method's place, recorded in
    ``wrapped`` before it is installed (``unwrap_forward_methods`` puts the registered one back)."""
    for module, name, registered, wrapper in methods:
        wrapped.append((module, name, registered, wrapper))
        module.__dict__[name] = wrapper


def unwrap_forward_methods(wrapped: Wrapped) -> None:
    """``wrap_forward_methods`` undone, last first, where the wrapper still sits (the user's assignment or deletion
    inside stands), each forgotten once put back (all again, if interrupted)."""
    while wrapped:
        module, name, registered, wrapper = wrapped[-1]
        if module.__dict__.get(name) is wrapper:
            module.__dict__[name] = registered
        wrapped.pop()


class _PreForwardGuard:
    """A state's ``_pre_forward`` (FSDP2's, or what its instance held: ``previous``, put back with the last
    check), after each live context's check (``guard_forward_methods``)."""

    def __init__(self, pre_forward: Callable[..., Any], previous: Any) -> None:
        self.pre_forward, self.previous = pre_forward, previous
        self.checks: list[Callable[[nn.Module], None]] = []

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        for check in list(self.checks):
            check(module)
        return self.pre_forward(module, *args)


#: What ``guard_forward_methods`` changed: each state, and the guard that holds the context's check.
Guarded = list[tuple[FSDPState, _PreForwardGuard]]


def guard_forward_methods(states: Iterable[FSDPState], check: Callable[[nn.Module], None], guarded: Guarded) -> None:
    """``check(module)`` first whenever a forward method registered on a module of one of ``states`` (FSDP2's
    ``register_fsdp_forward_method``) runs: it calls its state's ``_pre_forward`` itself, past ``_call_impl`` and
    every forward pre-hook, and all-gathers before a refusal could speak. An instance-level ``_pre_forward`` on the
    state, shared by nested contexts; FSDP2's forward hook keeps the method it bound at ``fully_shard``. Each state
    is recorded in ``guarded`` before it is changed."""
    for state in states:  # on the hot path ([Note: hot path] in ``_summon``): no method call but the guard's
        attrs = state.__dict__
        guard = attrs["_pre_forward"] if "_pre_forward" in attrs else None
        if type(guard) is not _PreForwardGuard:
            guard = _PreForwardGuard(state._pre_forward, guard)
        elif check in guard.checks:
            continue  # listed twice
        guarded += ((state, guard),)
        attrs["_pre_forward"] = guard
        guard.checks += (check,)


def unguard_forward_methods(guarded: Guarded, check: Callable[[nn.Module], None]) -> None:
    """``guard_forward_methods`` undone for ``check``, from the guards themselves (wherever they now sit); a guard
    still in its state's place goes with its last check. All again, if interrupted: ``guarded`` is emptied last."""
    for state, guard in guarded:
        checks = guard.checks
        if check in checks:
            checks.remove(check)
        attrs = state.__dict__
        if not checks and "_pre_forward" in attrs and attrs["_pre_forward"] is guard:
            if guard.previous is None:
                del attrs["_pre_forward"]
            else:
                attrs["_pre_forward"] = guard.previous
    del guarded[:]


def convert_bypassing_fsdp2(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
    """``nn.Module._apply`` on ``module``, never FSDP2's (which, inside a context, would reshard and adopt a
    slot's full tensor as its sharded parameter)."""
    return nn.Module._apply(module, *args, **kwargs)


def convert(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``module``'s own ``_apply``: FSDP2's on a unit, which reshards and adopts the converted shards."""
    module._apply(*args, **kwargs)


def groups_of_call(module: nn.Module, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[FSDPParamGroup]:
    """The groups a guarded call on ``module`` acts on: its own, and with ``set_reshard_after_forward``'s
    ``recurse`` (the default) every FSDP2 module's below it, as FSDP2 walks them."""
    modules: Iterable[nn.Module] = [module]
    if call == "set_reshard_after_forward" and kwargs.get("recurse", args[1] if len(args) > 1 else True):
        modules = module.modules()
    groups: list[FSDPParamGroup] = []
    for candidate in modules:
        state = fsdp_state_of(candidate) if isinstance(candidate, FSDPModule) else None
        if state is not None:
            groups += param_groups(state)
    return groups


# -- FSDP2's forward-input cast, which ``instrumentations/forward_io`` mends (listed in ``READS``) --
# See [Note: where the cast is reached] in ``instrumentations/forward_io``.

#: The module whose globals FSDP2 casts forward inputs through (``_fsdp_state``).
CAST_MODULE = FSDPState.__module__
#: The cast FSDP2 applies to each floating-point tensor, called through ``functools.partial``.
CAST_FN = "_cast_fp_tensor"
#: The walks FSDP2 casts forward inputs with: ``tree_map`` up to 2.7, ``_apply_to_tensors`` from 2.8.
CAST_WALKS = ("tree_map", "_apply_to_tensors")


def cast_fn(state_module: types.ModuleType) -> Any:
    """FSDP2's per-tensor cast in ``state_module`` (``CAST_MODULE``, as imported)."""
    return getattr(state_module, CAST_FN)


def has_cast_walk(state_module: types.ModuleType) -> bool:
    """Whether ``state_module`` has one of ``CAST_WALKS`` to wrap."""
    return any(callable(getattr(state_module, name, None)) for name in CAST_WALKS)


def wrap_cast_walks(state_module: types.ModuleType, wrapper: Any) -> dict[str, Any]:
    """``wrapper`` (wrapt's) around each of ``CAST_WALKS`` ``state_module`` has; returns ``{name: handle}``."""
    return {name: wrapt.wrap_function_wrapper(state_module, name, wrapper)
            for name in CAST_WALKS if callable(getattr(state_module, name, None))}


def unwrap_cast_walks(state_module: types.ModuleType, handles: dict[str, Any]) -> None:
    for name, handle in handles.items():
        wrapt.unwrap_object(state_module, name, handle, missing_ok=True)


def param_dtype_for_forward(group: FSDPParamGroup, fsdp_param: FSDPParam) -> torch.dtype | None:
    """The dtype FSDP2 would compute this parameter in, if it differs from the stored one. Lazy init resolves
    it per parameter (``FSDPParam.param_dtype``, None for no cast); before that (a group whose root cannot be
    initialised) it is read from the policy: the parameter's from 2.15 (``FSDPParam.mp_policy``, for
    ``param_dtype_override_fn``), the group's before."""
    if hasattr(fsdp_param, "param_dtype"):
        dtype = fsdp_param.param_dtype
    else:
        policy = getattr(fsdp_param, "mp_policy", None)
        if policy is None:
            policy = group.mp_policy
        dtype = policy.param_dtype
    if dtype is None or dtype == fsdp_param.sharded_param.dtype or not fsdp_param.sharded_param.is_floating_point():
        return None
    return dtype


def _suspended_hook(*args: Any, **kwargs: Any) -> None:
    """What a suspended hook's place holds: it does nothing."""


#: Suspended hooks, to give back: each hook's dict, its id, and the hook.
Suspended = list[tuple[dict[int, Any], int, Any]]


def suspend_hooks(sites: Iterable[HookSite], suspended: Suspended) -> None:
    """Make the hook at each site a no-op (one already suspended, or gone, is left alone), recorded in
    ``suspended`` for ``resume_hooks``. Only the entry's value is swapped: key, position and hook order stay.
    The records hold the hook dicts, alive while the summon's modules are (one context suspends and resumes)."""
    for hooks, hook_id in sites:
        hook = hooks.get(hook_id)
        if hook is not None and hook is not _suspended_hook:
            suspended.append((hooks, hook_id, hook))
            hooks[hook_id] = _suspended_hook


def resume_hooks(suspended: Suspended) -> None:
    """Give back every hook ``suspend_hooks`` recorded, last first."""
    for hooks, hook_id, hook in reversed(suspended):
        hooks[hook_id] = hook
    suspended.clear()


#: Where a module hook lives: the module's hook dict and the hook's id in it.
HookSite = tuple[dict[int, Any], int]

_SITES_ATTR = "_fsdp_shim_hook_sites"


def load_post_hook_sites(fsdp_params: Iterable[FSDPParam]) -> list[HookSite]:
    """The load post-hooks of these parameters: keep ``load_state_dict`` inside a context from making
    FSDP2 adopt a full tensor. Each ``FSDPParam`` registers one that calls ``reset_sharded_param``,
    which adopts whatever the attribute holds."""
    sites = []
    for fsdp_param in fsdp_params:
        handle = getattr(fsdp_param, "_post_load_hook_handle", None)
        if handle is not None:
            sites.append((fsdp_param._module_info.module._load_state_dict_post_hooks, handle.id))
    return sites


def group_hook_sites(group: FSDPParamGroup) -> list[HookSite]:
    """Every hook a summon suspends while it holds the whole group: the group's state-dict save and load
    pre-hooks (its ``to_sharded``) and every parameter's load post-hook. Kept on the group once it has its
    pre-hooks (registered once, at its lazy init): a group without them yet is looked up afresh each time."""
    sites = group.__dict__.get(_SITES_ATTR)
    if sites is None:
        sites = []
        for attr, handles in (
            ("_state_dict_pre_hooks", getattr(group, "_module_to_pre_save_state_dict_hook_handle", {})),
            ("_load_state_dict_pre_hooks", getattr(group, "_module_to_pre_load_state_dict_hook_handle", {})),
        ):
            sites += [(getattr(module, attr), handle.id) for module, handle in handles.items()]
        registered = bool(sites)
        sites += load_post_hook_sites(group.fsdp_params)
        if registered:
            group.__dict__[_SITES_ATTR] = sites
    return sites


@dataclass(slots=True)
class GroupMark:
    """What ``mark_summoned`` changed on one group's state, to undo it exactly (its hooks are
    suspended and resumed by the caller: ``suspend_hooks``)."""

    group: FSDPParamGroup
    sharded_state: ShardedState
    post_forward_mesh_info: Any
    to_sharded: Any  # the instance's own ``_to_sharded`` (an enclosing context's), or None
    lent_unsharded: list[FSDPParam] = field(default_factory=list)

    @classmethod
    def of(cls, group: FSDPParamGroup) -> GroupMark:
        """What marking ``group`` will change, as it is now: made (and kept by the caller) before
        ``mark_summoned`` changes anything, so that an interrupt anywhere leaves a mark to undo."""
        return cls(group, group._sharded_state, group.post_forward_mesh_info, group.__dict__.get("_to_sharded"))

    def unmark(self) -> None:
        """Undo ``mark_summoned``. See [Note: summoned groups]."""
        group = self.group
        if self.to_sharded is None:
            group.__dict__.pop("_to_sharded", None)
        else:
            group.__dict__["_to_sharded"] = self.to_sharded
        group._sharded_state = self.sharded_state
        group.post_forward_mesh_info = self.post_forward_mesh_info
        lent = self.lent_unsharded
        while lent:  # one at a time, each forgotten once gone: a second call finishes an interrupted first
            vars(lent[-1]).pop("_unsharded_param", None)
            lent.pop()


# [Note: summoned groups]
# While a context owns a unit's module attributes, FSDP2 must neither all-gather over them (its forward
# pre-hook would) nor put its sharded parameters back (its forward post-hook and ``state_dict()`` pre-hook
# would). A group whose every parameter is summoned is *marked*: its sharded state reads UNSHARDED
# (``unshard()`` a no-op), ``post_forward_mesh_info`` is None (``reshard()`` in forward a no-op), its
# ``_to_sharded`` does nothing (any other ``reshard()``: ``_stay_summoned``), its ``to_sharded`` state-dict
# pre-hooks are suspended (``group_hook_sites``), as is every summoned parameter's load post-hook
# (``load_post_hook_sites``), marked group or not. Its all-gather buffers stay freed: it is
# sharded underneath. From 2.14 the pre-hook also reads each parameter's ``unsharded_param``; a group never
# all-gathered has none, so the mark lends the summoned full parameter. ``unmark`` restores all exactly.
def _stay_summoned() -> None:
    """A marked group's ``_to_sharded``: FSDP2 reaches it past the mark where a forward method registered with
    ``register_fsdp_forward_method`` nests a forward of its own unit (the inner post-forward leaves the group
    idle, so the outer one's ``reshard()`` shards it), and it would put the shards back in the slots."""


def mark_summoned(mark: GroupMark) -> None:
    """Make FSDP2 leave the group's module attributes alone (see [Note: summoned groups]). Called once every
    parameter of the group holds its summoned full parameter, with the group's ``GroupMark.of``, which the
    caller keeps first; its hooks are the caller's to suspend (``_group.SummonedGroup``)."""
    group = mark.group
    try:
        for fsdp_param in group.fsdp_params:
            if getattr(fsdp_param, "_unsharded_param", None) is None:
                info = fsdp_param._module_info
                mark.lent_unsharded.append(fsdp_param)  # recorded first: ``unmark`` pops what is not there
                fsdp_param._unsharded_param = info.module._parameters[info.param_name]  # type: ignore[assignment]  # a registered parameter: never None
        group._sharded_state = ShardedState.UNSHARDED
        group.post_forward_mesh_info = None
        group.__dict__["_to_sharded"] = _stay_summoned
    except BaseException:  # interrupted part way: undone here too (``unmark`` may run twice)
        mark.unmark()
        raise


def forward_cut_short(group: FSDPParamGroup) -> bool:
    """Whether a forward through the group started and never finished (its training state says so)."""
    return group._training_state != TrainingState.IDLE


def settle_forward(group: FSDPParamGroup, modules: Iterable[nn.Module]) -> None:
    """Put back FSDP2's per-forward state (training states, the roots' forward marker) that a forward inside a
    context, cut short, left set: else the next summon is refused as "during forward" and the root's next
    forward skips its pre-forward. Entry saw them idle, so: as if the forward had not started."""
    group._training_state = TrainingState.IDLE
    for module in modules:
        state = fsdp_state_of(module)
        if state is not None:
            state._training_state = TrainingState.IDLE
            context = state._state_ctx
            if context.iter_forward_root is state:
                context.iter_forward_root = None


def roots_of(states: list[FSDPState]) -> tuple[list[FSDPState], list[nn.Module]]:
    """The initialised FSDP2 roots these states run under (their forward starts it all), and their modules."""
    roots: dict[int, FSDPState] = {}
    contexts: set[int] = set()
    for state in states:
        candidates: list[FSDPState] = [state]
        context = state._state_ctx
        if id(context) not in contexts:  # states of one root share its context: scan it once
            contexts.add(id(context))
            all_states = getattr(context, "all_states", [])
            # One root per context, listed first by FSDP2's lazy init (see [Note: hot path] in ``_summon``).
            candidates += all_states[:1] if all_states and all_states[0]._is_root else all_states
        for candidate in candidates:
            if candidate._is_root:
                roots.setdefault(id(candidate), candidate)
    states_found = list(roots.values())
    modules: list[nn.Module] = []
    for root in states_found:
        modules += root._modules  # a module has one state
    return states_found, modules


def root_modules(states: list[FSDPState]) -> list[nn.Module]:
    """``roots_of``'s modules."""
    return roots_of(states)[1]


def shard_rank(group: FSDPParamGroup) -> int:
    """This rank's coordinate in the group's FSDP shard group (what FSDP1 calls its rank)."""
    return int(group.mesh_info.shard_mesh_rank)  # type: ignore[attr-defined]  # FSDPMeshInfo's (annotated: its base)


def gather_mesh(fsdp_param: FSDPParam) -> Any:
    """The mesh FSDP2 gathers this parameter over, where the shim's gather must use it: its ``mesh_info``.

    [Note: the group is FSDP2's]
    ``DeviceMesh.__eq__`` ignores process groups and DTensor's caches map equal meshes to one another, so a
    model sharded on a group of its own can get specs naming another model's mesh. FSDP2 gathers over its own
    ``mesh_info``, and so does the shim (gather, group checks, claims), where that mesh lays the parameter out
    as its spec does (FSDP, HSDP). With tensor parallelism the DTensor's own mesh is kept (None).
    """
    mesh = fsdp_param.mesh_info.mesh
    own = fsdp_param.sharded_param.device_mesh  # type: ignore[attr-defined]  # FSDP2's sharded parameter is a DTensor
    return mesh if mesh.ndim == own.ndim else None


def group_modules(group: FSDPParamGroup) -> tuple[nn.Module, ...]:
    """The modules whose forward hooks drive this group (``fully_shard``'s arguments)."""
    return tuple(group.modules)


def is_live_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered with c10d (not destroyed, and from this process's world)."""
    return dist.is_initialized() and group in distributed_c10d._world.pg_map


def cuda_backend_name(group: dist.ProcessGroup) -> str | None:
    """The class name of the backend that serves ``group``'s CUDA tensors (c10d's ``_get_backend``, read
    with a default: optional), or None where the group cannot say."""
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:
        return None
    try:
        return type(get_backend(torch.device("cuda"))).__name__
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None


# -- the probe: what this module reads and writes (``READS``), and whether this torch has it all ---------
# By owner. A method (or property) must be an attribute of its class; a field, set on instances, must be named
# in the class: an annotation, or an attribute one of its methods loads or stores. A tuple needs one of its
# alternatives (releases differ). What is read with a ``getattr`` default is optional and not listed. Static:
# ``missing_internals`` runs without a process group, once, at activation on an unverified torch.
_METHODS: dict[type, tuple[str, ...]] = {
    FSDPModule: ("_apply",),  # bypassed inside contexts, replayed
    FSDPState: ("_lazy_init", "_pre_forward"),  # ``_pre_forward``: guarded per instance for a context
    FSDPParamGroup: ("_to_sharded", "is_sharded", "reshard"),
    FSDPParam: ("reset_sharded_param",),
}
_FIELDS: dict[type, tuple[str | tuple[str, ...], ...]] = {
    FSDPState: ("_modules", "_training_state", "_state_ctx", "_is_root", ("_fsdp_param_groups", "_fsdp_param_group")),
    FSDPParamGroup: ("fsdp_params", "_sharded_state", "post_forward_mesh_info", "_training_state",
                     "_reset_sharded_params", "modules", "mesh_info"),
    FSDPParam: ("sharded_param", "_module_info", "_unsharded_param", "_sharded_post_forward_param",
                ("param_dtype", "mp_policy"), "mesh_info"),
    FSDPStateContext: ("iter_forward_root",),
    ParamModuleInfo: ("module", "param_name", "shared_modules", "shared_param_names"),
}
#: Module-level names of FSDP2's ``_fsdp_state`` the ``fsdp2_cast`` instrumentation
#: (``instrumentations/forward_io``) reads or wraps: the cast it recognises, and one of the walks.
_STATE_MODULE_NAMES: tuple[str | tuple[str, ...], ...] = (CAST_FN, CAST_WALKS)

#: What a context writes into FSDP2's objects besides the fields above: the ``nn.Module`` methods it overrides on
#: units' instances (``override_methods``: probed as methods of ``nn.Module``), and the attributes of the shim's
#: own it keeps on states and groups (``unit_summon_cache``, ``group_hook_sites``: nothing to probe).
_OVERRIDDEN: tuple[str, ...] = ("_apply", "_call_impl")
_STASHED: dict[type, tuple[str, ...]] = {FSDPState: (_CACHE_ATTR,), FSDPParamGroup: (_SITES_ATTR,)}
#: What the patch writes on FSDP2's classes: the methods it wraps (probed; 2.7 lacks ``set_reshard_after_forward``,
#: wrapped where it exists) and the attribute it adds (``add_instance_form``: nothing to probe).
_WRAPPED: dict[type, tuple[str, ...]] = {FSDPState: ("__init__",), FSDPModule: GUARDED_CALLS}
_ADDED: dict[type, tuple[str, ...]] = {FSDPModule: (INSTANCE_FORM,)}

#: Everything probed, and everything written into FSDP2's objects, for ``fsdp-shim check -v``.
READS: tuple[str, ...] = (
    tuple(
        f"{owner.__name__}.{name if isinstance(name, str) else ' or '.join(name)}"
        for table in (_METHODS, _FIELDS) for owner, names in table.items() for name in names
    )
    + tuple(f"_fsdp_state.{n if isinstance(n, str) else ' or '.join(n)}" for n in _STATE_MODULE_NAMES)
    + ("TrainingState.IDLE", "ShardedState.UNSHARDED", "torch._C._current_graph_task_id",
       "distributed_c10d._world.pg_map")
    + tuple(f"nn.Module.{name} (overridden per instance)" for name in _OVERRIDDEN)
    + ("FSDPState._pre_forward (guarded per instance)",
       "FSDPParamGroup._to_sharded (a no-op per instance, while marked)",
       "register_fsdp_forward_method's wrapped_method (its methods wrapped per instance, where found)")
    + tuple(f"{owner.__name__}.{name} (the shim's own)" for owner, names in _STASHED.items() for name in names)
    + tuple(f"{owner.__name__}.{name} (wrapped)" for owner, names in _WRAPPED.items() for name in names)
    + tuple(f"{owner.__name__}.{name} (added to the class)" for owner, names in _ADDED.items() for name in names)
)


def _names_in(cls: type) -> set[str]:
    """Every attribute name ``cls`` defines, annotates, or loads or stores in its own code."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
        for value in vars(klass).values():
            functions = [value.fget, value.fset] if isinstance(value, property) else [getattr(value, "__func__", value)]
            stack = [code for f in functions if isinstance(code := getattr(f, "__code__", None), types.CodeType)]
            while stack:
                code = stack.pop()
                names.update(code.co_names)
                stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def missing_internals() -> list[str]:
    """The internals in ``READS`` this torch lacks, as ``Owner.name``; empty when all are there."""
    missing: list[str] = []
    for owner, methods in (*_METHODS.items(), *_WRAPPED.items()):
        missing += [f"{owner.__name__}.{m}" for m in methods
                    if m != "set_reshard_after_forward" and not hasattr(owner, m)]  # wrapped where it exists (2.8+)
    missing += [f"nn.Module.{m}" for m in _OVERRIDDEN if getattr(nn.Module, m, None) is None]
    for owner, fields in _FIELDS.items():
        names = _names_in(owner)
        for field_name in fields:
            alternatives = (field_name,) if isinstance(field_name, str) else field_name
            if not any(a in names for a in alternatives):
                missing.append(f"{owner.__name__}.{' or '.join(alternatives)}")
    for enum, member in ((TrainingState, "IDLE"), (ShardedState, "UNSHARDED")):
        if not hasattr(enum, member):
            missing.append(f"{enum.__name__}.{member}")
    state_module = sys.modules.get(FSDPState.__module__)
    for wanted in _STATE_MODULE_NAMES:
        alternatives = (wanted,) if isinstance(wanted, str) else wanted
        if not any(callable(getattr(state_module, a, None)) for a in alternatives):
            missing.append(f"_fsdp_state.{' or '.join(alternatives)}")
    if _REGISTERED_CODE is None:
        missing.append("register_fsdp_forward_method's wrapped_method")
    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        missing.append("torch._C._current_graph_task_id")
    world = getattr(distributed_c10d, "_world", None)
    if world is None or not hasattr(type(world), "pg_map"):
        missing.append("distributed_c10d._world.pg_map")
    return missing
