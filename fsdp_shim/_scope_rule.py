"""The scope room's ``recurse`` rule, from public torch alone: which modules ``summon_full_params(module, recurse)``
covers, and which implementation serves the call. Alike on every rank ([Note: every rank decides alike] in
``_summon``).

Apart from ``_scope`` because refusing mode (``_patching``) routes by this rule on a torch whose FSDP2 internals
may not import, and ``_scope`` imports them (``_fsdp2``, ``_param``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

#: Which implementation serves one ``summon_full_params`` call.
Route = Literal["fsdp1", "dtensor", "none"]


def is_fsdp1_tree(module: nn.Module, recurse: bool) -> bool:
    """Whether FSDP1 serves ``summon_full_params(module, recurse)``: the module is an FSDP1 wrapper, or,
    with ``recurse``, holds one."""
    if isinstance(module, FullyShardedDataParallel):
        return True
    return recurse and any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def scope_modules(root: nn.Module, recurse: bool) -> list[nn.Module]:
    """``root``'s subtree in ``named_modules()`` order; without ``recurse``,
    nested FSDP2 units and everything below them are left out."""
    seen: set[int] = set()
    ordered: list[nn.Module] = []
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if module is not root and not recurse and isinstance(module, FSDPModule):
            continue
        ordered.append(module)
        stack.extend(reversed([c for c in module._modules.values() if c is not None]))
    return ordered


def holds_distributed(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` hold something distributed, by public torch alone: a DTensor in a slot, or an
    FSDP2 unit (whose slots hold plain tensors after a forward)."""
    return any(isinstance(m, FSDPModule) or any(isinstance(t, DTensor) for t in (*m._parameters.values(),
                                                                                 *m._buffers.values()))
               for m in modules)


def route(
    module: nn.Module, recurse: bool, distributed: Callable[[list[nn.Module]], bool] = holds_distributed,
) -> tuple[Route, list[nn.Module] | None]:
    """Which implementation serves ``summon_full_params(module, recurse)``: FSDP1's for FSDP1 trees, the
    DTensor summon for an FSDP2 unit (which validates its arguments) or a scope ``distributed`` says holds
    something distributed, else none; and the scope's modules if the answer walked them."""
    if is_fsdp1_tree(module, recurse):
        return "fsdp1", None
    if isinstance(module, FSDPModule):
        return "dtensor", None
    modules = scope_modules(module, recurse)
    return ("dtensor" if distributed(modules) else "none"), modules
