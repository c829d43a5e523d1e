"""What the rooms share, from public torch alone (refusing mode imports it too): routing, shared by both
modes, the public unit helpers, and the one loop of every error path's undo (``run_each``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NoReturn

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

#: Which implementation serves one ``summon_full_params`` call.
Route = Literal["fsdp1", "dtensor", "none"]

_UNIT_TYPES: tuple[type, ...] = (FullyShardedDataParallel, FSDPModule)

#: The prefix FSDP1 wrappers add to every name below them.
FSDP1_PREFIX = "_fsdp_wrapped_module."


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
    something distributed, else none; and the scope's modules if the answer walked them. Alike on every rank
    ([Note: every rank decides alike] in ``_summon``)."""
    if is_fsdp1_tree(module, recurse):
        return "fsdp1", None
    if isinstance(module, FSDPModule):
        return "dtensor", None
    modules = scope_modules(module, recurse)
    return ("dtensor" if distributed(modules) else "none"), modules


def refuse_arguments(fsdp1: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
    """Refuse arguments FSDP1's signature does not take with FSDP1's own ``TypeError``, by binding them to
    ``fsdp1`` (a ``contextmanager`` function: calling it runs nothing of its body); those only a newer FSDP1
    takes are refused too: the shim serves FSDP1's known arguments."""
    fsdp1(*args, **kwargs)
    raise TypeError(f"summon_full_params(): fsdp_shim serves FSDP1's arguments (module, recurse, writeback, "
                    f"rank0_only, offload_to_cpu, with_grads) only, not {len(args)} positional and {sorted(kwargs)}")


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
    """The first name under which ``param`` (this very object) is reachable in ``model`` now (inside
    ``summon_full_params`` the full parameters are new objects)."""
    for name, candidate in model.named_parameters(remove_duplicate=False):
        if candidate is param:
            return clean_fqn(name)
    raise KeyError("parameter is not reachable from this module right now")


def run_each(steps: Iterable[Callable[[], object] | None]) -> BaseException | None:
    """Call every step (``None``: skipped), each even if one before it raised, ``KeyboardInterrupt`` too;
    return the first error, for the caller to raise once all have run."""
    first: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except BaseException as error:  # noqa: BLE001  # the rest still run; the first is returned
            first = first or error
    return first
