"""benchmarks/gpu_share_bench.py on the CPU: K trainings side by side, rows and gains recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_smoke_rows(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_share_bench.py"), "--smoke", "--out",
                        str(tmp_path), "--jobs", "1,2", "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_share_bench_smoke.json").read_text())
    rows = res["rows"]
    assert [row["jobs"] for row in rows] == [1, 2]
    assert rows[0]["steady_gain"] == 1.0 and rows[0]["end_to_end_gain"] == 1.0
    assert rows[1]["tokens"] == 2 * rows[0]["tokens"] and len(rows[1]["per_process_tokens_per_s"]) == 2
    assert all(row["steady_tokens_per_s"] > 0 and row["wall_s"] > 0 for row in rows)
