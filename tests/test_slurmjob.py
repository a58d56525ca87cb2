"""A run longer than one Slurm job (lrattnres/slurmjob.py): the trainer's deadline inside a job, and the
requeue after a stop at it, with Slurm's commands stood in for by scripts on PATH."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import word_corpus

from lrattnres import slurmjob
from lrattnres.train import cli, loop


def _fake(tmp_path: Path, name: str, body: str) -> Path:
    """An executable ``name`` on PATH that records its arguments in ``<name>.calls``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / (name + '.calls')}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bindir


def test_the_deadline_is_the_jobs_end_less_the_lead(tmp_path, monkeypatch):
    end = dt.datetime(2026, 12, 5, 10, 0, 0)
    bindir = _fake(tmp_path, "squeue", f"echo {end:%Y-%m-%dT%H:%M:%S}")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurmjob.deadline(148) is None  # outside a Slurm job: no deadline
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert slurmjob.deadline(148) == end.timestamp() - 148
    assert (tmp_path / "squeue.calls").read_text().split() == ["-h", "-j", "4242", "-o", "%e"]
    assert slurmjob.parse_time("Unknown") is None and slurmjob.parse_time("N/A") is None
    gone = lambda *a, **k: SimpleNamespace(returncode=1, stdout="", stderr="Invalid job id")  # noqa: E731
    assert slurmjob.deadline(148, run=gone) is None


def test_the_deadline_command_prints_epoch_seconds(tmp_path, monkeypatch, capsys):
    bindir = _fake(tmp_path, "squeue", "echo 2026-12-05T10:00:00")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert slurmjob.main(["deadline", "--lead", "60"]) == 0
    assert int(capsys.readouterr().out) == int(dt.datetime(2026, 12, 5, 9, 59).timestamp())
    monkeypatch.delenv("SLURM_JOB_ID")
    assert slurmjob.main(["deadline", "--lead", "60"]) == 0 and capsys.readouterr().out == ""


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("chain_corpus"), seed=2)


def _argv(manifest, out, *extra):
    spec = {"model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}, "seed": 1, "steps": 6,
            "micro_batch": 2, "grad_accum": 1, "seq_len": 32, "schedule": {"warmup_steps": 1},
            "val": {"every": 0, "final": False}, "checkpoint": {"every": 0}, "device": "cpu"}
    return ["--spec", json.dumps(spec), "--data", str(manifest), "--out", str(out), "--no-progress", *extra]


def test_a_run_stopped_at_its_deadline_requeues_its_job(manifest, tmp_path, monkeypatch, capsys):
    """Inside a Slurm job, a stop at the deadline after some updates requeues the job (exit 75 all the
    same); a stop by a signal or --stop-after does not, nor one before any update, nor outside Slurm."""
    bindir = _fake(tmp_path, "scontrol", "exit 0")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    calls = tmp_path / "scontrol.calls"
    left = {"n": 0}

    def deadline_after(k):
        left["n"] = 0

        def f():
            left["n"] += 1
            return 1e9 if left["n"] <= k else 0.5
        return f

    monkeypatch.setattr(loop.deadline_mod, "left", deadline_after(3))
    assert cli.main(_argv(manifest, tmp_path / "run", "--requeue-at-deadline")) == loop.EXIT_PREEMPTED
    assert calls.read_text().split() == ["requeue", "4242"]
    err = capsys.readouterr().err
    assert "stopped at step 3 (LRATTNRES_DEADLINE)" in err and "requeued Slurm job 4242 (run 3 of it ends here)" in err
    # the next run of the job resumes the checkpoint and finishes
    monkeypatch.setattr(loop.deadline_mod, "left", lambda: None)
    assert cli.main(_argv(manifest, tmp_path / "run", "--requeue-at-deadline")) == 0
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 6
    calls.unlink()
    # a stop without the deadline, or without an update, or without the option: no requeue
    assert cli.main(_argv(manifest, tmp_path / "other", "--requeue-at-deadline", "--stop-after", "2")) == 75
    monkeypatch.setattr(loop.deadline_mod, "left", deadline_after(0))
    assert cli.main(_argv(manifest, tmp_path / "other", "--requeue-at-deadline")) == 75
    assert "not requeueing: this run of the job reached its deadline before one update" in capsys.readouterr().err
    monkeypatch.setattr(loop.deadline_mod, "left", deadline_after(1))
    assert cli.main(_argv(manifest, tmp_path / "other")) == 75
    assert not calls.exists()


def test_a_refused_requeue_leaves_the_retry_to_snakemake(tmp_path, monkeypatch):
    bindir = _fake(tmp_path, "scontrol", "echo 'Requested operation is presently disabled' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    done, what = slurmjob.requeue()
    assert not done and "scontrol requeue 9 exited 1: Requested operation is presently disabled" in what
    monkeypatch.delenv("SLURM_JOB_ID")
    assert slurmjob.requeue() == (False, "not in a Slurm job")


def test_each_run_of_a_requeued_job_keeps_its_log(tmp_path, monkeypatch):
    from lrattnres import attempts

    log = tmp_path / "logs" / "train" / "run.log"
    log.parent.mkdir(parents=True)
    for restart, text in ((0, "first run\n"), (1, "second run\n")):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        log.unlink(missing_ok=True)
        log.write_text(text)
        attempts.keep_log(log, 1)
    assert (log.parent / "attempts" / "run.1.log").read_text() == "first run\n"
    assert (log.parent / "attempts" / "run.1.r1.log").read_text() == "second run\n"
