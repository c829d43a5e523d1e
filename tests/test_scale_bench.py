"""``scripts/fake_bench.py --model llama70b`` (Llama-3-70B's shapes on the fake backend) stays runnable: its
``--quick`` mode, a 1-D and an HSDP mesh, reports every contender's time, calls and peaks. No timing is
asserted; the calls counts are, since they do not depend on the machine: the per-unit summon makes fewer than
FSDP2's ``unshard()`` loop on the small shapes of ``--quick`` (every unit one collective)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fake_bench.py"


def test_llama70b_quick_reports_every_contender(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "llama70b", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [row["world"] for row in rows] == ["8", "8x4"]
    for row in rows:
        calls = row["calls_per_unit"]
        assert set(calls) >= {"summon_unit_rank0", "stream_fp32", "stream_bf16", "unshard", "full_tensor_loop",
                              "module_source"}
        assert all(row["median_ms_per_unit"][name] > 0 for name in calls)
        assert calls["summon_unit_rank0"] < 0.8 * calls["unshard"], calls
        assert row["peaks"]["summon_unit_rank0"]["whole"] > 0 and row["peaks"]["summon_model"]["whole"] > 0
        assert "summon_model" not in row["median_ms_per_unit"]  # peak only at these shapes
