"""Training results: Table 5 losses, Figure 1, the seed replication (Figure 2, Appendix A), the control,
the size pair (Table 1 losses) and the validation curves (Figure 10, left)."""

from __future__ import annotations

import statistics

from lrattnres import run_health
from lrattnres.checks import is_number
from lrattnres.report.html import badge, claims_table, effect, esc, figure, fmt, fmt_interval, table, verdict_cell

TITLE = "Training runs: rank/grouping sweep, seeds, control, size pair (Sections 4.2-4.5, Table 5, Table 1)"
ORDER = 20

METHOD_LABEL = {
    "baseline": "Baseline Transformer",
    "attnres": "AttnRes (r = d)",
    "lr": "LR-AttnRes (slice)",
    "lr-fullrms": "LR-AttnRes (full RMS)",
    "plr": "Projected LR-AttnRes",
}
COLORS = {"baseline": "black", "attnres": "tab:blue", "lr": "tab:orange", "lr-fullrms": "tab:green", "plr": "tab:purple"}


def _published_table5(ctx) -> list[dict]:
    """Table 5 rows of the published file: method, N, r, added FLOPs, val loss."""
    rows = {}
    for rec in ctx.published.values():
        if rec["source"] != "Table 5" or rec["quantity"] not in ("added_flops_pct", "val_loss"):
            continue
        row = rec["row"]
        key = (row.get("method"), str(row.get("N")), row.get("r"))
        rows.setdefault(key, {"method": row.get("method"), "N": row.get("N"), "r": row.get("r")})[rec["quantity"]] = rec["published"]
    return list(rows.values())


def _figure1(ctx, runs) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, points, title in (
        (axes[0], [(r["method"], r["added_flops_pct"], r["final_val_ce"]) for r in runs], f"reproduced ({ctx.scale} scale)"),
        (axes[1], [(p["method"], p.get("added_flops_pct"), p.get("val_loss")) for p in _published_table5(ctx)], "published (0.5B, 10B tokens)"),
    ):
        for method in COLORS:
            xs = [x for m, x, y in points if m == method and x is not None and y is not None]
            ys = [y for m, x, y in points if m == method and x is not None and y is not None]
            if xs:
                ax.scatter(xs, ys, color=COLORS[method], label=METHOD_LABEL[method], s=22)
        ax.set_xlabel("added FLOPs (% of the non-embedding core)")
        ax.set_ylabel("final validation loss")
        ax.set_title(title)
    axes[1].legend(fontsize=8)
    return figure(fig, "Figure 1: validation loss against added routing FLOPs, by method (left: this run; right: the paper's Table 5).", fig_id="figure-1")


def _curves(runs, caption, fig_id) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        curve = [p for p in r.get("val_curve", []) if p.get("ce") is not None]
        if curve:
            ax.plot([p["tokens"] or p["step"] for p in curve], [p["ce"] for p in curve], marker="o", ms=3,
                    color=COLORS.get(r["method"]), label=f"{r['run_id']}")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    return figure(fig, caption, fig_id=fig_id)


def _seed_figure(at: dict, lr: dict, pub_at: list, pub_lr: list) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, a, l, title in ((axes[0], list(at.values()), list(lr.values()), "reproduced"), (axes[1], pub_at, pub_lr, "published")):
        for i, (vals, label, color) in enumerate(((a, "AttnRes", "tab:blue"), (l, "LR-AttnRes", "tab:orange"))):
            if not vals:
                continue
            mean = statistics.fmean(vals)
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            ax.bar(i, mean, yerr=sd, color=color, alpha=0.6, capsize=6)
            ax.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
        ax.set_xticks([0, 1], ["AttnRes", "LR-AttnRes"])
        lo = min(a + l) if a + l else 0
        hi = max(a + l) if a + l else 1
        ax.set_ylim(lo - 3 * (hi - lo + 1e-3), hi + 3 * (hi - lo + 1e-3))
        ax.set_ylabel("final validation loss")
        ax.set_title(title)
    return figure(fig, "Figure 2: seed replication of the headline pair (mean ± sample SD, dots are seeds).", fig_id="figure-2")


def _epoch_warning(runs, split_tokens: int | None = None) -> str:
    """A warning paragraph when any run read its training split more than once ('' otherwise)."""
    epochs = [r["data_epochs"] for r in runs if r.get("data_epochs")]
    if not epochs or max(epochs) <= 1:
        return ""
    held = f" (it holds {fmt(split_tokens)} tokens)" if split_tokens else ""
    return (f'<p class="notrun"><b>Read with care:</b> these runs read their training split up to {max(epochs):.1f} '
            f"times{held}. Past one epoch the validation loss measures memorisation as well as modelling; the gap "
            "between training and validation loss shows it. Point the scale's data stage at a larger corpus "
            '(<code>data.source</code>; README, "Scales") before reading trends from it.</p>')


def _recorded_runs(ctx) -> str:
    """Training runs recorded on another machine (``reports/recorded.yaml``, key ``gpu_grid``: each run's
    result.json with its curves): the GPU path proven through the same rules, shown as measured,
    without verdicts, with each run's distance from the baseline, its epochs over the training split
    and its validation curve."""
    rec = (getattr(ctx, "recorded", None) or {}).get("gpu_grid")
    if not isinstance(rec, dict) or not rec.get("runs"):
        return ""
    # older recordings name the method only in model_config
    runs = {k: {**r, "method": r.get("method") or r.get("model_config", {}).get("method")} for k, r in rec["runs"].items()}
    base = next((r["final_val_ce"] for r in runs.values() if r["method"] == "baseline"), None)
    rows = []
    for run_id, r in sorted(runs.items()):
        prov = r.get("provenance", {})
        mem = (r.get("memory") or {}).get("cuda_max_allocated_mib")
        delta = "–" if base is None else f"{r['final_val_ce'] - base:+.4f}"
        rows.append([run_id, r.get("steps"), f"{r.get('tokens', 0):,}", f"{r['final_val_ce']:.4f}", delta,
                     fmt(r.get("train_ce_tail")), fmt(r.get("data_epochs")),
                     f"{r.get('tokens_per_s') or 0:,.0f}", f"{r.get('train_s', 0):.0f}",
                     "–" if mem is None else f"{mem / 1024:.1f}", prov.get("device"), (prov.get("commit") or "")[:8]])
    parts = [f"<h3>Recorded runs of the gpu scale (file <code>{esc(rec.get('_path'))}</code>)</h3>",
             "<p>Run through this Snakefile's train rule on a GPU: compiled, bf16, the "
             "routed runs through the fused kernel. Too few runs for any claim; they prove the GPU path and are "
             "shown as measured. &Delta; is the final validation loss minus the baseline's; train CE is the mean "
             "training cross-entropy of the last updates.</p>",
             table(["run", "steps", "tokens", "final val. CE", "Δ vs baseline", "train CE (end)", "epochs",
                    "tokens/s", "train s", "peak GiB", "device", "commit"], rows, "Recorded gpu-scale runs")]
    parts.append(_epoch_warning(runs.values(), rec.get("train_split_tokens")))
    incomplete = rec.get("incomplete") or {}
    if incomplete:
        items = ", ".join(f"<code>{esc(k)}</code> (stopped at update {v.get('last_step')} of {v.get('steps_planned')})"
                          for k, v in sorted(incomplete.items()))
        parts.append(f"<p>Started but cut off by the recording's time limit, so left out of the table: {items}.</p>")
    curves = [{**r, "run_id": k} for k, r in sorted(runs.items()) if r.get("val_curve")]
    if curves:
        parts.append(_curves(curves, "Validation loss during the recorded gpu-scale runs (periodic points over a part of the "
                                  "held-out split; the last point over all of it).", "figure-gpu-recorded"))
    return "\n".join(parts)


def _outlier_warning(runs) -> str:
    """A warning paragraph naming every run with gradient-norm outliers ('' when none has any)."""
    flagged = [r for r in runs if r.get("grad_outliers")]
    if not flagged:
        return ""
    items = "; ".join(f"<code>{esc(r['run_id'])}</code>: {esc(run_health.describe(r['grad_outliers']))}"
                      + (f" (found by replaying {esc(r['grad_outliers_from'])})" if r.get("grad_outliers_from")
                         == run_health.FROM_REPLAY else "")
                      for r in flagged)
    return (f'<p class="notrun"><b>Gradient-norm outliers:</b> {len(flagged)} run{"s" if len(flagged) != 1 else ""} '
            f"had a pre-clip gradient norm far above its running median, or not finite (the trainer's guard, "
            f"<code>train.grad_guard</code>): {items}. Such a run may have computed wrong gradients; every claim "
            "that rests on it says so in its note.</p>")


def _outlier_cell(r) -> str:
    """'–', or how many outliers the run had and its largest norm."""
    out = r.get("grad_outliers")
    if not out:
        return "–"
    w = run_health.worst(out)
    return f"⚠ {len(out)}, largest {run_health.as_float(w.get('norm')):.3g} at update {w.get('update')}"


def _shape(ctx) -> str:
    """The sweep's shape below the paper's scale: each configuration's loss change against the same
    scale's baseline beside the paper's, and the rank correlation of the two orderings."""
    rows = []
    for cid, c in ctx.claims.items():
        if cid.startswith("table5.loss_change_pct.") and c.get("reproduced") is not None:
            rows.append([esc(cid.removeprefix("table5.loss_change_pct.")), esc(effect(c["reproduced"], "_pct")),
                         esc(effect(c["published"], "_pct")),
                         esc(fmt_interval(c.get("interval"), c.get("n"), c.get("interval_kind"))), verdict_cell(c)])
    rho = ctx.claims.get("table5.loss_order_spearman", {})
    out = ["<h3>Shape of the sweep</h3>",
           "<p>Below the paper's scale the losses themselves differ; the pattern is compared instead. Each "
           "configuration's validation loss change relative to the same scale's baseline (in %) stands beside the "
           "paper's (its best, N = 8, r = 128, is -1.77% against its baseline), judged in the paper's sign with the "
           "single-run noise of this scale; and the configurations' ordering by loss is compared with Table 5's by "
           f"Spearman's rank correlation: {badge(rho.get('verdict'))} {esc(rho.get('note', ''))}</p>"]
    if rows:
        out.append(table(["paper row", "change (this scale)", "change (paper)", "95% interval, n", "verdict"], rows,
                         "Loss change against the baseline, per configuration", raw=True))
    return "\n".join(out)


def _usable_runs(ctx, grid: dict) -> list[dict]:
    """The grid's runs; a run without a finite ``final_val_ce`` keeps its row with the loss shown as
    missing, and the problem (file and key) goes to the page's list."""
    path = grid.get("_path", "grid result")
    runs = grid.get("runs")
    if not isinstance(runs, list):
        ctx.problems.append(f"{path}: key 'runs': expected a list of runs, got {type(runs).__name__}")
        return []
    out = []
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or not isinstance(r.get("run_id"), str):
            ctx.problems.append(f"{path}: runs[{i}]: expected a run with a 'run_id'; left out")
            continue
        if not is_number(r.get("final_val_ce")):
            why = r.get("problem") or f"{path}: runs[{i}] ({r['run_id']}).final_val_ce: expected a finite number, got {r.get('final_val_ce')!r}"
            if why not in ctx.problems:
                ctx.problems.append(why)
            r = {**r, "final_val_ce": None}
        out.append(r)
    return out


def build(ctx) -> str:
    grids = ctx.results("grid")
    pub5 = _published_table5(ctx)
    parts = []
    if not grids:
        parts.append('<p class="notrun">The training grid has not run at this scale yet; the published Table 5 follows.</p>')
        parts.append(table(["method", "N", "r", "added FLOPs (%)", "val. loss"],
                           [[METHOD_LABEL.get(p["method"], p["method"]), p["N"], p["r"], p.get("added_flops_pct"), p.get("val_loss")] for p in pub5],
                           "Table 5 (published)"))
        parts.append(claims_table([c for c in ctx.claims.values() if ctx.published[c["id"]]["stage"] == "grid"], "Claims of the training sections"))
        parts.append(_recorded_runs(ctx))
        return "\n".join(parts)

    grid = grids[0]
    runs = _usable_runs(ctx, grid)
    main = ctx.settings.get("presets", {}).get("main")
    seed0 = [r for r in runs if r["preset"] == main and r["seed"] == 0]
    pub_by_row = {f"{p['method']}.n{p['N']}.r{p['r']}" if p["method"] != "baseline" else "baseline": p for p in pub5}
    parts.append(_epoch_warning(runs))
    parts.append(_outlier_warning(runs))

    # Table 5 beside the published rows
    rows = []
    for r in sorted(seed0, key=lambda r: (list(METHOD_LABEL).index(r["method"]), str(r["blocks"]), r["rank"] or 0)):
        pub = pub_by_row.get(r["paper_row"] or "", {})
        claim = ctx.claims.get("table5.val_loss.baseline" if r["method"] == "baseline" else f"table5.val_loss.{r['paper_row']}")
        rows.append([
            esc(METHOD_LABEL[r["method"]]), esc(fmt(r["blocks"])), esc(fmt(r["rank"])),
            esc(f"{r['rank'] / r['d_model']:.3g}" if r["rank"] else "–"),
            esc(fmt(r["added_flops_pct"])), esc("–" if r["final_val_ce"] is None else f"{r['final_val_ce']:.4f}"),
            esc(r["paper_row"] or "–"), esc(fmt(pub.get("added_flops_pct"))), esc(fmt(pub.get("val_loss"))),
            badge(claim["verdict"]) if claim else "",
        ])
    parts.append(table(
        ["method", "N", "r", "r/d", "added FLOPs (%)", "val. loss", "paper row", "paper FLOPs (%)", "paper loss", "verdict"],
        rows, f"Table 5 reproduced ({ctx.scale} scale, preset {main}) beside the published 0.5B rows", raw=True))
    parts.append(_figure1(ctx, seed0))
    parts.append(_shape(ctx))

    # Seeds (Section 4.4, Appendix A)
    h = ctx.settings.get("grid", {}).get("headline")
    seeds_lr = {r["seed"]: r["final_val_ce"] for r in runs
                if "seeds" in r["roles"] and r["method"] == "lr" and r["final_val_ce"] is not None}
    seeds_at = {r["seed"]: r["final_val_ce"] for r in runs
                if "seeds" in r["roles"] and r["method"] == "attnres" and r["final_val_ce"] is not None}
    if seeds_lr and seeds_at:
        pub_at = [ctx.published[f"appA.val_loss.attnres.n8.r1024.s{s}"]["published"] for s in range(3)]
        pub_lr = [ctx.published[f"appA.val_loss.lr.n8.r128.s{s}"]["published"] for s in range(3)]
        srows = []
        for s in sorted(set(seeds_lr) | set(seeds_at)):
            at, lr = seeds_at.get(s), seeds_lr.get(s)
            srows.append([s, at, lr, (at - lr) if at is not None and lr is not None else None,
                          pub_at[s] if s < 3 else None, pub_lr[s] if s < 3 else None,
                          (pub_at[s] - pub_lr[s]) if s < 3 else None])
        def msd(v):
            v = list(v)
            return f"{statistics.fmean(v):.4f} ± {statistics.stdev(v):.4f}" if len(v) > 1 else fmt(v[0] if v else None)
        srows.append(["mean ± SD", msd(seeds_at.values()), msd(seeds_lr.values()),
                      msd([seeds_at[s] - seeds_lr[s] for s in seeds_at if s in seeds_lr]),
                      msd(pub_at), msd(pub_lr), msd([a - b for a, b in zip(pub_at, pub_lr)])])
        label = f"N = {h['blocks']}, r = {h['rank']}" if h else ""
        parts.append(table(["seed", "AttnRes", f"LR-AttnRes ({label})", "paired reduction",
                            "paper AttnRes N=8", "paper LR N=8 r=128", "paper reduction"], srows,
                           "Per-seed final validation losses (Appendix A) and paired reductions (Section 4.4)"))
        parts.append(_seed_figure(seeds_at, seeds_lr, pub_at, pub_lr))

    # Size pair (Table 1 loss columns, Section 4.5)
    prow = []
    for role, size in (("pair-small", "1b"), ("pair-large", "4b")):
        pair = [r for r in runs if role in r["roles"]]
        for method in ("attnres", "lr"):
            r = next((x for x in pair if x["method"] == method), None)
            pub = ctx.published.get(f"table1.val_loss.{size}.{method}", {}).get("published")
            claim = ctx.claims.get(f"table1.val_loss.{size}.{method}")
            prow.append([esc(r["preset"] if r else "–"), esc(size.upper()), esc(METHOD_LABEL[method]),
                         esc(fmt(r["final_val_ce"] if r else None)), esc(fmt(pub)), badge(claim["verdict"]) if claim else ""])
    parts.append(table(["preset", "stands for", "method", "val. loss", "paper val. loss", "verdict"], prow,
                       "Table 1, loss columns: the size pair (AttnRes vs LR-AttnRes)", raw=True))
    pair_runs = [r for r in runs if any(x.startswith("pair-") for x in r["roles"])]
    parts.append(_curves(pair_runs, "Figure 10 (left): validation loss during training of the size pair.", "figure-10-left"))

    # Run table and claims
    parts.append("<details><summary>All runs of this scale</summary>")
    parts.append(table(["run", "roles", "val. loss", "steps", "tokens", "wall (s)", "tokens/s", "gradient-norm outliers"],
                       [[r["run_id"], ", ".join(r["roles"]), r["final_val_ce"], r["steps"], r["tokens"], r["wall_s"],
                         r["tokens_per_s"], _outlier_cell(r)] for r in runs]))
    parts.append("</details>")
    parts.append(claims_table([c for c in ctx.claims.values() if ctx.published[c["id"]]["stage"] == "grid"], "Claims of the training sections"))
    parts.append(_recorded_runs(ctx))
    return "\n".join(parts)
