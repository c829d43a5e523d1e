"""The instrumentation mechanism: adapt one named module when it is imported."""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType
from typing import Any, ClassVar

import wrapt

from fsdp_shim import _versions

logger = logging.getLogger("fsdp_shim")


class Instrumentation:
    """One module's adaptation, applied when it is imported if it looks as read (``expects``), else logged and
    skipped; off with ``FSDP_SHIM_DISABLE_<NAME>``. Subclasses write mirror-image ``_apply``/``_undo``, changing
    only what blocks FSDP2 (or makes it wrong).

    [Note: binders]
    ``binders`` copy some of the module's ``bound_names`` by ``from ... import name``. While applied, a
    binder imported before is rebound to the adapted names, and one imported after copies them itself;
    ``uninstrument`` gives every binder holding an adapted name the original back.
    """

    name: ClassVar[str]
    module: ClassVar[str]
    upstream: ClassVar[str]
    expects: ClassVar[tuple[str, ...]] = ()
    binders: ClassVar[tuple[str, ...]] = ()
    bound_names: ClassVar[tuple[str, ...]] = ()  # what ``binders`` copy; see [Note: binders]

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._wanted = False
        self._pending: set[str] = set()  # module names with a post-import hook registered and not yet fired
        self._applied_to: ModuleType | None = None
        self._bound: dict[str, tuple[Any, Any]] = {}  # name -> (original, adapted); see [Note: binders]
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
        self._watch(self.module, self._on_import)
        for binder in self.binders:
            self._watch(binder, self._on_binder_import)

    def _watch(self, name: str, callback: Any) -> None:
        """``callback(module)`` once ``name`` is imported; a hook a time, re-registered: wrapt fires one once."""
        with self._lock:
            if name in self._pending:
                return
            self._pending.add(name)

        def fired(module: ModuleType) -> None:
            with self._lock:
                self._pending.discard(name)
            callback(module)

        wrapt.when_imported(name)(fired)

    def uninstrument(self) -> None:
        with self._lock:
            self._wanted = False
            module, self._applied_to = self._applied_to, None
            if module is not None:
                self._unbind()
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
                _versions.log_warning("fsdp_shim: not instrumenting %s: %s", self.module, problem)
                return
            unneeded = self._not_needed(module)
            if unneeded is not None:
                self.status = f"not needed: {unneeded}"
                logger.debug("not instrumenting %s: %s", self.module, unneeded)
                return
            originals = {name: getattr(module, name) for name in self.bound_names}
            self._apply(module)
            self._bound = {name: (original, getattr(module, name)) for name, original in originals.items()}
            self._applied_to = module
            for binder in self.binders:
                if binder in sys.modules:
                    self._rebind(sys.modules[binder])
            self.status = f"instrumented ({self.upstream})"
            logger.debug("instrumented %s", self.module)

    def _on_binder_import(self, binder: ModuleType) -> None:
        with self._lock:
            if self._applied_to is not None:
                self._rebind(binder)

    def _mismatch(self, module: ModuleType) -> str | None:
        missing = [name for name in self.expects if not hasattr(module, name)]
        return f"it has no {', '.join(missing)}" if missing else None

    def _not_needed(self, module: ModuleType) -> str | None:
        """Why the installed module needs no adaptation (it already serves FSDP2), or None."""
        return None

    def _apply(self, module: ModuleType) -> None:
        raise NotImplementedError

    def _undo(self, module: ModuleType) -> None:
        raise NotImplementedError

    def _rebind(self, binder: ModuleType) -> None:
        """Point ``binder``'s copies of the original names at the adapted ones (called under the lock)."""
        for name, (original, adapted) in self._bound.items():
            if getattr(binder, name, None) is original:
                setattr(binder, name, adapted)

    def _unbind(self) -> None:
        """Every binder holding an adapted name gets the original back (called under the lock)."""
        for binder in (sys.modules.get(name) for name in self.binders):
            for name, (original, adapted) in self._bound.items():
                if binder is not None and getattr(binder, name, None) is adapted:
                    setattr(binder, name, original)
        self._bound = {}
