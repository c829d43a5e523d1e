"""Any submodule imports first, in a fresh interpreter, and the patch still ends up installed.

A submodule imported first imports FSDP part way through its own import;
see ``fsdp_shim._activate``.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsdp_shim

MODULES = sorted(m.name.removeprefix("fsdp_shim.") for m in pkgutil.walk_packages(fsdp_shim.__path__, "fsdp_shim.")
                 if not m.name.endswith("__main__"))
CHECK = """
import inspect, sys
import fsdp_shim.{name}
import torch.distributed.fsdp as fsdp
import wrapt
assert isinstance(inspect.getattr_static(fsdp.FullyShardedDataParallel, "summon_full_params"), wrapt.FunctionWrapper)
import fsdp_shim
assert fsdp_shim.is_patched()
"""


def _import_first(name: str) -> tuple[str, int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_SHIM_")}
    proc = subprocess.run([sys.executable, "-c", CHECK.format(name=name)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=Path(__file__).resolve().parent.parent)
    return name, proc.returncode, proc.stderr[-2000:]


def test_every_submodule_imports_first_and_the_patch_is_installed():
    assert {"_summon", "_patching", "_gather.engine", "instrumentations.base", "tools.cli"} <= set(MODULES)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_import_first, MODULES))
    failed = {name: err for name, code, err in results if code != 0}
    assert not failed, failed
