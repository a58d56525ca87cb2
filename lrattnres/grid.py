"""The experiment grid: which training runs a scale makes, and what their results say.

Planning (:func:`plan`) turns a scale's ``grid`` settings into the list of runs of Sections 4.2-4.5 and
Appendix C: the rank/grouping sweep and the baseline on the main preset, extra seeds of the headline
pair, the full-width-RMS control, the projected-key configurations and the size pair.  At the paper
scale that is exactly the paper's run list (48 runs).  Runs are deduplicated by id, so a grid point
that serves two roles trains once.

Summarising (``python -m lrattnres summarize-grid``) reads every run's ``result.json`` and
``metrics.jsonl`` and writes the grid result: the per-run table, validation curves, gradient-norm
traces, and the claims of the training sections (Table 5 losses, Section 4.2-4.5, Appendix A).
Runs of the small scales are reported under the paper's row ids by analogy (same method and N, the
same r/d ratio); their value claims show "different scale".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lrattnres.accounting import added_flops
from lrattnres.config import deep_merge, resolve_rank
from lrattnres.errors import InputError
from lrattnres.io import atomic_write_json, read_json
from lrattnres.presets import get_preset
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.grid")

# The paper's sweep axes: a small-scale run maps to a paper row when its N is one of these and its
# r/d ratio lands on one of the paper's ranks at d = 1024.
PAPER_D = 1024
PAPER_RANKS = (16, 32, 64, 128, 256, 512, 768, 1024)
PAPER_BLOCKS = ("full", 4, 8, 16)
PAIR_SIZES = ("1b", "4b")
# The roles of Section 4.4 map onto the paper's rows whatever their N and r at a small scale.
HEADLINE_LR, HEADLINE_ATTNRES, CONTROL = "lr.n8.r128", "attnres.n8.r1024", "lr-fullrms.n8.r128"


@dataclass(frozen=True)
class Run:
    """One training run of the grid."""

    preset: str
    method: str  # baseline | attnres | lr | lr-fullrms | plr
    blocks: int | str | None  # None for the baseline
    rank: int | None  # None for the baseline
    seed: int
    steps: int | None = None  # overrides the scale's training length (the size pair)
    roles: tuple[str, ...] = field(default=(), compare=False)

    @property
    def run_id(self) -> str:
        if self.method == "baseline":
            return f"{self.preset}-baseline-s{self.seed}"
        return f"{self.preset}-{self.method}-n{self.blocks}-r{self.rank}-s{self.seed}"

    def model(self) -> dict[str, Any]:
        m: dict[str, Any] = {"preset": self.preset, "method": self.method}
        if self.method != "baseline":
            m.update(blocks=self.blocks, rank=self.rank)
        return m


def _routed(preset: str, blocks, rank, seed: int, *, method: str | None = None, steps=None, role: str) -> Run:
    d = get_preset(preset)["d_model"]
    r = resolve_rank(rank, d, where=f"grid ({role})")
    method = method or ("attnres" if r == d else "lr")
    return Run(preset, method, blocks, r, seed, steps, (role,))


def plan(settings: dict) -> list[Run]:
    """Every training run of the scale, deduplicated, in a stable order."""
    grid, presets = settings["grid"], settings["presets"]
    main = presets["main"]
    d_main = get_preset(main)["d_model"]
    runs: list[Run] = [Run(main, "baseline", None, None, 0, roles=("baseline",))]
    for blocks in grid["blocks"]:
        for rank in grid["ranks"]:
            runs.append(_routed(main, blocks, rank, 0, role="sweep"))
    if "headline" in grid:
        h = grid["headline"]
        for seed in range(grid.get("seeds", 1)):
            runs.append(_routed(main, h["blocks"], h["rank"], seed, method="lr", role="seeds"))
            runs.append(_routed(main, h["blocks"], d_main, seed, method="attnres", role="seeds"))
    if "control" in grid:
        c = grid["control"]
        runs.append(_routed(main, c["blocks"], c["rank"], 0, method="lr-fullrms", role="control"))
    for p in grid.get("projected", []):
        runs.append(_routed(main, p["blocks"], p["rank"], 0, method="plr", role="projected"))
    if "pair" in grid:
        pair = grid["pair"]
        for size_role in ("small", "large"):
            preset = presets[size_role]
            d = get_preset(preset)["d_model"]
            steps = pair.get("steps")
            runs.append(_routed(preset, pair["blocks"], d, 0, method="attnres", steps=steps, role=f"pair-{size_role}"))
            runs.append(_routed(preset, pair["blocks"], pair["rank"], 0, method="lr", steps=steps, role=f"pair-{size_role}"))
    merged: dict[str, Run] = {}
    for run in runs:
        if run.run_id in merged:
            old = merged[run.run_id]
            merged[run.run_id] = Run(**{**asdict(old), "roles": tuple(dict.fromkeys(old.roles + run.roles))})
        else:
            merged[run.run_id] = run
    return list(merged.values())


def train_spec(settings: dict, run: Run) -> dict:
    """The training spec of one run: the recipe, the scale's training settings, the run's model."""
    recipe = dict(settings["recipe"])
    model = run.model()
    for key in ("router", "attention", "norm_eps", "stream_dtype"):
        if key in recipe:
            model[key] = recipe.pop(key)
    spec = deep_merge(recipe, settings["train"])
    spec["model"] = model
    spec["seed"] = run.seed
    if run.steps is not None:
        spec.pop("tokens", None)
        spec["steps"] = run.steps
    return spec


# ----------------------------------------------------------------------------------- summarising


def paper_row(run: dict, d_model: int) -> str | None:
    """The paper's row key (``lr.n8.r128``) this run stands for, or None if it has no analogue."""
    if run["method"] == "baseline":
        return "baseline"
    blocks = run["blocks"]
    if blocks not in PAPER_BLOCKS:
        return None
    ratio = run["rank"] / d_model
    paper_r = round(ratio * PAPER_D)
    if paper_r not in PAPER_RANKS or not math.isclose(paper_r / PAPER_D, ratio, rel_tol=1e-9):
        return None
    return f"{run['method']}.n{blocks}.r{paper_r}"


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


def summarize(settings: dict, run_dirs: dict[str, Path], known_ids=None) -> dict:
    """The grid result: per-run table, curves and the claims of the training sections.

    ``known_ids``: the published claim ids; claims without a published counterpart (a small-scale
    run whose analogue the paper did not train) are left out of ``claims`` but stay in the table.
    """
    runs = plan(settings)
    table = []
    for run in runs:
        folder = run_dirs[run.run_id]
        result = read_json(folder / "result.json")
        ce = result.get("final_val_ce") if isinstance(result, dict) else None
        ok = ce is None or isinstance(ce, (int, float)) and not isinstance(ce, bool)
        if not isinstance(result, dict) or "final_val_ce" not in result or not ok:
            raise InputError(f"{folder / 'result.json'}: field 'final_val_ce' is {ce!r}; expected a number or null "
                             "(the result of a training run)")
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
            "final_val_ce": result["final_val_ce"],
            "steps": result.get("steps"),
            "tokens": result.get("tokens"),
            "data_epochs": result.get("data_epochs"),
            "wall_s": result.get("wall_s"),
            "tokens_per_s": result.get("tokens_per_s"),
            "grad_norm": result.get("grad_norm"),
            "val_curve": val,
            "grad_norm_trace": [s["grad_norm"] for s in steps],
        }
        row["paper_row"] = paper_row(row, d)
        table.append(row)
    produced = claims(settings, table)
    if known_ids is not None:
        dropped = sorted(set(produced) - set(known_ids))
        if dropped:
            log.info("no published counterpart, not claimed: %s", ", ".join(dropped))
        produced = {k: v for k, v in produced.items() if k in known_ids}
    return {"stage": "grid", "scale": settings["scale"], "runs": table, "claims": produced}


def _loss(rows: list[dict], **match) -> float | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r["final_val_ce"]
    return None


def claims(settings: dict, rows: list[dict]) -> dict[str, dict]:
    """Claims of Sections 4.2-4.5 / Appendix A from the run table (see reports/published.yaml)."""
    out: dict[str, dict] = {}
    scale = settings["scale"]
    note = "" if scale == "paper" else f"{scale} scale: analogous run (same method and N, same r/d)"

    def put(cid: str, value, text: str = "") -> None:
        if value is not None:
            out[cid] = {"reproduced": value, "note": "; ".join(t for t in (text, note) if t)}

    main = settings["presets"]["main"]
    seed0 = [r for r in rows if r["preset"] == main and r["seed"] == 0]
    sweep = [r for r in seed0 if "sweep" in r["roles"] or "baseline" in r["roles"] or r["method"] in ("plr", "lr-fullrms")]

    # Table 5 / Appendix A losses of seed 0 on the main preset
    for r in sweep:
        if r["paper_row"]:
            key = "table5.val_loss.baseline" if r["method"] == "baseline" else f"table5.val_loss.{r['paper_row']}"
            put(key, r["final_val_ce"], r["run_id"])

    base = _loss(seed0, method="baseline")
    routed = [r for r in seed0 if "sweep" in r["roles"] or r["method"] in ("plr", "lr-fullrms")]
    if base is not None and routed:
        beat = [r for r in routed if r["final_val_ce"] < base]
        put("sec4.2.routed_beat_baseline", len(beat) == len(routed), f"{len(beat)} of {len(routed)} routed runs below the baseline {base:.4f}")
    sweep_only = [r for r in seed0 if "sweep" in r["roles"]]
    endpoints = {r["blocks"]: r["final_val_ce"] for r in sweep_only if r["method"] == "attnres"}
    lowrank = [r for r in sweep_only if r["method"] == "lr" and r["blocks"] in endpoints]
    if lowrank:
        wins = sum(r["final_val_ce"] < endpoints[r["blocks"]] for r in lowrank)
        put("sec4.2.lowrank_beat_endpoint", wins, f"{wins} of {len(lowrank)} low-rank configurations beat r=d at the same N")
    if sweep_only:
        best = min(sweep_only, key=lambda r: r["final_val_ce"])
        put("sec4.2.best_is_lowrank", best["rank"] < best["d_model"], f"best: {best['run_id']} ({best['final_val_ce']:.4f})")
        best_lr = min((r for r in sweep_only if r["method"] == "lr"), key=lambda r: r["final_val_ce"], default=None)
        if best_lr:
            put("sec4.2.best_config", best_lr["paper_row"] or best_lr["run_id"], best_lr["run_id"])
            put("sec4.2.best_val_loss", best_lr["final_val_ce"], best_lr["run_id"])

    # Section 4.4: seeds and the control
    h = settings["grid"].get("headline")
    if h:
        d = next(r["d_model"] for r in seed0)
        hr = resolve_rank(h["rank"], d, where="grid.headline.rank")
        lr_runs = {r["seed"]: r["final_val_ce"] for r in rows if r["preset"] == main and r["method"] == "lr" and r["blocks"] == h["blocks"] and r["rank"] == hr}
        at_runs = {r["seed"]: r["final_val_ce"] for r in rows if r["preset"] == main and r["method"] == "attnres" and r["blocks"] == h["blocks"]}
        prow_lr, prow_at = HEADLINE_LR, HEADLINE_ATTNRES
        for seed in sorted(lr_runs):
            put(f"appA.val_loss.{prow_lr}.s{seed}", lr_runs[seed])
        for seed in sorted(at_runs):
            put(f"appA.val_loss.{prow_at}.s{seed}", at_runs[seed])
        pairs = sorted(set(lr_runs) & set(at_runs))
        if pairs:
            reductions = [at_runs[s] - lr_runs[s] for s in pairs]
            put("sec4.4.paired_reduction_all_positive", all(x > 0 for x in reductions), f"reductions per seed: {', '.join(f'{x:+.4f}' for x in reductions)}")
            put("sec4.4.paired_reduction_mean", statistics.fmean(reductions))
        if len(lr_runs) >= 2:
            put(f"sec4.4.val_loss_mean.{prow_lr}", statistics.fmean(lr_runs.values()))
            put(f"sec4.4.val_loss_sd.{prow_lr}", statistics.stdev(lr_runs.values()))
        if len(at_runs) >= 2:
            put(f"sec4.4.val_loss_mean.{prow_at}", statistics.fmean(at_runs.values()))
            put(f"sec4.4.val_loss_sd.{prow_at}", statistics.stdev(at_runs.values()))
        c = settings["grid"].get("control")
        if c:
            cr = resolve_rank(c["rank"], d, where="grid.control.rank")
            ctrl = _loss(seed0, method="lr-fullrms", blocks=c["blocks"], rank=cr)
            sl = _loss(seed0, method="lr", blocks=c["blocks"], rank=cr)
            at = _loss(seed0, method="attnres", blocks=c["blocks"])
            if ctrl is not None:
                put(f"appA.val_loss.{CONTROL}", ctrl)
            if ctrl is not None and at is not None:
                put("sec4.4.fullrms_beats_attnres", ctrl < at, f"control {ctrl:.4f} vs AttnRes {at:.4f}")
            if ctrl is not None and sl is not None and at is not None:
                gain = at - sl
                put("sec4.4.fullrms_close_to_slice", abs(ctrl - sl) < 0.5 * abs(gain) if gain > 0 else False,
                    f"|control - slice| = {abs(ctrl - sl):.4f}; slice gain over AttnRes {gain:+.4f}")

    # Section 4.5 / Table 1: the size pair
    for size_role, size in zip(("small", "large"), PAIR_SIZES):
        pair = [r for r in rows if f"pair-{size_role}" in r["roles"]]
        at = _loss(pair, method="attnres")
        lr = _loss(pair, method="lr")
        if at is not None:
            put(f"table1.val_loss.{size}.attnres", at, next(r["run_id"] for r in pair if r["method"] == "attnres"))
        if lr is not None:
            put(f"table1.val_loss.{size}.lr", lr, next(r["run_id"] for r in pair if r["method"] == "lr"))
        if at is not None and lr is not None:
            put(f"sec4.5.val_loss_reduction.{size}", at - lr)
            put(f"sec4.5.lr_lower_loss.{size}", lr < at, f"LR {lr:.4f} vs AttnRes {at:.4f}")
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
    from lrattnres.claims import load_published

    known = set(load_published(args.published))
    result = summarize(settings, {run.run_id: runs_root / run.run_id for run in plan(settings)}, known)
    result["provenance"] = provenance(settings, started=started)
    atomic_write_json(args.out, result)
    log.info("grid: %d runs, %d claims -> %s", len(result["runs"]), len(result["claims"]), args.out)
    return 0


# ------------------------------------------------------------------------ runs of the later stages

SIZE_OF_ROLE = {"sweep": "0.5b", "pair-small": "1b", "pair-large": "4b"}


def _claim_size(run: Run, order=("pair-large", "pair-small", "sweep")) -> str | None:
    """Which of the paper's model sizes a run stands for (its first role, in ``order``, that has one)."""
    for role in order:
        if role in run.roles:
            return SIZE_OF_ROLE[role]
    return None


def conversions(settings: dict) -> list[dict]:
    """Section 4.8: every standard AttnRes run of seed 0 is converted to the scale's conversion rank.

    ``settings["convert"]["rank"]`` maps a preset name to its rank (an int, ``"d/<k>"`` or ``"k"``
    for the checkpoint's joint query rank)."""
    ranks = settings.get("convert", {}).get("rank", {})
    out = []
    for run in plan(settings):
        if run.method != "attnres" or run.seed != 0:
            continue
        size = _claim_size(run, order=("sweep", "pair-small", "pair-large"))
        out.append({
            "run_id": run.run_id,
            "rank": ranks.get(run.preset, "k"),
            "claim_row": f"{size}.n{run.blocks}" if size else None,
        })
    return out


def evaluations(settings: dict) -> list[dict]:
    """Appendix G: the size pair's runs are evaluated downstream, standing for 1B and 4B."""
    out = []
    for run in plan(settings):
        for role in ("pair-small", "pair-large"):
            if role in run.roles:
                out.append({"run_id": run.run_id, "claim_size": SIZE_OF_ROLE[role]})
                break
    return out
