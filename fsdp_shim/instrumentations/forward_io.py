"""Two mends of how FSDP2 walks a unit's forward inputs and outputs, for RL code that ran on FSDP1."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import OrderedDict
from types import ModuleType
from typing import Any

import torch
import wrapt
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree

from fsdp_shim import _fsdp2 as fsdp2
from fsdp_shim.instrumentations.base import Instrumentation

logger = logging.getLogger("fsdp_shim")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields") and hasattr(x, "_asdict")


def cast_keeping_identity(cast: Any, x: Any) -> Any:
    """``cast`` on every tensor in ``x``, walked as torch's ``_apply_to_tensors``; an object none of whose
    tensors changed is returned itself, an unknown type is a leaf."""
    if isinstance(x, torch.Tensor):
        return cast(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {}
        for f in dataclasses.fields(x):
            if f.init:
                value = getattr(x, f.name)
                new = cast_keeping_identity(cast, value)
                if new is not value:
                    changes[f.name] = new
        return dataclasses.replace(x, **changes) if changes else x
    if isinstance(x, PackedSequence):
        return x  # torch's walk casts a copy of .data and returns the sequence itself
    if isinstance(x, dict):
        items = [(k, v, cast_keeping_identity(cast, v)) for k, v in x.items()]
        if all(new is v for _, v, new in items):
            return x
        rebuilt = x.__class__() if isinstance(x, OrderedDict) else {}
        for k, _, new in items:
            rebuilt[k] = new
        return rebuilt
    if isinstance(x, (list, tuple, set)):
        old = list(x)
        new = [cast_keeping_identity(cast, v) for v in old]
        if all(n is o for n, o in zip(new, old, strict=True)):
            return x
        return type(x)(*new) if _is_namedtuple(x) else type(x)(new)
    return x


class FSDP2ForwardCast(Instrumentation):
    """FSDP2's forward-input and output cast, keeping what it does not change: torch 2.7's walk copies
    transformers' ``DynamicCache``, so ``generate`` silently samples from wrong logits.

    [Note: where the cast is reached]
    On torch 2.7 to 2.15, ``_fsdp_state`` casts through one module global (``tree_map`` on 2.7,
    ``_apply_to_tensors`` after), called with ``functools.partial(_cast_fp_tensor, dtype)``. The mend wraps
    that global and takes over only calls with that partial; other uses (2.13's functorch path) reach torch's.
    """

    name = "fsdp2_cast"
    module = fsdp2.CAST_MODULE  # its globals are reached through ``_fsdp2``
    upstream = "torch 2.7.0 to 2.15.0: FSDPState's cast through tree_map (2.7) or _apply_to_tensors (2.8+)"
    expects = (fsdp2.CAST_FN,)

    def _mismatch(self, module: ModuleType) -> str | None:
        problem = super()._mismatch(module)
        if problem is None and not fsdp2.has_cast_walk(module):
            problem = f"it has neither {' nor '.join(fsdp2.CAST_WALKS)}"
        return problem

    def _apply(self, module: ModuleType) -> None:
        cast_fn = fsdp2.cast_fn(module)

        def walk(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if len(args) == 2 and not kwargs and isinstance(args[0], functools.partial) \
                    and args[0].func is cast_fn:
                return cast_keeping_identity(args[0], args[1])
            return wrapped(*args, **kwargs)

        self._handles = fsdp2.wrap_cast_walks(module, walk)

    def _undo(self, module: ModuleType) -> None:
        fsdp2.unwrap_cast_walks(module, self._handles)
        self._handles = {}


def _dict_flatten(output: Any) -> tuple[list[Any], list[Any]]:
    return list(dict.values(output)), list(dict.keys(output))


def _dict_flatten_with_keys(output: Any) -> tuple[list[tuple[Any, Any]], list[Any]]:
    return [(_pytree.MappingKey(k), v) for k, v in dict.items(output)], list(dict.keys(output))


_DICT_METHODS = frozenset(name for name in dir(dict) if not name.startswith("_"))


def shadowed_dict_methods(cls: type) -> set[str]:
    """The ``dict`` methods that fields of ``cls`` shadow (annotations: they exist before ``@dataclass`` runs)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
    return names & _DICT_METHODS


class ModelOutputFlatten(Instrumentation):
    """pytree's flatten of ``ModelOutput`` subclasses whose fields shadow a ``dict`` method: transformers'
    ``output.values()`` breaks on a ``values`` field (compose-rl's), and FSDP2's root post-forward flattens
    outputs (torch 2.7 to 2.12). Every such subclass, present or later, reads through ``dict`` itself."""

    name = "model_output"
    module = "transformers.utils.generic"
    upstream = ("transformers 4.51.3 and 5.24: ModelOutput.__init_subclass__ registers _model_output_flatten; "
                "compose-rl ae56991's CausalLMOutputWithPastAndValues has a values field")
    expects = ("ModelOutput",)

    def _apply(self, module: ModuleType) -> None:
        self._originals: dict[type, Any] = {}
        base = module.ModelOutput
        pending = [base]
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            self._mend(cls)

        def registered(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            if isinstance(instance, type):
                self._mend(instance)
            return result

        self._hook = wrapt.wrap_function_wrapper(base, "__init_subclass__", registered)
        self._base = base

    def _mend(self, cls: type) -> None:
        shadowed = shadowed_dict_methods(cls)
        if not shadowed:
            return
        with _pytree._NODE_REGISTRY_LOCK:
            node = _pytree.SUPPORTED_NODES.get(cls)
            if node is None or cls in self._originals:
                return  # not registered by transformers (or already mended): nothing to correct
            with_keys = _dict_flatten_with_keys if node.flatten_with_keys_fn is not None else None
            _pytree.SUPPORTED_NODES[cls] = node._replace(flatten_fn=_dict_flatten, flatten_with_keys_fn=with_keys)
            self._originals[cls] = node
        logger.debug("pytree flatten of %s.%s reads the dict itself (fields shadow %s)",
                     cls.__module__, cls.__qualname__, ", ".join(sorted(shadowed)))

    def _undo(self, module: ModuleType) -> None:
        wrapt.unwrap_object(self._base, "__init_subclass__", self._hook, missing_ok=True)
        with _pytree._NODE_REGISTRY_LOCK:
            for cls, node in self._originals.items():
                current = _pytree.SUPPORTED_NODES.get(cls)
                if current is not None and current.flatten_fn is _dict_flatten:
                    _pytree.SUPPORTED_NODES[cls] = node
        self._originals = {}
