"""compose-rl: the vLLM weight sync and the MPT generation helpers, on FSDP2 with no code change."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch.nn as nn
import wrapt
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from fsdp_shim._param import original_params
from fsdp_shim.instrumentations.base import Instrumentation


class FSDPUnitGate(wrapt.ObjectProxy):
    """``FullyShardedDataParallel`` as one module sees it: FSDP2 units pass its ``isinstance`` too."""

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, (self.__wrapped__, FSDPModule))


class NamesOfSummonedParams(dict):
    """A parameter -> name map built outside a context that answers for full parameters too, as under FSDP1."""

    def __missing__(self, key: Any) -> Any:
        for original in original_params(key):
            if original in self:
                return self[original]
        raise KeyError(key)


class ComposeRLWeightSync(Instrumentation):
    """compose-rl's vLLM weight sync: its ``FSDP`` global (an ``isinstance`` check) becomes an ``FSDPUnitGate``,
    ``build_param_fullnames``' map a ``NamesOfSummonedParams``."""

    name = "compose_rl"
    module = "compose_rl.algorithms.online.generation_utils.vllm_utils"
    upstream = "databricks/compose-rl@ae56991 (main): broadcast_to_vllm, is_fsdp_leaf, build_param_fullnames"
    expects = ("FSDP", "broadcast_to_vllm", "is_fsdp_leaf", "build_param_fullnames")

    def _mismatch(self, module: ModuleType) -> str | None:
        problem = super()._mismatch(module)
        if problem is None and getattr(module, "FSDP", None) is not FullyShardedDataParallel:
            problem = "its FSDP is not torch's FullyShardedDataParallel"
        return problem

    def _apply(self, module: ModuleType) -> None:
        self._gate = FSDPUnitGate(FullyShardedDataParallel)
        setattr(module, "FSDP", self._gate)  # noqa: B010  (a module global, by name)

        def names(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return NamesOfSummonedParams(wrapped(*args, **kwargs))

        self._names_handle = wrapt.wrap_function_wrapper(module, "build_param_fullnames", names)

    def _undo(self, module: ModuleType) -> None:
        if getattr(module, "FSDP", None) is self._gate:
            setattr(module, "FSDP", FullyShardedDataParallel)  # noqa: B010  (a module global, by name)
        wrapt.unwrap_object(module, "build_param_fullnames", self._names_handle, missing_ok=True)



# -- the MPT generation helpers ----------------------------------------------


def _mpt_blocks(model: Any) -> list[nn.Module] | None:
    """``model.transformer.blocks`` where no block is FSDP1's wrapper; else None (the helpers run as installed)."""
    blocks = getattr(getattr(model, "transformer", None), "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return None
    if any(hasattr(block, "_fsdp_wrapped_module") for block in blocks):
        return None
    return list(blocks)


def _flag_holder(block: nn.Module) -> nn.Module:
    """The module whose ``use_pad_tok_in_ffn`` is toggled: the block, or what its checkpoint wrapper holds."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def _flip_in_ffn(blocks: list[nn.Module]) -> None:
    for block in blocks:
        holder: Any = _flag_holder(block)  # MPT's plain bool attribute
        holder.use_pad_tok_in_ffn = not holder.use_pad_tok_in_ffn


def _fsdp2_aware_flip_for_generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``flip_pad_token_usage_for_generate(model)``: on FSDP2 blocks, turn the flag on everywhere if the
    first block has it off, and say whether it flipped, as the installed helper does on FSDP1."""
    blocks = _mpt_blocks(args[0] if args else kwargs.get("model"))
    if blocks is None:
        return wrapped(*args, **kwargs)
    flip = not _flag_holder(blocks[0]).use_pad_tok_in_ffn
    if flip:
        _flip_in_ffn(blocks)
    return flip


def _fsdp2_aware_flip_in_ffn(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``flip_pad_token_usage_in_ffn(model)``: on FSDP2 blocks, toggle every block's flag."""
    blocks = _mpt_blocks(args[0] if args else kwargs.get("model"))
    if blocks is None:
        return wrapped(*args, **kwargs)
    _flip_in_ffn(blocks)
    return None


class ComposeRLPadTokenFlip(Instrumentation):
    """compose-rl's MPT generation helpers reach ``use_pad_tok_in_ffn`` through ``block._fsdp_wrapped_module``,
    which FSDP2 units lack and must not get (torch's FSDP1 code reads it as "an FSDP1 wrapper")."""

    name = "compose_rl_mpt"
    module = "compose_rl.utils.utils"
    upstream = "databricks/compose-rl ae56991: flip_pad_token_usage_for_generate, flip_pad_token_usage_in_ffn"
    expects = ("flip_pad_token_usage_for_generate", "flip_pad_token_usage_in_ffn")
    binders = (
        "compose_rl.utils",
        "compose_rl.algorithms.online.generation_utils.generation_utils",
    )
    bound_names = ("flip_pad_token_usage_for_generate", "flip_pad_token_usage_in_ffn")
    _WRAPPERS = {
        "flip_pad_token_usage_for_generate": _fsdp2_aware_flip_for_generate,
        "flip_pad_token_usage_in_ffn": _fsdp2_aware_flip_in_ffn,
    }

    def _apply(self, module: ModuleType) -> None:
        self._handles = {name: wrapt.wrap_function_wrapper(module, name, wrapper)
                         for name, wrapper in self._WRAPPERS.items()}

    def _undo(self, module: ModuleType) -> None:
        for name, handle in self._handles.items():
            wrapt.unwrap_object(module, name, handle, missing_ok=True)
