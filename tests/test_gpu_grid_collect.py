"""benchmarks/gpu_grid_collect.py: finished and cut-off runs of one gpu_grid.sh call into gpu_grid.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def collect_mod():
    spec = importlib.util.spec_from_file_location("gpu_grid_collect", ROOT / "benchmarks" / "gpu_grid_collect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(folder: Path, steps: int, finished: bool, method: str = "lr") -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps({"kind": "train", "step": i, "tokens": 100 * i, "ce": 10.0 - i}) for i in range(1, steps + 1)]
    lines.append(json.dumps({"kind": "val", "step": 2, "tokens": 200, "val_ce": 7.5}))
    if finished:
        lines.append(json.dumps({"kind": "final_val", "step": steps, "tokens": 100 * steps, "val_ce": 7.0}))
        (folder / "result.json").write_text(json.dumps({"final_val_ce": 7.0, "tokens": 100 * steps,
                                                       "model_config": {"method": method}}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n" + ('{"kind": "tra' if not finished else ""))
    (folder / "spec.json").write_text(json.dumps({"model_config": {"method": method}, "total_steps": 10}))


def test_collect_finished_and_incomplete(tmp_path, collect_mod):
    out = tmp_path / "call"
    _run(out / "runs" / "base", 10, True, method="baseline")
    _run(out / "runs" / "cut", 4, False)  # killed: its metrics end in a torn line
    (out / "snakemake.log").write_text("[gpu_grid] base exit 0 after 12s\n[gpu_grid] cut exit 124 after 9s\n")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"splits": {"train": {"tokens": 400}}}))
    assert collect_mod.main([str(out), "--manifest", str(manifest)]) == 0
    doc = json.loads((out / "gpu_grid.json").read_text())
    base = doc["runs"]["base"]
    assert base["method"] == "baseline" and base["data_epochs"] == pytest.approx(1000 / 400)
    assert base["train_ce_tail"] == pytest.approx(sum(10.0 - i for i in range(1, 11)) / 10)
    assert [p["ce"] for p in base["val_curve"]] == [7.5, 7.0]
    assert doc["incomplete"] == {"cut": {**doc["incomplete"]["cut"], "last_step": 4, "steps_planned": 10}}
    assert doc["call"]["cut"] == {"exit": 124, "seconds": 9}


def test_collect_refuses_a_folder_without_runs(tmp_path, collect_mod, capsys):
    assert collect_mod.main([str(tmp_path)]) == 2
    assert "no runs/ folder" in capsys.readouterr().err
