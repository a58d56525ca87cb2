"""``python -m lrattnres train --spec '<json>' --data <manifest.json> --out <run dir>``

Exit codes: 0 done (``result.json`` written); 2 bad spec, bad input, a checkpoint that fails its
sha256 check or a refused resume (one line naming the file and the key); 3 non-finite loss (the
last good checkpoint is kept); 75 (EX_TEMPFAIL) stopped by SIGTERM/SIGINT, ``LRATTNRES_DEADLINE`` or
``--stop-after`` after writing ``checkpoint.json``: rerun the same command to resume (Slurm:
``--requeue``; Snakemake: ``--retries``).  A checkpoint written for another spec or data manifest is
moved aside into ``<out>/stale/`` and the run starts over (the log says so); one written on another
world size with the same tokens per update resumes, its optimiser state resharded; one written by
other training code follows ``--on-code-change`` (restart, the default: moved aside; refuse: exit 2
naming the changed files; continue: resumed, both commits recorded in the result).
``--requeue-at-deadline``: inside a Slurm job, a run stopped at its deadline requeues its job
(lrattnres/slurmjob.py), so that the next run of the same job continues it.

Data-parallel: ``torchrun --nproc-per-node K -m lrattnres train ...`` (NCCL on GPUs, gloo on CPUs);
the global batch is ``micro_batch x seq_len x grad_accum x K`` tokens.  torchrun forwards SIGTERM to
its workers, which agree on the step, write one checkpoint (every rank's loader and RNG state) and
exit 75; torchrun itself then exits 1 (its own convention).  Rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import sys

from lrattnres import slurmjob
from lrattnres.data import ManifestError
from lrattnres.io import DiskFull, read_spec_arg
from lrattnres.train.spec import SpecError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lrattnres train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="the run's settings as a JSON object, or @file.json")
    p.add_argument("--data", required=True, help="data manifest (manifest.json of prepare-data)")
    p.add_argument("--out", required=True, help="run folder (spec.json, metrics.jsonl, checkpoint.json, model.safetensors, result.json)")
    p.add_argument("--resume", choices=("auto", "never", "must", "force"), default="auto",
                   help="auto (default): continue from <out>/checkpoint.json when it was written for the same "
                        "spec, data and training code, else move it aside to <out>/stale/ and start over; never: "
                        "move it aside and start over; must: fail unless it can continue; force: continue even "
                        "if the training code changed")
    p.add_argument("--on-code-change", choices=("restart", "refuse", "continue"), default="restart",
                   help="with --resume auto, a checkpoint written by other training code: restart (default: move it "
                        "aside, start over), refuse (exit 2, naming the changed files) or continue (as --resume "
                        "force; the result records both commits)")
    p.add_argument("--requeue-at-deadline", action="store_true",
                   help="inside a Slurm job: after a stop at LRATTNRES_DEADLINE, requeue the job (scontrol requeue) "
                        "so that its next run continues the training")
    p.add_argument("--stop-after", type=int, default=None, help="checkpoint and exit 75 after this many updates")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress bar (plain status lines every log_every_s seconds of the spec instead, "
                        "as whenever stderr is not a terminal)")
    return p


def _keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of mmap/munmap-ing every large tensor.

    A CPU step allocates and frees several multi-MB tensors (logits, softmax numerators, their
    gradients); with glibc's defaults each one is a fresh mmap and thousands of page faults.
    Measured on a tiny run: system time 60 -> 15 ms per step (about 15% of the step).  Used only
    when training on the CPU (on a GPU host it would pin the peak host memory of checkpointing).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def _requeue(stopped) -> None:
    """Requeue this Slurm job after a stop at its deadline (rank 0 only; lrattnres/slurmjob.py)."""
    import os

    if slurmjob.job_id() is None or int(os.environ.get("RANK", "0")) != 0:
        return
    if stopped.updates < 1:
        print("train: not requeueing: this run of the job reached its deadline before one update; its wall time "
              "leaves no time to train after start-up and the signal lead (raise resources.train.runtime or "
              "cluster.runtime_max_min)", file=sys.stderr)
        return
    done, what = slurmjob.requeue()
    print(f"train: {what}" + ("; its next run resumes from the checkpoint" if done else
                              "; exiting 75 instead, so that a retry continues the run in a new job"), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = read_spec_arg(args.spec)
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    import torch

    device = spec.get("device", "auto") if isinstance(spec, dict) else "auto"
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        _keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lrattnres.train.loop import EXIT_NONFINITE, EXIT_PREEMPTED, NonFiniteLoss, Preempted, ResumeMismatch, train
    from lrattnres.train.checkpoint import CheckpointError

    try:
        train(spec, args.data, args.out, resume=args.resume, on_code_change=args.on_code_change,
              stop_after=args.stop_after, progress=not args.no_progress)
    except Preempted as e:
        print(f"train: {e}", file=sys.stderr)
        if args.requeue_at_deadline and e.reason == "deadline":
            _requeue(e)
        return EXIT_PREEMPTED
    except NonFiniteLoss as e:
        print(f"train: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except (SpecError, ResumeMismatch, ManifestError, CheckpointError, DiskFull, FileNotFoundError) as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
