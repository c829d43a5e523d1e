"""FSDP unit discovery that treats FSDP1 and FSDP2 alike.

FSDP1-era code often gates on ``isinstance(m, FullyShardedDataParallel)``,
which is never true for FSDP2 modules (and must stay so: FSDP1 code paths
would then reach for flat parameters). These helpers are the one-line
replacement for such gates.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

#: The prefix FSDP1 wrappers add to every name below them.
FSDP1_PREFIX = "_fsdp_wrapped_module."


def is_fsdp_module(module: nn.Module) -> bool:
    return isinstance(module, (FullyShardedDataParallel, FSDPModule))


def clean_fqn(name: str) -> str:
    return name.replace(FSDP1_PREFIX, "")


def fsdp_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if is_fsdp_module(module):
            yield clean_fqn(name), module


def param_fqn(model: nn.Module, param: nn.Parameter) -> str:
    for name, candidate in model.named_parameters(remove_duplicate=False):
        if candidate is param:
            return clean_fqn(name)
    raise KeyError("parameter is not reachable from this module right now")
