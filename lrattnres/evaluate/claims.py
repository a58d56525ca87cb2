"""Claim ids of ``reports/published.yaml`` that the evaluate stage produces.

Per run (``task_claims``): ``table8.acc.<size>.<method>.<task>``, ``table8.acc.<size>.<method>.mean``
and ``table1.avg_acc.<size>.<method>`` for ``method`` in {attnres, lr} and ``size`` the paper size
the run stands for (1b, 4b; small scales map their size pair onto these with ``--claim-size``).

Per size pair (``pair_claims``, computed by the evaluate-pairs stage from two evaluate results):
``sec4.5.avg_acc_gain.<size>`` (LR mean minus AttnRes mean, percentage points) and
``sec4.5.lr_higher_acc.<size>`` (the same gain with its standard error, judged by its interval). ``lr_above_attnres_each_pair``
gives the direction "LR-AttnRes mean above AttnRes mean at each size pair" over all pairs.

Only ids present in the published file are emitted.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

from lrattnres.evaluate.tasks import TASK_NAMES

PAPER_SIZES = ("1b", "4b")
PAIR_METHODS = ("attnres", "lr")
DEFAULT_PUBLISHED = Path(__file__).resolve().parents[2] / "reports" / "published.yaml"


def published_ids(path: str | Path | None = None) -> set[str] | None:
    """The claim ids of the published file, or None when it does not exist."""
    path = Path(path) if path is not None else DEFAULT_PUBLISHED
    if not path.exists():
        return None
    import yaml

    recs = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    if isinstance(recs, dict):  # tolerate {"claims": [...]}
        recs = recs.get("claims", [])
    return {str(r["id"]) for r in recs if isinstance(r, dict) and "id" in r}


def _scope_note(result: dict) -> str:
    lim = result.get("limit")
    rows = "complete splits" if lim is None else f"{lim} rows per task (seeded subsample, seed {result.get('seed', 0)})"
    stand_in = result.get("claim_size")
    size = result.get("size")
    who = f"{size} {result.get('method')} run"
    if stand_in and size != stand_in:
        who += f" standing in for the paper's {stand_in.upper()}"
    return f"{who}; {rows}"


def task_claims(result: dict, ids: set[str] | None) -> dict[str, dict]:
    """Claims of one evaluate result (``result['claim_size']`` set, method attnres or lr)."""
    size, method = result.get("claim_size"), result.get("method")
    if ids is None or size not in PAPER_SIZES or method not in PAIR_METHODS:
        return {}
    note = _scope_note(result)
    out: dict[str, dict] = {}
    for task, rec in result.get("tasks", {}).items():
        cid = f"table8.acc.{size}.{method}.{task}"
        if cid in ids and rec.get("value") is not None:
            out[cid] = {"reproduced": rec["value"], "note": f"{rec['metric']} over {rec['n']} items; {note}"}
    if result.get("mean") is not None and all(t in result.get("tasks", {}) for t in TASK_NAMES):
        for cid in (f"table8.acc.{size}.{method}.mean", f"table1.avg_acc.{size}.{method}"):
            if cid in ids:
                out[cid] = {"reproduced": result["mean"], "note": f"equal-weight mean of the eight tasks; {note}"}
    return out


def _pairs(results: Iterable[dict]) -> dict[str, dict[str, dict]]:
    """{size: {method: result}} over results with both a paper size and a pair method; the last
    result of a (size, method) wins."""
    pairs: dict[str, dict[str, dict]] = {}
    for r in results:
        size = r.get("claim_size") or r.get("size")
        if r.get("method") in PAIR_METHODS and r.get("mean") is not None:
            pairs.setdefault(str(size), {})[r["method"]] = r
    return pairs


def gain_stderr(lr: dict, attnres: dict) -> float | None:
    """Standard error (percentage points) of the eight-task mean accuracy gain LR - AttnRes:
    sqrt(sum over tasks of both runs' binomial standard errors squared) / 8.  The runs answer the same
    items, so this unpaired error is conservative.  None when a task lacks a standard error."""
    ses = []
    for t in TASK_NAMES:
        for r in (lr, attnres):
            se = (r.get("tasks", {}).get(t) or {}).get("stderr")
            if se is None:
                return None
            ses.append(float(se))
    return math.sqrt(sum(x * x for x in ses)) / len(TASK_NAMES)


def pair_claims(results: Iterable[dict], ids: set[str] | None = None) -> dict[str, dict]:
    """``sec4.5.avg_acc_gain.<size>`` (value) and ``sec4.5.lr_higher_acc.<size>`` (direction: the gain
    in percentage points with its standard error, :func:`gain_stderr`) from evaluate results."""
    out: dict[str, dict] = {}
    for size, by in _pairs(results).items():
        if not all(m in by for m in PAIR_METHODS):
            continue
        lr, ar = by["lr"], by["attnres"]
        gain = lr["mean"] - ar["mean"]
        note = f"LR {lr['mean']:.2f} vs AttnRes {ar['mean']:.2f} ({_scope_note(lr)})"
        if ids is None or f"sec4.5.avg_acc_gain.{size}" in ids:
            out[f"sec4.5.avg_acc_gain.{size}"] = {"reproduced": gain, "note": note}
        if ids is None or f"sec4.5.lr_higher_acc.{size}" in ids:
            se = gain_stderr(lr, ar)
            ev = {} if se is None else {"se": se, "n": sum(int((lr.get("tasks", {}).get(t) or {}).get("n") or 0)
                                                          for t in TASK_NAMES)}
            how = ("; binomial standard errors of both runs, unpaired (conservative)" if se is not None
                   else "; no standard errors in the results")
            out[f"sec4.5.lr_higher_acc.{size}"] = {"reproduced": gain, "note": note + how, **ev}
    return out


def lr_above_attnres_each_pair(results: Iterable[dict]) -> dict[str, Any]:
    """Direction "LR-AttnRes mean above AttnRes mean at each size pair".

    Returns ``{"reproduced": bool | None, "pairs": {size: {"lr", "attnres", "gain"}}, "note"}``;
    ``reproduced`` is None when no complete pair exists.
    """
    pairs = {}
    for size, by in sorted(_pairs(results).items()):
        if all(m in by for m in PAIR_METHODS):
            lr, ar = by["lr"]["mean"], by["attnres"]["mean"]
            pairs[size] = {"lr": lr, "attnres": ar, "gain": lr - ar}
    if not pairs:
        return {"reproduced": None, "pairs": {}, "note": "no size pair with both an LR-AttnRes and an AttnRes result"}
    ok = all(p["gain"] > 0 for p in pairs.values())
    detail = ", ".join(f"{s}: {p['lr']:.2f} vs {p['attnres']:.2f}" for s, p in pairs.items())
    return {"reproduced": ok, "pairs": pairs, "note": f"LR vs AttnRes eight-task mean: {detail}"}
