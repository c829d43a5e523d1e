"""The instrumentations ``patch()`` installs, and the client ones.

Client instrumentations adapt FSDP1-era call sites that never reach
``FullyShardedDataParallel.summon_full_params`` on FSDP2: they gate it
behind ``isinstance(m, FullyShardedDataParallel)``, or they look up names of
parameter objects in a map built before the context. The forward-I/O ones
(``_forward_io``) mend how FSDP2 walks forward inputs and outputs. The
mechanism, and how to add one, is in ``_instrumentor``.
"""

from __future__ import annotations

import logging
import sys
import torch.nn as nn
import wrapt
from fsdp_shim._summon import original_params
from fsdp_shim.instrumentations.base import Instrumentation
from fsdp_shim.instrumentations.forward_io import FSDP2ForwardCast, ModelOutputFlatten
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from types import ModuleType
from typing import Any


logger = logging.getLogger("fsdp_shim")


class FSDPUnitGate(wrapt.ObjectProxy):  # type: ignore[misc]
    """``FullyShardedDataParallel`` as one module sees it: FSDP2 units pass its ``isinstance``.

    Everything else (``summon_full_params``, ``StateDictType``, ...) is the
    real class. ``isinstance(unit, FullyShardedDataParallel)`` stays False
    everywhere else.
    """

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, (self.__wrapped__, FSDPModule))


class NamesOfSummonedParams(dict):  # type: ignore[type-arg]
    """A parameter -> name map built outside a context that also answers for its full parameters.

    Inside ``summon_full_params`` the slots hold new full parameters; FSDP1
    (``use_orig_params=True``) kept the objects, and clients built their maps
    on that. A miss falls back to the object the full parameter stands for,
    so the name is exactly the one the map gave that object (for a tie: the
    same name FSDP1 gives).
    """

    def __missing__(self, key: Any) -> Any:
        for original in original_params(key):
            if original in self:
                return self[original]
        raise KeyError(key)


class ComposeRLWeightSync(Instrumentation):
    """compose-rl's vLLM weight sync: ``broadcast_to_vllm`` and its helpers.

    Checked against databricks/compose-rl main, ae56991,
    ``compose_rl/algorithms/online/generation_utils/vllm_utils.py`` (first read
    at 00920bf6, a branch; the names and the structure below are the same on
    main, where rank 0 broadcasts each full parameter on ``model_update_group``
    inside the context):
    - ``broadcast_to_vllm`` selects units with ``isinstance(module, FSDP)``
      and ``is_fsdp_leaf`` does the same: the module global ``FSDP`` becomes
      an ``FSDPUnitGate``;
    - ``broadcast_to_vllm`` builds ``build_param_fullnames(model)`` before the
      per-unit ``summon_full_params`` loop and looks names up inside it: the
      map becomes a ``NamesOfSummonedParams``.
    """

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
            setattr(module, "FSDP", FullyShardedDataParallel)  # noqa: B010
        wrapt.unwrap_object(module, "build_param_fullnames", self._names_handle, missing_ok=True)


def _holds_fsdp2_unit(model: Any) -> bool:
    """Composer main's rule (mosaicml/composer #3907) for FSDP2: the model or a direct child is an ``FSDPModule``."""
    return isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in (model, *model.children()))


def _fsdp2_aware_gate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``is_model_fsdp``: the installed answer, or True where Composer main would say FSDP2."""
    if wrapped(*args, **kwargs):
        return True
    model = args[0] if args else kwargs.get("model")
    return _holds_fsdp2_unit(model)


def _recognises_fsdp2(gate: Any) -> bool:
    """Ask the installed gate, once, about a tiny module shaped as ``fully_shard`` leaves one.

    ``fully_shard`` swaps a module's class for a subclass of ``FSDPModule``; so
    does this probe, with no process group and no parameters. The gate must
    say True for the unit itself and for a parent holding it as a direct
    child, as Composer main's does. Decided by behaviour, never by version.
    """
    unit = nn.Module()
    unit.__class__ = type("FSDPProbe", (FSDPModule, nn.Module), {})
    try:
        return bool(gate(unit)) and bool(gate(nn.Sequential(unit)))
    except Exception:  # noqa: BLE001  (a gate that cannot answer does not recognise FSDP2)
        return False


class ComposerFSDPGate(Instrumentation):
    """Composer's ``is_model_fsdp`` gate: True for FSDP2 models too, as Composer main answers.

    Read at mosaicml/composer v0.32.1, ``composer/utils/misc.py`` (the newest
    release; llm-foundry 0.22, which compose-rl's pins resolve to, requires
    ``mosaicml>=0.32.1,<0.33``): ``is_model_fsdp`` imports FSDP1's class inside
    the function and answers True only for the model or a direct child that
    is an FSDP1 ``FullyShardedDataParallel``. Composer main (#3907) also
    accepts ``FSDPModule``. Every summon behind the gate is then skipped on
    FSDP2: Composer's own ``HuggingFaceModel.generate`` and, at
    databricks/compose-rl ae56991 (main), the policy's and the backbone's
    ``generate`` and the reward model's ``mask_last_embed_except_eos``.

    - Where the installed gate already recognises FSDP2 (``_recognises_fsdp2``),
      nothing changes.
    - Otherwise the function is wrapped (wrapt) to add #3907's answer; the
      gate has no module global to swap, since it imports the class inside.
    - ``from composer.utils import is_model_fsdp`` binds a copy of the
      reference in each importer: the re-export ``composer.utils``,
      ``composer.models.huggingface`` and compose-rl's three modules are
      rebound if imported first, and get the wrapper if imported after.
    """

    name = "composer"
    module = "composer.utils.misc"
    upstream = "mosaicml/composer v0.32.1: is_model_fsdp, answered as main's #3907"
    expects = ("is_model_fsdp",)
    binders = (
        "composer.utils",
        "composer.models.huggingface",
        "compose_rl.algorithms.online.hf_utils",
        "compose_rl.algorithms.online.model",
        "compose_rl.algorithms.reward_modeling.model",
    )
    _GATE = "is_model_fsdp"

    def _not_needed(self, module: ModuleType) -> str | None:
        if _recognises_fsdp2(getattr(module, self._GATE)):
            return "the installed is_model_fsdp recognises FSDP2 already (Composer with #3907)"
        return None

    def _apply(self, module: ModuleType) -> None:
        self._original = getattr(module, self._GATE)
        self._handle = wrapt.wrap_function_wrapper(module, self._GATE, _fsdp2_aware_gate)
        self._rebound: list[ModuleType] = []

    def _rebind(self, binder: ModuleType) -> None:
        if getattr(binder, self._GATE, None) is self._original:
            setattr(binder, self._GATE, self._handle)
            self._rebound.append(binder)

    def _undo(self, module: ModuleType) -> None:
        for binder in self._rebound:
            if getattr(binder, self._GATE, None) is self._handle:
                setattr(binder, self._GATE, self._original)
        self._rebound.clear()
        wrapt.unwrap_object(module, self._GATE, self._handle, missing_ok=True)


def _mpt_blocks(model: Any) -> list[nn.Module] | None:
    """``model.transformer.blocks`` where no block is FSDP1's wrapper (FSDP2 units, or unwrapped); else None:
    FSDP1's blocks, no transformer or no blocks, where compose-rl's helpers run as installed."""
    blocks = getattr(getattr(model, "transformer", None), "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return None
    if any(hasattr(block, "_fsdp_wrapped_module") for block in blocks):
        return None
    return list(blocks)


def _flag_holder(block: nn.Module) -> nn.Module:
    """The module whose ``use_pad_tok_in_ffn`` an FSDP2 block's generation toggles: the block itself, or the
    module its activation-checkpoint wrapper holds (FSDP1's helpers reach the same one through the wrapper)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def _flip_in_ffn(blocks: list[nn.Module]) -> None:
    for block in blocks:
        holder = _flag_holder(block)
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
    """compose-rl's MPT generation helpers reach an FSDP2 block itself, not FSDP1's wrapper.

    Read at databricks/compose-rl ae56991, ``compose_rl/utils/utils.py``:
    ``flip_pad_token_usage_for_generate(model)`` and
    ``flip_pad_token_usage_in_ffn(model)`` toggle llm-foundry MPT's
    ``use_pad_tok_in_ffn`` around generation (``hf_generate``), reaching every
    block of ``model.transformer.blocks`` through ``block._fsdp_wrapped_module``
    (and its ``_checkpoint_wrapped_module`` under activation checkpointing).
    On FSDP2 the block is the unit itself, so both raise ``AttributeError``.

    - Both are wrapped (wrapt). Where a block has no ``_fsdp_wrapped_module``,
      the block itself (or its ``_checkpoint_wrapped_module``) is the module
      whose flag is toggled; the helpers' contract (flip on if the first
      block has it off, report it; flip every block) is unchanged.
    - FSDP1 models, and models without ``transformer.blocks``, reach the
      installed helpers unchanged.
    - Why not give FSDP2 units a ``_fsdp_wrapped_module``: FSDP1 code, torch's
      own state-dict helpers among it, reads that attribute as "this is an
      FSDP1 wrapper" (``docs/migration.md``).
    - ``from compose_rl.utils import ...`` binds copies of both names: the
      re-export ``compose_rl.utils`` and ``hf_generate``'s module are rebound
      if imported first, and get the wrappers if imported after.
    """

    name = "compose_rl_mpt"
    module = "compose_rl.utils.utils"
    upstream = "databricks/compose-rl ae56991: flip_pad_token_usage_for_generate, flip_pad_token_usage_in_ffn"
    expects = ("flip_pad_token_usage_for_generate", "flip_pad_token_usage_in_ffn")
    binders = (
        "compose_rl.utils",
        "compose_rl.algorithms.online.generation_utils.generation_utils",
    )
    _WRAPPERS = {
        "flip_pad_token_usage_for_generate": _fsdp2_aware_flip_for_generate,
        "flip_pad_token_usage_in_ffn": _fsdp2_aware_flip_in_ffn,
    }

    def _apply(self, module: ModuleType) -> None:
        self._originals = {name: getattr(module, name) for name in self._WRAPPERS}
        self._handles = {name: wrapt.wrap_function_wrapper(module, name, wrapper)
                         for name, wrapper in self._WRAPPERS.items()}

    def _rebind(self, binder: ModuleType) -> None:
        for name, handle in self._handles.items():
            if getattr(binder, name, None) is self._originals[name]:
                setattr(binder, name, handle)

    def _undo(self, module: ModuleType) -> None:
        # Every binder holding a wrapper gets the original back: rebound ones, and those that imported the
        # name from the instrumented module (or its re-export) after the wrapper was in place.
        for binder in (sys.modules.get(name) for name in self.binders):
            for name, handle in self._handles.items():
                if binder is not None and getattr(binder, name, None) is handle:
                    setattr(binder, name, self._originals[name])
        for name, handle in self._handles.items():
            wrapt.unwrap_object(module, name, handle, missing_ok=True)


INSTRUMENTATIONS: tuple[Instrumentation, ...] = (
    ComposeRLWeightSync(), ComposerFSDPGate(), ComposeRLPadTokenFlip(), ModelOutputFlatten(), FSDP2ForwardCast(),
)


def instrument_all() -> None:
    for instrumentation in INSTRUMENTATIONS:
        instrumentation.instrument()


def uninstrument_all() -> None:
    for instrumentation in INSTRUMENTATIONS:
        instrumentation.uninstrument()


def statuses() -> dict[str, str]:
    """``{module: status}`` for ``fsdp-shim check --verbose``."""
    return {i.module: i.status for i in INSTRUMENTATIONS}
