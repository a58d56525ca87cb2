"""Run lm-eval on the materialised tasks with an adapter and summarise the metrics of Appendix G."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from lrattnres.evaluate.tasks import TASK_NAMES, TASKS, materialise

log = logging.getLogger("lrattnres.evaluate")


def binomial_stderr(p: float, n: int) -> float | None:
    """Standard error of a mean of n 0/1 scores (lm-eval's mean_stderr: sample SD / sqrt(n))."""
    if n < 2:
        return None
    return math.sqrt(max(p * (1 - p), 0.0) / (n - 1))


def run_eval(
    lm,
    tasks: list[str] | None = None,
    *,
    cache_dir: str | Path,
    limit: int | None = None,
    seed: int = 0,
    source: str = "offline",
) -> dict[str, Any]:
    """Zero-shot lm-eval over ``tasks`` (default: the eight of Appendix G).

    Returns ``{"tasks": {task: {"metric", "value" (percent), "stderr" (percent), "n"}}, "mean"
    (percent, equal weights, only when all eight tasks ran), "requests", "requests_per_s", "wall_s",
    "materialised": {...}}``.
    """
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    tasks = list(tasks or TASK_NAMES)
    mat = materialise(tasks, cache_dir, limit=limit, seed=seed, source=source)
    tm = TaskManager(include_path=mat["yaml_dir"], include_defaults=False)
    samples = None  # offline: the subsample is in the data files
    if source == "hub":
        samples = {t: i["samples"] for t, i in mat["tasks"].items() if i.get("samples") is not None} or None
    t0 = time.perf_counter()
    req0, fwd0 = lm.stats["requests"], lm.stats["forward_s"]
    res = evaluator.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=0,
        task_manager=tm,
        samples=samples,
        bootstrap_iters=0,
        log_samples=False,
        apply_chat_template=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    wall = time.perf_counter() - t0
    out_tasks: dict[str, dict] = {}
    for name in tasks:
        metric = TASKS[name].metric
        r = res["results"].get(name)
        if r is None:
            raise RuntimeError(f"lm-eval returned no result for task {name!r}")
        value = float(r[f"{metric},none"])
        n = int(res.get("n-samples", {}).get(name, {}).get("effective", mat["tasks"][name]["rows"]))
        se = binomial_stderr(value, n)
        out_tasks[name] = {
            "metric": metric,
            "value": 100.0 * value,
            "stderr": None if se is None else 100.0 * se,
            "n": n,
            "split": TASKS[name].split,
            "rows_total": mat["tasks"][name]["rows_total"],
        }
    mean = None
    if all(t in out_tasks for t in TASK_NAMES):
        mean = sum(out_tasks[t]["value"] for t in TASK_NAMES) / len(TASK_NAMES)
    reqs = lm.stats["requests"] - req0
    fwd = lm.stats["forward_s"] - fwd0
    return {
        "tasks": out_tasks,
        "mean": mean,
        "requests": reqs,
        "requests_per_s": reqs / fwd if fwd > 0 else None,
        "requests_per_s_wall": reqs / wall if wall > 0 else None,
        "wall_s": wall,
        "materialised": mat,
        "lm_eval_version": _lm_eval_version(),
    }


def _lm_eval_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("lm-eval")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return None
