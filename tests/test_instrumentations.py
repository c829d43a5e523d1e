"""Every instrumentation's life cycle, one parametrized test: ``patch()`` adapts its module, ``unpatch()``
puts back every object the module (and each module that copied a name from it) held, and ``patch()``
adapts it again. What each adaptation does for its client is tested beside that client
(``test_clients.py``, ``test_composer_gate.py``, ``test_forward_io.py``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

import fsdp_shim
from _helpers import patch_state_restored
from fsdp_shim.instrumentations import INSTRUMENTATIONS, statuses

STAND_INS = str(Path(__file__).parent / "stand_ins")


def _module(name: str) -> ModuleType:
    """The real module where it is installed (transformers, torch, the real Composer beside torch 2.7),
    else the structural stand-in under ``tests/stand_ins/`` (compose-rl, a Composer for other torch)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if STAND_INS not in sys.path:
            sys.path.insert(0, STAND_INS)
        for loaded in [m for m in sys.modules if m.split(".")[0] == name.split(".")[0]]:
            sys.modules.pop(loaded)  # a failed import may have left a half-made parent
        try:
            return importlib.import_module(name)
        except ImportError as error:
            pytest.skip(f"{name} is not importable here: {error}")


def _holdings(modules: list[ModuleType]) -> dict[tuple[str, ...], object]:
    """What each module holds by name, and what each class it defines holds (a wrapper may sit there)."""
    held: dict[tuple[str, ...], object] = {}
    for m in modules:
        for k, v in vars(m).items():
            if k.startswith("__"):
                continue
            held[(m.__name__, k)] = v
            if isinstance(v, type) and v.__module__ == m.__name__:
                held.update({(m.__name__, k, a): w for a, w in vars(v).items() if a not in ("__dict__", "__weakref__")})
    return held


@pytest.mark.parametrize("instrumentation", INSTRUMENTATIONS, ids=lambda i: i.name)
def test_patch_unpatch_patch_round_trips(instrumentation):
    module = _module(instrumentation.module)
    binders = [_module(name) for name in getattr(instrumentation, "binders", ())]
    with patch_state_restored():
        fsdp_shim.unpatch()
        before = _holdings([module, *binders])
        assert statuses()[instrumentation.module] == "not instrumented"
        fsdp_shim.patch()
        assert statuses()[instrumentation.module].startswith("instrumented"), statuses()[instrumentation.module]
        patched = _holdings([module, *binders])
        changed = {key for key in before if patched.get(key) is not before[key]}
        assert changed, "patch() changed nothing in the instrumented module"
        fsdp_shim.unpatch()
        after = _holdings([module, *binders])
        assert {key for key in before if after.get(key) is not before[key]} == set()
        assert statuses()[instrumentation.module] == "not instrumented"
        fsdp_shim.patch()
        assert {key for key in changed if _holdings([module, *binders]).get(key) is before[key]} == set()
