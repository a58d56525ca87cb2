"""benchmarks/train_step_bench.py --merge: one table from runs of equal settings (two GPUs at once)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import train_step_bench as tsb  # noqa: E402


def _doc(rows, **settings):
    base = {"preset": "1B", "micro_batch": 2, "seq_len": 2048, "grad_accum": 64, "attention": "flex",
            "updates": 5, "warmup": 2, "configs": ",".join(r["config"] for r in rows), "budget_s": 300.0}
    base.update(settings)
    return {"benchmark": "train_step", "date": "2026-01-01", "device": "GPU X", "git": {"commit": "stale"},
            "settings": base, "goal": {"lr_fused_vs_baseline_min": 0.9, "lr_fused_tokens_per_s_min": 62000},
            "rows": rows, "skipped": []}


def _row(config, tps):
    return {"config": config, "method": config.split("-")[0], "router": None, "rank": None, "blocks": None,
            "tokens_per_s": tps, "update_s_mean": 1.0, "update_s_cv": 0.01, "optimizer_s_mean": 0.1,
            "first_update_s": 1.0}


def test_merge_rates_every_row_against_the_first_baseline(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc([_row("baseline", 70000.0), _row("lr-fused", 63000.0)])))
    b.write_text(json.dumps(_doc([_row("attnres-fused", 56000.0)], budget_s=400.0)))
    doc = tsb.merge([str(a), str(b)], tmp_path / "out", "merged", "two GPUs at once", commit="abc1234")
    assert [r["config"] for r in doc["rows"]] == ["baseline", "lr-fused", "attnres-fused"]
    assert doc["rows"][2]["vs_baseline"] == pytest.approx(0.8)
    assert doc["goal"]["met"] is True and doc["goal"]["lr_fused_vs_baseline"] == pytest.approx(0.9)
    assert doc["git"]["commit"] == "abc1234" and doc["merged_from"][0]["git"] == {"commit": "stale"}
    written = json.loads((tmp_path / "out" / "merged.json").read_text())
    assert written["rows"] == doc["rows"]
    assert "two GPUs at once" in (tmp_path / "out" / "merged.md").read_text()


def test_merge_refuses_runs_of_other_settings(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc([_row("baseline", 70000.0)])))
    b.write_text(json.dumps(_doc([_row("lr-fused", 60000.0)], grad_accum=8)))
    with pytest.raises(SystemExit, match="grad_accum"):
        tsb.merge([str(a), str(b)], tmp_path / "out", "merged", "")
