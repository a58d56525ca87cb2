"""A training run longer than one Slurm job's time limit: a chain of runs of the same job.

Inside a Slurm job (``SLURM_JOB_ID`` set) the train rule gives the trainer a deadline,
``LRATTNRES_DEADLINE`` = the job's end time less the signal lead and ``cluster.signal_margin_s``
(:func:`deadline`), so that the trainer stops on its own, with its checkpoint written, before Slurm's
``--signal=TERM@<lead>`` can arrive. Stopped there, rank 0 requeues the job (:func:`requeue`,
``scontrol requeue``): Slurm puts the same job back in the queue, and its next run resumes from the
checkpoint with a whole time limit of its own. Snakemake's Slurm executor keeps waiting on the same
job id all the while (a requeued job is pending, not failed), so the chain takes as many runs as
the training needs, without a Snakemake retry.

A stop for any other reason is not requeued: a SIGTERM from ``scancel`` (a user stopping the run,
Snakemake cancelling its jobs on Ctrl-C, preemption, which Slurm requeues itself) or a job that
reached its deadline without one update (its wall time is too short to make progress). Where the
cluster refuses the requeue (``JobRequeue=0``, a job submitted with ``--no-requeue``), the trainer
exits 75 as before and Snakemake's retries continue the run in a new job.

``python -m lrattnres.slurmjob deadline --lead S`` prints the deadline in epoch seconds (nothing
outside a Slurm job or where the job's end time is unknown).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import subprocess
import sys

JOB_ENV = "SLURM_JOB_ID"
RESTART_ENV = "SLURM_RESTART_COUNT"


def job_id() -> str | None:
    """The Slurm job this process runs in, or None."""
    jid = os.environ.get(JOB_ENV, "").strip()
    return jid or None


def restart_count() -> int:
    """How many times Slurm has restarted (requeued) this job: 0 for its first run."""
    try:
        return max(0, int(os.environ.get(RESTART_ENV, "0") or 0))
    except ValueError:
        return 0


def parse_time(text: str) -> float | None:
    """Epoch seconds of a Slurm timestamp (``2026-12-05T10:00:00``, the cluster's local time), or None
    for ``Unknown``, ``N/A`` and anything unreadable."""
    text = text.strip()
    try:
        return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def end_time(jid: str, run=subprocess.run) -> float | None:
    """The end time of job ``jid`` as Slurm planned it (its start plus its time limit), or None."""
    try:
        proc = run(["squeue", "-h", "-j", jid, "-o", "%e"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return parse_time(lines[0]) if lines else None


def deadline(lead_s: float, run=subprocess.run) -> float | None:
    """Where the trainer of this Slurm job stops on its own: the job's end less ``lead_s``; None outside
    a Slurm job or where its end is unknown."""
    jid = job_id()
    if jid is None:
        return None
    end = end_time(jid, run)
    return None if end is None else end - lead_s


def requeue(run=subprocess.run) -> tuple[bool, str]:
    """Requeue this Slurm job (``scontrol requeue``): ``(done, what happened)``. Slurm then ends the
    job's processes and starts the same job again."""
    jid = job_id()
    if jid is None:
        return False, "not in a Slurm job"
    try:
        proc = run(["scontrol", "requeue", jid], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"scontrol requeue {jid}: {e}"
    if proc.returncode != 0:
        return False, f"scontrol requeue {jid} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:300]}"
    return True, f"requeued Slurm job {jid} (run {restart_count() + 1} of it ends here)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres.slurmjob", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("deadline", help="print LRATTNRES_DEADLINE for this Slurm job (empty outside one)")
    d.add_argument("--lead", type=float, required=True, help="seconds before the job's end")
    args = p.parse_args(argv)
    when = deadline(args.lead)
    if when is not None:
        print(int(when))
    return 0


if __name__ == "__main__":
    sys.exit(main())
