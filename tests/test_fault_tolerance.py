"""The fault suite: the faults a user meets at the smoke scale, and what each must leave behind.

Every test injects faults and checks that the failure is one clear line (exit 2 where the input is at
fault, naming the file), that nothing complete or valid is lost or used, and that a rerun finishes
the work. Each fault is recorded through the ``faults`` fixture; the session summary prints how
many faults were tried and how many runs lost anything (the goal: 0).

- At the command line (no Snakemake): a corrupt checkpoint (flipped bytes, truncated, junk), a
  corrupt token shard, a manifest of binary junk, junk in a jsonl source, a full disk, retries of a
  failure that cannot succeed, a data rebuild (identical, different) under a finished run.
- On the smoke DAG (tests/test_smoke_dag.py), run in a results folder whose name holds a space and a
  ';' (nothing may be written outside it): kill -9 of Snakemake while a training run is part way,
  then a rerun (the default profile's --rerun-incomplete); a changed spec, then a rerun; SIGTERM of a
  training job, resumed by Snakemake's retry; a corrupt checkpoint and malformed stage outputs under
  Snakemake.
- On the local one-node Slurm cluster (tests/test_slurm.py): a training job stopped, then requeued,
  while it runs resumes with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

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


# ====================================================================== a Slurm job requeued


