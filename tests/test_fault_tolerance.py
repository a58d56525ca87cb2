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
import yaml
from conftest import copy_repo, snakemake
from test_slurm import PROFILE, cluster_flags, slurm_cluster, slurm_logs  # noqa: F401  (fixture)

LOCAL_PROFILE = "workflow/profiles/default"


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
def test_training_job_stopped_then_requeued_resumes_with_identical_weights(slurm_cluster, tmp_path):
    """A training job submitted through the Slurm profile is interrupted twice while it runs:
    1. `scancel --signal=TERM` (what `--signal=TERM@300` does before the time limit): the trainer
       checkpoints and exits 75, the Slurm job fails, Snakemake submits it again (retries) and the
       new job resumes;
    2. `scontrol requeue` of that new job (what preemption with PreemptMode=REQUEUE does: SIGTERM,
       then back to the queue): Slurm starts the same job again and it resumes.
    The job asks for 2 (fake) GPUs, so it runs 2 data-parallel ranks under torchrun, as the paper
    scale's 8-GPU jobs do (gloo on this CPU machine). The final weights equal those of an
    uninterrupted run, bit for bit."""
    import torch

    from lrattnres.config import load_and_resolve
    from lrattnres.grid import plan

    work = copy_repo(tmp_path / "repo")
    if "train" not in snakemake(work, "--list-rules").stdout.split():
        pytest.skip("the workflow has no train rule yet")
    overrides = {"steps": 300, "checkpoint": {"every": 5}}
    overrides_file = tmp_path / "longer_training.yaml"
    overrides_file.write_text(json.dumps({"scale": "smoke", "train": overrides}))
    config = ["--configfile", "config.yaml", str(overrides_file)]
    runs = plan(load_and_resolve(work / "config.yaml", {"scale": "smoke", "train": overrides}))
    run = next((r.run_id for r in runs if r.method == "lr"), runs[0].run_id)
    rundir = work / "results" / "smoke" / "runs" / run
    train_log = work / "results" / "smoke" / "logs" / "train" / f"{run}.log"
    prof = yaml.safe_load((work / PROFILE / "config.yaml").read_text())
    extra = [f"train:{k}={v}" for k, v in (prof.get("set-resources") or {}).get("train", {}).items()]
    gpus = ["--set-resources", "train:gpu=2", "train:cpus_per_gpu=1", *extra]
    proc = _popen_snakemake(
        work, f"results/smoke/runs/{run}/model.pt", "--profile", PROFILE, *config, *cluster_flags(jobs=2), *gpus
    )
    t0 = time.time()
    resumed = lambda: re.findall(r"resumed at step (\d+)", train_log.read_text()) if train_log.exists() else []  # noqa: E731
    try:
        # 1. SIGTERM to the running job once it has written a checkpoint
        _wait_for(lambda: (rundir / "checkpoint.pt").exists() and _slurm_job_of(run), 300, proc, f"the first checkpoint of {run}")
        first = _slurm_job_of(run)
        assert not (rundir / "model.pt").exists(), "training finished before it could be stopped: raise its steps"
        subprocess.run(["scancel", "--signal=TERM", first], check=True, capture_output=True, text=True)
        # 2. requeue the resubmitted job once it has resumed
        _wait_for(lambda: resumed() and (_slurm_job_of(run) or first) != first, 300, proc, "the resubmitted job to resume")
        second = _slurm_job_of(run)
        step1 = int(resumed()[0])
        assert not (rundir / "model.pt").exists(), "training finished before it could be requeued: raise its steps"
        subprocess.run(["scontrol", "requeue", second], check=True, capture_output=True, text=True)
        t_requeue = time.time()
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    # Snakemake submitted data + train, then train again after the SIGTERM; Slurm restarted the
    # second train job itself after the requeue
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    assert len(ids) == 3 and first in ids and second in ids, out[-4000:]
    shown = subprocess.run(["scontrol", "show", "job", second], capture_output=True, text=True).stdout
    assert int(re.search(r"Restarts=(\d+)", shown).group(1)) >= 1, shown
    assert re.search(r"gpu[:=]2", shown), shown  # Slurm gave the job its 2 GPUs
    step2 = int(resumed()[-1])
    assert "world 2" in train_log.read_text()
    assert 0 < step1 < step2 < overrides["steps"], (step1, step2)
    # the requeued job appended to its Slurm log (--open-mode=append of the profile): both starts
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
    a = torch.load(rundir / "model.pt", map_location="cpu", weights_only=False)
    b = torch.load(ref / "model.pt", map_location="cpu", weights_only=False)
    assert a["step"] == b["step"] == overrides["steps"]
    assert a["model"].keys() == b["model"].keys()
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not differ, f"weights differ after resume: {differ[:5]}"
    print(f"SIGTERM to Slurm job {first} (resumed at step {step1}), requeue of job {second} (resumed at step "
          f"{step2}) of {overrides['steps']}: identical weights; {time.time() - t0:.0f} s "
          f"(after the requeue {time.time() - t_requeue:.0f} s)")
