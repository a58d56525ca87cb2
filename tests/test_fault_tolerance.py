"""Fault tolerance: a crash of Snakemake (kill -9 of its whole process group) in the middle of the
smoke DAG leaves no output that looks complete but is not, and `--rerun-incomplete` (the local
profile sets it) finishes the DAG; on Slurm, a training job requeued while it runs (as preemption
does: SIGTERM, then the job goes back to the queue) resumes from its checkpoint and ends with the
same weights as an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import copy_repo, snakemake
from test_slurm import PROFILE, cluster_flags, slurm_cluster, slurm_logs  # noqa: F401  (fixture)

LOCAL_PROFILE = "workflow/profiles/local"


def _wait_for(cond, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process ended ({proc.returncode}) before {what}:\n{out[-5000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _popen_snakemake(workdir: Path, *args: str) -> subprocess.Popen:
    """Snakemake in its own session (process group), so that the test can kill the whole group."""
    env = dict(os.environ, PYTHONPATH=str(workdir))
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", *args], cwd=workdir, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def check_outputs_complete(workdir: Path) -> dict[str, int]:
    """Every file that looks like a finished output is whole: JSON parses, torch checkpoints load,
    the data manifest verifies (every shard's size and sha256), HTML is closed. Temporary files of
    atomic writes (hidden, *.tmp) may remain after a kill -9; they never carry an output's name."""
    import torch

    from lrattnres.data import load_manifest

    counts = {"json": 0, "pt": 0, "manifest": 0, "html": 0, "jsonl": 0}
    for root in (workdir / "results", workdir / "reports"):
        for f in sorted(root.rglob("*")):
            if not f.is_file() or f.name.startswith(".") or f.suffix == ".tmp" or ".snakemake" in f.parts:
                continue
            if f.suffix == ".json":
                try:
                    json.loads(f.read_text(encoding="utf-8"))
                except ValueError as e:
                    raise AssertionError(f"{f}: looks complete but is not valid JSON ({e})") from None
                counts["json"] += 1
                if f.name == "manifest.json":
                    load_manifest(f, verify=True)
                    counts["manifest"] += 1
            elif f.suffix == ".pt":
                torch.load(f, map_location="cpu", weights_only=False)
                counts["pt"] += 1
            elif f.suffix == ".html":
                assert f.read_text(encoding="utf-8").rstrip().endswith("</html>"), f
                counts["html"] += 1
            elif f.suffix == ".jsonl":
                # an append-only log: a kill may cut its last line, never an earlier one
                lines = f.read_text(encoding="utf-8").split("\n")
                for line in lines[:-2]:
                    json.loads(line)
                counts["jsonl"] += 1
    return counts


@pytest.mark.slow
def test_kill_9_of_snakemake_then_rerun_incomplete(tmp_path):
    work = copy_repo(tmp_path / "repo")
    target = ("reports/paper.html", "--profile", LOCAL_PROFILE, "--cores", "2", "--config", "scale=smoke")
    proc = _popen_snakemake(work, *target)
    runs = work / "results" / "smoke" / "runs"
    try:
        # kill when a training job has written its first checkpoint and runs on (before the train
        # rule existed: when any job had started)
        if "train" in snakemake(work, "--list-rules").stdout.split():
            _wait_for(lambda: any(runs.glob("*/checkpoint.pt")), 300, proc, "a training checkpoint")
        else:
            logs = work / "results" / "smoke" / "logs"
            _wait_for(lambda: logs.is_dir() and any(logs.iterdir()), 300, proc, f"a log under {logs}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"snakemake was not killed mid-run ({proc.returncode})"
    assert not (work / "reports" / "paper.html").exists()
    before = check_outputs_complete(work)

    # The dead run left its lock and its incomplete-job markers behind.
    assert any((work / ".snakemake" / "locks").iterdir())
    # Snakemake refuses to run in the folder until it is unlocked (docs/slurm.md says so).
    locked = snakemake(work, *target, check=False)
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
    snakemake(work, "--unlock", "--config", "scale=smoke")
    interrupted = {p.parent.name for p in runs.glob("*/checkpoint.pt") if not (p.parent / "model.pt").exists()}
    t0 = time.time()
    snakemake(work, *target, timeout=600)
    elapsed = time.time() - t0
    after = check_outputs_complete(work)
    paper = json.loads((work / "reports" / "paper.json").read_text())
    assert paper["scale"] == "smoke" and len(paper["claims"]) >= 300
    assert after["html"] == 1 and after["json"] > before["json"]
    # the runs the crash interrupted resumed from their checkpoints (the trainer says so in its log)
    for run in interrupted:
        log = (work / "results" / "smoke" / "logs" / "train" / f"{run}.log").read_text()
        assert "resumed at step" in log, (run, log[-2000:])
    # nothing is left to do
    dry = snakemake(work, "-n", "reports/paper.html", "--config", "scale=smoke").stdout
    assert "Nothing to be done" in dry or "total" not in dry, dry[-2000:]
    print(f"kill -9 then --rerun-incomplete: outputs before {before}, after {after}; "
          f"{len(interrupted)} interrupted runs resumed; rerun {elapsed:.0f} s")


def _slurm_job_of(run: str) -> str | None:
    """The Slurm job id of the training job of ``run`` (the executor puts rule and wildcards in the
    job's comment)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%k|%T"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        jid, comment, state = line.split("|", 2)
        if comment.startswith("rule_train_") and comment.endswith(run) and state == "RUNNING":
            return jid
    return None


@pytest.mark.slurm
@pytest.mark.slow
def test_requeued_training_job_resumes_with_identical_weights(slurm_cluster, tmp_path):
    """`scontrol requeue` of a running training job (what preemption with PreemptMode=REQUEUE does:
    SIGTERM, then back to the queue): the trainer checkpoints and exits, Slurm starts the job again,
    it resumes, and the final weights equal those of an uninterrupted run, bit for bit."""
    import torch

    from lrattnres.config import load_and_resolve
    from lrattnres.grid import plan

    work = copy_repo(tmp_path / "repo")
    if "train" not in snakemake(work, "--list-rules").stdout.split():
        pytest.skip("the workflow has no train rule yet")
    overrides = {"steps": 120, "checkpoint": {"every": 5}}
    overrides_file = tmp_path / "longer_training.yaml"
    overrides_file.write_text(json.dumps({"scale": "smoke", "train": overrides}))
    config = ["--configfile", "config.yaml", str(overrides_file)]
    runs = plan(load_and_resolve(work / "config.yaml", {"scale": "smoke", "train": overrides}))
    run = next((r.run_id for r in runs if r.method == "lr"), runs[0].run_id)
    rundir = work / "results" / "smoke" / "runs" / run
    proc = _popen_snakemake(work, f"results/smoke/runs/{run}/model.pt", "--profile", PROFILE, *config, *cluster_flags(jobs=2))
    t0 = time.time()
    try:
        _wait_for(lambda: (rundir / "checkpoint.pt").exists(), 300, proc, f"the first checkpoint of {run}")
        jid = None
        _wait_for(lambda: (jid := _slurm_job_of(run)) is not None, 30, proc, "the running training job")
        jid = _slurm_job_of(run)
        assert not (rundir / "model.pt").exists(), "training finished before it could be requeued: raise its steps"
        subprocess.run(["scontrol", "requeue", jid], check=True, capture_output=True, text=True)
        t_requeue = time.time()
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    shown = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True).stdout
    restarts = int(re.search(r"Restarts=(\d+)", shown).group(1))
    assert restarts >= 1, shown
    # Snakemake submitted the job once: Slurm itself ran it again
    assert len(re.findall(r"has been submitted with SLURM jobid", out)) == 2, out[-4000:]  # data + train
    log = (work / "results" / "smoke" / "logs" / "train" / f"{run}.log").read_text()
    m = re.search(r"resumed at step (\d+)", log)
    assert m and 0 < int(m.group(1)) < overrides["steps"], log[-3000:]

    # the same run without interruption, by hand, from the spec the run recorded
    recorded = json.loads((rundir / "spec.json").read_text())
    ref = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "-m", "lrattnres", "train", "--spec", json.dumps(recorded["spec"]),
         "--data", str(work / "results" / "smoke" / "data" / "manifest.json"), "--out", str(ref),
         "--threads", "1", "--no-progress"],
        cwd=work, env=dict(os.environ, PYTHONPATH=str(work)), check=True, capture_output=True, timeout=600,
    )
    a = torch.load(rundir / "model.pt", map_location="cpu", weights_only=False)
    b = torch.load(ref / "model.pt", map_location="cpu", weights_only=False)
    assert a["step"] == b["step"] == overrides["steps"]
    assert a["model"].keys() == b["model"].keys()
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not differ, f"weights differ after resume: {differ[:5]}"
    print(f"requeue of Slurm job {jid} at step {m.group(1)}/{overrides['steps']}: resumed, identical weights; "
          f"{time.time() - t0:.0f} s (after requeue {time.time() - t_requeue:.0f} s)")
