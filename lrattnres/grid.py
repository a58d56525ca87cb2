"""The experiment grid's results: what the training runs of a scale say.

Which runs a scale makes is :mod:`lrattnres.gridplan` (:func:`plan`, :func:`train_spec`,
:func:`paper_row`, :func:`conversions`, :func:`evaluations`; importable from here too).

Summarising (``python -m lrattnres summarize-grid``) reads every run's ``result.json`` and
``metrics.jsonl`` and writes the grid result: the per-run table with each run's added FLOPs
(:mod:`lrattnres.accounting`), validation curves, gradient-norm traces, and the claims of the
training sections (Table 5 losses and shape, Sections 4.2-4.6, Appendices A, C.3 and C.5).  Runs of
the small scales are reported under the paper's row ids by analogy (same method and N, the same r/d
ratio); their value claims show "different scale".  The learning-rate check's runs stay out of the
table and the claims: they make the result's ``lr_check`` (:mod:`lrattnres.lrcheck`), and the noise
of the runs at the chosen rates its ``noise`` (:mod:`lrattnres.noise`).

Direction claims carry their evidence for the claims engine (lrattnres/claims.py): paired samples
over seeds or configurations, or, for a comparison of single runs, a standard error from the same
scale's run-to-run noise: the pooled sample SD of the headline pair's seed replicates times the norm
of the comparison's coefficients (sqrt 2 for a difference of two runs), with the pooled degrees of
freedom.  Near-ties take as margin half the headline pair's mean paired reduction.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from pathlib import Path

from lrattnres import lrcheck, noise, run_health, stats
from lrattnres.accounting import added_flops
from lrattnres.checks import is_number
from lrattnres.claims import load_published
from lrattnres.gridplan import (  # noqa: F401  (the plan's names, importable from here as before)
    CONTROL,
    HEADLINE_ATTNRES,
    HEADLINE_LR,
    LR_CHECK,
    PAIR_SIZES,
    PAPER_BLOCKS,
    PAPER_D,
    PAPER_RANKS,
    SIZE_OF_ROLE,
    Run,
    conversions,
    evaluations,
    lr_check_runs,
    paper_row,
    plan,
    train_spec,
)
from lrattnres.io import atomic_write_json, read_json
from lrattnres.presets import get_preset
from lrattnres.provenance import now, provenance
from lrattnres.ranks import resolve_rank

log = logging.getLogger("lrattnres.grid")


def read_curve(metrics_path: Path) -> tuple[list[dict], list[dict]]:
    """(validation points, per-update points) of a run's metrics.jsonl (lrattnres.train.metrics).

    Validation points are the periodic ``val`` records and the ``final_val`` record; update points
    are the ``train`` records."""
    val, steps = [], []
    if not metrics_path.exists():
        return val, steps
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        kind = rec.get("kind")
        if kind in ("val", "final_val"):
            val.append({"step": rec.get("step"), "tokens": rec.get("tokens"), "ce": rec.get("val_ce"), "final": kind == "final_val"})
        elif kind == "train":
            steps.append({"step": rec.get("step"), "tokens": rec.get("tokens"), "grad_norm": rec.get("grad_norm"), "ce": rec.get("ce")})
    return val, steps


def summarize(settings: dict, run_dirs: dict[str, Path], known_ids=None, published: dict | None = None) -> dict:
    """The grid result: per-run table, curves and the claims of the training sections.

    ``known_ids``: the published claim ids; claims without a published counterpart (a small-scale
    run whose analogue the paper did not train) are left out of ``claims`` but stay in the table.
    ``published``: the published records by id (Table 5's losses for the rank correlation).  A run
    whose ``final_val_ce`` is not a finite number stays in the table with ``final_val_ce`` null and a
    ``problem`` naming the file and key; the claims that depend on it are left without a value.
    """
    runs = plan(settings)
    table = [run_row(run, run_dirs[run.run_id]) for run in runs if LR_CHECK not in run.roles]
    check = [run_row(run, run_dirs[run.run_id]) for run in lr_check_runs(settings)]
    produced = claims(settings, table, published)
    if known_ids is not None:
        dropped = sorted(set(produced) - set(known_ids))
        if dropped:
            log.info("no published counterpart, not claimed: %s", ", ".join(dropped))
        produced = {k: v for k, v in produced.items() if k in known_ids}
    lr_check = lrcheck.summarize(settings, check)
    return {"stage": "grid", "scale": settings["scale"], "runs": table, "claims": produced,
            "lr_check": lr_check, "noise": noise.summarize(settings, table, lr_check)}


def run_row(run: Run, folder: Path) -> dict:
    """One run's row of the grid result, from its ``result.json`` and ``metrics.jsonl``.  A run whose
    ``final_val_ce`` is not a finite number keeps its row with ``final_val_ce`` null and a ``problem``
    naming the file and key."""
    result = read_json(folder / "result.json")
    loss = result.get("final_val_ce") if isinstance(result, dict) else None
    problem = None
    if not is_number(loss):
        problem = f"{folder / 'result.json'}: final_val_ce: expected a finite number, got {loss!r}"
        log.warning("%s", problem)
        loss = None
    if not isinstance(result, dict):
        result = {}
    val, steps = read_curve(folder / "metrics.jsonl")
    shape = get_preset(run.preset)
    d = shape["d_model"]
    cost = added_flops(shape["n_layers"], d, shape["d_ff"], run.method, run.blocks, run.rank)
    row = {
        "run_id": run.run_id,
        "preset": run.preset,
        "d_model": d,
        "method": run.method,
        "blocks": run.blocks,
        "rank": run.rank,
        "seed": run.seed,
        "roles": list(run.roles),
        "added_flops_pct": cost["pct"],
        "final_val_ce": loss,
        "steps": result.get("steps"),
        "tokens": result.get("tokens"),
        "data_epochs": result.get("data_epochs"),
        "wall_s": result.get("wall_s"),
        "tokens_per_s": result.get("tokens_per_s"),
        "grad_norm": result.get("grad_norm"),
        "stopped": result.get("stopped"),
        "val_curve": val,
        "grad_norm_trace": [s["grad_norm"] for s in steps],
    }
    if run.lr_scale is not None:
        row["lr_scale"] = run.lr_scale
    # the trainer's gradient-norm outliers (lrattnres/run_health.py): a run with any is flagged
    row["grad_outliers"], row["grad_outliers_from"] = run_health.run_outliers(result, row["grad_norm_trace"])
    row["paper_row"] = paper_row(row, d)
    if problem:
        row["problem"] = problem
    return row


def _loss(rows: list[dict], **match) -> float | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r["final_val_ce"]
    return None


SEGMENTS = 5  # contiguous segments of a run pair's per-step gradient norms (paired batch means)
# A bad run's loss is replaced by each of these in turn: a claim that changes depends on it.
_SENTINELS = (-1.0e6, 1.0e6)


def claims(settings: dict, rows: list[dict], published: dict | None = None) -> dict[str, dict]:
    """Claims of Sections 4.2-4.6, Appendices A and C.3, C.5 and Table 5's shape from the run table
    (see reports/published.yaml).  ``published``: the records by id (Table 5's losses for the rank
    correlation).

    A run whose ``final_val_ce`` is not a finite number (its ``problem`` says why) leaves every claim
    that depends on it without a value and with the problem as its note: the claims are computed
    with the run's loss set to a very low and to a very high value, and a claim that differs between
    the two depends on it.  A run with gradient-norm outliers (``grad_outliers``) is found the same
    way, its loss and gradient norms set to extreme values in turn: every claim whose value or
    evidence moves rests on it, and its note says so (lrattnres/run_health.py)."""
    out = _claims_known(settings, rows, published)
    for run in rows:
        if not run.get("grad_outliers"):
            continue
        text = run_health.note(run["run_id"], run["grad_outliers"])
        for cid in _resting_on(settings, rows, published, run, out):
            old = out[cid].get("note")
            out[cid] = {**out[cid], "note": f"{old}; {text}" if old else text}
    return out


def _claims_known(settings: dict, rows: list[dict], published: dict | None) -> dict[str, dict]:
    """The claims, those that depend on a run without a finite loss left without a value."""
    bad = [r for r in rows if not is_number(r.get("final_val_ce"))]
    if not bad:
        return _claims(settings, rows, published)
    why = "; ".join(r.get("problem") or f"{r['run_id']}: final_val_ce: expected a finite number, got "
                    f"{r.get('final_val_ce')!r}" for r in bad)
    outs = [_claims(settings, [dict(r, final_val_ce=v) if r in bad else r for r in rows], published)
            for v in _SENTINELS]
    out = {}
    for cid in dict.fromkeys(list(outs[0]) + list(outs[1])):
        a, b = outs[0].get(cid), outs[1].get(cid)
        out[cid] = a if a == b else {"reproduced": None, "note": f"not computed: {why}"}
    return out


def _resting_on(settings: dict, rows: list[dict], published: dict | None, run: dict, base: dict) -> list[str]:
    """The claim ids of ``base`` whose value or evidence changes when ``run``'s loss and gradient
    norms are set to extreme values (each of :data:`_SENTINELS` in turn)."""
    def moved(v: float) -> dict:
        norm = 1e-9 if v < 0 else 1e9
        gn = dict(run.get("grad_norm") or {})
        if gn.get("mean") is not None:
            gn["mean"] = norm
        loss = v if is_number(run.get("final_val_ce")) else run.get("final_val_ce")
        return {**run, "final_val_ce": loss, "grad_norm": gn,
                "grad_norm_trace": [norm] * len(run.get("grad_norm_trace") or [])}

    def evidence(c: dict | None) -> dict | None:
        return None if c is None else {k: v for k, v in c.items() if k != "note"}

    found = set()
    for v in _SENTINELS:
        other = _claims_known(settings, [moved(v) if r is run else r for r in rows], published)
        found |= {cid for cid in base if evidence(base[cid]) != evidence(other.get(cid))}
    return [cid for cid in base if cid in found]


def _claims(settings: dict, rows: list[dict], published: dict | None) -> dict[str, dict]:
    """The claims of the training sections, in the order the paper states them."""
    book = _GridClaims(settings, rows, published)
    for section in (book.table5, book.sec4_2_routing, book.sec4_2_ranks, book.sec4_3, book.sec4_4, book.sec4_5,
                    book.sec4_6, book.appendix_c3, book.appendix_c5):
        section()
    return book.out


class _GridClaims:
    """The run table seen as the paper's sections see it (seed 0 of the main preset, the sweep, the
    headline pair's seeds), with the evidence every direction claim shares: the single-run noise
    (pooled seed SD of the headline pair) and the near-tie margin (half its mean paired reduction)."""

    def __init__(self, settings: dict, rows: list[dict], published: dict | None):
        self.out: dict[str, dict] = {}
        self.rows, self.published = rows, published
        self.scale = settings["scale"]
        self.note = ("" if settings.get("paper_runs")
                     else f"{self.scale} scale: analogous run (same method and N, same r/d)")
        self.main = settings["presets"]["main"]
        self.seed0 = [r for r in rows if r["preset"] == self.main and r["seed"] == 0]
        self.sweep = [r for r in self.seed0 if "sweep" in r["roles"] or "baseline" in r["roles"]
                      or r["method"] in ("plr", "lr-fullrms")]
        self.grid = settings["grid"]
        self.d = next((r["d_model"] for r in self.seed0), None)
        self.h = self.grid.get("headline")
        self._seed_noise()
        self.base = _loss(self.seed0, method="baseline")
        self.sweep_only = [r for r in self.seed0 if "sweep" in r["roles"]]
        self.by_nr = {(r["blocks"], r["rank"]): r for r in self.sweep_only}
        self.settings_n = list(dict.fromkeys(r["blocks"] for r in self.sweep_only))
        self.block_ns = sorted(n for n in self.settings_n if n != "full")
        self.ends = [r for r in self.sweep_only if r["method"] == "attnres"]
        self.lows = [r for r in self.sweep_only if r["method"] == "lr"]
        self.full = sorted((r for r in self.sweep_only if r["method"] == "lr" and r["blocks"] == "full"),
                           key=lambda r: r["rank"])

    def _seed_noise(self) -> None:
        """Run-to-run noise of one training run at this scale: the headline pair's seed replicates."""
        self.lr_runs: dict[int, float] = {}
        self.at_runs: dict[int, float] = {}
        h, d, main = self.h, self.d, self.main
        if h and d:
            hr = resolve_rank(h["rank"], d, where="grid.headline.rank")
            self.lr_runs = {r["seed"]: r["final_val_ce"] for r in self.rows if r["preset"] == main
                            and r["method"] == "lr" and r["blocks"] == h["blocks"] and r["rank"] == hr}
            self.at_runs = {r["seed"]: r["final_val_ce"] for r in self.rows if r["preset"] == main
                            and r["method"] == "attnres" and r["blocks"] == h["blocks"]}
        self.pooled = stats.pooled_sd([list(self.lr_runs.values()), list(self.at_runs.values())])
        self.noise_text = ("no seed replicates at this scale: single-run comparisons have no interval"
                           if self.pooled is None else
                           f"single-run noise: pooled seed SD {self.pooled[0]:.3g} ({self.pooled[1]} df, headline pair)")
        self.pairs = sorted(set(self.lr_runs) & set(self.at_runs))
        self.reductions = [self.at_runs[s] - self.lr_runs[s] for s in self.pairs]
        mean = statistics.fmean(self.reductions) if self.reductions else 0
        self.margin = abs(mean) / 2 if mean != 0 else None

    # ---- writing claims

    def put(self, cid: str, value, text: str = "", **evidence) -> None:
        if value is not None:
            self.out[cid] = {"reproduced": value, "note": "; ".join(t for t in (text, self.note) if t), **evidence}

    def absent(self, cid: str, why: str) -> None:
        self.out[cid] = {"reproduced": None, "note": f"{why} ({self.scale} scale)"}

    def single(self, norm: float) -> dict:
        """Evidence of a single-run contrast whose coefficients have Euclidean norm ``norm``."""
        return {} if self.pooled is None else {"se": self.pooled[0] * norm, "df": self.pooled[1]}

    def judged(self, text: str) -> str:
        return "; ".join(t for t in (text, self.noise_text) if t)

    def tie(self, cid: str, effect: float, text: str, norm: float) -> None:
        ev = self.single(norm)
        if self.margin is not None:
            ev["margin"] = self.margin
        self.put(cid, effect, self.judged(text + (
            "; no tie margin: the headline pair has no paired reduction" if self.margin is None
            else "; margin: half the headline pair's mean paired reduction")), **ev)

    # ---- the sections

    def table5(self) -> None:
        """Table 5 / Appendix A losses of seed 0 on the main preset; each configuration's change against
        the baseline, and the ordering's rank correlation with the paper's."""
        put, base = self.put, self.base
        for r in self.sweep:
            if r["paper_row"]:
                key = "table5.val_loss.baseline" if r["method"] == "baseline" else f"table5.val_loss.{r['paper_row']}"
                put(key, r["final_val_ce"], r["run_id"])
        if base is None:
            return
        routed = [r for r in self.sweep if r["method"] != "baseline" and r["paper_row"]]
        for r in routed:
            put(f"table5.loss_change_pct.{r['paper_row']}", 100.0 * (r["final_val_ce"] / base - 1.0),
                self.judged(f"{r['run_id']} {r['final_val_ce']:.4f} against the baseline {base:.4f}"),
                **{k: (100.0 * v / base if k == "se" else v) for k, v in self.single(math.sqrt(2)).items()})
        if self.published is not None:
            pts = {r["paper_row"]: [r["final_val_ce"], self.published[f"table5.val_loss.{r['paper_row']}"]["published"]]
                   for r in routed if f"table5.val_loss.{r['paper_row']}" in self.published}
            if len(pts) >= 3:
                rho = stats.spearman_interval([v[0] for v in pts.values()], [v[1] for v in pts.values()])["rho"]
                put("table5.loss_order_spearman", rho, f"configurations: {', '.join(pts)}", pairs=pts)
            else:
                self.absent("table5.loss_order_spearman", f"{len(pts)} configurations with a Table 5 row: too few to rank")

    def sec4_2_routing(self) -> None:
        """Section 4.2: routed against the baseline, low rank against r = d, the best configuration."""
        put, judged, single, base, sweep_only = self.put, self.judged, self.single, self.base, self.sweep_only
        if base is not None and sweep_only:
            imp = [base - r["final_val_ce"] for r in sweep_only]
            below = sum(x > 0 for x in imp)
            put("sec4.2.routed_beat_baseline", statistics.fmean(imp),
                judged(f"{below} of {len(imp)} sweep configurations below the baseline {base:.4f}"),
                samples=imp, unit="configurations", labels=[r["run_id"] for r in sweep_only],
                **_item(single(math.sqrt(2))))
        endpoints = {r["blocks"]: r["final_val_ce"] for r in self.ends}
        lowrank = [r for r in self.lows if r["blocks"] in endpoints]
        exception = [r for r in lowrank if r["paper_row"] == "lr.nfull.r16"]
        counted = [r for r in lowrank if r not in exception]
        if counted:
            imp = [endpoints[r["blocks"]] - r["final_val_ce"] for r in counted]
            wins = sum(x > 0 for x in imp)
            put("sec4.2.lowrank_beat_endpoint", statistics.fmean(imp),
                judged(f"{wins} of {len(imp)} low-rank configurations ({wins / len(imp):.3f}) beat r = d at the same N "
                       f"(paper: 27 of 28 = 0.964)" + ("; the exception's analogue (full, r = d/64) apart" if exception else "")),
                samples=imp, unit="configurations", labels=[r["run_id"] for r in counted], **_item(single(math.sqrt(2))))
        if exception:
            r = exception[0]
            put("sec4.2.lowrank_endpoint_exception.nfull.r16", r["final_val_ce"] - endpoints["full"],
                judged(f"{r['run_id']} {r['final_val_ce']:.4f} against full r = d {endpoints['full']:.4f}"),
                **single(math.sqrt(2)))
        elif sweep_only:
            self.absent("sec4.2.lowrank_endpoint_exception.nfull.r16", "no full-routing run at r = d/64")
        if self.ends and self.lows:
            be, bl = min(self.ends, key=lambda r: r["final_val_ce"]), min(self.lows, key=lambda r: r["final_val_ce"])
            put("sec4.2.best_is_lowrank", be["final_val_ce"] - bl["final_val_ce"],
                judged(f"best r = d {be['run_id']} {be['final_val_ce']:.4f}, best r < d {bl['run_id']} "
                       f"{bl['final_val_ce']:.4f}"), **single(math.sqrt(2)))
            put("sec4.2.best_config", bl["paper_row"] or bl["run_id"], bl["run_id"])
            put("sec4.2.best_val_loss", bl["final_val_ce"], bl["run_id"])

    def sec4_2_ranks(self) -> None:
        """Section 4.2: the best rank per routing setting, whether the rank preference depends on the
        grouping, and the headline configuration against AttnRes and against half its rank."""
        put, judged, single, d, sweep_only, by_nr = self.put, self.judged, self.single, self.d, self.sweep_only, self.by_nr
        interior, labels = [], []
        for n in self.settings_n:
            runs = sorted((r for r in sweep_only if r["blocks"] == n), key=lambda r: r["rank"])
            if len(runs) >= 3:
                interior.append(min(runs[0]["final_val_ce"], runs[-1]["final_val_ce"])
                                - min(r["final_val_ce"] for r in runs[1:-1]))
                labels.append(f"N={n}")
            best = min(runs, key=lambda r: r["final_val_ce"]) if runs else None
            if best is not None and n in PAPER_BLOCKS:
                put(f"sec4.2.best_rank.n{n}", round(best["rank"] / best["d_model"] * PAPER_D),
                    f"{best['run_id']} (r = {best['rank']} of d = {best['d_model']}; paper-equivalent rank r/d x {PAPER_D})")
        if interior:
            put("sec4.2.best_rank_interior", statistics.fmean(interior),
                f"per routing setting ({', '.join(labels)}): " + ", ".join(f"{x:+.4f}" for x in interior),
                samples=interior, unit="routing settings")
        elif sweep_only:
            self.absent("sec4.2.best_rank_interior", "fewer than three ranks per routing setting: no interior rank")
        ranks = sorted({r["rank"] for r in sweep_only if r["method"] == "lr"})
        if d and "full" in self.settings_n and self.block_ns and len(ranks) >= 2:
            r_small = d // 8 if d % 8 == 0 and d // 8 in ranks else ranks[0]
            r_large = ranks[-1]
            deltas = {n: by_nr[(n, r_large)]["final_val_ce"] - by_nr[(n, r_small)]["final_val_ce"]
                      for n in self.settings_n if (n, r_large) in by_nr and (n, r_small) in by_nr}
            blk = [deltas[n] for n in self.block_ns if n in deltas]
            if r_large > r_small and "full" in deltas and blk:
                put("sec4.2.rank_preference_depends_on_grouping", statistics.fmean(blk) - deltas["full"],
                    judged(f"L(r = {r_large}) - L(r = {r_small}): full {deltas['full']:+.4f}, "
                           + ", ".join(f"N={n} {deltas[n]:+.4f}" for n in self.block_ns if n in deltas)),
                    **single(math.sqrt(2 / len(blk) + 2)))
        h = self.h
        if not (h and d):
            return
        hr = resolve_rank(h["rank"], d, where="grid.headline.rank")
        at0 = _loss(self.seed0, method="attnres", blocks=h["blocks"])
        lr0 = _loss(self.seed0, method="lr", blocks=h["blocks"], rank=hr)
        if at0 is not None and lr0 is not None:
            put("sec4.2.improvement_vs_attnres_n8", at0 - lr0, f"N = {h['blocks']}, r = {hr}, seed 0")
        if self.ends and lr0 is not None:
            put("sec4.2.improvement_vs_best_attnres", min(r["final_val_ce"] for r in self.ends) - lr0,
                f"N = {h['blocks']}, r = {hr}")
        r16 = hr // 2 if hr % 2 == 0 else None
        a, b = by_nr.get((h["blocks"], r16)), by_nr.get((h["blocks"], hr))
        if a is not None and b is not None and a["method"] == "lr":
            self.tie("sec4.2.r64_minus_r128", a["final_val_ce"] - b["final_val_ce"], f"{a['run_id']} - {b['run_id']}",
                     math.sqrt(2))
        elif sweep_only:
            self.absent("sec4.2.r64_minus_r128", f"no sweep run at N = {h['blocks']}, r = {r16} (half the headline rank)")

    def _spread(self, rank: int) -> tuple[float, list[dict]] | None:
        """The range of the final losses over the block settings run at ``rank`` (at least two)."""
        runs = [self.by_nr[(n, rank)] for n in self.block_ns if (n, rank) in self.by_nr]
        if len(runs) < 2:
            return None
        vals = [x["final_val_ce"] for x in runs]
        return max(vals) - min(vals), runs

    def sec4_3(self) -> None:
        """Section 4.3: block granularity."""
        put, d, sweep_only, block_ns = self.put, self.d, self.sweep_only, self.block_ns
        if not d:
            return
        for n in block_ns:
            if n in PAPER_BLOCKS:
                put(f"sec4.3.block_min_val_loss.n{n}", min(r["final_val_ce"] for r in sweep_only if r["blocks"] == n))
        sp = self._spread(d // 4) if d % 4 == 0 else None
        if sp:
            self.tie("sec4.3.block_spread.r256", sp[0], "block settings at r = d/4: " + ", ".join(
                f"{x['run_id']} {x['final_val_ce']:.4f}" for x in sp[1]), math.sqrt(2))
        elif sweep_only:
            self.absent("sec4.3.block_spread.r256", "fewer than two block settings at r = d/4")
        sp = self._spread(d // 2) if d % 2 == 0 else None
        if sp:
            put("sec4.3.block_spread.r512", sp[0], ", ".join(x["run_id"] for x in sp[1]))
        if len(block_ns) >= 2:
            self._sec4_3_more_blocks()
        elif sweep_only:
            for cid in ("sec4.3.more_blocks_not_consistently_better", "sec4.3.r256_to_r512_depends_on_n"):
                self.absent(cid, "fewer than two block settings")

    def _sec4_3_more_blocks(self) -> None:
        """Section 4.3 with at least two block settings: the best N per rank, whether the largest N is
        consistently better, and whether r = d/4 -> d/2 depends on N."""
        put, judged, single, d, by_nr, block_ns = self.put, self.judged, self.single, self.d, self.by_nr, self.block_ns
        nmax = block_ns[-1]
        worst = []
        for r_ in sorted({r["rank"] for r in self.sweep_only}):
            runs = {n: by_nr[(n, r_)]["final_val_ce"] for n in block_ns if (n, r_) in by_nr}
            if len(runs) >= 2:
                best_n = min(runs, key=runs.get)
                paper_r = round(r_ / d * PAPER_D)
                if paper_r in PAPER_RANKS:
                    put(f"sec4.3.best_blocks.r{paper_r}", best_n, f"r = {r_}: " + ", ".join(
                        f"N={n} {v:.4f}" for n, v in runs.items()))
                if nmax in runs:
                    worst.append((runs[nmax] - min(v for n, v in runs.items() if n != nmax), r_))
        if worst:
            w, wr = max(worst)
            put("sec4.3.more_blocks_not_consistently_better", w,
                judged(f"largest N = {nmax} against the best smaller N, largest excess at r = {wr}"),
                **single(math.sqrt(2)))
        if d % 4 == 0:
            q, hf = d // 4, d // 2
            dl = {n: by_nr[(n, hf)]["final_val_ce"] - by_nr[(n, q)]["final_val_ce"]
                  for n in block_ns if (n, q) in by_nr and (n, hf) in by_nr}
            small = [dl[n] for n in block_ns[:-1] if n in dl]
            if nmax in dl and small:
                put("sec4.3.r256_to_r512_depends_on_n", statistics.fmean(small) - dl[nmax],
                    judged(f"L(r = {hf}) - L(r = {q}): " + ", ".join(f"N={n} {v:+.4f}" for n, v in dl.items())),
                    **single(math.sqrt(2 / len(small) + 2)))
            elif self.sweep_only:
                self.absent("sec4.3.r256_to_r512_depends_on_n", "no pair of block settings run at both r = d/4 and d/2")

    def sec4_4(self) -> None:
        """Section 4.4 and Appendix A: the headline pair over seeds, and the full-width-RMS control."""
        put, judged, single = self.put, self.judged, self.single
        lr_runs, at_runs, reductions, d = self.lr_runs, self.at_runs, self.reductions, self.d
        if not (self.h and d):
            return
        for seed in sorted(lr_runs):
            put(f"appA.val_loss.{HEADLINE_LR}.s{seed}", lr_runs[seed])
        for seed in sorted(at_runs):
            put(f"appA.val_loss.{HEADLINE_ATTNRES}.s{seed}", at_runs[seed])
        if self.pairs:
            put("sec4.4.paired_reduction_all_positive", statistics.fmean(reductions),
                judged(f"reductions per seed: {', '.join(f'{x:+.4f}' for x in reductions)}"),
                samples=reductions, unit="seeds", labels=[f"seed {s}" for s in self.pairs],
                **_item(single(math.sqrt(2))))
            put("sec4.4.paired_reduction_mean", statistics.fmean(reductions))
        if len(lr_runs) >= 2:
            put(f"sec4.4.val_loss_mean.{HEADLINE_LR}", statistics.fmean(lr_runs.values()))
            put(f"sec4.4.val_loss_sd.{HEADLINE_LR}", statistics.stdev(lr_runs.values()))
        if len(at_runs) >= 2:
            put(f"sec4.4.val_loss_mean.{HEADLINE_ATTNRES}", statistics.fmean(at_runs.values()))
            put(f"sec4.4.val_loss_sd.{HEADLINE_ATTNRES}", statistics.stdev(at_runs.values()))
        c = self.grid.get("control")
        if not c:
            return
        cr = resolve_rank(c["rank"], d, where="grid.control.rank")
        ctrl = _loss(self.seed0, method="lr-fullrms", blocks=c["blocks"], rank=cr)
        if ctrl is not None:
            put(f"appA.val_loss.{CONTROL}", ctrl)
        if ctrl is not None and at_runs:
            m = statistics.fmean(at_runs.values())
            put("sec4.4.fullrms_beats_attnres", m - ctrl,
                judged(f"control {ctrl:.4f} vs AttnRes mean {m:.4f} over {len(at_runs)} seeds"),
                **single(math.sqrt(1 + 1 / len(at_runs))))
        if ctrl is not None and lr_runs:
            m = statistics.fmean(lr_runs.values())
            self.tie("sec4.4.fullrms_close_to_slice", ctrl - m,
                     f"control {ctrl:.4f} vs slice mean {m:.4f} over {len(lr_runs)} seeds",
                     math.sqrt(1 + 1 / len(lr_runs)))

    def sec4_5(self) -> None:
        """Section 4.5 / Table 1: the size pair."""
        put = self.put
        for size_role, size in zip(("small", "large"), PAIR_SIZES):
            pair = [r for r in self.rows if f"pair-{size_role}" in r["roles"]]
            at = _loss(pair, method="attnres")
            lr = _loss(pair, method="lr")
            if at is not None:
                put(f"table1.val_loss.{size}.attnres", at, next(r["run_id"] for r in pair if r["method"] == "attnres"))
            if lr is not None:
                put(f"table1.val_loss.{size}.lr", lr, next(r["run_id"] for r in pair if r["method"] == "lr"))
            if at is not None and lr is not None:
                put(f"sec4.5.val_loss_reduction.{size}", at - lr)
                put(f"sec4.5.lr_lower_loss.{size}", at - lr,
                    self.judged(f"LR {lr:.4f} vs AttnRes {at:.4f}; the main preset's seed noise stands for the pair's"),
                    **self.single(math.sqrt(2)))

    def sec4_6(self) -> None:
        """Section 4.6: the loss over the full-routing ranks whose N_eff the diagnostics compare."""
        full = self.full
        mid = [r for r in full if r["rank"] * 2 <= r["d_model"]]
        if len(full) >= 2 and mid and mid[-1] is not full[0]:
            lo, hi = full[0], mid[-1]
            self.put("sec4.6.loss_improves_r16_to_r512", lo["final_val_ce"] - hi["final_val_ce"],
                     self.judged(f"{lo['run_id']} {lo['final_val_ce']:.4f} -> {hi['run_id']} {hi['final_val_ce']:.4f}"),
                     **self.single(math.sqrt(2)))
        elif self.sweep_only:
            self.absent("sec4.6.loss_improves_r16_to_r512", "fewer than two full-routing ranks r <= d/2")

    def appendix_c3(self) -> None:
        """Appendix C.3: projected keys."""
        put, judged, single, seed0, by_nr = self.put, self.judged, self.single, self.seed0, self.by_nr
        plr = [r for r in seed0 if r["method"] == "plr"]
        if plr and self.lows:
            bp, bl = min(plr, key=lambda r: r["final_val_ce"]), min(self.lows, key=lambda r: r["final_val_ce"])
            self.tie("appC.3.best_plr_minus_best_lr", bp["final_val_ce"] - bl["final_val_ce"],
                     f"{bp['run_id']} - {bl['run_id']}", math.sqrt(2))
        plr_full = sorted((r for r in plr if r["blocks"] == "full"), key=lambda r: r["rank"])
        matched = [(p, by_nr[("full", p["rank"])]) for p in plr_full if ("full", p["rank"]) in by_nr
                   and by_nr[("full", p["rank"])]["method"] == "lr"]
        if matched:
            p, s_ = next(((p, s_) for p, s_ in matched if p["paper_row"] == "plr.nfull.r64"), matched[0])
            if p["paper_row"] == "plr.nfull.r64":
                put("appC.3.lr_minus_plr.full.r64", s_["final_val_ce"] - p["final_val_ce"], f"{s_['run_id']} - {p['run_id']}")
            put("appC.3.plr_beats_lr.full.r64", s_["final_val_ce"] - p["final_val_ce"],
                judged(f"{s_['run_id']} {s_['final_val_ce']:.4f} vs {p['run_id']} {p['final_val_ce']:.4f}"),
                **single(math.sqrt(2)))
        elif seed0:
            self.absent("appC.3.plr_beats_lr.full.r64", "no full-routing projected run with a sliced run of the same rank")
        if len(plr_full) >= 2:
            put("appC.3.plr_full_improves_with_rank", plr_full[0]["final_val_ce"] - plr_full[-1]["final_val_ce"],
                judged(f"{plr_full[0]['run_id']} -> {plr_full[-1]['run_id']}"), **single(math.sqrt(2)))
        elif seed0:
            self.absent("appC.3.plr_full_improves_with_rank", "fewer than two full-routing projected runs")

    def appendix_c5(self) -> None:
        """Appendix C.5: the rank of the lowest loss is not the rank of the smallest gradient norm."""
        full_g = [r for r in self.full if (r.get("grad_norm") or {}).get("mean") is not None]
        if len(full_g) < 2:
            return
        la = min(full_g, key=lambda r: r["final_val_ce"])
        ga = min(full_g, key=lambda r: r["grad_norm"]["mean"])
        samples = _segment_ratios(la.get("grad_norm_trace") or [], ga.get("grad_norm_trace") or [])
        effect = 100.0 * (la["grad_norm"]["mean"] / ga["grad_norm"]["mean"] - 1.0)
        text = (f"lowest loss {la['run_id']} (mean norm {la['grad_norm']['mean']:.4g}), smallest mean norm "
                f"{ga['run_id']} ({ga['grad_norm']['mean']:.4g})" + ("; one rank minimises both" if la is ga else ""))
        self.put("appC.5.grad_argmin_not_loss_argmin.nfull", effect, text,
                 **({"samples": samples, "unit": "segments of the run pair"} if samples else {}))


def _item(single_evidence: dict) -> dict:
    """The single-run half-width of each item of an "every" claim (``item_se`` and ``df``)."""
    if not single_evidence:
        return {}
    return {"item_se": single_evidence["se"], "df": single_evidence["df"]}


def _segment_ratios(a: list, b: list, k: int = SEGMENTS) -> list[float]:
    """100 (mean a / mean b - 1) on each of ``k`` contiguous segments of two runs' per-step series
    (steps where either is not finite left out); [] when a segment would be empty."""
    pts = [(x, y) for x, y in zip(a, b) if is_number(x) and is_number(y)]
    if len(pts) < k:
        return []
    out = []
    for seg in stats.segments(pts, k):
        mb = statistics.fmean(y for _, y in seg)
        if mb <= 0:
            return []
        out.append(100.0 * (statistics.fmean(x for x, _ in seg) / mb - 1.0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres summarize-grid", description="collect the grid's training runs")
    p.add_argument("--settings", required=True, help="resolved settings JSON of the scale")
    p.add_argument("--runs", required=True, help="folder holding one sub-folder per run id")
    p.add_argument("--published", required=True, help="reports/published.yaml (claim ids)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    started = now()
    settings = read_json(args.settings)
    runs_root = Path(args.runs)

    published = load_published(args.published)
    result = summarize(settings, {run.run_id: runs_root / run.run_id for run in plan(settings)}, set(published), published)
    result["provenance"] = provenance(settings, started=started)
    atomic_write_json(args.out, result)
    log.info("grid: %d runs, %d claims -> %s", len(result["runs"]), len(result["claims"]), args.out)
    return 0
