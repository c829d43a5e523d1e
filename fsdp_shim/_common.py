"""What the rooms share, from public torch alone (refusing mode imports it too): FSDP2's
``_fsdp_common``, for the shim.

- Units and routing: "is this an FSDP1 tree" (``is_fsdp1_tree``) and which implementation serves a
  call (``route``: FSDP1's, the DTensor summon, or a null context), asked by both modes, the active
  one through ``_summon.summon`` (which adds the registry's and FSDP2's records to "holds anything
  distributed"); the public unit helpers (``fsdp_units``, ``is_fsdp_module``, ``param_fqn``), the
  one-line replacement for FSDP1-era ``isinstance(m, FullyShardedDataParallel)``, never true of an
  FSDP2 unit.
- ``run_each``: the one loop of every error path's undo (each step runs; the first error is
  raised after); ``refuse_arguments``: both modes' refusal of arguments FSDP1 does not take. The
  errors callers catch by type are ``_errors``' (torch-free, for ``import fsdp_shim``).
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
    with ``recurse``, holds one. The one test, for routing in both modes and for the stream's refusal."""
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
    """Whether ``modules`` (a ``scope_modules`` list) hold something distributed, by public torch alone:
    a parameter or buffer slot holding a DTensor, or an FSDP2 unit among them (whose slots hold plain
    tensors after a forward). The one predicate of both modes: the active mode adds only what the
    registry and FSDP2's own records know (``_scope.has_distributed_params``)."""
    return any(isinstance(m, FSDPModule) or any(isinstance(t, DTensor) for t in (*m._parameters.values(),
                                                                                 *m._buffers.values()))
               for m in modules)


def route(
    module: nn.Module, recurse: bool, distributed: Callable[[list[nn.Module]], bool] = holds_distributed,
) -> tuple[Route, list[nn.Module] | None]:
    """Which implementation serves ``summon_full_params(module, recurse)``, and the scope's modules if
    the answer walked them (the summon reuses the walk).

    FSDP1 trees go to FSDP1, untouched. An FSDP2 unit takes the DTensor path
    (it validates its arguments, then may find nothing to gather). Any other
    module takes it when ``distributed`` says its scope (``scope_modules``:
    ``recurse`` honoured) holds something distributed, else gets a null
    context, as FSDP1's is for a module without FSDP1 state. The module tree
    and slot types are the same on every rank outside contexts; inside one,
    the active mode's ``distributed`` also asks the registry, which
    every rank keeps alike (see [Note: every rank decides alike] in ``_summon``).
    """
    if is_fsdp1_tree(module, recurse):
        return "fsdp1", None
    if isinstance(module, FSDPModule):
        return "dtensor", None
    modules = scope_modules(module, recurse)
    return ("dtensor" if distributed(modules) else "none"), modules


def refuse_arguments(fsdp1: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
    """Refuse arguments FSDP1's signature does not take, as both modes' wrappers do: with FSDP1's own
    ``TypeError``, in its words, raised by binding them to ``fsdp1``, FSDP1's ``summon_full_params`` (a
    ``contextmanager`` function: calling it binds its arguments and runs nothing of its body). Where this
    FSDP1 takes them (a newer signature), the shim, which serves FSDP1's known arguments only, refuses."""
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
    """The first name under which ``param`` (this very object) is reachable in ``model`` now.

    Inside ``summon_full_params`` the full parameters are new objects, so look
    them up there, not in a map built before the context.
    """
    for name, candidate in model.named_parameters(remove_duplicate=False):
        if candidate is param:
            return clean_fqn(name)
    raise KeyError("parameter is not reachable from this module right now")


def run_each(steps: Iterable[Callable[[], object] | None]) -> BaseException | None:
    """Call every step (``None``: skipped), each even if one before it raised, ``KeyboardInterrupt`` too; return
    the first error, for the caller to raise once all have run. Every undo of an error path runs so."""
    first: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except BaseException as error:  # noqa: BLE001  # the rest still run; the first is returned
            first = first or error
    return first
