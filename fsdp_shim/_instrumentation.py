"""Client instrumentations: adapt known FSDP1-era call sites when their module is imported.

The patch reaches every ``FullyShardedDataParallel.summon_full_params`` call,
but some clients never make the call on FSDP2: they gate it behind
``isinstance(m, FullyShardedDataParallel)``, or they look up names of
parameter objects in a map built before the context. An instrumentation
fixes exactly that, in one named module, in the manner of OpenTelemetry's
instrumentors:

- it names the module, the functions and the upstream revision it was read at;
- it waits for the module with ``wrapt.when_imported`` (applied at once if
  already imported);
- it checks that the module looks as read, and otherwise logs and changes
  nothing;
- ``uninstrument`` (from ``fsdp_shim.unpatch()``) undoes it by handle;
- its own environment variable switches it off.

[Note: adding an instrumentation]
Subclass ``Instrumentation`` with ``name``, ``module``, ``upstream``,
``expects`` (module attributes that must exist) and ``_apply``/``_undo``
mirroring each other, then add an instance to ``INSTRUMENTATIONS``. Change
only what blocks FSDP2, and only inside that module.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType
from typing import Any, ClassVar

import wrapt
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from fsdp_shim import _diagnostics, _versions
from fsdp_shim._swap import original_params

logger = logging.getLogger("fsdp_shim")


class Instrumentation:
    """One client module's adaptation. Subclasses fill in the class attributes and ``_apply``/``_undo``."""

    name: ClassVar[str]
    module: ClassVar[str]
    upstream: ClassVar[str]
    expects: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted = False
        self._hook_registered = False
        self._applied_to: ModuleType | None = None
        self.status = "not instrumented"

    @property
    def env(self) -> str:
        """The variable that switches this instrumentation off."""
        return f"FSDP_SHIM_DISABLE_{self.name.upper()}"

    def instrument(self) -> None:
        with self._lock:
            if _versions.env_flag(self.env):
                self.status = f"off ({self.env} is set)"
                return
            self._wanted = True
            if self._applied_to is None:
                self.status = f"waiting for import of {self.module}"
            register = not self._hook_registered
            self._hook_registered = True
        if register:  # wrapt keeps hooks for the process; ours checks _wanted when it fires
            wrapt.when_imported(self.module)(self._on_import)
        elif self.module in sys.modules:
            self._on_import(sys.modules[self.module])

    def uninstrument(self) -> None:
        with self._lock:
            self._wanted = False
            module, self._applied_to = self._applied_to, None
            if module is not None:
                self._undo(module)
                logger.debug("uninstrumented %s", self.module)
            self.status = "not instrumented"

    def _on_import(self, module: ModuleType) -> None:
        with self._lock:
            if not self._wanted or self._applied_to is not None:
                return
            problem = self._mismatch(module)
            if problem is not None:
                self.status = f"skipped: {problem}"
                _diagnostics.log_warning("fsdp_shim: not instrumenting %s: %s", self.module, problem)
                return
            self._apply(module)
            self._applied_to = module
            self.status = f"instrumented ({self.upstream})"
            logger.debug("instrumented %s", self.module)

    def _mismatch(self, module: ModuleType) -> str | None:
        missing = [name for name in self.expects if not hasattr(module, name)]
        return f"it has no {', '.join(missing)}" if missing else None

    def _apply(self, module: ModuleType) -> None:
        raise NotImplementedError

    def _undo(self, module: ModuleType) -> None:
        raise NotImplementedError


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

    Read at databricks/compose-rl 00920bf6a24fa54ac762474af3a2cab2a03f8b3e,
    ``compose_rl/algorithms/online/generation_utils/vllm_utils.py``:
    - ``broadcast_to_vllm`` selects units with ``isinstance(module, FSDP)``
      and ``is_fsdp_leaf`` does the same: the module global ``FSDP`` becomes
      an ``FSDPUnitGate``;
    - ``broadcast_to_vllm`` builds ``build_param_fullnames(model)`` before the
      per-unit ``summon_full_params`` loop and looks names up inside it: the
      map becomes a ``NamesOfSummonedParams``.
    """

    name = "compose_rl"
    module = "compose_rl.algorithms.online.generation_utils.vllm_utils"
    upstream = "databricks/compose-rl@00920bf6: broadcast_to_vllm, is_fsdp_leaf, build_param_fullnames"
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


INSTRUMENTATIONS: tuple[Instrumentation, ...] = (ComposeRLWeightSync(),)


def instrument_all() -> None:
    for instrumentation in INSTRUMENTATIONS:
        instrumentation.instrument()


def uninstrument_all() -> None:
    for instrumentation in INSTRUMENTATIONS:
        instrumentation.uninstrument()


def statuses() -> dict[str, str]:
    """``{module: status}`` for ``fsdp-shim check --verbose``."""
    return {i.module: i.status for i in INSTRUMENTATIONS}
