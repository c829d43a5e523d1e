"""``scripts/fake_bench.py`` on torch's fake backend reports every contender of the small models (one process).

The harness is how issue 22's figures are made; this keeps it runnable, for
a flat mesh and an HSDP one, with several runs. It asserts no timing
(timings here are noise), only that each contender ran and was counted.
The fake backend moves no data, so values are not checked here: the rest
of the suite checks them on gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fake_bench.py"


def test_fake_bench_reports_every_contender(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--world", "4", "2x2", "--model", "units96", "--reps", "1", "--runs", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(row["world"], row["model"]) for row in rows] == [("4", "units96")] * 2 + [("2x2", "units96")] * 2
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from fake_bench import MODELS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    contenders = MODELS["units96"]["contenders"]
    assert set(contenders) >= {"summon_unit", "summon_unit_rank0", "unshard", "summon_model", "stream_fp32",
                               "stream_bf16", "full_tensor_loop"}
    for row in rows:
        for name in contenders:
            assert row["median_ms_per_unit"][name] > 0, name
            assert row["calls_per_unit"][name] > 0, name
            assert row["peaks"][name]["whole"] >= 0, name
        for name in contenders:  # (first quartile, median, third quartile) of per-repetition ratios
            low, median, high = row["ratio_to_unshard"][name]
            assert 0 < low <= median <= high, (name, low, median, high)
    assert "summon_unit" in proc.stdout and "2 run(s)" in proc.stdout
