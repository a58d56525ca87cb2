"""The scale's noise at its chosen recipe, measured on the seed pairs, and the rule that sizes them.

From the grid's rows (lrattnres/grid.py) this gives the grid result's ``noise``:

- per run of the headline pair's seeds and the baseline: the share of updates clipped
  (``grad_norm.above_clip_pct`` of its result), its largest gradient norm and its recorded
  gradient-norm outliers, each flagged where the clipped share reaches half the updates or an
  outlier was recorded;
- the baseline at the configured rates against the learning-rate check's x1 run (the reference
  rates: the paper's), the difference of their final validation CE; and against the check's run at
  the configured multiple, which has the baseline's spec and seed: the two repeat one run, and their
  difference is the device's own run-to-run noise;
- the paired differences of the headline pair (LR-AttnRes minus AttnRes, same seed), their SD with
  its chi-square interval (:func:`lrattnres.stats.sd_interval`) and n;
- the rule of ``grid.noise``: where that SD exceeds ``max_paired_sd`` nats, the headline pair needs
  ``seeds`` seeds (``grid.seeds`` sets the headline pair's seeds only: no other run changes).

What each claim could resolve at this noise is its ``mdd`` (lrattnres/claims.py).
"""

from __future__ import annotations

import math
from typing import Any

from lrattnres import lrcheck, stats
from lrattnres.checks import is_number

# A run whose updates are clipped this often (percent) or more is flagged: its clipping shapes the
# update more than the rates do.
CLIPPED_FLAG_PCT = 50.0


def _finite(x) -> bool:
    return is_number(x) and math.isfinite(x)


def run_health(row: dict) -> dict[str, Any]:
    """One run's clipped share, largest norm and outliers, with the flags the report shows."""
    found = lrcheck.outliers(row)
    clipped = (row.get("grad_norm") or {}).get("above_clip_pct")
    flags = []
    if _finite(clipped) and clipped >= CLIPPED_FLAG_PCT:
        flags.append(f"{clipped:.0f}% of updates clipped")
    if found:
        flags.append(f"{len(found)} gradient-norm outlier(s)")
    if row.get("stopped"):
        flags.append("stopped on a non-finite loss")
    return {"run_id": row["run_id"], "method": row["method"], "seed": row["seed"], "roles": list(row.get("roles", [])),
            "final_val_ce": row.get("final_val_ce"), "above_clip_pct": clipped, "max_grad_norm": lrcheck.max_norm(row),
            "outliers": found, "outliers_recorded": found is not None, "flags": flags}


def headline_pairs(settings: dict, rows: list[dict]) -> list[dict]:
    """``[{"seed", "lr", "attnres", "difference"}]``: the headline pair's final validation CEs per seed
    where both ran, difference = LR-AttnRes minus AttnRes."""
    main = settings["presets"]["main"]
    lr = {r["seed"]: r["final_val_ce"] for r in rows if r["preset"] == main and "seeds" in r["roles"]
          and r["method"] == "lr" and _finite(r.get("final_val_ce"))}
    at = {r["seed"]: r["final_val_ce"] for r in rows if r["preset"] == main and "seeds" in r["roles"]
          and r["method"] == "attnres" and _finite(r.get("final_val_ce"))}
    return [{"seed": s, "lr": lr[s], "attnres": at[s], "difference": lr[s] - at[s]} for s in sorted(set(lr) & set(at))]


def paired_noise(pairs: list[dict], level: float = stats.LEVEL) -> dict[str, Any]:
    """n, mean, SD and the SD's chi-square interval of the paired differences."""
    diffs = [p["difference"] for p in pairs]
    n = len(diffs)
    out: dict[str, Any] = {"n": n, "mean": None, "sd": None, "sd_interval": None, "level": level}
    if n:
        out["mean"] = math.fsum(diffs) / n
    if n >= 2:
        sd = stats.mean_interval(diffs)["sd"]
        out.update(sd=sd, sd_interval=stats.sd_interval(sd, n, level))
    return out


def seeds_rule(settings: dict, paired: dict) -> dict[str, Any] | None:
    """The rule of ``grid.noise`` evaluated on the paired SD, or None where the scale states none."""
    rule = (settings.get("grid") or {}).get("noise")
    if not rule:
        return None
    planned = int(settings["grid"].get("seeds", 1))
    out = {"max_paired_sd": rule["max_paired_sd"], "seeds": rule["seeds"], "planned_seeds": planned,
           "exceeded": None}
    sd = paired.get("sd")
    if sd is None:
        out["text"] = (f"not evaluated: {paired['n']} seed pair(s), an SD needs two "
                       f"(rule: above {rule['max_paired_sd']:g} nats, {rule['seeds']} seeds)")
        return out
    out["exceeded"] = sd > rule["max_paired_sd"]
    if not out["exceeded"]:
        out["text"] = (f"SD of the paired differences {sd:.4f} <= {rule['max_paired_sd']:g} nats: "
                       f"{planned} seeds are enough")
    elif planned >= rule["seeds"]:
        out["text"] = (f"SD of the paired differences {sd:.4f} > {rule['max_paired_sd']:g} nats: the headline pair "
                       f"needs {rule['seeds']} seeds, and the scale runs {planned}")
    else:
        out["text"] = (f"SD of the paired differences {sd:.4f} > {rule['max_paired_sd']:g} nats: the headline pair "
                       f"needs {rule['seeds']} seeds; the scale runs {planned} (set grid.seeds: {rule['seeds']}, "
                       "docs/gpu-scale.md)")
    return out


def against_reference(settings: dict, rows: list[dict], check: dict | None) -> dict[str, Any] | None:
    """The baseline at the configured rates against the check's x1 run (the reference rates), or
    None without both."""
    if not check:
        return None
    ref = next((r for r in check["runs"] if r["multiplier"] == 1.0), None)
    main = settings["presets"]["main"]
    base = next((r for r in rows if r["preset"] == main and r["method"] == "baseline" and r["seed"] == 0
                 and "baseline" in r["roles"]), None)
    if ref is None or base is None:
        return None
    k = check["configured"]["multiplier"]
    out = {"baseline_run": base["run_id"], "final_val_ce": base.get("final_val_ce"), "reference_run": ref["run_id"],
           "reference_final_val_ce": ref["final_val_ce"], "configured_multiplier": k, "difference": None,
           "repeat_run": None, "repeat_final_val_ce": None, "repeat_difference": None}
    if _finite(out["final_val_ce"]) and _finite(out["reference_final_val_ce"]):
        out["difference"] = out["final_val_ce"] - out["reference_final_val_ce"]
    # the check's run at the configured multiple has the baseline's spec and seed: the two repeat one run
    same = next((r for r in check["runs"] if k is not None and math.isclose(r["multiplier"], k, rel_tol=lrcheck.REL_TOL)), None)
    if same is not None and same["run_id"]:
        out.update(repeat_run=same["run_id"], repeat_final_val_ce=same["final_val_ce"])
        if _finite(out["final_val_ce"]) and _finite(same["final_val_ce"]):
            out["repeat_difference"] = out["final_val_ce"] - same["final_val_ce"]
    return out


def summarize(settings: dict, rows: list[dict], check: dict | None) -> dict[str, Any]:
    """The grid result's ``noise`` from the grid's rows (without the check's runs) and the check's
    result (:func:`lrattnres.lrcheck.summarize`)."""
    main = settings["presets"]["main"]
    watched = [r for r in rows if r["preset"] == main and ("seeds" in r["roles"] or "baseline" in r["roles"])]
    pairs = headline_pairs(settings, rows)
    paired = paired_noise(pairs)
    return {"runs": [run_health(r) for r in watched], "pairs": pairs, "paired": paired,
            "rule": seeds_rule(settings, paired), "against_reference": against_reference(settings, rows, check)}


def describe(result: dict) -> list[str]:
    """The noise summary as lines of text (the ``recipe`` command)."""
    lines = ["noise at the configured recipe:"]
    for r in result["runs"]:
        clip = "–" if r["above_clip_pct"] is None else f"{r['above_clip_pct']:.1f}%"
        ce = "–" if not _finite(r["final_val_ce"]) else f"{r['final_val_ce']:.4f}"
        mx = "–" if r["max_grad_norm"] is None else f"{r['max_grad_norm']:.3g}"
        out = "not recorded" if not r["outliers_recorded"] else str(len(r["outliers"]))
        lines.append(f"  {r['run_id']}: val CE {ce}, clipped {clip}, max norm {mx}, outliers {out}"
                     + (f"  [{'; '.join(r['flags'])}]" if r["flags"] else ""))
    ref = result.get("against_reference")
    if ref and ref["difference"] is not None:
        lines.append(f"  baseline {ref['final_val_ce']:.4f} against the reference rates' {ref['reference_final_val_ce']:.4f}: "
                     f"{ref['difference']:+.4f} nats")
    if ref and ref["repeat_difference"] is not None:
        lines.append(f"  the baseline repeats {ref['repeat_run']} (same spec and seed): {ref['repeat_difference']:+.4f} nats")
    p = result["paired"]
    if p["sd"] is not None:
        lo, hi = p["sd_interval"]
        lines.append(f"  paired differences (LR-AttnRes minus AttnRes): mean {p['mean']:+.4f}, SD {p['sd']:.4f} "
                     f"[{lo:.4f}, {hi:.4f}] (95%, chi-square), n = {p['n']}")
    else:
        lines.append(f"  paired differences: n = {p['n']}, no SD")
    if result.get("rule"):
        lines.append(f"  rule: {result['rule']['text']}")
    return lines
