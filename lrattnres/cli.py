"""``python -m lrattnres [--job-log LOG --attempt N --code C --gpu-slots S/K] <stage> ...``: every stage.

Each stage lives in its own module with a ``main(argv) -> int``; it is imported only when it runs,
so a cheap stage (accounting, report) does not pay for torch's import.  Before that import, where
stderr is not a terminal (a log file), the libraries' own progress bars are switched off
(``lrattnres.progress.quiet_library_bars``): the stages report progress in plain lines there.

Exit codes shared by every stage: 0 done; 2 a user error (:class:`lrattnres.errors.UserError`, a
missing input file, a full disk), printed as one line naming the file, the key and what was
expected; 75 a temporary stop that a rerun continues (training stopped by SIGTERM); anything else a
failure. With ``--job-log`` (the workflow's rules give it, with Snakemake's attempt number) the exit
status is recorded beside the log and a retry of a failure that cannot succeed stops at once
(:mod:`lrattnres.attempts`). With ``--gpu-slots S/K`` the stage first claims S of the K slots of
one GPU of the machine and sees only that GPU (:mod:`lrattnres.gpus`). ``--code`` (the fingerprint of
the stage's code, lrattnres/deps.py, that the rule gives) is named in the job log's first line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lrattnres import attempts, gpus
from lrattnres.errors import UserError, one_line
from lrattnres.io import DiskFull, is_disk_full
from lrattnres.progress import quiet_library_bars
from lrattnres.provenance import now

STAGES: dict[str, tuple[str, str]] = {
    "config": ("lrattnres.config", "print the resolved, validated configuration of a scale"),
    "memory": ("lrattnres.memory_cli", "the estimated GPU memory of each size's training ranks"),
    "jobs": ("lrattnres.jobs_cli", "what each training job asks of a cluster: placement, wall time, signal"),
    "accounting": ("lrattnres.accounting", "Appendix F: FLOPs, parameters and memory"),
    "corpus-pack": ("lrattnres.data.docs", "extract installed documentation into an offline text pack"),
    "prepare-data": ("lrattnres.data.cli", "tokenise a corpus into token shards and a manifest"),
    "train": ("lrattnres.train.cli", "train one model (resumable)"),
    "summarize-grid": ("lrattnres.grid", "collect the training runs of a scale into the grid result"),
    "recipe": ("lrattnres.recipe", "the learning-rate check and the noise at the chosen rates, from runs or pieces"),
    "convert": ("lrattnres.convert", "convert a standard AttnRes checkpoint to LR-AttnRes"),
    "evaluate": ("lrattnres.evaluate.cli", "zero-shot downstream evaluation with lm-eval"),
    "evaluate-pairs": ("lrattnres.evaluate.pairs", "the size-pair accuracy claims from the evaluations"),
    "evaluate-tasks": ("lrattnres.evaluate.tasks", "write the offline downstream tasks for lm-eval's --include_path"),
    "lm-eval": ("lrattnres.evaluate.lm_eval_cli", "lm-eval's own command line, with the lrattnres model registered"),
    "kernel-check": ("lrattnres.kernel_check", "the fused routing kernel against the reference"),
    "kernel-reads": ("lrattnres.kernel_reads", "Appendix I on a trained model: every routing read"),
    "throughput": ("lrattnres.throughput.cli", "training-step throughput with the paper's protocol"),
    "diagnostics": ("lrattnres.diagnostics", "routing diagnostics: N_eff, heatmaps, grad norms"),
    "piece": ("lrattnres.pieces", "run a scale in pieces that continue each other across machines"),
    "report": ("lrattnres.report", "render reports/paper.html and reports/paper.json"),
}


def _usage() -> str:
    width = max(map(len, STAGES))
    lines = ["usage: python -m lrattnres <stage> [args]", "", "stages:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in STAGES.items()]
    return "\n".join(lines)


def _job_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options before the stage name: ``--job-log PATH``, ``--attempt N``, ``--code C``,
    ``--gpu-slots S/K``.
    (Their names are no prefix of a torchrun option: torchrun would take ``--log`` for ``--log-dir``
    although it comes after ``-m lrattnres``.)"""
    p = argparse.ArgumentParser(prog="python -m lrattnres", add_help=False, allow_abbrev=False)
    p.add_argument("--job-log", dest="log", default=None)
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--gpu-slots", default=None)
    p.add_argument("--code", default=None)
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        i += 1 if "=" in argv[i] else 2
    return p.parse_args(argv[:i]), argv[i:]


def run_stage(stage: str, rest: list[str]) -> int:
    """Run one stage; user errors and a full disk become one line on stderr and exit code 2."""
    quiet_library_bars()
    try:
        module = importlib.import_module(STAGES[stage][0])
        return int(module.main(rest) or 0)
    except DiskFull as e:
        print(f"{stage}: {e}", file=sys.stderr)
    except (UserError, FileNotFoundError) as e:
        print(f"{stage}: {one_line(e)}", file=sys.stderr)
    except OSError as e:
        if not is_disk_full(e):
            raise
        print(f"{stage}: no space left on device: {e.filename or '(a file this stage writes)'}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    opts, argv = _job_options(argv)
    if not argv or argv[0] not in STAGES:
        print(f"unknown stage {argv[0] if argv else ''!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    stage, rest = argv[0], argv[1:]
    if opts.gpu_slots:
        slots, _, per_gpu = opts.gpu_slots.partition("/")
        gpus.claim(int(slots), int(per_gpu or 1), say=lambda m: print(m, file=sys.stderr, flush=True))
    if opts.log is None:
        return run_stage(stage, rest)

    of_code = f", code {opts.code}" if opts.code else ""
    print(f"[lrattnres] {stage}: attempt {opts.attempt}{of_code}, started {now()}", file=sys.stderr, flush=True)
    attempts.keep_log(opts.log, opts.attempt)
    refused = attempts.refusal(stage, opts.attempt, opts.log)
    if refused is not None:
        print(refused[1], file=sys.stderr)
        return refused[0]
    attempts.record(opts.log, stage, opts.attempt, "running")
    code, status = 1, "exited"
    try:
        code = run_stage(stage, rest)
    except KeyboardInterrupt:
        code, status = 130, "interrupted"
        raise
    finally:
        attempts.record(opts.log, stage, opts.attempt, status, code)
    return code
