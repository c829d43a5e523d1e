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
      ``composer.models.huggingface`` and compose-rl's three modules get the
      wrapper, imported first or after, and the original back on unpatch
      (see [Note: binders] in ``base``).
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
