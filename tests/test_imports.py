"""Any submodule imports first, in a fresh interpreter, and the patch still ends up installed.

A submodule imported first imports FSDP part way through its own import;
see ``fsdp_shim._activate``. Each module gets a process of its own, forked
from one that imported ``torch`` alone (``torch.distributed.fsdp`` and
fsdp_shim not yet): ``import torch`` is most of a fresh interpreter's
seconds, and the order under test starts after it. fsdp_shim imported before
torch itself (its import hooks in place while torch imports) is
``test_patching``'s import-order test, in fresh interpreters.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
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
# Forks a child per module, two at a time; a child's stderr goes to a file of its own. Prints {module: [exit
# code, stderr's tail]}.
FORKS = """
import json, os, sys, traceback
import torch
assert not any(m == "fsdp_shim" or m.startswith(("fsdp_shim.", "torch.distributed.fsdp")) for m in sys.modules)
check, names, logs = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
running, codes = {}, {}

def reap():
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)

for name in names:
    if len(running) == 2:
        reap()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            exec(compile(check.format(name=name), "<check " + name + ">", "exec"), {})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    running[pid] = name
while running:
    reap()
print(json.dumps({name: [code, open(os.path.join(logs, name)).read()[-2000:]] for name, code in codes.items()}))
"""


def test_every_submodule_imports_first_and_the_patch_is_installed(tmp_path):
    assert {"_summon", "_patching", "_gather.engine", "instrumentations.base", "tools.cli"} <= set(MODULES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_SHIM_")}
    proc = subprocess.run([sys.executable, "-c", FORKS, CHECK, json.dumps(MODULES), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(results) == MODULES
    failed = {name: err for name, (code, err) in results.items() if code != 0}
    assert not failed, failed
