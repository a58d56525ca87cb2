"""benchmarks/ncu_profile.py: the summary reads ncu's raw CSV page (units, program output around it)
and keeps the kernels that carry the run's time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_profile  # noqa: E402

HEADER = ['ID', 'Kernel Name', 'gpu__time_duration.sum', 'dram__bytes_read.sum', 'launch__registers_per_thread',
          'sm__warps_active.avg.pct_of_peak_sustained_active',
          'smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_selected_per_issue_active.ratio']
UNITS = ['', '', 'usecond', 'Mbyte', 'register/thread', '%', 'ratio', 'ratio', 'ratio']


def _csv(rows) -> str:
    q = lambda xs: ",".join(f'"{x}"' for x in xs)  # noqa: E731
    return "\n".join(["==PROF== Connected to process 1", "profiled ours S=9", q(HEADER), q(UNITS)] + [q(r) for r in rows])


def test_parse_raw_csv_reads_units_and_stalls():
    text = _csv([["0", "_attnres_fwd_kernel", "97.5", "1,208.3", "69", "40.2", "12.5", "3.25", "1.0"],
                 ["1", "reduce_kernel(float*)", "2", "0.5", "16", "80", "1", "0", "1"]])
    rows = ncu_profile.parse_raw_csv(text)
    assert [r["kernel"] for r in rows] == ["_attnres_fwd_kernel", "reduce_kernel(float*)"]
    fwd = rows[0]
    assert fwd["us"] == 97.5 and fwd["dram_read_MB"] == 1208.3 and fwd["registers"] == 69
    assert fwd["achieved_occupancy_pct"] == 40.2
    assert fwd["stalls"] == {"long_scoreboard": 12.5, "barrier": 3.25}  # "selected" is not a stall


def test_parse_raw_csv_nanoseconds_and_bytes():
    header = ['ID', 'Kernel Name', 'gpu__time_duration.sum', 'dram__bytes_write.sum']
    q = lambda xs: ",".join(f'"{x}"' for x in xs)  # noqa: E731
    text = "\n".join([q(header), q(['', '', 'nsecond', 'byte']), q(['0', 'k', '1500', '2000000'])])
    (row,) = ncu_profile.parse_raw_csv(text)
    assert row["us"] == 1.5 and row["dram_write_MB"] == 2.0


def test_summarize_keeps_the_kernels_that_carry_the_time(tmp_path):
    (tmp_path / "ours_S9.csv").write_text(_csv([["0", "_attnres_fwd_kernel", "97", "1", "69", "40", "12", "3", "1"],
                                                 ["1", "tiny", "1", "0", "16", "80", "1", "0", "1"],
                                                 ["2", "_attnres_bwd_kernel", "175", "2", "80", "30", "20", "1", "1"]]))
    (tmp_path / "meta.json").write_text(json.dumps({"device": "GPU X", "shape": "s", "date": "d"}))
    (tmp_path / "notes.txt").write_text("not a run")
    doc = ncu_profile.summarize(str(tmp_path), str(tmp_path))
    (run,) = doc["runs"]
    assert run["impl"] == "ours" and run["S"] == 9
    assert [k["kernel"] for k in run["kernels"]] == ["_attnres_fwd_kernel", "_attnres_bwd_kernel"]
    md = (tmp_path / "ncu_summary.md").read_text()
    assert "GPU X" in md and "| ours | 9 | _attnres_bwd_kernel |" in md
    assert json.loads((tmp_path / "ncu_summary.json").read_text())["env"]["device"] == "GPU X"
