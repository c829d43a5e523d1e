"""The patch lifecycle, and which FSDP serves a module: FSDP1's, or the shim's DTensor summon.

Owns the decision "is this an FSDP1 tree" (``is_fsdp1_tree``): the patch's
wrapper, in both modes, and the stream ask it; ``_summon.summon`` routes
the rest. Also the public unit helpers (``fsdp_units``, ``is_fsdp_module``,
``param_fqn``), which treat FSDP1 and FSDP2 units alike. Everything here
reads public torch only, so refusing mode can import it (see [Note:
refusing mode]).

[Note: one handle]
``wrap_function_wrapper`` returns the ``FunctionWrapper`` it installs; that
object is our handle. ``is_patched`` asks wrapt whether the handle is still
in the attribute's wrapper chain (a third party may have replaced or wrapped
it since), and ``unpatch`` removes it by identity with ``unwrap_object``, which
restores the exact original ``staticmethod`` object. wrapt resolves the
attribute through the class ``__dict__``, not ``getattr``, which is how the
``staticmethod`` survives: ``inspect.getattr_static`` then shows the wrapper,
whose ``__wrapped__`` is the original staticmethod, and
``inspect.signature`` still reports FSDP1's signature.

[Note: the instance form]
FSDP1's staticmethod is also called through an instance,
``unit.summon_full_params(unit, ...)``. FSDP2 units have no such attribute,
so ``patch`` gives ``FSDPModule`` one (a staticmethod that routes like the
class form) if, and only if, no class in its MRO defines it: torch's own
attribute is never replaced. ``unpatch`` removes it, by identity.

``patch`` also installs the client instrumentations (``instrumentations``) and
the ``fully_shard`` guard (``_refuse_fully_shard_inside``); ``unpatch``
removes them.

[Note: refusing mode]
``patch(refusal)`` with a reason installs the same wrapper, routing to
``_refusing_summon`` instead of ``_summon.summon``: FSDP1 trees and plain modules
reach FSDP1's original, a module holding DTensors (or an FSDP2 unit) raises.
It reads only public torch (``FSDPModule``, ``DTensor``), so it works on a
torch whose FSDP2 internals moved; nothing of the package but ``_versions``
is imported (no instrumentations, no guard). See [Note: version policy] in ``_versions``.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch.nn as nn
import wrapt
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_shim import _versions

logger = logging.getLogger("fsdp_shim")

_TARGET = FullyShardedDataParallel
_NAME = "summon_full_params"

_lock = threading.Lock()
_handle: wrapt.FunctionWrapper | None = None
_refusal: str | None = None  # see [Note: refusing mode]
_summon: Any = None  # _summon.summon, bound by patch() when not refusing


def _fsdp1_arguments(
    module: Any, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
    offload_to_cpu: bool = False, with_grads: bool = False,
) -> tuple[Any, bool, bool, bool, bool, bool]:
    """FSDP1's signature, bound by the interpreter rather than ``inspect.Signature.bind`` (which costs
    more than a whole per-unit summon's refusal checks); the arguments in FSDP1's order.

    ``test_patching`` checks that its parameters and defaults are FSDP1's exactly.
    """
    return module, recurse, writeback, rank0_only, offload_to_cpu, with_grads


def _summon_full_params_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Route one ``FSDP.summon_full_params(...)`` call (see [Note: summon lifecycle] in ``_summon``)."""
    bound = _fsdp1_arguments(*args, **kwargs)
    if _refusal is not None:
        return _refusing_summon(wrapped, _refusal, *bound)
    return _summon(*bound, fsdp1=wrapped)


def is_fsdp1_tree(module: nn.Module, recurse: bool) -> bool:
    """Whether FSDP1 serves ``summon_full_params(module, recurse)``: the module is an FSDP1 wrapper, or,
    with ``recurse``, holds one. The one test, for routing in both modes and for the stream's refusal."""
    if isinstance(module, FullyShardedDataParallel):
        return True
    return recurse and any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def _refusing_summon(wrapped: Any, refusal: str, module: Any, recurse: bool, *rest: Any) -> Any:
    """FSDP1's own context, unless the module holds DTensors: then raise. See [Note: refusing mode]."""
    if not isinstance(module, nn.Module) or is_fsdp1_tree(module, recurse):
        return wrapped(module, recurse, *rest)
    if isinstance(module, FSDPModule) or (isinstance(module, nn.Module) and any(
        isinstance(t, DTensor) for t in (*module.parameters(), *module.buffers())
    )):
        raise RuntimeError(
            f"summon_full_params({type(module).__name__}) holds DTensor parameters, which fsdp_shim cannot gather "
            f"on this torch: {refusal}. Without fsdp_shim this call would silently do nothing."
        )
    return wrapped(module, recurse, *rest)


def _instance_form(*args: Any, **kwargs: Any) -> Any:
    """``FSDPModule.summon_full_params``: FSDP1's staticmethod, reached through an FSDP2 unit."""
    return FullyShardedDataParallel.summon_full_params(*args, **kwargs)


_INSTANCE_FORM = staticmethod(_instance_form)


def _install_instance_form() -> None:
    if any(_NAME in vars(cls) for cls in FSDPModule.__mro__):
        return  # no-op: torch (or someone) defines it; never replace it
    setattr(FSDPModule, _NAME, _INSTANCE_FORM)


def _remove_instance_form() -> None:
    if vars(FSDPModule).get(_NAME) is _INSTANCE_FORM:
        delattr(FSDPModule, _NAME)


_guard_handle: wrapt.FunctionWrapper | None = None  # on FSDPState.__init__, while patched


def _refuse_fully_shard_inside(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fully_shard`` raises while the calling thread has a context open.

    Inside, the slots hold plain full tensors, so ``fully_shard`` would shard
    *them* where outside it refuses, and training then diverges silently.
    The guard sits on ``FSDPState.__init__``: ``fully_shard``'s ``contract``
    builds the state first, before it registers anything on the module, so a
    refusal leaves the module untouched.
    """
    from fsdp_shim import _registry  # noqa: PLC0415  (not in refusing mode's imports; cached after the first)

    if _registry.has_live_context(threading.get_ident()):
        raise RuntimeError(
            "fully_shard() inside summon_full_params is not supported: the module attributes hold "
            "full tensors there, which FSDP2 would shard in place of the real parameters. "
            "Call fully_shard() outside the context."
        )
    return wrapped(*args, **kwargs)


def is_patched() -> bool:
    current = inspect.getattr_static(_TARGET, _NAME)
    return _handle is not None and wrapt.is_wrapped_by(current, _handle)


def patch(refusal: str | None = None) -> bool:
    """Install the wrapper; returns False (and changes nothing) if ours is already there.

    With ``refusal``, the wrapper refuses DTensor summons: see [Note: refusing mode].
    """
    global _handle, _refusal, _summon, _guard_handle
    with _lock:
        if is_patched():
            return False
        _refusal = refusal
        if refusal is None:
            from fsdp_shim._summon import summon  # noqa: PLC0415  (needs the FSDP2 internals)

            _summon = summon
        _handle = wrapt.wrap_function_wrapper(_TARGET, _NAME, _summon_full_params_wrapper)
        _install_instance_form()
        if refusal is None:
            from fsdp_shim import instrumentations  # noqa: PLC0415
            from fsdp_shim._fsdp2 import FSDPState  # noqa: PLC0415

            if _guard_handle is None:
                _guard_handle = wrapt.wrap_function_wrapper(FSDPState, "__init__", _refuse_fully_shard_inside)
            instrumentations.instrument_all()
        logger.debug("patched FullyShardedDataParallel.summon_full_params%s", " (refusing)" if refusal else "")
        return True


def unpatch() -> bool:
    """Remove our wrapper by handle; returns False if it was not installed."""
    global _handle, _guard_handle
    with _lock:
        if _handle is None:
            return False
        removed = wrapt.unwrap_object(_TARGET, _NAME, _handle, missing_ok=True)
        _handle = None
        _remove_instance_form()
        if _refusal is None:
            from fsdp_shim._fsdp2 import FSDPState  # noqa: PLC0415
            from fsdp_shim.instrumentations import uninstrument_all  # noqa: PLC0415

            uninstrument_all()
            if _guard_handle is not None:
                wrapt.unwrap_object(FSDPState, "__init__", _guard_handle, missing_ok=True)
                _guard_handle = None
        if removed is None:
            _versions.log_warning("summon_full_params was replaced by someone else; nothing to unpatch")
            return False
        logger.debug("restored FullyShardedDataParallel.summon_full_params")
        return True


# -- units, FSDP1 and FSDP2 alike (public: ``fsdp_units``, ``is_fsdp_module``, ``param_fqn``) ------
# FSDP1-era code often gates on ``isinstance(m, FullyShardedDataParallel)``,
# which is never true for FSDP2 modules (and must stay so: FSDP1 code paths
# would then reach for flat parameters). These helpers are the one-line
# replacement for such gates.


_UNIT_TYPES: tuple[type, ...] = (FullyShardedDataParallel, FSDPModule)

#: The prefix FSDP1 wrappers add to every name below them.
FSDP1_PREFIX = "_fsdp_wrapped_module."


def is_fsdp_module(module: nn.Module) -> bool:
    """True for FSDP1 wrappers and FSDP2 (``fully_shard``) units."""
    return isinstance(module, _UNIT_TYPES)


def clean_fqn(name: str) -> str:
    """A name without FSDP1's wrapper prefixes: the name in the unwrapped model."""
    return name.replace(FSDP1_PREFIX, "")


def fsdp_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, unit)`` for every FSDP1 or FSDP2 unit in ``model``, outermost first."""
    for name, module in model.named_modules():
        if is_fsdp_module(module):
            yield clean_fqn(name), module


def param_fqn(model: nn.Module, param: nn.Parameter) -> str:
    """The first name under which ``param`` (this very object) is reachable in ``model`` now.

    Inside ``summon_full_params`` the full parameters are new objects, so look
    them up there, not in a map built before the context.
    """
    for name, candidate in model.named_parameters(remove_duplicate=False):
        if candidate is param:
            return clean_fqn(name)
    raise KeyError("parameter is not reachable from this module right now")
