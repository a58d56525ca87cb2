"""benchmarks/kernel_compare.py: the before/after comparison of two kernel trees (its --smoke run on the
CPU, and the ratio and flag rules on made-up times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_compare as kc  # noqa: E402


def test_grid_shapes_are_the_s9_shapes():
    shapes = kc.grid_shapes()
    assert len(shapes) == 18 and {s[2] for s in shapes} == {9}
    assert (8192, 1536, 9, 384) in shapes and (4096, 2560, 9, 320) in shapes and (4096, 1024, 9, 1024) in shapes
    assert kc.grid_shapes((8192,)) == [s for s in shapes if s[0] == 8192]


def _round(times):
    return {"rows": [{"tokens": 8192, "d": d, "S": 9, "r": d // 4, "fwd_us": f, "fwdbwd_us": fb}
                     for d, (f, fb) in zip((1024, 1536), times)]}


def test_ratios_take_each_trees_median_and_flag_over_the_tolerance():
    runs = {"before": {"shapes": [_round([(10, 100), (20, 200)]), _round([(12, 100), (20, 210)]),
                                  _round([(11, 100), (20, 190)])],
                       "step": [{"config": "lr-fused", "tokens_per_s": 65000.0}]},
            "after": {"shapes": [_round([(11, 102), (20, 200)]), _round([(11, 103), (21, 207)]),
                                 _round([(11, 104), (20, 208)])],
                      "step": [{"config": "lr-fused", "tokens_per_s": 62000.0}]}}
    shapes, steps = kc.compare(runs, 0.03)
    assert shapes[0]["before_fwdbwd_us"] == 100 and shapes[0]["after_fwdbwd_us"] == 103
    assert shapes[0]["ratio_fwdbwd_us"] == pytest.approx(1.03) and not shapes[0]["slower"]  # 3% is within
    assert shapes[1]["ratio_fwdbwd_us"] == pytest.approx(207 / 200) and shapes[1]["slower"]
    assert steps[0]["ratio_time"] == pytest.approx(65000 / 62000) and steps[0]["slower"]
    doc = {"device": "x", "date": "d", "before": {"name": "abc"}, "after": {"name": "working tree"}, "rounds": 3,
           "tolerance": 0.03, "shapes": shapes, "steps": steps}
    md = kc.markdown(doc)
    assert md.count("SLOWER") == 2 and "more than 3% slower after: 2" in md


def test_smoke_run_compares_two_trees(tmp_path):
    """--smoke: the revision's kernels (git archive) and the working tree's, each in its own process
    through Triton's interpreter, a table with a ratio per shape and one for the smoke step."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_compare.py"), "--smoke", "--before", "HEAD",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "kernel_compare_smoke.json").read_text())
    assert doc["smoke"] and len(doc["shapes"]) == len(kc.SMOKE_SHAPES) and len(doc["steps"]) == 1
    assert all(r["ratio_fwd_us"] > 0 and r["ratio_fwdbwd_us"] > 0 for r in doc["shapes"])
    before, after = doc["runs"]["before"]["shapes"][0]["kernels"], doc["runs"]["after"]["shapes"][0]["kernels"]
    assert Path(after) == ROOT / "kernels" and Path(before) != Path(after) and before.endswith("kernels")
    assert "| tokens | d | S | r |" in (tmp_path / "kernel_compare_smoke.md").read_text()
