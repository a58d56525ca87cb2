"""benchmarks/compiled_grad_probe.py on the CPU: arguments, the run plan, the specs, what a run's files
say, the summary, and the whole script in its smoke mode."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import compiled_grad_probe as probe  # noqa: E402


def test_learning_rates_and_names_are_parsed_strictly():
    assert probe.parse_lrs("0.005/0.001, 0.02/0.003") == [(0.005, 0.001), (0.02, 0.003)]
    for bad in ("0.005", "a/b", "0/0.001", ""):
        with pytest.raises(SystemExit, match="--lrs"):
            probe.parse_lrs(bad)
    with pytest.raises(SystemExit, match=r"--train-variants: unknown \['flexx'\]"):
        probe.parse_args(["--out", "x", "--train-variants", "sdpa,flexx"])
    with pytest.raises(SystemExit, match="--grad-variants"):
        probe.parse_args(["--out", "x", "--grad-variants", "eager"])  # eager has no compiled step to check
    with pytest.raises(SystemExit, match="--parallel"):
        probe.parse_args(["--out", "x", "--parallel", "0"])
    a = probe.parse_args(["--out", "x"])
    assert a.stage_list == ["grads", "train"] and a.lr_list == [(0.005, 0.001), (0.02, 0.003)] and a.steps == 150
    assert a.grad_variant_list == list(probe.GRAD_VARIANTS) and a.method_list == ["baseline", "lr", "attnres"]


def test_every_variant_is_one_documented_flex_path():
    from lrattnres.attention import FLEX_VARIANT_FLAGS, parse_flex_variant

    for name, v in probe.VARIANTS.items():
        assert parse_flex_variant(v["flex_variant"]) <= set(FLEX_VARIANT_FLAGS), name
        assert (v["attention"] == "flex") == name.startswith("flex"), name
    assert not probe.VARIANTS["eager"]["compile"] and probe.VARIANTS["sdpa"]["attention"] == "auto"


def test_the_plan_runs_the_most_telling_runs_first():
    lrs = [(0.005, 0.001), (0.02, 0.003)]
    variants = ["sdpa", "eager", "flex", "flex-contiguous", "flex-outside", "flex-tensor_mask"]
    runs = probe.plan_runs(["baseline", "lr", "attnres"], variants, lrs)
    assert len(runs) == 36 and len({r["name"] for r in runs}) == 36
    head = [(r["variant"], probe.lr_label(r["lrs"])) for r in runs[::3]]  # each over the three methods
    # first the runs the default attention is judged by: its own at both learning rates, eager beside
    # it at the higher ones (one wave of nine processes); then eager and flex at the lower ones
    assert head[:5] == [("sdpa", "0.005/0.001"), ("sdpa", "0.02/0.003"), ("eager", "0.02/0.003"),
                        ("eager", "0.005/0.001"), ("flex", "0.005/0.001")]
    assert head[5:7] == [("flex-contiguous", "0.005/0.001"), ("flex-outside", "0.005/0.001")]
    assert [r["method"] for r in runs[:3]] == ["baseline", "lr", "attnres"]
    assert runs[0]["name"] == "baseline-sdpa-0.005_0.001"


def test_the_training_spec_is_the_gpu_scales_but_for_what_a_row_names():
    from lrattnres.config import load_and_resolve
    from lrattnres.gridplan import plan, train_spec

    settings = load_and_resolve(REPO / "config.yaml", {"scale": "gpu"})
    base = train_spec(settings, next(r for r in plan(settings) if r.run_id == "gpu-small-lr-n8-r48-s0"))
    spec = probe.train_spec(settings, "lr", "flex-contiguous", (0.02, 0.003), 150)
    assert spec["steps"] == 150 and "tokens" not in spec
    assert spec["optim"]["muon"]["lr"] == 0.02 and spec["optim"]["adam"]["lr"] == 0.003
    assert spec["optim"]["muon"]["momentum"] == base["optim"]["muon"]["momentum"]
    assert spec["model"] == {**base["model"], "attention": "flex"} and spec["compile"] is True
    assert spec["val"]["every"] == 0 and spec["val"]["final"] is True
    same = {k: v for k, v in base.items() if k not in ("steps", "optim", "model", "compile", "val", "checkpoint")}
    assert {k: spec[k] for k in same} == same  # micro-batch, sequence, precision, schedule, clipping, seed ...
    assert same["precision"] == "bf16" and same["micro_batch"] == 32 and same["seq_len"] == 512
    eager = probe.train_spec(settings, "baseline", "eager", (0.005, 0.001), 150)
    assert eager["compile"] is False and eager["model"]["attention"] == "auto" and eager["model"]["method"] == "baseline"
    from lrattnres.train.spec import resolve

    resolve(spec), resolve(eager)  # the trainer accepts them


def _run_folder(tmp_path: Path, norms: list, outliers: list, result: dict | None) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    lines = [{"kind": "train", "step": i + 1, "grad_norm": g, "ce": 9.0 - i} for i, g in enumerate(norms)]
    lines += [{"kind": "grad_outlier", "step": e["update"] + 1, **e} for e in outliers]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "tra')  # a cut line
    if result is not None:
        (d / "result.json").write_text(json.dumps(result))
    return d


def test_a_run_that_stopped_on_an_infinite_norm(tmp_path):
    d = _run_folder(tmp_path, [2.0, 1.5, 12.0, 3e9], [{"update": 3, "norm": 3e9, "median": 1.7},
                                                    {"update": 4, "norm": "inf", "median": 1.7}], None)
    r = probe.read_run(d, 3)
    assert r["status"].startswith("stopped: non-finite") and r["updates"] == 4
    assert r["max_grad_norm"] == math.inf and r["nonfinite_update"] == 4 and r["first_update_above_bound"] == 2
    assert r["outliers"] == 2 and r["final_val_ce"] is None and r["last_train_ce"] == 6.0


def test_a_finished_run_reads_its_result(tmp_path):
    event = {"update": 1, "norm": 400.0, "median": 2.0}
    d = _run_folder(tmp_path, [2.0, 400.0, 2.5], [event],
                    {"final_val_ce": 5.87, "final_train_ce": 5.9, "grad_norm": {"outliers": [event]},
                     "provenance": {"attention": {"backend": "sdpa"}}})
    r = probe.read_run(d, 0)
    assert r["status"] == "done" and r["max_grad_norm"] == 400.0 and r["first_update_above_bound"] == 1
    assert r["outliers"] == 1 and r["first_outliers"] == [event] and r["final_val_ce"] == 5.87
    assert r["attention"] == {"backend": "sdpa"} and r["nonfinite_update"] is None
    assert probe.read_run(tmp_path / "absent", None)["status"] == "not started"
    assert probe.read_run(d, 75)["status"].startswith("stopped at the budget")


def test_the_criterion_waits_for_every_default_run():
    lrs = [(0.005, 0.001), (0.02, 0.003)]

    def rec(variant, lr, code, norm):
        return {"variant": variant, "lrs": lr, "exit_code": code, "max_grad_norm": norm}

    runs = [rec("sdpa", "0.005/0.001", 0, 2.5), rec("sdpa", "0.005/0.001", None, None),
            rec("flex", "0.005/0.001", 3, math.inf), rec("sdpa", "0.02/0.003", 3, math.inf)]
    assert probe.criteria(runs, lrs)["holds"] is None and probe.criteria(runs, lrs)["runs_finished"] == "1 of 2"
    runs[1] = rec("sdpa", "0.005/0.001", 0, 9.9)
    assert probe.criteria(runs, lrs)["holds"] is True  # the flex and high-lr runs do not count
    runs[1] = rec("sdpa", "0.005/0.001", 0, 10.5)
    assert probe.criteria(runs, lrs)["holds"] is False


def test_names_and_tables():
    assert probe.gpu_word("NVIDIA H200") == "h200" and probe.gpu_word("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    doc = {"device": "GPU X", "date": "2026-12-05", "data": "d", "provenance": {"commit": "abc"}, "scale": "gpu",
           "settings": {"steps": 150},
           "grads": {"flex-tensor_mask": {"error": "worker exit -11: illegal memory access", "cases": []}},
           "runs": [{"lrs": "0.005/0.001", "variant": "flex", "method": "baseline", "status": "done", "updates": 150,
                     "max_grad_norm": math.inf, "first_update_above_bound": 43, "outliers": 7, "final_val_ce": None}],
           "criteria": {"default_attention_below_bound_at": "0.005/0.001", "bound": 10.0, "holds": None,
                        "runs_finished": "0 of 3"}}
    md = probe.markdown(doc)
    assert "illegal memory access" in md and "| 0.005/0.001 | flex | baseline | done | 150 | inf | 43 | 7 | – |" in md
    assert json.loads(json.dumps(probe._json_safe(doc)))["runs"][0]["max_grad_norm"] == "inf"


def test_smoke_run_of_the_whole_script(tmp_path):
    """Both stages on the CPU: one gradient check through a worker process, one eager training."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compiled_grad_probe.py"), "--smoke", "--out",
                        str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--methods", "baseline",
                        "--train-variants", "eager", "--min-run-s", "5"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (out,) = (tmp_path / "out").glob("compiled_grad_probe_smoke_*.json")
    doc = json.loads(out.read_text())
    case = doc["grads"]["sdpa"]["cases"][0]
    assert doc["grads"]["sdpa"]["exit_code"] == 0 and case["init"]["pass"] and case["moved"]["pass"]
    (run,) = doc["runs"]
    assert run["status"] == "done" and run["updates"] == 3 and run["final_val_ce"] > 0 and run["outliers"] == 0
    assert doc["criteria"]["holds"] is None  # no run of the default attention in this selection
    assert doc["provenance"]["commit"] and out.with_suffix(".md").is_file()
