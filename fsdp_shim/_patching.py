"""The patch lifecycle: which wrapper serves ``FullyShardedDataParallel.summon_full_params``, and its undo.

Active mode adds the instrumentations, two guards and the instance form; refusing mode only ``_refusing_wrapper``,
on FSDP1's class. Module-level imports read public torch only, and every write into FSDP2's classes goes through
``_fsdp2``, imported in active mode only: refusing mode serves a torch whose FSDP2 internals may not import.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.nn as nn
import wrapt
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_shim import _versions
from fsdp_shim._common import refuse_arguments
from fsdp_shim._errors import UnsupportedTorchError
from fsdp_shim._scope_rule import route

logger = logging.getLogger("fsdp_shim")

_TARGET = FullyShardedDataParallel
_NAME = "summon_full_params"

_lock = threading.Lock()
_handle: wrapt.FunctionWrapper | None = None
_active = False  # whether ``_handle`` serves DTensor summons (else it refuses them)
#: A wrapt wrapper: the summon's, handed in from above, since this module must never import the summon.
Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]


def _fsdp1_arguments(
    module: Any, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
    offload_to_cpu: bool = False, with_grads: bool = False,
) -> tuple[Any, bool, bool, bool, bool, bool]:
    """FSDP1's signature (``test_patching`` checks it), bound by the interpreter; the arguments in its order."""
    return module, recurse, writeback, rank0_only, offload_to_cpu, with_grads


def _refusing_wrapper(refusal: str, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Refusing mode's wrapper: FSDP1's own context, unless the call would take the DTensor route: then raise.
    Routes by ``_scope_rule.route`` (public torch only), so it works where FSDP2's internals moved."""
    try:
        module, recurse, *rest = _fsdp1_arguments(*args, **kwargs)
    except TypeError:  # arguments FSDP1's signature does not take: refused in its own words
        refuse_arguments(wrapped, args, kwargs)
    if isinstance(module, nn.Module) and route(module, recurse)[0] == "dtensor":
        raise UnsupportedTorchError(
            f"summon_full_params({type(module).__name__}) holds DTensor parameters, which fsdp_shim cannot gather "
            f"on this torch: {refusal}. Without fsdp_shim this call would silently do nothing."
        )
    return wrapped(module, recurse, *rest)


def _instance_form(*args: Any, **kwargs: Any) -> Any:
    """``FSDPModule.summon_full_params``: FSDP1's staticmethod, reached through an FSDP2 unit."""
    return FullyShardedDataParallel.summon_full_params(*args, **kwargs)


_INSTANCE_FORM = staticmethod(_instance_form)


_guard_handle: wrapt.FunctionWrapper | None = None  # on FSDPState.__init__, while patched
_call_handles: list[tuple[str, wrapt.FunctionWrapper]] = []  # on FSDPModule's guarded calls, while patched


def _refuse_fully_shard_inside(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fully_shard`` raises while the calling thread has a context open (it would shard the full tensors);
    on ``FSDPState.__init__``, which runs before ``fully_shard`` changes the module."""
    from fsdp_shim import _health  # noqa: PLC0415  (not in refusing mode's imports; cached after the first)

    if _health.has_live_context(threading.get_ident()):
        raise RuntimeError(
            "fully_shard() inside summon_full_params is not supported: the module attributes hold "
            "full tensors there, which FSDP2 would shard in place of the real parameters. "
            "Call fully_shard() outside the context."
        )
    return wrapped(*args, **kwargs)


def _refuse_fsdp2_call_inside(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """FSDP2's ``reshard()``, ``unshard()`` and ``set_reshard_after_forward()`` on a group a live context holds.

    [Note: FSDP2's calls inside]
    A held group is sharded underneath (entry resharded it) and gets its shards back at exit, so ``reshard()`` is
    done for it (peft's ``merge_adapter()`` reshards every unit from 0.22), where FSDP2's would put the shards in
    the full parameters' slots; refused under ``rank0_only``, whose other ranks hold the live shards in the slots
    (what follows, as peft's merge, would edit them, or run collectives on some ranks only). ``unshard()`` would
    gather over them, ``set_reshard_after_forward()`` rewrite what exit reverts: refused on every rank alike,
    before any change. FSDP2's other setters and paths (hooks, ``state_dict()``) touch nothing held, and a
    context redirects ``_apply``.
    """
    from fsdp_shim import _fsdp2, _registry  # noqa: PLC0415  (not in refusing mode's imports; cached after the first)

    if _registry.has_live_slots():
        module, call_args = (instance, args) if instance is not None else (args[0], args[1:])
        groups = _fsdp2.groups_of_call(module, wrapped.__name__, call_args, kwargs)
        owners = [[owner for fsdp_param in _fsdp2.group_params(group) for m, n in _fsdp2.param_slots(fsdp_param)
                   if (owner := _registry.owner_of((id(m), n))) is not None] for group in groups]
        rank0_only = any(owner.call.rank0_only for found in owners for owner in found)  # shards in the others' slots
        if any(owners) and wrapped.__name__ == "reshard" and not rank0_only:  # FSDP2's returns None too
            return _fsdp2.reshard_groups([group for group, found in zip(groups, owners, strict=True) if not found])
        if any(owners):
            raise RuntimeError(
                f"{type(module).__name__}.{wrapped.__name__}() inside summon_full_params"
                f"{'(rank0_only=True)' if rank0_only else ''} over its parameters is not supported: the context "
                "holds them, and restores FSDP2's state on exit. Call it after the context."
            )
    return wrapped(*args, **kwargs)


def is_patched() -> bool:
    """Whether our wrapper (the handle ``wrap_function_wrapper`` returned) is still in the attribute's wrapper
    chain: a third party may have replaced or wrapped it since. wrapt patches the class ``__dict__`` entry,
    so the ``staticmethod`` survives and ``inspect.signature`` still reports FSDP1's."""
    current = inspect.getattr_static(_TARGET, _NAME)
    return _handle is not None and wrapt.is_wrapped_by(current, _handle)


def patch(refusal: str | None = None, summon: Wrapper | None = None) -> bool:
    """Install the wrapper; returns False (and changes nothing) if ours is already there.

    With ``refusal``, the wrapper refuses DTensor summons; otherwise ``summon`` serves them, and the
    instrumentations and the guards are installed.
    """
    wrapper: Wrapper | None = summon if refusal is None else functools.partial(_refusing_wrapper, refusal)
    if wrapper is None:
        raise TypeError("patch() needs the DTensor summon's wrapper to install, or a refusal")
    global _handle, _active, _guard_handle
    with _lock:
        if is_patched():
            return False
        _handle = wrapt.wrap_function_wrapper(_TARGET, _NAME, wrapper)
        _active = refusal is None
        if _active:
            from fsdp_shim import instrumentations  # noqa: PLC0415  (not in refusing mode)
            from fsdp_shim import _fsdp2  # noqa: PLC0415  (FSDP2's internals: not in refusing mode)

            _fsdp2.add_instance_form(_INSTANCE_FORM)
            if _guard_handle is None:
                _guard_handle = _fsdp2.wrap_state_init(_refuse_fully_shard_inside)
            if not _call_handles:
                _call_handles.extend(_fsdp2.wrap_guarded_calls(_refuse_fsdp2_call_inside))
            instrumentations.instrument_all()
        logger.debug("patched FullyShardedDataParallel.summon_full_params%s", " (refusing)" if refusal else "")
        return True


def unpatch() -> bool:
    """Remove our wrapper by handle, restoring the exact original; returns False if it was not installed."""
    global _handle, _guard_handle
    with _lock:
        if _handle is None:
            return False
        removed = wrapt.unwrap_object(_TARGET, _NAME, _handle, missing_ok=True)
        _handle = None
        if _active:
            from fsdp_shim import _fsdp2  # noqa: PLC0415  (not in refusing mode)
            from fsdp_shim.instrumentations import uninstrument_all  # noqa: PLC0415  (not in refusing mode)

            _fsdp2.remove_instance_form(_INSTANCE_FORM)
            uninstrument_all()
            if _guard_handle is not None:
                _fsdp2.unwrap_state_init(_guard_handle)
                _guard_handle = None
            if _call_handles:
                _fsdp2.unwrap_guarded_calls(_call_handles)
                _call_handles.clear()
        if removed is None:
            _versions.log_warning("summon_full_params was replaced by someone else; nothing to unpatch")
            return False
        logger.debug("restored FullyShardedDataParallel.summon_full_params")
        return True
