"""GPU slots of one machine: the count without torch, and which GPU a job claims (no GPU needed: the
claim only locks files and sets CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO

from lrattnres import gpus

CLAIM = """
import os, sys, time
from lrattnres import gpus
dev = gpus.claim(int(sys.argv[1]), int(sys.argv[2]), poll_s=0.05)
print(dev, os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
time.sleep(float(sys.argv[3]))
"""


def _claim(tmp_path, slots, per_gpu, hold_s, visible="0,1"):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": visible,
           "LRATTNRES_GPU_LOCKS": str(tmp_path / "locks")}
    for k in ("WORLD_SIZE", "SLURM_JOB_ID"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-c", CLAIM, str(slots), str(per_gpu), str(hold_s)], env=env,
                            stdout=subprocess.PIPE, text=True)


def test_count_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpus.count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpus.count() == 0


def test_exclusive_job_gets_a_gpu_of_its_own(tmp_path):
    """Four slots per GPU, two GPUs: a shared job takes one slot of GPU 0; an exclusive job then gets
    GPU 1; a second exclusive job waits until a whole GPU is free."""
    shared = _claim(tmp_path, 1, 4, 3)
    assert shared.stdout.readline().split() == ["0", "0"]
    excl = _claim(tmp_path, 4, 4, 3)
    assert excl.stdout.readline().split() == ["1", "1"]
    t0 = time.time()
    waiting = _claim(tmp_path, 4, 4, 0)
    line = waiting.stdout.readline().split()  # blocks until the shared job (GPU 0) exits
    assert time.time() - t0 > 1.5 and line[0] in ("0", "1")
    for p in (shared, excl, waiting):
        p.wait(timeout=30)


def test_shared_jobs_spread_over_the_gpus(tmp_path):
    procs, seen = [], []
    for _ in range(3):
        procs.append(_claim(tmp_path, 1, 2, 2))
        seen.append(procs[-1].stdout.readline().split()[0])
    assert seen == ["0", "1", "0"]  # the GPU with the most free slots first
    for p in procs:
        p.wait(timeout=30)


def test_a_job_without_gpus_sees_none(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpus.claim(0, 4) is None and os.environ["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"SLURM_JOB_ID": "7"}])
def test_batch_systems_and_torchrun_keep_what_they_see(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpus.claim(1, 4) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
