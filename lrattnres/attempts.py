"""Retry only what a retry can fix: a record of each job's last attempt.

Snakemake's ``--retries`` is a plain count: it reruns a failed job whatever made it fail. Every rule
runs its stage as ``python -m lrattnres --job-log <log> --attempt <n> <stage> ...`` (``n`` is
Snakemake's attempt number). The stage's exit status is recorded in
``<log folder>/attempts/<log stem>.status.json``; the next attempt of the same job reads it and

- runs again when the last attempt stopped in a way a retry can fix: exit 75 (EX_TEMPFAIL: a
  training run stopped by SIGTERM or preemption after writing its checkpoint), an interrupt, or no
  exit at all (killed by a signal, the OOM killer, a lost node: the record still says "running");
- otherwise (a user error, exit 2; a non-finite loss, exit 3; any other failure) stops at once with
  the same exit code and one line saying why, instead of repeating a run that cannot succeed.

A first attempt always runs: a new Snakemake invocation after a fix starts at attempt 1.

Snakemake removes a job's log before each attempt. So that every attempt's output is kept, the
stage links its log to ``<log folder>/attempts/<log stem>.<n>.log`` as it starts (a hard link: the
same file under a second name, complete even if the process is killed; a copy at exit where links
are not supported). A Slurm job that is requeued runs the same attempt again
(lrattnres/slurmjob.py); its k-th restart keeps its log as ``<log stem>.<n>.r<k>.log``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
from pathlib import Path
from typing import Any

from lrattnres.io import atomic_write_json
from lrattnres.provenance import now
from lrattnres.slurmjob import restart_count

EX_TEMPFAIL = 75
RETRYABLE_CODES = frozenset({EX_TEMPFAIL})


def _attempts_dir(log: str | os.PathLike) -> Path:
    return Path(log).parent / "attempts"


def status_path(log: str | os.PathLike) -> Path:
    return _attempts_dir(log) / f"{Path(log).stem}.status.json"


def attempt_log(log: str | os.PathLike, attempt: int, restart: int = 0) -> Path:
    log = Path(log)
    again = f".r{restart}" if restart else ""
    return _attempts_dir(log) / f"{log.stem}.{attempt}{again}{log.suffix or '.log'}"


def keep_log(log: str | os.PathLike, attempt: int) -> None:
    """Give the log of this attempt a second name that outlives Snakemake's removal of ``log`` (and,
    in a requeued Slurm job, the next run's)."""
    log, keep = Path(log), attempt_log(log, attempt, restart_count())
    if not log.is_file():
        return
    try:
        keep.parent.mkdir(parents=True, exist_ok=True)
        if keep.exists() and os.path.samefile(keep, log):
            return  # another process of the same job (torchrun) linked it already
        keep.unlink(missing_ok=True)
        os.link(log, keep)
    except OSError:
        atexit.register(lambda: shutil.copyfile(log, keep) if log.is_file() else None)


def read_status(log: str | os.PathLike) -> dict[str, Any] | None:
    try:
        rec = json.loads(status_path(log).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def retryable(rec: dict[str, Any] | None) -> bool:
    """Whether the attempt ``rec`` describes may succeed when run again."""
    if rec is None or rec.get("status") in ("running", "interrupted"):
        return True
    return rec.get("code") in RETRYABLE_CODES


def refusal(stage: str, attempt: int, log: str | os.PathLike) -> tuple[int, str] | None:
    """``(exit code, message)`` when attempt ``attempt`` must not run, else None."""
    if attempt <= 1:
        return None
    rec = read_status(log)
    if retryable(rec):
        return None
    code = rec.get("code")
    code = code if isinstance(code, int) and 0 < code < 256 else 1
    return code, (f"{stage}: not retrying: attempt {rec.get('attempt')} exited {rec.get('code')}, a failure a retry "
                  f"cannot fix (only exit {EX_TEMPFAIL}, an interrupt or a killed process are retried); its log "
                  f"is above in {log}")


def record(log: str | os.PathLike, stage: str, attempt: int, status: str, code: int | None = None) -> None:
    """Write the status of the current attempt (status: running | exited | interrupted)."""
    rec = {"stage": stage, "attempt": attempt, "status": status, "code": code, "pid": os.getpid(), "time": now()}
    try:
        atomic_write_json(status_path(log), rec)
    except OSError:
        pass  # the record only steers retries; a full disk is reported by the stage itself
