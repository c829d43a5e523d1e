"""FSDP unit discovery that treats FSDP1 and FSDP2 alike.

FSDP1-era code often gates on ``isinstance(m, FullyShardedDataParallel)``,
which is never true for FSDP2 modules (and must stay so: FSDP1 code paths
would then reach for flat parameters). These helpers are the one-line
replacement for such gates.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel

try:
    from torch.distributed.fsdp import FSDPModule

    _UNIT_TYPES: tuple[type, ...] = (FullyShardedDataParallel, FSDPModule)
except ImportError:  # torch < 2.6 kept FSDP2 elsewhere; the shim is inactive there anyway
    _UNIT_TYPES = (FullyShardedDataParallel,)

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
