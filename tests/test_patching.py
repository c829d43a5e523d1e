"""The patch lifecycle (wrapt) and dispatch, in this process."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch.nn as nn
import wrapt
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_shim
from fsdp_shim import _versions
from fsdp_shim._dispatch import route_for

ORIGINAL = inspect.getattr_static(FSDP, "summon_full_params")
while isinstance(ORIGINAL, wrapt.FunctionWrapper):  # the import patched it
    ORIGINAL = ORIGINAL.__wrapped__
SIGNATURE = inspect.signature(ORIGINAL.__func__)


@pytest.fixture(autouse=True)
def _restore_patch_state():
    was = fsdp_shim.is_patched()
    yield
    (fsdp_shim.patch if was else fsdp_shim.unpatch)()


def test_import_patches_with_a_wrapt_wrapper_around_the_staticmethod():
    assert fsdp_shim.is_patched()
    current = inspect.getattr_static(FSDP, "summon_full_params")
    assert isinstance(current, wrapt.FunctionWrapper)
    assert current.__wrapped__ is ORIGINAL and isinstance(ORIGINAL, staticmethod)
    assert inspect.signature(FSDP.summon_full_params) == SIGNATURE


def test_patch_unpatch_round_trip_restores_the_exact_object():
    assert fsdp_shim.patch() is False  # already patched: no second wrapper
    wrapper = inspect.getattr_static(FSDP, "summon_full_params")
    assert wrapper.__wrapped__ is ORIGINAL
    assert fsdp_shim.unpatch() is True
    assert inspect.getattr_static(FSDP, "summon_full_params") is ORIGINAL
    assert not fsdp_shim.is_patched()
    assert fsdp_shim.unpatch() is False  # harmless
    assert fsdp_shim.patch() is True
    assert fsdp_shim.is_patched()
    assert inspect.getattr_static(FSDP, "summon_full_params").__wrapped__ is ORIGINAL


def test_unpatch_beneath_a_third_party_wrapper_keeps_theirs():
    calls = []

    def theirs(wrapped, instance, args, kwargs):
        calls.append(1)
        return wrapped(*args, **kwargs)

    handle = wrapt.wrap_function_wrapper(FSDP, "summon_full_params", theirs)
    try:
        assert fsdp_shim.is_patched()  # ours is still in the chain
        assert fsdp_shim.unpatch() is True
        assert inspect.getattr_static(FSDP, "summon_full_params") is handle
        with FSDP.summon_full_params(nn.Linear(2, 2)):
            pass
        assert calls == [1]
        assert fsdp_shim.patch() is True  # on top of theirs
    finally:
        fsdp_shim.unpatch()
        wrapt.unwrap_object(FSDP, "summon_full_params", handle)
    assert inspect.getattr_static(FSDP, "summon_full_params") is ORIGINAL


def test_instance_access_still_works_like_a_staticmethod():
    assert FSDP.__dict__["summon_full_params"] is inspect.getattr_static(FSDP, "summon_full_params")
    with FSDP.summon_full_params(nn.Linear(2, 2), recurse=False):
        pass


def test_dispatch_routes_and_rejects_non_modules():
    assert route_for(nn.Linear(2, 2), True) == "none"
    with pytest.raises(TypeError, match="nn.Module"):
        route_for(object(), True)
    with pytest.raises(TypeError, match="nn.Module"):
        FSDP.summon_full_params(object())
    with pytest.raises(TypeError):  # FSDP1's signature is enforced
        FSDP.summon_full_params(nn.Linear(2, 2), bogus=True)


def _python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=True
    )
    return result.stdout.strip()


def test_fsdp_shim_disable_imports_without_patching():
    code = "import fsdp_shim; print(fsdp_shim.is_patched())"
    assert _python(code, FSDP_SHIM_DISABLE="1") == "False"
    assert _python(code, FSDP_SHIM_DISABLE="") == "True"


def test_versions_are_data_and_the_guard_reads_them():
    assert _versions.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert _versions.parse_version("2.6.0a0+git1") == (2, 6, 0)
    assert _versions.at_least("2.13.0", _versions.MIN_TORCH)
    assert not _versions.at_least("2.5.1", _versions.MIN_TORCH)
    assert _versions.is_tested_torch("2.13.1") and not _versions.is_tested_torch("2.7.0")
    assert fsdp_shim.unsupported_reason is None
    setup_cfg = open(os.path.join(os.path.dirname(__file__), "..", "setup.cfg")).read()
    for requirement in _versions.INSTRUMENTS:
        assert requirement.replace(" ", "") in setup_cfg


def test_guard_refuses_to_patch_without_the_internals_it_uses():
    code = (
        "import sys, logging; logging.basicConfig(level=logging.WARNING)\n"
        "import torch.distributed.fsdp\n"
        "sys.modules['torch.distributed.fsdp._fully_shard._fsdp_param_group'] = None\n"
        "import fsdp_shim\n"
        "print(fsdp_shim.is_patched(), fsdp_shim.unsupported_reason is not None)\n"
        "try:\n"
        "    fsdp_shim.summon_full_params(None)\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', 'inactive' in str(exc))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "refused:", "True"]
    assert "fsdp_shim is inactive" in result.stderr and "FSDP2 internals" in result.stderr


def test_guard_refuses_an_unsupported_torch():
    code = "import torch; torch.__version__ = '2.5.1'; import fsdp_shim; print(fsdp_shim.is_patched())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
    assert "older than the supported 2.6" in result.stderr
