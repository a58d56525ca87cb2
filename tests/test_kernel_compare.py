"""benchmarks/kernel_compare.py: the before/after comparison of two kernel trees in one process (its
--smoke run on the CPU, the shape subset, and the pinned configurations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_compare as kc  # noqa: E402


def test_subset_covers_the_grid_axes():
    """About 12 shapes of the 90-shape grid: every width, both token counts, small and large S, r = d
    and r < d."""
    grid = kc.grid_shapes()
    assert len(grid) == 90 and set(kc.SUBSET) <= set(grid) and len(kc.SUBSET) == 12
    assert {s[0] for s in kc.SUBSET} == {4096, 8192} and {s[1] for s in kc.SUBSET} == {1024, 1536, 2560}
    assert {2, 49} <= {s[2] for s in kc.SUBSET}
    assert any(s[3] == s[1] for s in kc.SUBSET) and any(s[3] < s[1] for s in kc.SUBSET)


def test_after_runs_the_configurations_before_chose():
    """pinned_like: the before tree's tuned choices for a shape's classes, as the after tree's pinned
    settings; None where it chose none."""
    import torch

    fwd = {"BLOCK_T": 4, "num_warps": 4, "PREFETCH": 1, "EVICT": True, "STAGES": 1, "KEY0": 2, "PAIR": False}
    bwd = {"SB": 1, "BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "EVICT": False, "STAGES": 1, "KEY0": 2,
           "PAIR": True, "DEFER": False, "PERSIST": 0}
    tuned = {"fwd/512x3/key2/S9/N8192": fwd, "bwd/512x3/key2/S9/N8192": bwd, "sum/8192x384/bfloat16": {"method": "once"}}
    s = kc.pinned_like(tuned, 8192, 1536, 9, 384, torch.device("cpu"))
    assert s.pinned("fwd") == fwd and s.pinned("bwd") == bwd and s.dq_sum == "once"
    assert kc.pinned_like(tuned, 8192, 1536, 9, 1536, torch.device("cpu")) is None  # another class


def test_smoke_run_compares_two_trees_in_one_process(tmp_path):
    """--smoke: the revision's kernels (git archive) beside the working tree's in one process: the CPU
    fallback bit for bit, the interpreted kernels within 1e-5."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_compare.py"), "--smoke", "--before", "HEAD",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "kernel_compare_smoke.json").read_text())
    assert doc["smoke"] and len(doc["shapes"]) == len(kc.SMOKE_SHAPES)
    assert all(r["fallback_bitwise"] and r["pass"] for r in doc["shapes"])
    assert "| tokens | d | S | r |" in (tmp_path / "kernel_compare_smoke.md").read_text()
