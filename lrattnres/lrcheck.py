"""The learning-rate check: a scale's rates chosen on the baseline alone, by a rule fixed in advance.

A scale below the paper's trains far fewer, smaller updates than the paper tuned its rates for (the
gpu scale: 1,500 updates of 16,384 tokens at d = 384, against 38,146 of 262,144 at d = 1024). Its
``grid.lr_check`` trains the main preset's baseline, seed 0, at several multiples of a reference
pair of rates (the paper's: Muon 1e-3, Adam 3e-4), Muon's and Adam's scaled together, with
everything else of the scale's recipe kept (schedule shape, warm-up, z-loss, clipping). The runs
are planned by :mod:`lrattnres.gridplan` (``<preset>-baseline-lrx<multiplier>-s0``) and summarised
here into the grid result's ``lr_check``.

The rule (:data:`RULE`, stated in config.yaml and docs/gpu-scale.md before any run):

1. A multiplier is *eligible* when its run made every update (no ``stopped``: no non-finite loss or
   gradient norm), has a finite final validation CE, and recorded no gradient-norm outlier
   (``grad_norm.outliers`` of its result; a trainer that records none is judged on the first two).
2. The eligible multiplier with the lowest final validation CE is the lowest. Every eligible
   multiplier within ``tie_margin`` nats of it is a near-tie, and the smallest multiplier among them
   wins: at a near-tie the slower rate leaves more room before divergence for every method.
3. No eligible multiplier: no winner; the scale cannot take its rates from the check.
4. A winner at the largest multiplier is shown as being at the grid's edge; the grid is not
   extended after the runs.

Every method then trains with the winner's rates, unchanged: the scale's ``recipe`` in config.yaml
is set to them, and :func:`configured` compares the configured rates with the winner, so that the
report flags a scale whose runs do not use the check's rates.
"""

from __future__ import annotations

import math
from typing import Any

from lrattnres.checks import is_number

RULE = (
    "A multiplier is eligible when its run made every update (no non-finite loss or gradient norm), has a "
    "finite final validation CE, and recorded no gradient-norm outlier.",
    "The eligible multiplier with the lowest final validation CE wins; eligible multipliers within the tie "
    "margin of that CE are near-ties, and the smallest of them wins.",
    "No eligible multiplier: no winner. A winner at the largest multiplier is shown as at the grid's edge; "
    "the grid is not extended after the runs.",
)
# Relative tolerance when comparing configured rates with a multiple of the reference (floating point).
REL_TOL = 1e-9


def settings_of(settings: dict) -> dict | None:
    """The scale's check settings (``grid.lr_check``), or None when the scale has no check."""
    return (settings.get("grid") or {}).get("lr_check") or None


def max_norm(row: dict) -> float | None:
    """The run's largest gradient norm: the trainer's ``grad_norm.max`` where it records one, else
    the largest finite norm of its per-update trace."""
    g = row.get("grad_norm") or {}
    if is_number(g.get("max")):
        return float(g["max"])
    finite = [x for x in row.get("grad_norm_trace") or [] if is_number(x) and math.isfinite(x)]
    return max(finite) if finite else None


def outliers(row: dict) -> list[dict] | None:
    """The run's recorded gradient-norm outliers (``{"update", "norm", "median"}`` each), or None when
    its trainer records none."""
    g = row.get("grad_norm") or {}
    found = g.get("outliers")
    return list(found) if isinstance(found, list) else None


def _status(row: dict | None) -> tuple[str, str]:
    """(status, why) of one multiplier's run: eligible | diverged | outliers | not run."""
    if row is None:
        return "not run", "no result yet"
    stopped = row.get("stopped")
    if stopped:
        return "diverged", stopped.get("reason") or f"stopped at update {stopped.get('update')}"
    if not is_number(row.get("final_val_ce")) or not math.isfinite(row["final_val_ce"]):
        return "diverged", row.get("problem") or "no finite final validation CE"
    found = outliers(row)
    if found:
        return "outliers", f"{len(found)} gradient-norm outlier(s), first at update {found[0].get('update')}"
    return "eligible", ""


def choose(rows: list[dict], tie_margin: float) -> dict | None:
    """The winner among ``rows`` (``multiplier``, ``final_val_ce``, ``status``) by the rule, or None
    without an eligible row: ``{"multiplier", "final_val_ce", "lowest", "near_ties", "edge"}``."""
    eligible = [r for r in rows if r["status"] == "eligible"]
    if not eligible:
        return None
    lowest = min(eligible, key=lambda r: (r["final_val_ce"], r["multiplier"]))
    # within the margin, inclusive (1e-12: a difference of two printed losses is not exact in binary)
    ties = sorted((r for r in eligible if r["final_val_ce"] - lowest["final_val_ce"] <= tie_margin + 1e-12),
                  key=lambda r: r["multiplier"])
    win = ties[0]
    return {"multiplier": win["multiplier"], "run_id": win.get("run_id"), "final_val_ce": win["final_val_ce"],
            "muon_lr": win.get("muon_lr"), "adam_lr": win.get("adam_lr"),
            "lowest": {"multiplier": lowest["multiplier"], "final_val_ce": lowest["final_val_ce"]},
            "near_ties": [r["multiplier"] for r in ties],
            "edge": win["multiplier"] == max(r["multiplier"] for r in rows)}


def multiple_of(rates: dict, reference: dict) -> float | None:
    """k when Muon's and Adam's rates are both k times the reference's (within rounding), else None."""
    try:
        k = rates["muon"] / reference["muon"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return k if math.isclose(rates["adam"], reference["adam"] * k, rel_tol=REL_TOL) else None


def configured(settings: dict, check: dict, winner: dict | None) -> dict[str, Any]:
    """The scale's configured rates against the check's winner: ``{"muon_lr", "adam_lr", "multiplier"
    (of the reference, or None), "matches_winner" (None without a winner), "note"}``."""
    optim = (settings.get("recipe") or {}).get("optim") or {}
    rates = {"muon": (optim.get("muon") or {}).get("lr"), "adam": (optim.get("adam") or {}).get("lr")}
    k = multiple_of(rates, check["reference"])
    out = {"muon_lr": rates["muon"], "adam_lr": rates["adam"], "multiplier": k, "matches_winner": None}
    where = f"the scale's recipe (Muon {rates['muon']:g}, Adam {rates['adam']:g}"
    where += f", x{k:g} of the reference)" if k is not None else ", no common multiple of the reference)"
    if winner is None:
        out["note"] = f"{where}: the check has no winner to compare with"
        return out
    want = {g: check["reference"][g] * winner["multiplier"] for g in ("muon", "adam")}
    same = all(math.isclose(rates[g], want[g], rel_tol=REL_TOL) for g in want)
    out["matches_winner"] = same
    out["note"] = (f"{where} are the check's winner (x{winner['multiplier']:g})" if same else
                   f"{where} are not the check's winner x{winner['multiplier']:g} (Muon {want['muon']:g}, Adam "
                   f"{want['adam']:g}): set scales.{settings.get('scale')}.recipe.optim to the winner's rates")
    return out


def summarize(settings: dict, rows: list[dict]) -> dict[str, Any] | None:
    """The check's result from its runs' grid rows (lrattnres/grid.py ``run_row``; a multiplier without
    a row has not run), or None at a scale without a check.

    ``state``: "not run" (no run has a result), "incomplete" (some have), "done"."""
    check = settings_of(settings)
    if check is None:
        return None
    by_scale = {float(r["lr_scale"]): r for r in rows if r.get("lr_scale") is not None}
    table = []
    for m in check["multipliers"]:
        m = float(m)
        row = by_scale.get(m)
        status, why = _status(row)
        found = outliers(row) if row else None
        table.append({
            "multiplier": m, "run_id": row["run_id"] if row else None,
            "muon_lr": check["reference"]["muon"] * m, "adam_lr": check["reference"]["adam"] * m,
            "final_val_ce": row.get("final_val_ce") if row else None,
            "above_clip_pct": ((row.get("grad_norm") or {}).get("above_clip_pct")) if row else None,
            "max_grad_norm": max_norm(row) if row else None,
            "outliers": found, "outliers_recorded": found is not None,
            "stopped": row.get("stopped") if row else None,
            "status": status, "why": why,
        })
    missing = sum(r["status"] == "not run" for r in table)
    state = "not run" if missing == len(table) else "incomplete" if missing else "done"
    winner = choose(table, check["tie_margin"]) if state == "done" else None
    return {"state": state, "reference": dict(check["reference"]), "multipliers": [float(m) for m in check["multipliers"]],
            "tie_margin": check["tie_margin"], "rule": list(RULE), "runs": table, "winner": winner,
            "configured": configured(settings, check, winner)}


def describe(result: dict | None) -> list[str]:
    """The check's result as lines of text (the ``recipe`` command and logs)."""
    if result is None:
        return ["no learning-rate check at this scale (grid.lr_check)"]
    ref = result["reference"]
    lines = [f"learning-rate check: baseline at multiples of Muon {ref['muon']:g}, Adam {ref['adam']:g} "
             f"({result['state']}); tie margin {result['tie_margin']:g} nats",
             f"{'x':>6} {'Muon':>9} {'Adam':>9} {'val CE':>8} {'clipped':>8} {'max norm':>9}  status"]
    for r in result["runs"]:
        ce = "–" if r["final_val_ce"] is None else f"{r['final_val_ce']:.4f}"
        clip = "–" if r["above_clip_pct"] is None else f"{r['above_clip_pct']:.1f}%"
        mx = "–" if r["max_grad_norm"] is None else f"{r['max_grad_norm']:.3g}"
        lines.append(f"{r['multiplier']:>6g} {r['muon_lr']:>9.3g} {r['adam_lr']:>9.3g} {ce:>8} {clip:>8} {mx:>9}  "
                     f"{r['status']}" + (f" ({r['why']})" if r["why"] else ""))
    w = result["winner"]
    if w is not None:
        lines.append(f"winner: x{w['multiplier']:g} (Muon {w['muon_lr']:g}, Adam {w['adam_lr']:g}), final val CE "
                     f"{w['final_val_ce']:.4f}; near-ties {', '.join(f'x{m:g}' for m in w['near_ties'])}"
                     + ("; at the grid's edge" if w["edge"] else ""))
    elif result["state"] == "done":
        lines.append("no eligible multiplier: the check has no winner")
    lines.append(result["configured"]["note"])
    return lines
