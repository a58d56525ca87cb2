"""The fault suite: the faults a user meets at the smoke scale, and what each must leave behind.

Every test injects faults and checks that the failure is one clear line (exit 2 where the input is at
fault, naming the file), that nothing complete or valid is lost or used, and that a rerun finishes
the work. Each fault is recorded through the ``faults`` fixture; the session summary prints how
many faults were tried and how many runs lost anything (the goal: 0).

- At the command line (no Snakemake): a corrupt checkpoint (flipped bytes, truncated, junk), a
  corrupt token shard, a manifest of binary junk, junk in a jsonl source, a full disk, retries of a
  failure that cannot succeed, a data rebuild (identical, different) under a finished run.
- On the smoke DAG that the workflow tests share (tests/conftest.py, ``smoke_dag``), run in a results
  folder whose name holds a space and a ';' (nothing may be written outside it): kill -9 of
  Snakemake while a training run is part way, then a rerun (the default profile's
  --rerun-incomplete); a changed spec, then a rerun; SIGTERM of a training job, resumed by
  Snakemake's retry; a corrupt checkpoint and malformed stage outputs under Snakemake.

A training job requeued by Slurm while it runs resumes with the same weights as an uninterrupted
run (the last test; it needs the local one-node Slurm cluster).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import (REPO, SMOKE_ARGS, SMOKE_RESULTS, check_outputs_complete, copy_repo, popen_snakemake,
                      snakemake, wait_for)
from test_slurm import PROFILE, cluster_flags, slurm_cluster, slurm_logs  # noqa: F401  (fixture)

from lrattnres.cli import main as cli_main

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "model layer residual attention depth query key value token document routing weight sum block rank").split()


def _one_line_error(text: str, *needles: str) -> str:
    """The last line of a stage's stderr: one line, no traceback, naming every needle."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert lines and "Traceback" not in text, text[-3000:]
    last = lines[-1]
    for n in needles:
        assert n in last, (n, last)
    return last


def _flip(path: Path, at: float = 0.5, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i:i + n] = bytes(b ^ 0xFF for b in data[i:i + n])
    path.write_bytes(bytes(data))


# ==================================================================== faults at the command line


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small jsonl corpus, its prepared data, and the spec of a short training run on it."""
    from lrattnres.data import prepare

    d = tmp_path_factory.mktemp("faults")
    rng = random.Random(0)
    with open(d / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120)))}) + "\n")
    data_spec = {"source": "local", "local": {"glob": str(d / "docs.jsonl")}, "val_tokens": 1500,
                 "shard_tokens": 20000, "vocab": "compact"}
    prepare(data_spec, d / "data", progress=False)
    spec = {"model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}, "seed": 1, "steps": 6,
            "micro_batch": 4, "seq_len": 32, "schedule": {"warmup_steps": 2}, "val": {"every": 0, "batches": 2},
            "checkpoint": {"every": 2}, "device": "cpu"}
    return {"dir": d, "data_spec": data_spec, "manifest": d / "data" / "manifest.json", "spec": spec}


def _train_argv(corpus, out, *extra, spec=None) -> list[str]:
    return ["train", "--spec", json.dumps(spec or corpus["spec"]), "--data", str(corpus["manifest"]),
            "--out", str(out), "--no-progress", *extra]


def _subprocess(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lrattnres", *argv], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_corrupt_checkpoint_is_refused_and_never_used(corpus, tmp_path, capsys, faults):
    """Flipped bytes in the weights, a truncated training state, junk in checkpoint.json: each
    stops the run with exit 2 and one line naming the file; nothing is written; --resume never then
    moves the corrupt checkpoint aside (kept) and the run starts over."""
    run = tmp_path / "run"
    assert cli_main(_train_argv(corpus, run, "--stop-after", "2")) == 75
    good = tmp_path / "good"
    shutil.copytree(run, good)
    rec = json.loads((run / "checkpoint.json").read_text())
    junk = os.urandom(300)
    damages = {
        "flipped weights": (rec["files"]["tensors"][0]["file"], lambda p: _flip(p)),
        "truncated state": (rec["files"]["state"][0]["file"], lambda p: p.write_bytes(p.read_bytes()[:100])),
        "junk checkpoint.json": ("checkpoint.json", lambda p: p.write_bytes(junk)),
    }
    for fault, (name, damage) in damages.items():
        shutil.rmtree(run)
        shutil.copytree(good, run)
        damage(run / name)
        metrics = (run / "metrics.jsonl").read_bytes()
        capsys.readouterr()
        assert cli_main(_train_argv(corpus, run)) == 2, fault
        _one_line_error(capsys.readouterr().err, name)
        assert (run / "metrics.jsonl").read_bytes() == metrics and not (run / "model.safetensors").exists()
        faults(f"corrupt checkpoint ({fault})", runs=1, lost=0)
    # the same through a separate process: exit status 2
    proc = _subprocess(*_train_argv(corpus, run))
    assert proc.returncode == 2 and "checkpoint.json" in _one_line_error(proc.stderr)
    # --resume never: the corrupt checkpoint moves aside, whole, and the run starts over
    assert cli_main(_train_argv(corpus, run, "--resume", "never")) == 0
    (stale,) = (run / "stale").iterdir()
    assert (stale / "checkpoint.json").read_bytes() == junk  # kept as it was, not deleted
    assert json.loads((run / "result.json").read_text())["steps"] == 6


def test_corrupt_shard_and_junk_manifest_are_refused(corpus, tmp_path, capsys, faults):
    data = tmp_path / "data"
    shutil.copytree(corpus["manifest"].parent, data)
    m = json.loads((data / "manifest.json").read_text())
    shard = data / m["splits"]["train"]["shards"][0]["file"]
    _flip(shard)
    spec = dict(corpus["spec"])
    argv = ["train", "--spec", json.dumps(spec), "--data", str(data / "manifest.json"), "--out", str(tmp_path / "r1"),
            "--no-progress"]
    assert cli_main(argv) == 2
    _one_line_error(capsys.readouterr().err, shard.name, "sha256")
    assert not (tmp_path / "r1" / "checkpoint.json").exists()
    faults("corrupt token shard")
    (data / "manifest.json").write_bytes(os.urandom(400))
    argv[argv.index("--out") + 1] = str(tmp_path / "r2")
    assert cli_main(argv) == 2
    _one_line_error(capsys.readouterr().err, "manifest.json", "not valid JSON")
    faults("manifest of binary junk")


def test_junk_in_a_jsonl_source_names_the_file(tmp_path, capsys, faults):
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": " ".join(WORDS[i:i + 30])}) + "\n" for i in range(20)))
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"text": "fine"}\n' + bytes(range(128, 256)) * 4 + b"\n")
    spec = {"source": "local", "local": {"glob": str(tmp_path / "*.jsonl")}, "val_tokens": 50}
    assert cli_main(["prepare-data", "--spec", json.dumps(spec), "--out", str(tmp_path / "d1"), "--no-progress"]) == 2
    _one_line_error(capsys.readouterr().err, str(binary), "not UTF-8")
    faults("binary junk in a jsonl source")
    binary.write_text('{"text": "fine"}\nnot json at all\n')
    assert cli_main(["prepare-data", "--spec", json.dumps(spec), "--out", str(tmp_path / "d2"), "--no-progress"]) == 2
    _one_line_error(capsys.readouterr().err, f"{binary}:2", "not valid JSON")
    faults("a line of non-JSON in a jsonl source")
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()


def test_full_disk_is_named(corpus, tmp_path, capsys, faults, monkeypatch):
    """A full disk is one line, 'no space left on device: <path>', exit 2, whatever library wrote:
    torch's zip writer says only 'unexpected pos'. On a real full file system where one can be
    mounted (root), else through a writer that fails as torch's does on a full disk."""
    import torch

    from lrattnres import io as lio

    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    try:
        if mounted:
            out = mnt / "run"
            proc = _subprocess(*_train_argv(corpus, out))
            assert proc.returncode == 2, proc.stderr[-3000:]
            line = _one_line_error(proc.stderr, "no space left on device: ", str(out))
            assert "unexpected pos" not in line
            faults("full disk (a 256 KiB file system)")
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)

    def full_write(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", full_write)
    monkeypatch.setattr(lio, "_free_bytes", lambda folder: 0)
    target = tmp_path / "state.pt"
    with pytest.raises(lio.DiskFull, match=f"no space left on device: {re.escape(str(target))}"):
        lio.atomic_torch_save({"x": 1}, target)
    assert not list(tmp_path.glob(".state.pt.*"))  # the partial file is gone
    assert cli_main(_train_argv(corpus, tmp_path / "run2")) == 2
    _one_line_error(capsys.readouterr().err, "no space left on device: ")
    monkeypatch.setattr(lio, "_free_bytes", lambda folder: 10 << 30)  # room left: not a full disk
    with pytest.raises(RuntimeError, match="unexpected pos"):
        lio.atomic_torch_save({"x": 1}, target)
    faults("full disk (simulated writer)")


def test_retries_run_only_what_can_succeed(corpus, tmp_path, faults):
    """A user error fails its retry at once (same exit code, no work); a preempted run (exit 75) and
    a killed one (no exit recorded) run again and resume; each attempt's log is kept."""
    log = tmp_path / "logs" / "run.log"
    log.parent.mkdir()

    def attempt(n: int, *argv: str) -> subprocess.CompletedProcess:
        log.unlink(missing_ok=True)  # Snakemake removes a job's log before each attempt
        with open(log, "w") as f:  # and the rule's shell writes a new one
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            return subprocess.run([sys.executable, "-m", "lrattnres", "--job-log", str(log), "--attempt", str(n), *argv],
                                  env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=300)

    bad = _train_argv(corpus, tmp_path / "bad", spec={**corpus["spec"], "stepz": 3})
    assert attempt(1, *bad).returncode == 2 and "stepz" in log.read_text()
    t0 = time.time()
    assert attempt(2, *bad).returncode == 2
    assert "not retrying: attempt 1 exited 2" in log.read_text() and time.time() - t0 < 20
    assert "stepz" in (tmp_path / "logs" / "attempts" / "run.1.log").read_text()  # attempt 1's log kept
    faults("retry of a user error (exit 2)", runs=1, lost=0)

    run = tmp_path / "run"
    assert attempt(1, *_train_argv(corpus, run, "--stop-after", "2")).returncode == 75
    assert attempt(2, *_train_argv(corpus, run)).returncode == 0
    assert "resumed at step 2" in log.read_text()
    assert "stopped at step 2" in (tmp_path / "logs" / "attempts" / "run.1.log").read_text()
    faults("retry after exit 75 (preemption)", runs=1, lost=0)

    status = tmp_path / "logs" / "attempts" / "run.status.json"
    rec = json.loads(status.read_text())
    status.write_text(json.dumps({**rec, "status": "running", "code": None}))  # as a kill -9 leaves it
    assert attempt(3, *_train_argv(corpus, run)).returncode == 0
    faults("retry after a killed attempt", runs=1, lost=0)


def test_data_rebuilt_differently_reruns_training(corpus, tmp_path, faults):
    from lrattnres.data import prepare
    from lrattnres.train.loop import train

    data = tmp_path / "data"
    prepare(corpus["data_spec"], data, progress=False)
    spec = {**corpus["spec"], "val": {"every": 0, "final": False}}
    first = train(spec, data / "manifest.json", tmp_path / "run", progress=False)
    prepare({**corpus["data_spec"], "val_tokens": 1000}, data, progress=False)
    again = train(spec, data / "manifest.json", tmp_path / "run", progress=False)
    assert not again["resumed"] and first["steps"] == again["steps"] == 6
    (stale,) = (tmp_path / "run" / "stale").iterdir()
    assert "data manifest differs" in (stale / "reason.txt").read_text()
    faults("data rebuilt differently under a finished run", runs=1, lost=0)


def test_data_rebuilt_identically_does_not_rerun_training(corpus, tmp_path, faults):
    from lrattnres.data import prepare
    from lrattnres.train.loop import train

    data = tmp_path / "data"
    prepare(corpus["data_spec"], data, progress=False)
    spec = {**corpus["spec"], "val": {"every": 0, "final": False}}
    train(spec, data / "manifest.json", tmp_path / "run", progress=False)
    shutil.rmtree(data)
    prepare(corpus["data_spec"], data, progress=False)
    again = train(spec, data / "manifest.json", tmp_path / "run", progress=False)
    assert again["resumed"] and not (tmp_path / "run" / "stale").exists()
    faults("data rebuilt identically under a finished run", runs=1, lost=0)


# ================================================================================ faults on the DAG

RESULTS, SMOKE = SMOKE_RESULTS, SMOKE_ARGS  # the shared smoke DAG (tests/conftest.py, smoke_dag)


@pytest.mark.slow
def test_kill_9_then_rerun_incomplete_in_an_injection_path(smoke_dag, faults):
    dag = smoke_dag
    work, res = dag["work"], dag["res"]
    assert dag["killed"], "snakemake was not killed mid-run"
    assert dag["locked"].returncode != 0 and "--unlock" in dag["locked"].stdout + dag["locked"].stderr
    # no second command ran, and nothing was written outside the results folder
    assert not list(work.parent.rglob("INJECTED*")) and not list(Path.cwd().glob("INJECTED*"))
    assert dag["after"] == dag["before"]
    faults("results path with a space and ';' (shell injection)", runs=1, lost=0)
    # the rerun finished the DAG; every output is whole
    after = dag["counts_done"]
    paper = dag["paper"]
    assert paper["scale"] == "smoke" and len(paper["claims"]) >= 300
    assert dag["html"].rstrip().endswith("</html>")
    runs = len(list(res.glob("runs/*")))
    assert runs and after["weights"] == runs and after["json"] > dag["counts_killed"]["json"]
    # the kill stopped at least one training run part way, and each resumed from the checkpoint it had
    interrupted = dag["interrupted"]
    assert interrupted, "the kill interrupted no training run"
    lost = 0
    for run, step in interrupted.items():
        log = dag["train_logs"][run]
        lost += f"resumed at step {step}" not in log or "moved it aside" in log
    assert lost == 0, interrupted
    faults("kill -9 of Snakemake, then --rerun-incomplete", runs=len(interrupted), lost=lost)
    assert dag["planned_after"] == {}
    print(f"smoke DAG with kill -9 and rerun: {dag['seconds']:.0f} s; {len(interrupted)} runs resumed")


def _run_of(res: Path, method: str = "lr") -> str:
    return sorted(p.name for p in (res / "runs").iterdir() if f"-{method}-" in p.name)[0]


@pytest.mark.slow
def test_changed_spec_then_sigterm_then_retry_resumes(smoke_dag, faults):
    """One run's training lengthened (a changed spec): its finished checkpoint moves aside and the run
    starts over. A SIGTERM to its training process mid-run: the trainer checkpoints and exits 75,
    Snakemake's retry (the default profile) resumes it, and both attempts' logs are kept."""
    work, res = smoke_dag["work"], smoke_dag["res"]
    run = _run_of(res)
    folder, logs = res / "runs" / run, res / "logs" / "train"
    before = json.loads((folder / "checkpoint.json").read_text())
    longer = ("--cores", "2", "--config", "scale=smoke", f"results={RESULTS}",
              'train={"steps": 600, "checkpoint": {"every": 10}}')
    proc = popen_snakemake(work, str(folder.relative_to(work) / "model.safetensors"), *longer)
    status = logs / "attempts" / f"{run}.status.json"

    def mid_run() -> bool:
        try:
            rec = json.loads((folder / "checkpoint.json").read_text())
        except (OSError, ValueError):
            return False
        return rec["spec"]["steps"] == 600 and 10 <= rec["step"] < 500

    try:
        wait_for(mid_run, 300, proc, "a checkpoint of the longer run")
        os.kill(json.loads(status.read_text())["pid"], signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-5000:]
    first, second = (logs / "attempts" / f"{run}.1.log").read_text(), (logs / "attempts" / f"{run}.2.log").read_text()
    assert "moved it aside" in first and "steps: checkpoint 4 != now 600" in first
    k = int(re.search(r"stopped at step (\d+)", first).group(1))
    assert f"resumed at step {k}" in second and "attempt 2" in second
    assert json.loads((folder / "result.json").read_text())["steps"] == 600
    stale = [d for d in (folder / "stale").iterdir() if (d / "checkpoint.json").exists()]
    kept = [json.loads((d / "checkpoint.json").read_text()) for d in stale]
    assert any(r["step"] == before["step"] == 4 and r["files"] == before["files"] for r in kept)
    faults("changed spec (steps 4 -> 600) under a finished run", runs=1, lost=0)
    faults("SIGTERM of a training job, retried by Snakemake", runs=1, lost=0)
    # the same spec again: the run resumes from its final checkpoint, no step is trained again
    snakemake(work, str(folder.relative_to(work) / "model.safetensors"), *longer, "--forcerun", "train")
    log = (logs / f"{run}.log").read_text()
    assert "resumed at step 600" in log and "moved it aside" not in log
    # back to the scale's own length: the 600-step checkpoint moves aside in turn
    snakemake(work, str(folder.relative_to(work) / "model.safetensors"), *SMOKE)
    assert "steps: checkpoint 600 != now 4" in (logs / f"{run}.log").read_text()
    assert len([d for d in (folder / "stale").iterdir() if (d / "checkpoint.json").exists()]) == 2


@pytest.mark.slow
def test_corrupt_checkpoint_and_malformed_outputs_under_snakemake(smoke_dag, faults):
    """Faults under Snakemake, then the recovery a user makes:
    - a run whose weights are missing and whose checkpoint is corrupt: its training job stops with
      one line naming the file, and the retry stops at once (nothing is trained twice);
    - another run's weights truncated: its diagnostics refuse them by name;
    - a third run's result.json malformed: the grid summary names the file and key in that run's
      row and leaves the claims that need it without a value (the report still renders).
    Removing the bad files makes Snakemake redo what they came from: the truncated weights come back
    bit for bit from the run's final checkpoint, without training."""
    from lrattnres.train import checkpoint as ckpt

    work, res = smoke_dag["work"], smoke_dag["res"]
    logs = res / "logs"
    runs = sorted(p.name for p in (res / "runs").iterdir() if "-attnres-" in p.name or "-plr-" in p.name)
    a, b, c = runs[:3]
    fa, fb, fc = (res / "runs" / r for r in (a, b, c))
    (fa / "model.safetensors").unlink()
    rec = json.loads((fa / "checkpoint.json").read_text())
    _flip(fa / rec["files"]["tensors"][0]["file"])
    proc = snakemake(work, str((fa / "model.safetensors").relative_to(work)), *SMOKE, check=False)
    assert proc.returncode != 0
    _one_line_error((logs / "train" / "attempts" / f"{a}.1.log").read_text(), rec["files"]["tensors"][0]["file"], "sha256")
    assert "not retrying: attempt 1 exited 2" in (logs / "train" / "attempts" / f"{a}.2.log").read_text()
    assert not (logs / "train" / "attempts" / f"{a}.3.log").exists() or "not retrying" in (
        logs / "train" / "attempts" / f"{a}.3.log").read_text()

    weights_b = {k: v.clone() for k, v in ckpt.read_model(fb / "model.safetensors")[0].items()}  # not the mmap
    mb = fb / "model.safetensors"
    mb.write_bytes(mb.read_bytes()[: mb.stat().st_size // 2])
    (fc / "result.json").write_text(json.dumps({"stage": "train", "final_val_ce": "nan?"}))
    targets = [str((res / n).relative_to(work)) for n in ("diagnostics.json", "grid.json")]
    (fa / "checkpoint.json").unlink()  # the user's fix for the corrupt checkpoint: start that run over
    row_b = str((res / "diagnostics" / f"{b}.json").relative_to(work))
    proc = snakemake(work, *targets, *SMOKE, "--keep-going", "--forcerun", row_b, "grid_summary",
                     check=False)
    assert proc.returncode != 0
    _one_line_error((logs / "diagnostics" / "attempts" / f"{b}.1.log").read_text(), str(mb.relative_to(work)),
                    "sha256")
    assert "not retrying: attempt 1 exited 2" in (logs / "diagnostics" / f"{b}.log").read_text()  # the retry
    (row_c,) = [r for r in json.loads((res / "grid.json").read_text())["runs"] if r["run_id"] == c]
    assert str((fc / "result.json").relative_to(work)) in row_c["problem"] and "final_val_ce" in row_c["problem"]
    # recovery: the user removes what is bad; Snakemake redoes only what it came from
    mb.unlink()
    (fc / "result.json").unlink()
    snakemake(work, *targets, *SMOKE)
    back = ckpt.read_model(mb)[0]
    assert all(bool((back[k] == weights_b[k]).all()) for k in weights_b)
    for r in (b, c):
        log = (logs / "train" / f"{r}.log").read_text()
        assert "resumed at step 4" in log and "moved it aside" not in log, r
    faults("corrupt checkpoint of an interrupted run, under Snakemake", runs=1, lost=0)
    faults("truncated weights read by a later stage", runs=1, lost=0)
    faults("malformed result.json read by a later stage", runs=1, lost=0)
    check_outputs_complete(work / RESULTS)


# ====================================================================== a Slurm job requeued


@pytest.mark.slurm
@pytest.mark.slow
def test_training_job_stopped_then_requeued_resumes_with_identical_weights(slurm_cluster, tmp_path, faults):
    """A training job submitted through the Slurm profile is interrupted twice while it runs:
    1. `scancel --signal=TERM` (what `--signal=TERM@300` does before the time limit): the trainer
       checkpoints and exits 75, the Slurm job fails, Snakemake submits it again (retries) and the
       new job resumes;
    2. `scontrol requeue` of that new job (what preemption with PreemptMode=REQUEUE does: SIGTERM,
       then back to the queue): Slurm starts the same job again and it resumes.
    The job asks for 2 (fake) GPUs, so it runs 2 data-parallel ranks under torchrun, as the paper
    scale's 8-GPU jobs do (gloo on this CPU machine). The final weights equal those of an
    uninterrupted run, bit for bit."""
    from lrattnres.config import load_and_resolve
    from lrattnres.grid import plan
    from lrattnres.train.checkpoint import read_model

    work = copy_repo(tmp_path / "repo")
    overrides = {"steps": 300, "checkpoint": {"every": 5}}
    overrides_file = tmp_path / "longer_training.yaml"
    overrides_file.write_text(json.dumps({"scale": "smoke", "train": overrides}))
    config = ["--configfile", "config.yaml", str(overrides_file)]
    runs = plan(load_and_resolve(work / "config.yaml", {"scale": "smoke", "train": overrides}))
    run = next((r.run_id for r in runs if r.method == "lr"), runs[0].run_id)
    rundir = work / "results" / "smoke" / "runs" / run
    train_log = work / "results" / "smoke" / "logs" / "train" / f"{run}.log"
    attempt_logs = train_log.parent / "attempts"
    prof = yaml.safe_load((work / PROFILE / "config.yaml").read_text())
    extra = [f"train:{k}={v}" for k, v in (prof.get("set-resources") or {}).get("train", {}).items()]
    gpus = ["--set-resources", "train:gpu=2", "train:cpus_per_gpu=1", *extra]
    proc = popen_snakemake(
        work, f"results/smoke/runs/{run}/model.safetensors", "--profile", PROFILE, *config, *cluster_flags(jobs=2), *gpus
    )
    t0 = time.time()

    def resumed() -> list[str]:
        text = "".join(p.read_text() for p in [train_log, *attempt_logs.glob(f"{run}.*.log")] if p.exists())
        return re.findall(r"resumed at step (\d+)", text)

    try:
        # 1. SIGTERM to the running job once it has written a checkpoint
        wait_for(lambda: (rundir / "checkpoint.json").exists() and _slurm_job_of(run), 300, proc,
                  f"the first checkpoint of {run}")
        first = _slurm_job_of(run)
        assert not (rundir / "model.safetensors").exists(), "training finished before it could be stopped: raise its steps"
        subprocess.run(["scancel", "--signal=TERM", first], check=True, capture_output=True, text=True)
        # 2. requeue the resubmitted job once it has resumed
        wait_for(lambda: resumed() and (_slurm_job_of(run) or first) != first, 300, proc, "the resubmitted job to resume")
        second = _slurm_job_of(run)
        step1 = int(resumed()[0])
        assert not (rundir / "model.safetensors").exists(), "training finished before it could be requeued: raise its steps"
        subprocess.run(["scontrol", "requeue", second], check=True, capture_output=True, text=True)
        t_requeue = time.time()
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    assert len(ids) == 3 and first in ids and second in ids, out[-4000:]
    shown = subprocess.run(["scontrol", "show", "job", second], capture_output=True, text=True).stdout
    assert int(re.search(r"Restarts=(\d+)", shown).group(1)) >= 1, shown
    assert re.search(r"gpu[:=]2", shown), shown  # Slurm gave the job its 2 GPUs
    step2 = int(resumed()[-1])
    assert "world 2" in train_log.read_text()
    assert 0 < step1 < step2 < overrides["steps"], (step1, step2)
    second_log = next((work / "results" / "slurm").rglob(f"{second}.log")).read_text()
    assert second_log.count("Building DAG of jobs") >= 2, second_log[-3000:]

    # the same run without interruption, by hand, from the spec the run recorded
    recorded = json.loads((rundir / "spec.json").read_text())
    ref = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "lrattnres", "train", "--spec", json.dumps(recorded["spec"]),
         "--data", str(work / "results" / "smoke" / "data" / "manifest.json"), "--out", str(ref),
         "--threads", "1", "--no-progress"],
        cwd=work, env=dict(os.environ, PYTHONPATH=str(work)), check=True, capture_output=True, timeout=600,
    )
    (a, ma), (b, mb) = read_model(rundir / "model.safetensors"), read_model(ref / "model.safetensors")
    assert ma["step"] == mb["step"] == overrides["steps"] and a.keys() == b.keys()
    differ = [k for k in a if not bool((a[k] == b[k]).all())]
    assert not differ, f"weights differ after resume: {differ[:5]}"
    faults("Slurm: SIGTERM, then requeue of a training job", runs=1, lost=int(bool(differ)))
    print(f"SIGTERM to Slurm job {first} (resumed at step {step1}), requeue of job {second} (resumed at step "
          f"{step2}) of {overrides['steps']}: identical weights; {time.time() - t0:.0f} s "
          f"(after the requeue {time.time() - t_requeue:.0f} s)")


def _slurm_job_of(run: str) -> str | None:
    """The Slurm job id of the training job of ``run`` (the executor puts rule and wildcards in the
    job's comment)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%k|%T"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        jid, comment, state = line.split("|", 2)
        if comment.startswith("rule_train_") and comment.endswith(run) and state == "RUNNING":
            return jid
    return None
