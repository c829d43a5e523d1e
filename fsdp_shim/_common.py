"""What the rooms share, from public torch alone (refusing mode imports it too): the refusal of arguments FSDP1
does not take, the public unit helpers, and the one loop of every error path's undo (``run_each``). The ``recurse``
rule and routing are the scope room's (``_scope_rule``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

_UNIT_TYPES: tuple[type, ...] = (FullyShardedDataParallel, FSDPModule)

#: The prefix FSDP1 wrappers add to every name below them.
FSDP1_PREFIX = "_fsdp_wrapped_module."


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
