"""The figures' data and the claims, from the rows of the analysed runs (no model, no torch): the
``--aggregate`` mode of ``python -m lrattnres diagnostics``."""

from __future__ import annotations

import math
import statistics
from typing import Any

from lrattnres import stats
from lrattnres.diagnostics.settings import DiagnosticsError, validate_settings
from lrattnres.gridplan import CONTROL, HEADLINE_ATTNRES, HEADLINE_LR, PAIR_SIZES, PAPER_D, plan


def _main_seed0(rows: list[dict], settings: dict) -> list[dict]:
    main = settings["presets"]["main"]
    return [r for r in rows if r["preset"] == main and r["seed"] == 0]


def n8_blocks(rows: list[dict], settings: dict):
    """The N that stands for the paper's N = 8: 8 when the main preset has an AttnRes run at N = 8,
    else the headline's N (the paper's headline is N = 8)."""
    seed0 = _main_seed0(rows, settings)
    if any(r["method"] == "attnres" and r["blocks"] == 8 for r in seed0):
        return 8
    h = settings["grid"].get("headline")
    return h["blocks"] if h else None


def _closest(runs: list[dict], target_ratio: float) -> dict | None:
    runs = [r for r in runs if r.get("rank")]
    if not runs:
        return None
    return min(runs, key=lambda r: (abs(math.log(r["r_over_d"] / target_ratio)), r["rank"]))


def fig6_runs(rows: list[dict], settings: dict) -> dict[str, dict | None]:
    """AttnRes, projected and sliced runs at the N = 8 analogue (the paper: r = 32 projected, r = 64
    sliced; otherwise the run of that method whose r/d is closest to the paper's)."""
    N = n8_blocks(rows, settings)
    seed0 = [r for r in _main_seed0(rows, settings) if r["blocks"] == N]
    at = next((r for r in seed0 if r["method"] == "attnres"), None)
    plr = [r for r in seed0 if r["method"] == "plr"]
    lr = [r for r in seed0 if r["method"] == "lr" and r["rank"] < r["d_model"]]
    return {
        "attnres": at,
        "plr": next((r for r in plr if r["paper_row"] == f"plr.n{N}.r32"), None) or _closest(plr, 32 / PAPER_D),
        "lr": next((r for r in lr if r["paper_row"] == f"lr.n{N}.r64"), None) or _closest(lr, 64 / PAPER_D),
    }


def figures_data(rows: list[dict], settings: dict) -> dict[str, Any]:
    seed0 = _main_seed0(rows, settings)
    routed = [r for r in seed0 if r.get("n_eff")]
    full = sorted((r for r in routed if r["blocks"] == "full" and r["method"] in ("lr", "attnres")), key=lambda r: r["rank"])
    fig4 = [{"run_id": r["run_id"], "method": r["method"], "rank": r["rank"], "r_over_d": r["r_over_d"],
             "paper_r": round(r["r_over_d"] * PAPER_D), "n_eff": r["n_eff"]} for r in full]
    N = n8_blocks(rows, settings)
    f6 = fig6_runs(rows, settings)
    fig6 = {"blocks": N, "runs": {m: (None if r is None else {"run_id": r["run_id"], "rank": r["rank"], "n_eff": r["n_eff"]})
                                  for m, r in f6.items()}}
    # full routing: projected runs beside the sliced runs of the same ranks and full AttnRes (C.4's matched pairs)
    plr_full = [r for r in routed if r["method"] == "plr" and r["blocks"] == "full"]
    ranks = {r["rank"] for r in plr_full}
    matched = [r for r in full if r["method"] == "attnres" or r["rank"] in ranks] if plr_full else []
    fig6["full"] = [{"run_id": r["run_id"], "method": r["method"], "rank": r["rank"], "n_eff": r["n_eff"]}
                    for r in sorted(plr_full + matched, key=lambda r: (r["method"], r["rank"]))]
    # Figure 7: mean gradient norm against rank, one series per (method, N); the baseline as a level
    series: dict[str, list] = {}
    for r in seed0:
        if r["method"] == "baseline" or r["grad_norm"]["mean"] is None:
            continue
        if not ({"sweep", "projected", "control"} & set(r["roles"])):
            continue
        key = f"{'lr' if r['method'] == 'attnres' else r['method']}.n{r['blocks']}"  # AttnRes: the sliced r = d end
        series.setdefault(key, []).append({"run_id": r["run_id"], "rank": r["rank"], "r_over_d": r["r_over_d"],
                                           "paper_r": round(r["r_over_d"] * PAPER_D), "mean": r["grad_norm"]["mean"]})
    for pts in series.values():
        pts.sort(key=lambda p: p["rank"])
    base = next((r for r in seed0 if r["method"] == "baseline"), None)
    fig7 = {"baseline": None if base is None else base["grad_norm"]["mean"], "series": series}
    # Figure 8: full routing at three ranks (top row), AttnRes / projected / sliced at N = 8 (bottom)
    low = [r for r in full if r["method"] == "lr"] or full
    top = [low[0], low[len(low) // 2], low[-1]] if len(low) > 3 else low
    fig8 = {"top": list(dict.fromkeys(r["run_id"] for r in top)),
            "bottom": [r["run_id"] for r in (f6["attnres"], f6["plr"], f6["lr"]) if r is not None]}
    # Figure 10 right: the size pair's traces
    fig10: dict[str, dict] = {}
    for role, size in zip(("small", "large"), PAIR_SIZES):
        for r in rows:
            if f"pair-{role}" in r["roles"]:
                fig10.setdefault(size, {})[r["method"]] = {"run_id": r["run_id"], **r["grad_norm_trace"]}
    return {"fig4": fig4, "fig6": fig6, "fig7": fig7, "fig8": fig8, "fig10": fig10}


def run_rows(rows: list[dict], settings: dict) -> dict[str, dict]:
    """Paper row key -> run (main preset, seed 0): grid.paper_row first, then the Section 4.4 roles
    (headline LR and AttnRes, the control) for the paper's N = 8 rows."""
    out: dict[str, dict] = {}
    seed0 = _main_seed0(rows, settings)
    for r in seed0:
        if r["paper_row"] and r["paper_row"] not in out:
            out[r["paper_row"]] = r
    h = settings["grid"].get("headline")
    if h:
        for r in seed0:
            if "seeds" in r["roles"] and r["method"] == "attnres":
                out.setdefault(HEADLINE_ATTNRES, r)
            if "seeds" in r["roles"] and r["method"] == "lr":
                out.setdefault(HEADLINE_LR, r)
    for r in seed0:
        if "control" in r["roles"]:
            out.setdefault(CONTROL, r)
    return out


SEGMENTS = 5  # contiguous segments of a run pair's per-step gradient norms (paired batch means)


def _norms_by_step(row: dict) -> dict:
    tr = row.get("grad_norm_trace") or {}
    return {st: g for st, g in zip(tr.get("step") or [], tr.get("norm") or [])
            if isinstance(g, (int, float)) and math.isfinite(g)}


def _segment_effects(rows: list[dict], effect, k: int = SEGMENTS) -> list[float]:
    """``effect(*segments)`` on ``k`` contiguous segments of the runs' per-step norms at the steps all
    of them logged (the runs share seed and data order, so a segment covers the same batches in
    each); [] with fewer than ``k`` common steps or where ``effect`` is undefined."""
    by = [_norms_by_step(r) for r in rows]
    steps = sorted(set.intersection(*(set(b) for b in by))) if by else []
    if len(steps) < k:
        return []
    out = []
    for seg in stats.segments(steps, k):
        v = effect(*[[b[st] for st in seg] for b in by])
        if v is None or not math.isfinite(v):
            return []
        out.append(v)
    return out


def _mean(xs):
    return statistics.fmean(xs)


def _pvar(xs):
    return statistics.pvariance(xs)


def _reduction_pct(stat):
    """100 (1 - stat(b) / stat(a)): how much lower b's statistic is than a's, in %."""
    def f(a, b):
        sa = stat(a)
        return None if sa <= 0 else 100.0 * (1.0 - stat(b) / sa)
    return f


def _segmented(rows: list[dict], effect) -> dict:
    samples = _segment_effects(rows, effect)
    return {"samples": samples, "unit": "segments of the runs' training (same data order)"} if samples else {}


def claims(rows: list[dict], settings: dict, known_ids=None) -> dict[str, dict]:
    """The diagnostics claims of reports/published.yaml computed from the analysed runs.

    Direction claims carry their evidence for the claims engine: N_eff comparisons are single runs
    judged by the record's threshold (relative differences in %); gradient-norm comparisons are
    paired over ``SEGMENTS`` contiguous segments of the runs' per-step norms."""
    book = _DiagnosticClaims(rows, settings, known_ids)
    book.n_eff()
    book.sweep_grad_norms()
    book.size_pair()
    return book.out


class _DiagnosticClaims:
    """The analysed runs as the paper's diagnostics see them, and the claims made of them."""

    def __init__(self, rows: list[dict], settings: dict, known_ids):
        self.out: dict[str, dict] = {}
        self.rows, self.settings, self.known_ids = rows, settings, known_ids
        self.scale = settings.get("scale", "?")
        self.analog = ("" if settings.get("paper_runs")
                       else f"{self.scale} scale: analogous run (same method and N, same r/d, or same role)")
        self.by_row = run_rows(rows, settings)
        self.seed0 = _main_seed0(rows, settings)

    def put(self, cid: str, value, text: str = "", *, value_claim: bool = True, how: str | None = None,
            **evidence) -> None:
        if value is None or (self.known_ids is not None and cid not in self.known_ids):
            return
        note = "; ".join(t for t in (text, (how or self.analog) if value_claim and self.analog else "") if t)
        self.out[cid] = {"reproduced": value, "note": note, **evidence}

    def n_eff(self) -> None:
        """N_eff at the final read (Section 4.6, Appendix D.1)."""
        put, seed0 = self.put, self.seed0
        for key, r in self.by_row.items():
            if r.get("n_eff"):
                prefix = "sec4.6" if key.startswith("lr.nfull.") else "appD.1"
                put(f"{prefix}.n_eff_final.{key}", r["n_eff"][-1], f"{r['run_id']}, {r.get('tokens')} tokens")
        full_lr = sorted((r for r in seed0 if r["method"] == "lr" and r["blocks"] == "full" and "sweep" in r["roles"]
                          and r.get("n_eff")), key=lambda r: r["rank"])

        def excess(lo: dict, hi: dict) -> float:
            return 100.0 * (lo["n_eff"][-1] / hi["n_eff"][-1] - 1.0)

        if len(full_lr) >= 2:
            lo, hi = full_lr[0], full_lr[-1]
            put("sec4.6.n_eff_full_decreases_with_rank", excess(lo, hi),
                f"final-read N_eff {lo['n_eff'][-1]:.6g} at r={lo['rank']} ({lo['run_id']}) vs {hi['n_eff'][-1]:.6g} at "
                f"r={hi['rank']} ({hi['run_id']}), the smallest and largest r<d of the full sweep", value_claim=False)
            mid = [r for r in full_lr if 2 * r["rank"] <= r["d_model"]]
            if mid and mid[-1] is not lo:
                put("sec4.6.n_eff_falls_r16_to_r512", excess(lo, mid[-1]),
                    f"final-read N_eff {lo['n_eff'][-1]:.6g} at r={lo['rank']} vs {mid[-1]['n_eff'][-1]:.6g} at "
                    f"r={mid[-1]['rank']} ({mid[-1]['run_id']}), the largest r <= d/2", value_claim=False)
        f6 = fig6_runs(self.rows, self.settings)
        at = f6["attnres"]
        low = [r for r in (f6["lr"], f6["plr"]) if r is not None and r.get("n_eff")]
        if at is not None and at.get("n_eff") and low:
            worst = min(low, key=lambda r: r["n_eff"][-1])
            who = ", ".join(f"{r['run_id']} {r['n_eff'][-1]:.6g}" for r in low)
            put("appD.1.lowrank_broader_final_read.n8", excess(worst, at),
                f"N = {at['blocks']} stands for N = 8; final-read N_eff: AttnRes {at['run_id']} {at['n_eff'][-1]:.6g} "
                f"vs {who}" + ("" if f6["plr"] else "; no projected run at this N"), value_claim=False)

    def _below(self, ref: dict, runs: list[dict], cid: str, extra: str) -> None:
        """``cid``: how far the largest mean gradient norm of ``runs`` lies below ``ref``'s, in %."""
        b = ref["grad_norm"]["mean"]
        worst = max(runs, key=lambda r: r["grad_norm"]["mean"])
        self.put(cid, 100.0 * (1.0 - worst["grad_norm"]["mean"] / b),
                 f"{ref['run_id']} {b:.6g} vs " + ", ".join(f"{r['run_id']} {r['grad_norm']['mean']:.6g}" for r in runs)
                 + extra, value_claim=False,
                 **_segmented([ref, *runs], lambda a, *bs: 100.0 * (1.0 - max(_mean(x) for x in bs) / _mean(a))))

    def sweep_grad_norms(self) -> None:
        """Appendix C.5: mean gradient norms of the 0.5B sweep."""
        put, seed0 = self.put, self.seed0
        base = next((r for r in seed0 if r["method"] == "baseline"), None)
        if base is not None:
            put("appC.5.grad_norm_mean.baseline", base["grad_norm"]["mean"], base["run_id"])
        for key, r in self.by_row.items():
            if key != "baseline":
                put(f"appC.5.grad_norm_mean.{key}", r["grad_norm"]["mean"], r["run_id"])
        plr_runs = [r for r in seed0 if r["method"] == "plr" and r["grad_norm"]["mean"] is not None]
        full_plr = [r for r in plr_runs if r["blocks"] == "full"]
        stand = full_plr or plr_runs
        if base is not None and base["grad_norm"]["mean"] and stand:
            self._below(base, stand, "appC.5.plr_full_below_baseline",
                        "" if full_plr else "; no full projected run at this scale: the block projected runs stand in")
        at_full = next((r for r in seed0 if r["method"] == "attnres" and r["blocks"] == "full"
                        and "sweep" in r["roles"] and r["grad_norm"]["mean"]), None)
        if at_full is not None and full_plr:
            self._below(at_full, full_plr, "appC.5.plr_full_below_attnres", "")
        ctrl = next((r for r in seed0 if "control" in r["roles"]), None)
        if ctrl is not None:
            sl = next((r for r in seed0 if r["method"] == "lr" and r["blocks"] == ctrl["blocks"]
                       and r["rank"] == ctrl["rank"]), None)
            if (sl is not None and None not in (ctrl["grad_norm"]["mean"], sl["grad_norm"]["mean"])
                    and sl["grad_norm"]["mean"] > 0):
                put("appC.5.fullrms_above_slice", 100.0 * (ctrl["grad_norm"]["mean"] / sl["grad_norm"]["mean"] - 1.0),
                    f"control {ctrl['run_id']} {ctrl['grad_norm']['mean']:.6g} vs sliced {sl['run_id']} "
                    f"{sl['grad_norm']['mean']:.6g}", value_claim=False,
                    **_segmented([ctrl, sl], lambda c, s_: 100.0 * (_mean(c) / _mean(s_) - 1.0)))
        for n in dict.fromkeys(r["blocks"] for r in seed0 if "sweep" in r["roles"]):
            runs = [r for r in seed0 if "sweep" in r["roles"] and r["blocks"] == n and r["method"] == "lr"
                    and r["grad_norm"]["mean"] is not None]
            if runs and n in ("full", 4, 8, 16):
                g = min(runs, key=lambda r: r["grad_norm"]["mean"])
                put(f"appC.5.grad_norm_argmin_rank.n{n}", round(g["r_over_d"] * PAPER_D),
                    f"{g['run_id']} (r = {g['rank']}; paper-equivalent rank r/d x {PAPER_D}) among "
                    + ", ".join(f"r={r['rank']} {r['grad_norm']['mean']:.4g}"
                                for r in sorted(runs, key=lambda r: r["rank"])))

    def size_pair(self) -> None:
        """Table 9 / Appendix G.1: the size pair's gradient norms, their variance and clipping."""
        put = self.put
        for role, size in zip(("small", "large"), PAIR_SIZES):
            pair = {r["method"]: r for r in self.rows if f"pair-{role}" in r["roles"]}
            how = f"{self.scale} scale: the pair-{role} runs stand for {size.upper()}"
            for m in ("attnres", "lr"):
                r = pair.get(m)
                if r is None:
                    continue
                g = r["grad_norm"]
                put(f"table9.grad_norm_mean.{size}.{m}", g["mean"], r["run_id"], how=how)
                put(f"table9.grad_norm_var.{size}.{m}", g["var"], r["run_id"], how=how)
                put(f"table9.above_clip_pct.{size}.{m}", g["above_clip_pct"], f"{r['run_id']}, threshold {g['clip']:g}",
                    how=how)
            a, l = pair.get("attnres"), pair.get("lr")
            if a is not None and l is not None:
                self._pair_reductions(size, a, l, how)

    def _pair_reductions(self, size: str, a: dict, l: dict, how: str) -> None:
        """Appendix G.1: how much lower LR-AttnRes's (``l``) gradient norms are than AttnRes's (``a``)."""
        put = self.put
        ga, gl = a["grad_norm"], l["grad_norm"]
        who = f"{size.upper()} pair: {l['run_id']} vs {a['run_id']}"
        if ga["mean"] and gl["mean"] is not None:
            red = 100.0 * (ga["mean"] - gl["mean"]) / ga["mean"]
            put(f"appG.1.grad_norm_mean_reduction_pct.{size}", red, who, how=how)
            put(f"appG.1.lr_lower_grad_norm.{size}", red, f"{who}: mean {gl['mean']:.6g} vs {ga['mean']:.6g}",
                value_claim=False, **_segmented([a, l], _reduction_pct(_mean)))
        if ga["var"] and gl["var"] is not None:
            red = 100.0 * (ga["var"] - gl["var"]) / ga["var"]
            put(f"appG.1.grad_norm_var_reduction_pct.{size}", red, who, how=how)
            put(f"appG.1.lr_lower_grad_norm_var.{size}", red, f"{who}: variance {gl['var']:.6g} vs {ga['var']:.6g}",
                value_claim=False, **_segmented([a, l], _reduction_pct(_pvar)))
        if None not in (ga["above_clip_pct"], gl["above_clip_pct"]):
            clip = ga["clip"]

            def above(xs, clip=clip):
                return 100.0 * sum(x > clip for x in xs) / len(xs)

            put(f"appG.1.lr_fewer_clipped.{size}", ga["above_clip_pct"] - gl["above_clip_pct"],
                f"{who}: {gl['above_clip_pct']:.2f}% vs {ga['above_clip_pct']:.2f}% of steps above {clip:g}",
                value_claim=False, **_segmented([a, l], lambda x, y: above(x) - above(y)))


def aggregate(settings: dict, rows: list[dict], known_ids=None) -> dict:
    """The diagnostics result (without provenance) from the per-run rows of :func:`analyse_run`.

    Rows are ordered as :func:`lrattnres.gridplan.plan` orders the runs; a planned run without a row is an
    error, a row of a run that the scale does not plan is left out."""
    diag = validate_settings(settings.get("diagnostics"), "settings.diagnostics")
    by_id = {r["run_id"]: r for r in rows}
    ordered = []
    for run in plan(settings):
        if run.run_id not in by_id:
            raise DiagnosticsError(f"no diagnostics row for run {run.run_id} of the grid (diagnose it first)")
        ordered.append(by_id[run.run_id])
    return {
        "stage": "diagnostics",
        "scale": settings.get("scale"),
        "settings": diag,
        "runs": {r["run_id"]: r for r in ordered},
        "figures_data": figures_data(ordered, settings),
        "claims": claims(ordered, settings, known_ids),
    }
