"""Composer: its ``is_model_fsdp`` gate answers for FSDP2 too, as Composer main does."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch.nn as nn
import wrapt
from torch.distributed.fsdp import FSDPModule

from fsdp_shim.instrumentations.base import Instrumentation


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
    """Whether the installed gate says True for an ``FSDPModule`` (a probe with no process group, classed as
    ``fully_shard`` leaves one) and for its direct parent: decided by behaviour, never by version."""
    unit = nn.Module()
    unit.__class__ = type("FSDPProbe", (FSDPModule, nn.Module), {})
    try:
        return bool(gate(unit)) and bool(gate(nn.Sequential(unit)))
    except Exception:  # noqa: BLE001  (a gate that cannot answer does not recognise FSDP2)
        return False


class ComposerFSDPGate(Instrumentation):
    """Composer's ``is_model_fsdp`` gate, True for FSDP2 too (as main's #3907): released Composer skips every
    summon behind it on FSDP2. Wrapped (it imports the class inside: no global to swap); one that already
    recognises FSDP2 is left alone."""

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
    bound_names = ("is_model_fsdp",)
    _GATE = "is_model_fsdp"

    def _not_needed(self, module: ModuleType) -> str | None:
        if _recognises_fsdp2(getattr(module, self._GATE)):
            return "the installed is_model_fsdp recognises FSDP2 already (Composer with #3907)"
        return None

    def _apply(self, module: ModuleType) -> None:
        self._handle = wrapt.wrap_function_wrapper(module, self._GATE, _fsdp2_aware_gate)

    def _undo(self, module: ModuleType) -> None:
        wrapt.unwrap_object(module, self._GATE, self._handle, missing_ok=True)
