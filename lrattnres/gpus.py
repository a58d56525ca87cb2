"""GPUs of one machine: how many there are, and which one a job runs on.

Snakemake schedules GPU jobs on one machine with two resources (``workflow/rules/common.smk``):
``gpu`` (the GPUs a job uses, also what a cluster executor requests) and ``gpu_slots``. Every GPU
has ``K`` slots; a job that may share its GPU with ``k - 1`` others (``jobs_per_gpu: k``) takes
``K / k`` of them, every other GPU job (timing jobs always) takes all ``K``. The workflow offers
``K`` slots per GPU of the machine, so the scheduler never starts more than fits.

The scheduler only counts; it does not say which GPU. :func:`claim` picks one, the GPU with the most
free slots: it locks free slots of that GPU (``flock`` on one file per slot, held until the process
exits, even by ``kill -9``) and sets ``CUDA_VISIBLE_DEVICES`` to it. Two Snakemake runs on the same machine share the lock files,
so they do not crowd one GPU either. A job that declares no GPU sees none. Under a batch system
(Slurm gives the job its GPUs), for torchrun's workers and for a job of several GPUs nothing is
claimed: the job uses what it sees.
"""

from __future__ import annotations

import fcntl
import os
import re
import sys
import tempfile
import time
from pathlib import Path

_HELD: list = []  # open lock files of this process's claim


def visible_devices() -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``, or None when it is not set."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [v.strip() for v in value.split(",") if v.strip()]
    if entries and entries[0].startswith("-"):
        return []
    return entries


def count() -> int:
    """GPUs this process may use, without importing torch: ``CUDA_VISIBLE_DEVICES`` when set, else
    the NVIDIA device files of the machine (``/dev/nvidia0`` ...)."""
    visible = visible_devices()
    if visible is not None:
        return len(visible)
    return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name)) if os.path.isdir("/dev") else 0


def lock_dir() -> Path:
    return Path(os.environ.get("LRATTNRES_GPU_LOCKS") or Path(tempfile.gettempdir()) / f"lrattnres-gpus-{os.getuid()}")


def _try_lock(path: Path):
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def claim(slots: int, per_gpu: int, *, poll_s: float = 1.0, say=None) -> str | None:
    """Lock ``slots`` of the ``per_gpu`` slots of one GPU and make it this process's only visible
    GPU; returns its device name, or None where nothing is claimed (a batch system's assignment,
    torchrun's workers, a job of several GPUs; a job of no GPU is left none to see). Waits while every GPU is too full (the scheduler's counts
    guarantee room overall; one GPU's free slots can still be split over two)."""
    if os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_JOB_ID"):
        return None  # torchrun's workers, or a batch system's allocation: use what is visible
    if slots <= 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a job that declares no GPU sees none
        return None
    if per_gpu <= 0 or slots > per_gpu:
        return None
    devices = visible_devices()
    if devices is None:
        devices = [str(i) for i in range(count())]
    if not devices:
        return None
    folder = lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        best: tuple[str, list] | None = None  # the GPU with the most free slots that fits the job
        for dev in devices:
            got = [f for j in range(per_gpu)
                   if (f := _try_lock(folder / f"gpu{re.sub(r'[^A-Za-z0-9_-]', '_', dev)}.slot{j}")) is not None]
            if len(got) >= slots and (best is None or len(got) > len(best[1])):
                if best is not None:
                    _close(best[1])
                best = (dev, got)
            else:
                _close(got)
        if best is not None:
            dev, got = best
            _close(got[slots:])
            _HELD.extend(got[:slots])
            os.environ["CUDA_VISIBLE_DEVICES"] = dev
            if say is not None:
                say(f"[lrattnres] GPU {dev}: {slots} of its {per_gpu} slots")
            return dev
        if not waited and say is not None:
            say(f"[lrattnres] waiting for {slots} free slots of one GPU (of {', '.join(devices)})")
        waited = True
        time.sleep(poll_s)


def _close(files) -> None:
    for f in files:
        f.close()


def release() -> None:
    while _HELD:
        _HELD.pop().close()


if __name__ == "__main__":  # pragma: no cover - `python -m lrattnres.gpus` prints the count
    print(count(), file=sys.stdout)
