"""``python -m lrattnres <stage> ...``: one subcommand per pipeline stage.

Each stage lives in its own module with a ``main(argv) -> int``; it is imported only when it runs,
so a cheap stage (accounting, report) does not pay for torch's import.  Before that import, where
stderr is not a terminal (a log file), the libraries' own progress bars are switched off
(``lrattnres.progress.quiet_library_bars``): the stages report progress in plain lines there.
"""

from __future__ import annotations

import importlib
import sys

STAGES: dict[str, tuple[str, str]] = {
    "config": ("lrattnres.config", "print the resolved, validated configuration of a scale"),
    "accounting": ("lrattnres.accounting", "Appendix F: FLOPs, parameters and memory"),
    "corpus-pack": ("lrattnres.data.docs", "extract installed documentation into an offline text pack"),
    "prepare-data": ("lrattnres.data.cli", "tokenise a corpus into token shards and a manifest"),
    "train": ("lrattnres.train.cli", "train one model (resumable)"),
    "summarize-grid": ("lrattnres.grid", "collect the training runs of a scale into the grid result"),
    "convert": ("lrattnres.convert", "convert a standard AttnRes checkpoint to LR-AttnRes"),
    "evaluate": ("lrattnres.evaluate.cli", "zero-shot downstream evaluation with lm-eval"),
    "evaluate-pairs": ("lrattnres.evaluate.pairs", "the size-pair accuracy claims from the evaluations"),
    "evaluate-tasks": ("lrattnres.evaluate.tasks", "write the offline downstream tasks for lm-eval's --include_path"),
    "lm-eval": ("lrattnres.evaluate.lm_eval_cli", "lm-eval's own command line, with the lrattnres model registered"),
    "kernel-check": ("lrattnres.kernel_check", "the fused routing kernel against the reference"),
    "throughput": ("lrattnres.throughput", "training-step throughput with the paper's protocol"),
    "diagnostics": ("lrattnres.diagnostics", "routing diagnostics: N_eff, heatmaps, grad norms"),
    "piece": ("lrattnres.pieces", "run a scale in pieces that continue each other across machines"),
    "report": ("lrattnres.report", "render reports/paper.html and reports/paper.json"),
}


def _usage() -> str:
    width = max(map(len, STAGES))
    lines = ["usage: python -m lrattnres <stage> [args]", "", "stages:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in STAGES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"unknown stage {stage!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from lrattnres.progress import quiet_library_bars

    quiet_library_bars()
    module = importlib.import_module(STAGES[stage][0])
    return int(module.main(rest) or 0)
