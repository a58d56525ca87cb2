"""Gradient-norm outliers of training runs, for the stages and the report that rest on the runs.

The trainer's guard (lrattnres/train/guard.py) records every pre-clip gradient norm far above its
running median, or not finite, in the run's ``result.json`` (``grad_norm.outliers``).  A run with any
outlier may have computed wrong gradients: a fault of a compiled path shows in the norm while the
loss keeps falling (docs/attention.md).  So the report flags such a run where it lists runs, and a
claim whose verdict rests on it says so in its note: the grid stage finds exactly which of its
claims rest on the run (lrattnres/grid.py), and for the claims of the stages that read trained
weights (conversion, evaluation, diagnostics, the per-run kernel check) :func:`annotate_claims`
names the flagged runs among those the stage read.

A result written before the guard existed has no ``outliers``; its run's per-update norms
(metrics.jsonl) are replayed through the guard with its default settings instead, and the row says so.
"""

from __future__ import annotations

import math
from typing import Any

from lrattnres.train.guard import GradGuard

FROM_RESULT = "result.json"
FROM_REPLAY = "metrics.jsonl, the guard replayed with its default settings"


def as_float(x: Any) -> float:
    """A norm from JSON: numbers as they are, "nan"/"inf" strings (metrics.jsonl) as floats."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def run_outliers(result: dict | None, trace: list | None = None) -> tuple[list[dict], str | None]:
    """``(outliers, source)`` of one run: result.json's ``grad_norm.outliers`` where it has them;
    else the guard (default settings) replayed over ``trace``, the run's per-update norms in order;
    ``([], None)`` with neither."""
    gn = (result or {}).get("grad_norm") if isinstance(result, dict) else None
    if isinstance(gn, dict) and isinstance(gn.get("outliers"), list):
        return [dict(e) for e in gn["outliers"] if isinstance(e, dict)], FROM_RESULT
    if trace:
        guard = GradGuard()
        guard.replay([as_float(x) for x in trace])
        return guard.outliers, FROM_REPLAY
    return [], None


def worst(outliers: list[dict]) -> dict:
    """The outlier with the largest norm (a non-finite one first)."""
    def key(e):
        n = as_float(e.get("norm"))
        return (not math.isfinite(n), n if math.isfinite(n) else 0.0)

    return max(outliers, key=key)


def describe(outliers: list[dict]) -> str:
    """"3 gradient-norm outliers, the largest 2.1e+09 at update 43 (running median 1.8)"."""
    w = worst(outliers)
    n = len(outliers)
    med = w.get("median")
    median = "" if med is None else f" (running median {as_float(med):.3g})"
    return (f"{n} gradient-norm outlier{'s' if n != 1 else ''}, the largest {as_float(w.get('norm')):.3g} at update "
            f"{w.get('update')}{median}")


def note(run_id: str, outliers: list[dict]) -> str:
    """What a claim resting on a flagged run adds to its note."""
    return f"rests on {run_id}, whose training had {describe(outliers)}: its gradients may be wrong"


def flagged_runs(grid_results: list[dict]) -> dict[str, list[dict]]:
    """Run id -> outliers of every run with any, from the grid results' run tables
    (lrattnres/grid.py puts each run's ``grad_outliers`` in its row)."""
    out: dict[str, list[dict]] = {}
    for grid in grid_results:
        for row in grid.get("runs") or []:
            if isinstance(row, dict) and isinstance(row.get("run_id"), str) and row.get("grad_outliers"):
                out[row["run_id"]] = row["grad_outliers"]
    return out


def runs_of(result: dict) -> set[str]:
    """The training runs a stage result rests on, as it names them: ``run_id``, ``runs`` (a mapping
    by run id, or a list of run ids or of rows with ``run_id``), ``conversions`` (rows with
    ``run_id``)."""
    ids: set[str] = set()
    if isinstance(result.get("run_id"), str):
        ids.add(result["run_id"])
    runs = result.get("runs")
    if isinstance(runs, dict):
        ids.update(k for k in runs if isinstance(k, str))
    for key in ("runs", "conversions"):
        if isinstance(result.get(key), list):
            for r in result[key]:
                rid = r.get("run_id") if isinstance(r, dict) else r
                if isinstance(rid, str):
                    ids.add(rid)
    return ids


def annotate_claims(produced: dict[str, dict], results: list[dict], flagged: dict[str, list[dict]],
                    skip_stages: tuple[str, ...] = ("grid",)) -> list[str]:
    """Add to the note of every produced claim of ``results`` (but those of ``skip_stages``, which
    name their own) the flagged runs among the runs its result rests on; returns the claim ids
    annotated.  ``produced``: the merged claims of the report (changed in place)."""
    done = []
    for result in results:
        if result.get("stage") in skip_stages or not isinstance(result.get("claims"), dict):
            continue
        hit = sorted(runs_of(result) & set(flagged))
        if not hit:
            continue
        text = ("computed from runs that include " + "; ".join(f"{r} ({describe(flagged[r])})" for r in hit)
                + ": their gradients may be wrong")
        for cid in result["claims"]:
            if cid in produced:
                old = produced[cid].get("note")
                produced[cid] = {**produced[cid], "note": f"{old}; {text}" if old else text}
                done.append(cid)
    return done
