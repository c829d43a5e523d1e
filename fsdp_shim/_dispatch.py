"""Route a ``summon_full_params`` call: FSDP1 original, DTensor path, or nothing.

FSDP1 module trees go to FSDP1's own implementation untouched. Trees with
DTensor parameters in scope (FSDP2, HSDP, tensor parallel) go to ``_swap``.
Anything else is a null context, as FSDP1's version is for a module without
FSDP1 state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, ContextManager, Literal

import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_shim._fsdp2_internals import is_fsdp2_module
from fsdp_shim._layout import bucket_bytes_chosen
from fsdp_shim._refusals import validate_args
from fsdp_shim._scope import has_distributed_params, scope_modules
from fsdp_shim._swap import DTensorSummon

logger = logging.getLogger("fsdp_shim")

Route = Literal["fsdp1", "dtensor", "none"]


def _route(module: Any, recurse: bool) -> tuple[Route, list[nn.Module] | None]:
    """Which implementation serves ``summon_full_params(module, recurse=recurse)``, and the scope's
    modules where finding it walked them (the swap reuses the walk)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"summon_full_params expects an nn.Module, got {type(module).__name__}")
    if recurse:
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            return "fsdp1", None
    elif isinstance(module, FullyShardedDataParallel):
        return "fsdp1", None
    if is_fsdp2_module(module):  # a unit: the DTensor path validates, then may find nothing
        return "dtensor", None
    modules = scope_modules(module, recurse)
    return ("dtensor" if has_distributed_params(modules) else "none"), modules


def summon(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
    *,
    bucket_mb: float | None = None,
    fsdp1: Callable[..., ContextManager[Any]] | None = None,
) -> ContextManager[None]:
    """Dispatch one call. ``fsdp1`` is the original FSDP1 implementation, if known."""
    route, modules = _route(module, recurse)
    logger.debug("summon_full_params(%s): route=%s", type(module).__name__, route)
    if route == "fsdp1":
        original = fsdp1 if fsdp1 is not None else _original_fsdp1()
        return original(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)
    if route == "none":
        return contextlib.nullcontext()
    # Checked at the call, which a with statement makes at once: FSDP1 checks at __enter__, one step later.
    validate_args(writeback, rank0_only, offload_to_cpu, with_grads, module)
    bucket_bytes, chosen = bucket_bytes_chosen(bucket_mb)
    return DTensorSummon(
        module, recurse=recurse, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu,
        with_grads=with_grads, bucket_bytes=bucket_bytes, modules=modules, bucket_chosen=chosen,
    )


def _original_fsdp1() -> Callable[..., ContextManager[Any]]:
    """FSDP1's entry point; through our patch, if installed, which routes back to the original."""
    return FullyShardedDataParallel.summon_full_params
