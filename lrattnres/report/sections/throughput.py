"""Report section: training-step throughput (Section 4.9, Table 3, Appendix I).

Shows the published Table 3 (H100 and B200), this run's throughput result (the scale's presets on
this run's device) and, when present, the recorded GPU results (every ``ctx.recorded["throughput_gpu*"]``,
measured on another machine), each labelled with its device, date and commit.
"""

from __future__ import annotations

from typing import Any

from lrattnres.report.html import claims_table, esc, fmt, table
from lrattnres.throughput.comparison import compare

TITLE = "Training throughput (Section 4.9, Table 3, Appendix I)"
ORDER = 70

SIZES = (("1b", "1B"), ("4b", "4B"))
GPUS = (("h100", "H100"), ("b200", "B200"))
GAIN_LABELS = {
    "rank": "rank gain: r = d/4 vs r = d, this project's kernel (Table 3)",
    "kernel": "kernel gain: fused vs reference router at r = d/4",
    "combined_vs_fla": "combined gain: ours r = d/4 vs FLA r = d (Section 4.9)",
    "kernel_vs_fla": "ours r = d vs FLA r = d",
    "routing_rd4": "cost of routing: ours r = d/4 vs plain backbone",
    "routing_rd": "cost of routing: ours r = d vs plain backbone",
}
NAME_LABELS = {
    "baseline": "plain backbone (no routing)",
    "fused-rd": "ours (fused) r = d",
    "fused-rd4": "ours (fused) r = d/4",
    "reference-rd4": "reference router r = d/4",
    "fla-rd": "FLA r = d",
}


def _pub(ctx, cid: str) -> Any:
    rec = ctx.published.get(cid)
    return None if rec is None else rec.get("published")


def _mean_sd(mean: Any, sd: Any) -> str:
    if mean is None:
        return "–"
    if sd is None:
        return f"{mean:,.0f}"
    return f"{mean:,.0f} ± {sd:,.0f}"


def _ci(lo: Any, hi: Any, digits: int = 3) -> str:
    if lo is None or hi is None:
        return "–"
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def _gain(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:+.{digits}f}"


def published_table(ctx) -> str:
    rows = []
    for g, G in GPUS:
        for s, S in SIZES:
            base = f"{g}.{s}"
            cells = [G, S]
            for impl, rk in (("fla", "rd"), ("fast", "rd"), ("fast", "rd4")):
                cells.append(_mean_sd(_pub(ctx, f"table3.tokens_per_s.{base}.{impl}.{rk}"),
                                      _pub(ctx, f"table3.tokens_per_s_sd.{base}.{impl}.{rk}")))
            gain = _pub(ctx, f"table3.rank_gain_pct.{base}")
            cells.append("–" if gain is None else f"{gain:.3f}")
            cells.append(_ci(_pub(ctx, f"table3.rank_gain_ci_low.{base}"), _pub(ctx, f"table3.rank_gain_ci_high.{base}")))
            comb = _pub(ctx, f"sec4.9.combined_gain_pct.{base}")
            cells.append("–" if comb is None else f"{comb:.2f}")
            rows.append(cells)
    headers = ["GPU", "Model", "FLA r = d", "Fast r = d", "Fast r = d/4", "Rank gain (%)", "95% CI (%)",
               "Fast r = d/4 vs FLA (%)"]
    return table(headers, rows, "Published Table 3 (tokens/s, mean ± sample SD, five repeats; the paper's "
                                "hardware: H100 and B200, compiled, 64 accumulation steps)")


def _provenance_line(res: dict, label: str) -> str:
    prov = res.get("provenance") or {}
    spec = res.get("spec") or {}
    accum = sorted({r.get("grad_accum") for r in res.get("rows", []) if r.get("grad_accum") is not None})
    parts = [
        f"<b>{esc(label)}</b>",
        f"device <b>{esc(res.get('device') or prov.get('device'))}</b>",
        f"date {esc(prov.get('finished') or prov.get('started') or '?')}",
        f"commit {esc((prov.get('commit') or '?')[:12])}{' (dirty)' if prov.get('dirty') else ''}",
        f"{esc(res.get('precision'))}, {'compiled' if res.get('compile') else 'eager (not compiled)'}",
        f"microbatch {esc(spec.get('micro_batch'))} × {esc(spec.get('seq_len'))}, accumulation "
        f"{esc(', '.join(map(str, accum)) or spec.get('grad_accum'))} (paper: 2 × 2048 × 64)",
        f"tokens: {esc(res.get('tokens'))}",
    ]
    if res.get("_path"):
        parts.append(f"file {esc(res['_path'])}")
    if not res.get("complete", True):
        parts.append("<b>partial result</b> (stopped by its deadline or cut off)")
    return "<p>" + "; ".join(parts) + ".</p>"


def _presets(res: dict) -> list[str]:
    out: list[str] = []
    for r in res.get("rows", []):
        if r["preset"] not in out:
            out.append(r["preset"])
    return out


def _stopping_notes(res: dict) -> list[str]:
    """Per preset, how many measurements met the stopping rule and how many ran to the update cap: a
    measurement at the cap is noisier than the rule asks for, and the reader should know."""
    spec = res.get("spec") or {}
    out = []
    for p in _presets(res):
        runs = [r for r in res.get("runs", []) if r.get("preset") == p and r.get("stopped")]
        if not runs:
            continue
        met = sum(r["stopped"] == "converged" for r in runs)
        out.append(f"{p}: {met} of {len(runs)} measurements met the stopping rule (two {spec.get('window', '?')}-update "
                   f"windows with CV <= {spec.get('cv', '?')} and drift <= {spec.get('drift', '?')}); the rest ran to "
                   f"the cap of {spec.get('max_updates', '?')} updates")
    return out


def _accumulation(res: dict) -> str:
    accum = sorted({r.get("grad_accum") for r in res.get("rows", []) if r.get("grad_accum") is not None})
    return ", ".join(map(str, accum)) or str((res.get("spec") or {}).get("grad_accum", "?"))


def resolution_lines(res: dict) -> list[str]:
    """Per size: the resolved gain's 95% half-width, the repeats behind it, and why the measuring
    stopped (resolved, the budget spent, the repeat cap, the deadline, or no target asked)."""
    spec = res.get("spec") or {}
    gname = spec.get("resolve_gain", "rank")
    out = []
    for p in _presets(res):
        g = (res.get("gains", {}).get(p) or {}).get(gname) or {}
        r = (res.get("resolution") or {}).get(p) or {}
        hw, n, target = g.get("half_width"), g.get("n"), r.get("target_half_width", spec.get("target_half_width"))
        line = f"{p}: {GAIN_LABELS.get(gname, gname)}: 95% half-width " + ("–" if hw is None else f"{hw:.3f} points")
        line += f" over {n or 0} paired repeats"
        why = r.get("stopped")
        if target is None:
            line += "; no target half-width asked (the protocol's repeats only)"
        elif why == "resolved":
            line += f"; resolved: at most the target {target:g}"
        elif why == "budget":
            line += (f"; not resolved (target {target:g}): the size's budget was spent "
                     f"({r.get('spent_s', 0):.0f} of {r.get('budget_s')} s)")
        elif why == "max_repeats":
            line += f"; not resolved (target {target:g}) within {r.get('max_repeats')} repeats"
        else:
            line += f"; not resolved (target {target:g})" + (f": stopped ({why})" if why else ": measuring unfinished")
        out.append(line)
    return out


def protocol_table(res: dict, label: str) -> str:
    """Appendix I's protocol beside the result's: what is the same and what differs."""
    rows = [[r["aspect"], r["paper"], r["here"], {True: "same", False: "differs", None: "–"}[r["same"]], r["note"]]
            for r in (res.get("protocol") or compare(res))]
    return table(["aspect", "Appendix I", "this result", "", "note"], rows,
                 f"{label}: the measurement protocol, the paper's and this result's")


def result_tables(res: dict, label: str) -> str:
    """Table 3 layout, every configuration, and the paired gains of one throughput result."""
    out = [_provenance_line(res, label)]
    if not res.get("compile") or _accumulation(res) != "64":
        out.append(f"<p><b>Not the paper's protocol:</b> {'compiled' if res.get('compile') else 'eager'}, accumulation "
                   f"{esc(_accumulation(res))} (Appendix I: compiled, 64 accumulation steps). Its step times and "
                   "intervals are not comparable with Table 3's.</p>")
    by = {(r["preset"], r["name"]): r for r in res.get("rows", [])}
    gains = res.get("gains", {})
    t3 = []
    for p in _presets(res):
        g = gains.get(p, {})
        rank = g.get("rank", {})
        cells = [p]
        for name in ("fla-rd", "fused-rd", "fused-rd4", "reference-rd4", "baseline"):
            r = by.get((p, name))
            cells.append(_mean_sd(r["mean"], r["sd"]) if r else "–")
        cells.append(_gain(rank.get("mean")))
        cells.append(_ci(*(rank.get("ci95") or [None, None])))
        cells.append(_gain(g.get("combined_vs_fla", {}).get("mean"), 2))
        cells.append(_gain(g.get("kernel", {}).get("mean"), 2))
        cells.append(_gain(g.get("routing_rd4", {}).get("mean"), 2))
        cells.append(str(rank.get("n") or "–"))
        t3.append(cells)
    out.append(table(["Preset", "FLA r = d", "ours r = d", "ours r = d/4", "reference r = d/4", "plain backbone",
                      "Rank gain (%)", "95% CI (%)", "vs FLA (%)", "kernel vs reference (%)",
                      "r = d/4 vs plain (%)", "repeats"], t3,
                     f"{label}: Table 3 layout (tokens/s, mean ± sample SD over repeats; gains are paired means)"))
    rows = []
    for r in res.get("rows", []):
        rows.append([r["preset"], NAME_LABELS.get(r["name"], r["name"]), r["method"], r["impl"],
                     "–" if r.get("r") is None else r["r"], "–" if r.get("N") is None else r["N"],
                     _mean_sd(r["mean"], r["sd"]), ", ".join(f"{v:,.0f}" for v in r.get("repeats", [])),
                     r.get("tokens_per_update")])
    out.append(table(["Preset", "configuration", "method", "router", "r", "N", "tokens/s", "per repeat",
                      "tokens/update"], rows, f"{label}: every configuration"))
    grows = []
    for p in _presets(res):
        for gname, g in gains.get(p, {}).items():
            grows.append([p, GAIN_LABELS.get(gname, gname), _gain(g.get("mean")), _ci(*(g.get("ci95") or [None, None])),
                          "–" if g.get("sd") is None else f"{g['sd']:.3f}",
                          ", ".join(f"{x:+.2f}" for x in g.get("per_repeat", []))])
    if grows:
        out.append(table(["Preset", "paired gain", "mean (%)", "95% CI (%)", "SD (%)", "per repeat (%)"], grows,
                         f"{label}: paired gains g_j = 100 (v_j^A / v_j^B - 1), 95% CI mean ± t(0.975, n-1) s/sqrt(n)"))
    out.append(protocol_table(res, label))
    skipped = res.get("skipped") or []
    notes = resolution_lines(res)
    notes += list(res.get("notes") or []) + [f"{s['preset']}: {s['method']} skipped ({s['why']})" for s in skipped]
    notes += _stopping_notes(res)
    if notes:
        out.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    return "\n".join(out)


def build(ctx) -> str:
    out = [
        "<p>Complete training-step throughput with the protocol of Appendix I: matched shared weights per "
        "repeat, one cached token buffer with document boundaries transferred every update, the production "
        "update (forward, backward, accumulation, clipping, Muon + AdamW) timed between device "
        "synchronisations, three warm-up updates, 8 to 30 measured updates with the paper's stopping rule, "
        "repeats with rotated method order, and paired gains with 95% intervals; where a result asks for it, "
        "more repeats of r = d/4 and r = d until the rank gain's interval is narrow enough or the size's time "
        "budget is spent. Each method compiles once per process: its repeats there reload the shared weights "
        "and start a fresh optimiser on the same compiled graph (the table under each result says what else "
        "differs from Appendix I). The interval uses "
        "t(0.975, n-1) s/sqrt(n): the paper's formula prints s_g/5, which for five repeats would be "
        "narrower than a 95% interval by sqrt(5).  Beyond the paper, the plain backbone (no routing) and the "
        "reference router show the cost of routing and the kernel's gain.</p>",
        published_table(ctx),
    ]
    local = ctx.results("throughput")
    rec_all = getattr(ctx, "recorded", None) or {}
    recorded = [(k, rec_all[k]) for k in sorted(rec_all) if k.startswith("throughput_gpu")
                and isinstance(rec_all[k], dict) and rec_all[k].get("stage") == "throughput"]
    if not local and not recorded:
        out.append("<p><b>Not run:</b> the throughput stage has produced no result at this scale, and no "
                   "recorded GPU result is listed (<code>reports/recorded.yaml</code>, keys <code>throughput_gpu*</code>).</p>")
    for res in local:
        out.append(f"<h3>This run (scale {esc(ctx.scale)})</h3>")
        out.append("<p>Different scale and hardware from Table 3: the numbers show the protocol and the "
                   "relative costs at this scale, not the paper's values.</p>")
        out.append(result_tables(res, f"scale {ctx.scale}"))
    for key, res in recorded:
        dev = res.get("device") or (res.get("provenance") or {}).get("device")
        mode = f"{'compiled' if res.get('compile') else 'eager'}, accumulation {_accumulation(res)}"
        out.append(f"<h3>Recorded GPU result ({esc(dev)}, {esc(mode)})</h3>")
        out.append(f"<p>Measured on another machine and included from its recorded file (<code>{esc(key)}</code>). "
                   "Different hardware from Table 3 unless the device is an H100 or B200; see the settings line "
                   "for the accumulation and compilation used.</p>")
        out.append(result_tables(res, f"recorded, {dev}, {mode}"))
    step = rec_all.get("train_step")
    if isinstance(step, dict) and step.get("benchmark") == "train_step":
        out.append(train_step_table(step))
    claims = (ctx.claims_with_prefix("table3.") + ctx.claims_with_prefix("sec4.9.")
              + ctx.claims_with_prefix("appI.repeats_met_stopping_rule."))
    if claims:
        out.append(claims_table(claims, "Claims of Table 3, Section 4.9 and Appendix I's stopping rule (the tokens/s "
                                        "values are claimed only from a run on the paper's GPUs, H100 or B200, at "
                                        "the 1B/4B shapes; the gains' directions, judged by their interval over "
                                        "repeats, from those GPUs or one of the same architecture, an H200 for "
                                        "the H100)"))
    return "\n".join(out)


def train_step_table(doc: dict) -> str:
    """The recorded production-step benchmark (benchmarks/train_step_bench.py): one config after
    another, not the paired protocol above; its speed goal is LR-AttnRes at >= 90% of the baseline."""
    st = doc.get("settings", {})
    git = doc.get("git") or {}
    mode = "eager" if st.get("no_compile") else "compiled"
    head = (f"<h3>Recorded training-step benchmark ({esc(doc.get('device'))}, {mode})</h3>"
            f"<p>{esc(st.get('preset'))}, micro-batch {esc(st.get('micro_batch'))} × {esc(st.get('seq_len'))}, "
            f"accumulation {esc(st.get('grad_accum'))}, attention {esc(st.get('attention'))}, "
            f"{esc(st.get('updates'))} timed updates after "
            f"{esc(st.get('warmup'))} warm-up; {esc(doc.get('date'))}, commit {esc((git.get('commit') or '?')[:10])}, "
            f"file <code>{esc(doc.get('_path'))}</code>. Goal: LR-AttnRes (fused, r = d/4) at ≥ 90% of the "
            "baseline's tokens/s and ≥ 62,000 tokens/s.</p>")
    rows = []
    for r in doc.get("rows", []):
        if "error" in r:
            rows.append([r["config"], "error", r["error"][:80], "", "", "", ""])
            continue
        name = r["config"] + ("" if r.get("finite", True) else " (loss not finite)")
        rows.append([name, r.get("router") or "–", r.get("rank") or "–", f"{r['tokens_per_s']:,.0f}",
                     f"{100 * r['vs_baseline']:.1f}%" if r.get("vs_baseline") else "–",
                     f"{r['update_s_mean']:.3f} ({100 * r['update_s_cv']:.1f}%)",
                     fmt(r.get("peak_allocated_gib"), 3)])
    goal = doc.get("goal", {})
    met = goal.get("met")
    tail = "" if met is None else (f"<p>Goal {'met' if met else 'missed'}: {100 * goal['lr_fused_vs_baseline']:.1f}% of "
                                   f"the baseline, {goal['lr_fused_tokens_per_s']:,.0f} tokens/s.</p>")
    for m in doc.get("merged_from", []):
        tail += f"<p>Rows {esc(', '.join(m['configs']))}: {esc(m['file'])} ({esc(m['note'])}).</p>"
    skipped = ", ".join(x["config"] for x in doc.get("skipped", []))
    if skipped:
        tail += f"<p>Not timed (the benchmark's time budget): {esc(skipped)}.</p>"
    return head + table(["config", "router", "r", "tokens/s", "vs baseline", "update s (CV)", "peak GiB"], rows,
                        "Training-step throughput, one H200") + tail


__all__ = ["TITLE", "ORDER", "build", "protocol_table", "published_table", "resolution_lines", "result_tables",
           "train_step_table"]
