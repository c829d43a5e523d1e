"""``scripts/fake_bench.py --check``, the first step of ``scripts/device_check.sh``, keeps running without a GPU.

On the GPU machine it runs ``--check --device cuda --world 8 2x4 64 2x32 1024 2x512``;
here the same mode runs on the CPU at W = 8 (flat and HSDP 2x4 meshes), so that
it cannot rot while no GPU is lent. Only the CUDA-only paths may say "skipped". No
timing or memory figure is asserted (noise here, "n/a" on the CPU); every
path must pass its checks and name its world size and mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fake_bench.py"


def _paths():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from fake_bench import CUDA_ONLY, PATHS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return PATHS, CUDA_ONLY


def test_fake_bench_check_runs_every_path_on_the_cpu(tmp_path):
    paths, cuda_only = _paths()
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--device", "cpu", "--world", "8", "2x4", "--reps", "2",
         "--timeout", "150",
         "--json", str(out)],
        capture_output=True, text=True, timeout=330, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert {(row["world"], row["mesh"]) for row in rows} == {(8, "8"), (8, "2x4")}
    for mesh in ("8", "2x4"):
        got = {row["path"]: row for row in rows if row["mesh"] == mesh}
        assert list(got) == list(paths), mesh
        for path, row in got.items():
            if path in cuda_only:
                assert row["status"] == "skipped", (mesh, row)
                continue
            assert row["status"] == "ok", (mesh, row)
            assert row["ms"] > 0 and row["reps"] >= 1, (mesh, row)
            if path != "unshard loop":  # the multi-rank path: the shim posted all-gathers
                assert row["all_gathers"] > 0, (mesh, row)
        assert got["summon_unit r0 loop"]["ratio_to_unshard"] > 0
        assert got["summon_unit r0 loop"]["per"] == "unit"
    lines = proc.stdout.splitlines()
    for path in paths:  # every path printed on a row that names W and the mesh
        for mesh in ("8", "2x4"):
            assert any(line.split()[:2] == ["8", mesh] and path in line for line in lines), (path, mesh)
    assert "cuda:gloo 2-process run" in proc.stdout and "skipped" in proc.stdout
    assert "fake_bench --check: 0 failed of 18 checks" in proc.stdout


def test_device_late_imports_against_this_package_and_refuses_the_cpu():
    """``scripts/device_late.py`` (CUDA only) still imports what it uses from the package, and says why it
    cannot run here instead of failing part way."""
    late = SCRIPT.parent / "device_late.py"
    proc = subprocess.run([sys.executable, str(late)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-4000:]
    assert "no CUDA device" in proc.stderr
