"""End-to-end tests of the trainer on a tiny corpus: resume, SIGTERM, starting over after a change,
checked checkpoints, NaN, DDP, final CE."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lrattnres.train import loop
from lrattnres.train.checkpoint import CheckpointError, load_checkpoint, load_model, read_model
from conftest import word_corpus
from lrattnres.train.loop import NonFiniteLoss, Preempted, ResumeMismatch, train

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("train_corpus"), seed=0)


def make_spec(**over):
    s = {"model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}, "seed": 1, "steps": 6,
         "micro_batch": 4, "grad_accum": 2, "seq_len": 32, "schedule": {"warmup_steps": 2},
         "val": {"every": 3, "batches": 2}, "checkpoint": {"every": 2}, "device": "cpu"}
    s.update(over)
    return s


def load(out):
    """The whole checked resumable state of run folder ``out``."""
    return load_checkpoint(out)


def weights(path):
    return read_model(path)[0]


def records(out, kind="train"):
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def full_run(manifest, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "full"
    res = train(make_spec(), manifest, out, progress=False)
    return out, res


def test_outputs_and_metrics(full_run):
    out, res = full_run
    for name in ("spec.json", "metrics.jsonl", "checkpoint.json", "model.safetensors", "model.safetensors.sha256",
                 "result.json"):
        assert (out / name).exists(), name
    r = json.loads((out / "result.json").read_text())
    assert r["stage"] == "train" and r["run_id"] == "full" and r["steps"] == 6
    assert r["tokens"] == 6 * 4 * 2 * 32 and r["val_tokens"] > 0 and r["final_val_ce"] > 0
    assert r["train_split_tokens"] > 0 and r["data_epochs"] == pytest.approx(r["tokens"] / r["train_split_tokens"])
    assert set(r["grad_norm"]) >= {"mean", "var", "above_clip_pct", "count", "max", "outliers"} and "provenance" in r
    assert r["grad_norm"]["outliers"] == [] and r["grad_norm"]["max"] >= r["grad_norm"]["mean"] > 0
    assert r["grad_norm"]["guard"] == {"factor": 100.0, "window": 100, "min_history": 10}
    # the attention the forward ran (auto on the CPU: masked SDPA) and its version
    assert r["provenance"]["attention"] == {"requested": "auto", "backend": "sdpa", "version": f"torch {torch.__version__}"}
    recs = records(out)
    assert [x["step"] for x in recs] == list(range(1, 7))
    for x in recs:
        assert x["loss"] == pytest.approx(x["ce"] + x["zloss"])  # z-loss counted once
        assert set(x["lr"]) == {"muon", "adam"} and x["tokens_per_s"] > 0 and "memory" in x
    assert recs[0]["lr"]["muon"] == pytest.approx(0.5e-3) and recs[0]["lr"]["adam"] == pytest.approx(1.5e-4)
    assert [x["step"] for x in records(out, "val")] == [3]
    assert len(records(out, "final_val")) == 1


def test_resume_bit_for_bit(manifest, full_run, tmp_path):
    out, _ = full_run
    with pytest.raises(Preempted):
        train(make_spec(), manifest, tmp_path, progress=False, stop_after=3)
    assert load(tmp_path)["step"] == 3 and not (tmp_path / "result.json").exists()
    res = train(make_spec(), manifest, tmp_path, progress=False)
    assert res["resumed"] and res["steps"] == 6
    a, b = weights(out / "model.safetensors"), weights(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = load(out)["optimizers"], load(tmp_path)["optimizers"]
    assert oa.keys() == ob.keys() == {"muon", "adam"}
    for name in oa:
        assert oa[name].keys() == ob[name].keys() and oa[name]
        for p, st in oa[name].items():
            for k, v in st.items():
                assert torch.equal(v, ob[name][p][k]), (name, p, k)
    ra, rb = records(out), records(tmp_path)
    assert [(x["step"], x["loss"], x["grad_norm"]) for x in ra] == [(x["step"], x["loss"], x["grad_norm"]) for x in rb]
    assert json.loads((tmp_path / "result.json").read_text())["final_val_ce"] == json.loads((out / "result.json").read_text())["final_val_ce"]


def test_resume_must_refuses_other_config(manifest, tmp_path):
    with pytest.raises(Preempted):
        train(make_spec(), manifest, tmp_path, progress=False, stop_after=1)
    other = make_spec(model={"preset": "smoke", "method": "lr", "blocks": 2, "rank": 16})
    with pytest.raises(ResumeMismatch, match=r"model\.rank: checkpoint 8 != now 16"):
        train(other, manifest, tmp_path, progress=False, resume="must")
    with pytest.raises(ResumeMismatch, match=r"optim\.muon\.lr"):
        train(make_spec(optim={"muon": {"lr": 0.02}}), manifest, tmp_path, progress=False, resume="force")
    assert load(tmp_path)["step"] == 1 and not (tmp_path / "stale").exists()  # a refusal moves nothing
    # allowed changes: validation/checkpoint cadence, device, compile
    with pytest.raises(Preempted):
        train(make_spec(val={"every": 0, "batches": 1}), manifest, tmp_path, progress=False, stop_after=2)
    assert load(tmp_path)["step"] == 2 and [r["step"] for r in records(tmp_path)] == [1, 2]


def test_changed_steps_moves_the_checkpoint_aside_and_starts_over(manifest, tmp_path):
    """A finished run whose spec changed (more steps) starts fresh; its checkpoint, metrics and spec
    move into stale/ with the reason, and the log says so."""
    train(make_spec(steps=4, val={"every": 0, "final": False}), manifest, tmp_path, progress=False)
    old = load(tmp_path)
    logged = []
    res = train(make_spec(steps=6, val={"every": 0, "final": False}), manifest, tmp_path, progress=False,
                log=logged.append)
    assert not res["resumed"] and res["steps"] == 6
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4, 5, 6]
    (stale,) = (tmp_path / "stale").iterdir()
    assert stale.name.endswith("-step4")
    assert {"checkpoint.json", "metrics.jsonl", "spec.json", "reason.txt"} <= {p.name for p in stale.iterdir()}
    assert "steps: checkpoint 4 != now 6" in (stale / "reason.txt").read_text()
    assert [r["step"] for r in records(stale)] == [1, 2, 3, 4]
    kept = load(stale)  # the stale checkpoint is whole and still checks
    assert kept["step"] == 4 and all(torch.equal(kept["model"][k], old["model"][k]) for k in old["model"])
    assert any("moved it aside to" in m and "steps: checkpoint 4 != now 6" in m for m in logged), logged
    # the same spec again resumes (nothing more moves aside)
    again = train(make_spec(steps=6, val={"every": 0, "final": False}), manifest, tmp_path, progress=False)
    assert again["resumed"] and len(list((tmp_path / "stale").iterdir())) == 1


def _flip_bytes(path: Path, at: float = 0.5, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i:i + n] = bytes(b ^ 0xFF for b in data[i:i + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("part", ["tensors", "state"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_checkpoint_is_refused_never_used(manifest, tmp_path, part, damage):
    with pytest.raises(Preempted):
        train(make_spec(), manifest, tmp_path, progress=False, stop_after=2)
    rec = json.loads((tmp_path / "checkpoint.json").read_text())
    target = tmp_path / rec["files"][part][0]["file"]
    if damage == "flip":
        _flip_bytes(target)
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=rf"{target.name}: sha256 .* differs .* refusing to use it"):
        train(make_spec(), manifest, tmp_path, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text() == before and not (tmp_path / "model.safetensors").exists()
    # on the command line: exit 2, one line naming the file
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lrattnres", "train", "--spec", json.dumps(make_spec()), "--data",
                           manifest, "--out", str(tmp_path), "--no-progress"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and target.name in proc.stderr and "Traceback" not in proc.stderr
    # --resume never moves the corrupt checkpoint aside (kept, not deleted) and starts over
    res = train(make_spec(val={"final": False}), manifest, tmp_path, progress=False, resume="never")
    assert not res["resumed"] and res["steps"] == 6
    (stale,) = (tmp_path / "stale").iterdir()
    assert (stale / target.name).exists()


def test_checkpoint_holds_no_pickled_code(manifest, tmp_path):
    """The training state loads with weights_only=True; the weights are safetensors."""
    with pytest.raises(Preempted):
        train(make_spec(), manifest, tmp_path, progress=False, stop_after=2)
    rec = json.loads((tmp_path / "checkpoint.json").read_text())
    state = torch.load(tmp_path / rec["files"]["state"][0]["file"], weights_only=True)
    assert set(state) == {"rng", "loader", "grad_norms"}
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / rec["files"]["tensors"][0]["file"])
    assert {k[len("model."):] for k in tensors if k.startswith("model.")} == set(load(tmp_path)["model"])
    assert any(k.endswith(".momentum_buffer") for k in tensors) and any(k.endswith(".exp_avg_sq") for k in tensors)


def test_nonfinite_loss_stops_and_keeps_last_checkpoint(manifest, tmp_path, monkeypatch):
    real = loop.loss_sums
    calls = {"n": 0}

    def poisoned(logits, targets):
        calls["n"] += 1
        ce, z = real(logits, targets)
        if calls["n"] > 2 * 4:  # from the 5th update on (2 micro-batches each)
            z = z * float("nan")
        return ce, z

    monkeypatch.setattr(loop, "loss_sums", poisoned)
    with pytest.raises(NonFiniteLoss, match=r"non-finite z-loss .* at step 5"):
        train(make_spec(), manifest, tmp_path, progress=False)
    assert load(tmp_path)["step"] == 4
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "result.json").exists()
    assert all(torch.isfinite(v).all() for v in load(tmp_path)["model"].values())
    # the guard recorded the non-finite norm of that update before the run stopped
    (event,) = records(tmp_path, "grad_outlier")
    assert event["step"] == 5 and event["update"] == 4 and event["norm"] == "nan" and event["median"] > 0


_ACCUMULATE = loop.accumulate_gradients


def _inflated_norm(monkeypatch, at: int, start: int, times: float = 1e4):
    """accumulate_gradients, with the reported pre-clip norm of update index ``at`` multiplied by
    ``times`` (a fault that shows in the norm only); ``start``: the update the next train() call
    begins at."""
    real = _ACCUMULATE
    state = {"update": start}

    def fake(*a, **kw):
        ce, zl, gn = real(*a, **kw)
        u, state["update"] = state["update"], state["update"] + 1
        return ce, zl, gn * times if u == at else gn

    monkeypatch.setattr(loop, "accumulate_gradients", fake)
    return state


def test_grad_outlier_is_reported_recorded_and_survives_resume(manifest, tmp_path, monkeypatch):
    """A norm far above the running median is reported in one line with its update index, norm and
    median, recorded in metrics.jsonl and result.json, and found the same way by a run resumed
    before it (the guard's history restored from the checkpoint: with min_history 2, a run resumed
    at update 2 that forgot updates 0 and 1 would not judge update 3) and by one resumed after it."""
    spec = make_spec(grad_guard={"factor": 50, "window": 4, "min_history": 2}, val={"every": 0, "batches": 1, "final": False})
    lines = []
    _inflated_norm(monkeypatch, at=3, start=0)
    full = train(spec, manifest, tmp_path / "full", progress=False, log=lines.append)
    (event,) = full["grad_norm"]["outliers"]
    norms = [r["grad_norm"] for r in records(tmp_path / "full")]
    assert event["update"] == 3 and event["norm"] == norms[3] and event["median"] == pytest.approx(sorted(norms[:3])[1])
    assert full["grad_norm"]["max"] == norms[3]
    said = [x for x in lines if "gradient-norm outlier" in x]
    assert len(said) == 1 and "update index 3 (step 4)" in said[0] and f"{event['norm']:.4g}" in said[0]
    assert f"{event['median']:.4g}" in said[0] and "\n" not in said[0]
    assert [(r["step"], r["update"]) for r in records(tmp_path / "full", "grad_outlier")] == [(4, 3)]
    for stop in (2, 4):  # resumed before the outlier, and after it
        out, lines = tmp_path / f"stop{stop}", []
        _inflated_norm(monkeypatch, at=3, start=0)
        with pytest.raises(Preempted):
            train(spec, manifest, out, progress=False, stop_after=stop, log=lines.append)
        _inflated_norm(monkeypatch, at=3, start=stop)
        res = train(spec, manifest, out, progress=False, log=lines.append)
        assert res["resumed"] and res["grad_norm"]["outliers"] == full["grad_norm"]["outliers"], stop
        assert sum("gradient-norm outlier" in x for x in lines) == 1, (stop, lines)  # the replay says nothing
        assert [(r["step"], r["update"]) for r in records(out, "grad_outlier")] == [(4, 3)]


def test_nonfinite_loss_recorded_as_the_result_where_the_spec_asks(manifest, tmp_path, monkeypatch):
    """A run of the learning-rate check (spec record_nonfinite) that diverges ends with a result saying
    so, its weights of the last good update, and no final validation: a diverged rate is an outcome."""
    real = loop.loss_sums
    calls = {"n": 0}

    def poisoned(logits, targets):
        calls["n"] += 1
        ce, z = real(logits, targets)
        if calls["n"] > 2 * 4:  # from the 5th update on (2 micro-batches each)
            z = z * float("inf")
        return ce, z

    monkeypatch.setattr(loop, "loss_sums", poisoned)
    res = train(make_spec(record_nonfinite=True), manifest, tmp_path, progress=False)
    assert res["stopped"]["update"] == 5 and res["stopped"]["term"] == "z-loss"
    assert res["steps"] == 4 and res["final_val_ce"] is None and res["val_tokens"] == 0
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk["stopped"] == res["stopped"] and (tmp_path / "model.safetensors").exists()
    assert all(torch.isfinite(v).all() for v in weights(tmp_path / "model.safetensors").values())
    assert records(tmp_path, "stopped")[0]["update"] == 5 and not records(tmp_path, "final_val")


def test_grad_norm_logged_before_clipping(manifest, tmp_path):
    tight = train(make_spec(steps=2, grad_clip=1e-4, val={"final": False}), manifest, tmp_path / "a", progress=False)
    loose = train(make_spec(steps=2, grad_clip=None, val={"final": False}), manifest, tmp_path / "b", progress=False)
    ga, gb = records(tmp_path / "a"), records(tmp_path / "b")
    assert ga[0]["grad_norm"] == gb[0]["grad_norm"] > 1e-3  # same pre-clip norm, far above the clip
    assert tight["grad_norm"]["above_clip_pct"] == 100.0 and loose["grad_norm"]["above_clip_pct"] is None
    wa, wb = weights(tmp_path / "a" / "model.safetensors"), weights(tmp_path / "b" / "model.safetensors")
    assert not torch.equal(wa["layers.0.attn.qkv.weight"], wb["layers.0.attn.qkv.weight"])


def test_final_val_ce_matches_fp64(full_run, manifest):
    from lrattnres.data import iter_eval_batches, load_manifest

    out, res = full_run
    model, info = load_model(out / "model.safetensors")
    model = model.double()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in iter_eval_batches(load_manifest(manifest), "val", 3, 32):
            logits = model(b.inputs, b.doc_ids)
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), reduction="sum").item()
            count += b.targets.numel()
    assert count == res["val_tokens"]
    assert res["final_val_ce"] == pytest.approx(total / count, rel=1e-6)
    assert info["step"] == 6 and info["model_config"]["rank"] == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, spec, manifest, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        train(spec, manifest, out, progress=False)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_ddp_two_ranks_match_one(manifest, tmp_path):
    import torch.multiprocessing as mp

    base = dict(steps=3, grad_accum=2, val={"every": 0, "final": True}, checkpoint={"every": 0})
    one = train(make_spec(micro_batch=4, **base), manifest, tmp_path / "one", progress=False)
    mp.start_processes(_ddp_worker, args=(2, _free_port(), make_spec(micro_batch=2, **base), manifest,
                                          str(tmp_path / "two")), nprocs=2, join=True, start_method="spawn")
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    assert two["world_size"] == 2 and two["tokens"] == one["tokens"]
    a, b = weights(tmp_path / "one" / "model.safetensors"), weights(tmp_path / "two" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    ra, rb = records(tmp_path / "one"), records(tmp_path / "two")
    for x, y in zip(ra, rb):
        assert y["ce"] == pytest.approx(x["ce"], rel=1e-5) and y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert two["final_val_ce"] == pytest.approx(one["final_val_ce"], rel=1e-5)
    assert two["val_tokens"] == one["val_tokens"]


def test_sigterm_writes_checkpoint_that_resumes(manifest, tmp_path):
    spec = make_spec(steps=100000, checkpoint={"every": 0}, val={"every": 0, "final": False})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lrattnres.train", "--spec", json.dumps(spec), "--data", manifest,
                             "--out", str(tmp_path), "--no-progress"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "spec.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == loop.EXIT_PREEMPTED, err
    assert "checkpoint" in err and (tmp_path / "checkpoint.json").exists()
    k = load(tmp_path)["step"]
    with pytest.raises(Preempted, match=f"stopped at step {k + 2}"):
        train(spec, manifest, tmp_path, progress=False, stop_after=k + 2)
    assert [r["step"] for r in records(tmp_path)] == list(range(1, k + 3))


def test_code_change_starts_over(manifest, tmp_path, monkeypatch):
    with pytest.raises(Preempted):
        train(make_spec(steps=3), manifest, tmp_path, progress=False, stop_after=1)
    monkeypatch.setattr(loop, "code_fingerprint", lambda: "other")
    with pytest.raises(ResumeMismatch, match="other training code"):
        train(make_spec(steps=3), manifest, tmp_path, progress=False, resume="must")
    res = train(make_spec(steps=3, val={"final": False}), manifest, tmp_path, progress=False)
    assert not res["resumed"] and [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    (stale,) = (tmp_path / "stale").iterdir()
    assert "other training code" in (stale / "reason.txt").read_text()


def test_code_change_refused_or_continued_as_the_policy_says(manifest, tmp_path, monkeypatch, capsys):
    """on_code_change: refuse stops with exit 2 naming the changed file and leaves the checkpoint where
    it is; continue (or --resume force) resumes it, and the result records both commits and the file."""
    from lrattnres.train import cli
    from lrattnres.train.loop import CodeChanged

    with pytest.raises(Preempted):
        train(make_spec(steps=3), manifest, tmp_path, progress=False, stop_after=1)
    files = loop.code_files()
    edited = "lrattnres/train/loop.py"
    monkeypatch.setattr(loop, "code_fingerprint", lambda: "other")
    monkeypatch.setattr(loop, "code_files", lambda: {**files, edited: "0" * 64})
    with pytest.raises(CodeChanged, match=rf"step 1 was written by other training code \(changed: {edited};"):
        train(make_spec(steps=3), manifest, tmp_path, progress=False, on_code_change="refuse")
    argv = ["--spec", json.dumps(make_spec(steps=3)), "--data", str(manifest), "--out", str(tmp_path), "--no-progress"]
    capsys.readouterr()
    assert cli.main(argv + ["--on-code-change", "refuse"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and edited in err and "--resume force" in err and "--resume never" in err
    assert load(tmp_path)["step"] == 1 and not (tmp_path / "stale").exists()  # nothing moved, nothing lost
    res = train(make_spec(steps=3, val={"final": False}), manifest, tmp_path, progress=False, on_code_change="continue")
    assert res["resumed"] and [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    (change,) = res["code_changes"]
    assert change["step"] == 1 and change["changed_files"] == [edited]
    assert change["checkpoint_commit"] == change["commit"] == res["provenance"]["commit"]  # both commits recorded
    assert json.loads((tmp_path / "result.json").read_text())["code_changes"] == res["code_changes"]
    # --resume force continues as well, and the earlier change stays on record
    with pytest.raises(Preempted):
        train(make_spec(steps=5), manifest, tmp_path / "b", progress=False, stop_after=2)
    monkeypatch.setattr(loop, "code_fingerprint", lambda: "third")
    res = train(make_spec(steps=5, val={"final": False}), manifest, tmp_path / "b", progress=False, resume="force",
                on_code_change="refuse")
    assert res["resumed"] and len(res["code_changes"]) == 1 and res["code_changes"][0]["step"] == 2


def test_plain_status_lines_where_stderr_is_not_a_terminal(manifest, tmp_path, monkeypatch):
    """In a log file (a non-terminal stderr) training prints whole lines, no carriage returns: step,
    loss, tokens/s, elapsed and ETA, here after every update (log_every_s tiny); with 0, none."""
    import io
    import re

    fake = io.StringIO()  # isatty() is False, as for a log file
    monkeypatch.setattr(sys, "stderr", fake)
    spec = make_spec(steps=3, val={"every": 0, "batches": 1}, checkpoint={"every": 0}, log_every_s=1e-9)
    train(spec, manifest, tmp_path / "logged", progress=True)
    text = fake.getvalue()
    assert "\r" not in text
    pattern = re.compile(r"\[train\] logged: step (\d)/3 \(\d+\.\d%\), loss (\d+\.\d{4}), [\d,]+ tokens/s, "
                         r"elapsed \d+:\d\d, eta \d+:\d\d")
    steps = [int(m.group(1)) for m in map(pattern.fullmatch, text.splitlines()) if m]
    assert steps == [1, 2, 3], text
    fake.seek(0)
    fake.truncate()
    train(dict(spec, log_every_s=0), manifest, tmp_path / "quiet", progress=True)
    assert "step 1/3" not in fake.getvalue() and "done" in fake.getvalue()
