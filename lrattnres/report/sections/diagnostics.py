"""Report section: routing diagnostics (Sections 4.6-4.7, Appendices C.4, C.5, D.1, E.2, G.1;
Figures 4, 6, 7, 8 and 10 right; Tables 6 and 9)."""

from __future__ import annotations

import math
from typing import Any

from lrattnres.report.html import badge, claims_table, esc, figure, fmt, table

TITLE = "Routing diagnostics (Sections 4.6-4.7, Appendices C-E, G.1; Figures 4, 6-8, 10; Tables 6, 9)"
ORDER = 50

METHOD_NAMES = {"baseline": "Baseline", "attnres": "AttnRes", "lr": "LR-AttnRes", "lr-fullrms": "LR-AttnRes (full RMS)",
                "plr": "Projected LR-AttnRes"}
SIZES = ("1b", "4b")
T6_GROUPS = (("kda_pre_attention", "KDA pre-attention"), ("full_pre_attention", "Full pre-attention"),
             ("pre_mlp", "Pre-MLP"), ("final_output", "Final output"), ("all", "All active queries"))
OUR_GROUPS = (("pre_attention", "pre-attention"), ("pre_mlp", "pre-MLP"), ("final_output", "final output"),
              ("all", "all"))
DISPLAY_CAP = 4.0  # Figure 10: norms capped at 4 for display, as in the paper


def _result(ctx) -> dict | None:
    results = ctx.results("diagnostics")
    return results[-1] if results else None


def _num(x: Any, digits: int = 4) -> str:
    if x is None or isinstance(x, bool):
        return fmt(x)
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.1f}"


def _cells(ctx, cid: str, digits: int = 4) -> list[str]:
    """published, reproduced, verdict badge of a claim id."""
    rec = ctx.published.get(cid)
    if rec is None:
        return ["–", "–", ""]
    c = ctx.claims.get(cid, {})
    return [esc(_num(rec.get("published"), digits)), esc(_num(c.get("reproduced"), digits)), badge(c.get("verdict"))]


def _label(run: dict) -> str:
    if run["method"] == "baseline":
        return "baseline"
    return f"{METHOD_NAMES.get(run['method'], run['method'])} N={run['blocks']} r={run['rank']}"


def _paper_r(run: dict) -> str:
    r = run.get("r_over_d")
    return "" if r is None else f" (r/d = 1/{1 / r:g}, paper r = {round(r * 1024)})" if r < 1 else " (r = d)"


# ----------------------------------------------------------------------------------- figures


def _int_ticks(ax, y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _fig4(res: dict) -> str:
    import matplotlib.pyplot as plt

    curves = res.get("figures_data", {}).get("fig4") or []
    if not curves:
        return '<p class="note">Figure 4: no full-routing run at this scale.</p>'
    fig, ax = plt.subplots()
    cmap = plt.get_cmap("viridis")
    for i, c in enumerate(curves):
        x = list(range(1, len(c["n_eff"]) + 1))
        ax.plot(x, c["n_eff"], marker=".", color=cmap(i / max(1, len(curves) - 1)),
                label=f"r={c['rank']} (paper r={c['paper_r']})" + (" AttnRes" if c["method"] == "attnres" else ""))
    n = len(curves[0]["n_eff"])
    ax.plot(range(1, n + 1), [t + 1 for t in range(1, n + 1)], ls=":", color="grey", label="uniform (S_t)")
    _int_ticks(ax)
    ax.set_xlabel("read site t (after write t; the last feeds the head)")
    ax.set_ylabel("N_eff = exp(H)")
    ax.set_title("Full routing: effective number of sources")
    ax.legend(fontsize=8)
    return figure(fig, "Figure 4 (reproduced): token-averaged effective number of sources per read site, full "
                       "LR-AttnRes rank sweep of this scale, one curve per rank. The paper's final-site values are "
                       "44.57 (r=16), 29.85 (r=512) and 27.42 (r=768) of 49 sources.", fig_id="fig4")


def _fig6(res: dict) -> str:
    import matplotlib.pyplot as plt

    f6 = res.get("figures_data", {}).get("fig6") or {}
    runs = {m: r for m, r in (f6.get("runs") or {}).items() if r}
    full = f6.get("full") or []
    if not runs and not full:
        return '<p class="note">Figure 6: no AttnRes, projected or sliced runs to compare at this scale.</p>'
    panels = (1 if runs else 0) + (1 if full else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.0), squeeze=False, layout="constrained")
    axes = list(axes[0])
    styles = {"attnres": ("AttnRes", "tab:red"), "plr": ("Projected", "tab:blue"), "lr": ("Sliced", "tab:green")}
    if runs:
        ax = axes.pop(0)
        for m in ("attnres", "plr", "lr"):
            r = runs.get(m)
            if r:
                name, color = styles[m]
                ax.plot(range(1, len(r["n_eff"]) + 1), r["n_eff"], marker="o", ms=3, color=color,
                        label=f"{name} r={r['rank']} ({r['run_id']})")
        _int_ticks(ax)
        ax.set_xlabel("read site t")
        ax.set_ylabel("N_eff = exp(H)")
        ax.set_title(f"Block routing, N = {f6.get('blocks')} (stands for the paper's N = 8)", fontsize=10)
        ax.legend(fontsize=8)
    if full:
        ax = axes.pop(0)
        for r in full:
            name, color = styles[r["method"]]
            ax.plot(range(1, len(r["n_eff"]) + 1), r["n_eff"], marker=".", color=color,
                    ls={"plr": "--", "lr": "-", "attnres": ":"}[r["method"]], alpha=0.6 + 0.4 * (r["method"] != "lr"),
                    label=f"{name} r={r['rank']}")
        _int_ticks(ax)
        ax.set_xlabel("read site t")
        ax.set_ylabel("N_eff = exp(H)")
        ax.set_title("Full routing: projected vs sliced at matched ranks", fontsize=10)
        ax.legend(fontsize=8)
    return figure(fig, "Figure 6 (reproduced): effective number of sources by method: standard AttnRes, projected and "
                       "sliced keys at the N = 8 analogue, and full routing at the projected runs' ranks. The paper "
                       "reports final-read values 3.62 (AttnRes), 5.65 (projected r=32) and 5.47 (sliced r=64) at N = 8.",
                  fig_id="fig6")


def _fig8(res: dict) -> str:
    import matplotlib.pyplot as plt
    import numpy as np

    fd = res.get("figures_data", {}).get("fig8") or {}
    runs = res.get("runs", {})
    rows = [[runs[i] for i in fd.get(k, []) if i in runs and runs[i].get("heatmap")] for k in ("top", "bottom")]
    rows = [r for r in rows if r]
    if not rows:
        return '<p class="note">Figure 8: no routed run with a heatmap.</p>'
    ncol = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), ncol, figsize=(4.2 * ncol, 3.6 * len(rows)), squeeze=False,
                             layout="constrained")
    for i, row in enumerate(rows):
        mats = [np.array([[np.nan if v is None else v for v in line] for line in r["heatmap"]], dtype=float).T
                for r in row]
        vmax = max(float(np.nanmax(m)) for m in mats)
        for j in range(ncol):
            ax = axes[i][j]
            if j >= len(row):
                ax.axis("off")
                continue
            im = ax.imshow(np.ma.masked_invalid(mats[j]), origin="lower", aspect="auto", vmin=0, vmax=vmax,
                           cmap="magma", extent=(0.5, mats[j].shape[1] + 0.5, -0.5, mats[j].shape[0] - 0.5))
            ax.set_title(_label(row[j]), fontsize=9)
            _int_ticks(ax, y=True)
            ax.set_xlabel("read site t")
            ax.set_ylabel("source (0 = embedding)")
            ax.grid(False)
        fig.colorbar(im, ax=list(axes[i]), shrink=0.8)
    return figure(fig, "Figure 8 (reproduced): mean depth-wise attention weights, source index by read site. Top: "
                       "full routing at three ranks; bottom: AttnRes, projected and sliced at the N = 8 analogue. "
                       "Source 0 is the embedding; source j >= 1 is block j (write o_j for full routing; a read inside "
                       "block j sees its partial sum in the same row). Empty cells: sources a read cannot see. Each "
                       "row of panels has its own colour scale (the paper fixes 0.345 and 0.883).", fig_id="fig8")


def _fig7(res: dict) -> str:
    import matplotlib.pyplot as plt

    f7 = res.get("figures_data", {}).get("fig7") or {}
    series = f7.get("series") or {}
    if not series:
        return '<p class="note">Figure 7: no routed run with gradient norms.</p>'
    fig, ax = plt.subplots()
    for key, pts in sorted(series.items()):
        method, n = key.split(".n", 1)
        ax.plot([p["paper_r"] for p in pts], [p["mean"] for p in pts], marker="o", ms=4,
                ls="--" if method == "plr" else "-",
                label=f"{METHOD_NAMES.get(method, method)} N={n}" + (" (r = d: AttnRes)" if method == "lr" else ""))
    if f7.get("baseline") is not None:
        ax.axhline(f7["baseline"], color="black", lw=1, ls=":", label="baseline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("routing-key rank as the paper's r (r/d x 1024)")
    ax.set_ylabel("mean pre-clipping gradient norm")
    ax.legend(fontsize=8)
    return figure(fig, "Figure 7 (reproduced): mean gradient norm against routing-key rank for sliced, projected and "
                       "full-width-RMS routing, over every training step of each run.", fig_id="fig7")


def _fig10(res: dict) -> str:
    import matplotlib.pyplot as plt

    f10 = res.get("figures_data", {}).get("fig10") or {}
    if not f10:
        return '<p class="note">Figure 10 (right): no size-pair run at this scale.</p>'
    sizes = [s for s in SIZES if s in f10]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(7, 3.2 * len(sizes)), squeeze=False, layout="constrained")
    colors = {"attnres": "tab:red", "lr": "tab:blue"}
    window = None
    for ax, size in zip(axes[:, 0], sizes):
        for m in ("attnres", "lr"):
            tr = f10[size].get(m)
            if not tr:
                continue
            window = tr.get("window")
            norms = [None if v is None else min(v, DISPLAY_CAP) for v in tr["norm"]]
            ax.plot(tr["step"], [math.nan if v is None else v for v in norms], color=colors[m], alpha=0.25, lw=0.6)
            ax.plot(tr["step"], [min(v, DISPLAY_CAP) for v in tr["trailing_mean"]], color=colors[m], lw=1.8,
                    label=f"{METHOD_NAMES[m]} ({tr['run_id']})")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_title(f"size pair standing for {size.upper()}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("pre-clip grad norm")
        ax.legend(fontsize=8)
    return figure(fig, f"Figure 10, right (reproduced): pre-clipping gradient norms of the size pair, capped at "
                       f"{DISPLAY_CAP:g} for display; faint: each step, solid: trailing {window}-step mean (the paper: "
                       "1,000 steps, from 3B to 20B tokens). Dotted: the clip threshold 1.", fig_id="fig10")


# ------------------------------------------------------------------------------------ tables


def _n_eff_table(ctx, res: dict | None) -> str:
    rows = []
    for cid, rec in ctx.published.items():
        if ".n_eff_final." not in cid:
            continue
        row = rec["row"]
        c = ctx.claims.get(cid, {})
        rows.append([esc(rec["source"]), esc(METHOD_NAMES.get(row["method"], row["method"])), esc(row.get("N")),
                     esc(row.get("r")), *_cells(ctx, cid), esc(c.get("note", ""))])
    caption = ("Final-read effective number of sources quoted by the paper (Section 4.6, Appendix D.1), beside this "
               "scale's analogous run where the scale has one (same method and N, same r/d, or the same role).")
    out = [table(["source", "method", "N", "r", "paper", "reproduced", "verdict", "note"], rows, caption, raw=True)]
    direction = [ctx.claims[c] for c in ("sec4.6.n_eff_full_decreases_with_rank", "sec4.6.n_eff_falls_r16_to_r512",
                                         "sec4.6.loss_improves_r16_to_r512", "sec4.6.broader_routing_not_lower_loss",
                                         "appD.1.lowrank_broader_final_read.n8") if c in ctx.claims]
    if direction:
        out.append(claims_table(direction, "Direction claims on N_eff"))
    if res:
        runs = [r for r in res.get("runs", {}).values() if r.get("n_eff")]
        if runs:
            out.append(table(
                ["run", "method", "N", "r", "sources at final read", "N_eff first read", "N_eff final read", "tokens"],
                [[r["run_id"], METHOD_NAMES.get(r["method"], r["method"]), r["blocks"], r["rank"],
                  (r.get("sources") or [None])[-1], r["n_eff"][0], r["n_eff"][-1], r.get("tokens")] for r in runs],
                "Every routed run of this scale: N_eff at the first and the final read."))
    return "\n".join(out)


def _table9(ctx, res: dict | None) -> str:
    pair = {}
    for r in (res or {}).get("runs", {}).values():
        for role, size in (("pair-small", SIZES[0]), ("pair-large", SIZES[1])):
            if role in r.get("roles", []):
                pair[(size, r["method"])] = r["run_id"]
    rows = []
    for size in SIZES:
        for m in ("attnres", "lr"):
            cells = []
            for q in ("grad_norm_mean", "grad_norm_var", "above_clip_pct"):
                cells += _cells(ctx, f"table9.{q}.{size}.{m}")
            run = pair.get((size, m), "")
            rows.append([esc(size.upper()), esc(METHOD_NAMES[m]), *cells, esc(run)])
    headers = ["model", "method", "mean paper", "ours", "verdict", "variance paper", "ours", "verdict",
               "above 1 (%) paper", "ours", "verdict", "our run"]
    out = [table(headers, rows, "Table 9: full-run pre-clipping gradient-norm statistics (population variance; "
                                "share of steps above the clip threshold 1). Our rows: the small size pair of this "
                                "scale standing for 1B/4B.", raw=True)]
    g1 = [c for cid, c in ctx.claims.items() if cid.startswith("appG.1.")]
    if g1:
        out.append(claims_table(g1, "Appendix G.1: reductions and directions at each size pair"))
    return "\n".join(out)


def _c5(ctx) -> str:
    c5 = [c for cid, c in ctx.claims.items() if cid.startswith("appC.5.")]
    return claims_table(c5, "Appendix C.5: mean gradient norms of the sweep and their directions") if c5 else ""


def _grad_table(res: dict) -> str:
    rows = []
    for r in res.get("runs", {}).values():
        g = r.get("grad_norm") or {}
        rows.append([r["run_id"], _label(r) + _paper_r(r), g.get("count"), g.get("mean"), g.get("var"),
                     g.get("above_clip_pct"), g.get("clip")])
    return table(["run", "configuration", "steps", "mean", "variance", "above clip (%)", "clip"], rows,
                 "Gradient-norm statistics of every run of this scale (pre-clipping norms of every step).")


def _table6(ctx, res: dict | None) -> str:
    rows = []
    for g, label in T6_GROUPS:
        rows.append([label] + [ctx.published.get(f"table6.{q}.{g}", {}).get("published")
                               for q in ("count", "d_eff_mean", "d_eff_median", "zero_frac_pct")])
    out = ['<p>Appendix E analyses the 186 active folded static queries of Kimi K3 (width d = 7168). Kimi K3 and its '
           "checkpoint are out of this project's reach: its Table 6 numbers are shown as published (not reproduced, "
           "stage none), and beside them the same statistics for the static queries of <b>our</b> checkpoints, which "
           "are different, far smaller models (query width r, weightless routing norms so no folding is needed). "
           "D_eff = exp(-sum_j p_j log p_j) with p_j = q_j^2 / sum_k q_k^2; zeros are exact (no tolerance).</p>",
           table(["query group (Kimi K3)", "count", "mean D_eff", "median D_eff", "mean zeros (%)"], rows,
                 "Table 6 (published, Kimi K3, d = 7168): folded-query utilisation by site type. Mean D_eff of all "
                 "queries is 8.4% of the width.")]
    if res:
        ours = []
        for r in res.get("runs", {}).values():
            qu = r.get("query_util")
            if not qu:
                continue
            grp = qu.get("groups", {})
            ours.append([r["run_id"], _label(r), qu.get("width"), grp.get("all", {}).get("count")]
                        + [grp.get(g, {}).get("d_eff_mean") for g, _ in OUR_GROUPS]
                        + [grp.get("all", {}).get("d_eff_median"),
                           None if qu.get("d_eff_frac") is None else 100 * qu["d_eff_frac"],
                           None if qu.get("zero_frac") is None else 100 * qu["zero_frac"]])
        if ours:
            out.append(table(["run (our model)", "configuration", "width r", "queries"]
                             + [f"mean D_eff {lab}" for _, lab in OUR_GROUPS]
                             + ["median D_eff all", "mean D_eff / r (%)", "mean zeros (%)"], ours,
                             "Our checkpoints' static queries (a different model from Table 6's): pre-attention = "
                             "reads after even writes (the first, embedding-only read has no query), pre-MLP = reads "
                             "after odd writes, final output = the read feeding the head."))
    return "\n".join(out)


# ------------------------------------------------------------------------------------- build


def build(ctx) -> str:
    res = _result(ctx)
    parts = []
    if res is None:
        parts.append('<p class="notrun">The diagnostics stage has not run at this scale; the published numbers are '
                     "shown alone.</p>")
    else:
        s = res.get("settings", {})
        tokens = sorted({r.get("tokens") for r in res.get("runs", {}).values() if r.get("tokens")})
        parts.append(
            f"<p>Held-out tokens per routed run: {esc(', '.join(f'{t:,}' for t in tokens) or '–')} from the "
            f"{esc(s.get('split', 'val'))} split in order (the paper: 1,007,616). N_eff(t, x) = exp(H(alpha_t(x))) "
            "(Eq. 14) is averaged over tokens per read site; read t follows write t, the final read feeds the head. "
            + ("" if ctx.paper_runs else
               f"Scale {esc(ctx.scale)}: runs stand for the paper's rows by method, N and r/d (or by role); value "
               "claims show \"different scale\", directions are checked.") + "</p>")
    parts.append("<h3>Effective number of sources (Section 4.6, Appendices C.4 and D.1)</h3>")
    if res:
        parts += [_fig4(res), _fig6(res)]
    parts.append(_n_eff_table(ctx, res))
    parts.append("<h3>Mean attention heatmaps (Appendix D.1)</h3>")
    parts.append(_fig8(res) if res else '<p class="note">Figure 8: not run.</p>')
    parts.append("<h3>Gradient norms (Section 4.7, Appendices C.5 and G.1)</h3>")
    if res:
        parts.append(_fig7(res))
    parts.append(_c5(ctx))
    parts.append(_table9(ctx, res))
    if res:
        parts += [_fig10(res), _grad_table(res)]
    parts.append("<h3>Static-query utilisation (Appendix E.2, Table 6)</h3>")
    parts.append(_table6(ctx, res))
    return "\n".join(p for p in parts if p)
