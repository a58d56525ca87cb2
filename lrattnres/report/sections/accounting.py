"""Report section: cost accounting (Appendix F, Table 5's added-FLOPs column, F.4-F.6).

It follows the training results and its tables are collapsed: the page opens with the verdict counts
of the accounting claims and the tables open on a click."""

from __future__ import annotations

from typing import Any

from collections import Counter

from lrattnres.report.html import badge, claims_table, esc, fmt, table

TITLE = "Cost accounting (Appendix F, Table 5)"
ORDER = 90

METHOD_NAMES = {
    "baseline": "Baseline Transformer",
    "attnres": "AttnRes",
    "lr": "LR-AttnRes",
    "lr-fullrms": "LR-AttnRes (full RMS)",
    "plr": "Projected LR-AttnRes",
}


def _pct(x: Any, digits: int = 4) -> str:
    if x is None:
        return "–"
    if x == 0:
        return "0"
    return f"{x:#.{digits}g}"  # keeps trailing zeros: 0.4320 as printed


def _int(x: Any) -> str:
    return "–" if x is None else f"{x:,}"


def _method(m: str, N: Any) -> str:
    if m == "baseline":
        return METHOD_NAMES[m]
    return ("Full " if N == "full" else "Block ") + METHOD_NAMES[m]


def _result(ctx) -> dict | None:
    results = ctx.results("accounting")
    return results[-1] if results else None


def _table5(ctx, result: dict | None) -> str:
    rows_by_key: dict[tuple, dict] = {}
    if result:
        for r in result.get("tables", {}).get("paper", {}).get("0.5B", {}).get("rows", []):
            rows_by_key[(r["method"], r["N"], r["r"])] = r
    rows = []
    for cid, rec in ctx.published.items():
        if not cid.startswith("table5.added_flops."):
            continue
        row = rec["row"]
        m, N, r = row["method"], row.get("N"), row.get("r")
        claim = ctx.claims.get(cid, {})
        t = rows_by_key.get((m, N, r), {})
        loss = ctx.claims.get(cid.replace(".added_flops.", ".val_loss."), {})
        rows.append([
            esc(_method(m, N)),
            esc("–" if N is None else N),
            esc("–" if r is None else r),
            esc(_pct(t.get("kernel_pct"))),
            esc(_pct(t.get("key_proj_pct"))),
            esc(_pct(claim.get("reproduced"))),
            esc(_pct(rec["published"])),
            badge(claim.get("verdict")),
            esc("–" if loss.get("published") is None else f"{loss['published']:.3f}"),
        ])
    caption = ("Table 5, added FLOPs (% of the non-embedding core C_base = L(4d² + 3dm) per token), 0.5B "
               "(L = 24, d = 1024, m = 2816). Reproduced values are shown to 4 significant figures, the printed "
               "precision; the verdict compares them rounded as the paper printed them.")
    headers = ["method", "N", "r", "kernel %", "key proj. %", "reproduced %", "published %", "verdict",
               "published val. loss"]
    return table(headers, rows, caption, raw=True)


def _paper_arch_table(name: str, arch: dict) -> str:
    rows = []
    for r in arch["rows"]:
        rows.append([
            _method(r["method"], r["N"]), "–" if r["N"] is None else r["N"], "–" if r["r"] is None else r["r"],
            _int(r["max_sources"]), _pct(r["added_flops_pct"]),
            _pct(r["flops_reduction_vs_attnres_pct"]),
            _int(r["param_query_params"]), _int(r["param_key_params"]),
            _int(r["param_delta_vs_baseline"]), _int(r["param_delta_vs_attnres"]),
            _pct(r["param_pct_vs_baseline"]),
            _int(r["act_mem_elements_per_token"]), _int(r["act_mem_bytes_bf16_per_token"]),
            _int(r["total_params"]),
        ])
    shape = arch["shape"]
    preset = f", preset {shape['preset']}" if shape.get("preset") else ""
    vocab = f", V = {shape['vocab_size']:,}" if shape.get("vocab_size") else ", vocabulary from the data manifest"
    caption = (f"{name}{preset}: L = {shape['n_layers']}, d = {shape['d_model']}, m = {shape['d_ff']}{vocab}; "
               f"C_base = {arch['core_flops']:,} multiply-adds per token; {arch['active_queries']} active queries.")
    headers = ["method", "N", "r", "max sources", "added FLOPs %", "FLOPs saved vs AttnRes %", "query params",
               "key-proj. params", "Δparams vs baseline", "Δparams vs AttnRes", "Δparams % of core",
               "retained sources (elements/token)", "bf16 bytes/token", "total params"]
    return table(headers, rows, caption)


def build(ctx) -> str:
    mine = [c for cid, c in ctx.claims.items() if ctx.published.get(cid, {}).get("stage") == "accounting"]
    counts = Counter(c["verdict"] for c in mine)
    summary = ", ".join(f"{n} {v}" for v, n in counts.most_common())
    return (f'<p>{len(mine)} analytic claims ({esc(summary)}): added FLOPs, parameters and memory of every '
            'configuration, computed for the paper\'s architectures at every scale.</p>'
            '<details class="collapsed" id="accounting-tables"><summary>Show the accounting tables</summary>'
            + _tables(ctx) + "</details>")


def _tables(ctx) -> str:
    result = _result(ctx)
    out: list[str] = []
    out.append(
        "<p>Everything in this section is analytic (Appendix F), so it is computed for the paper's 0.5B, 1B and "
        "4B architectures at every scale and must match to the printed precision. Depth-kernel cost per read: "
        "n<sub>t</sub>(d + r) multiply-adds for n<sub>t</sub> sources (scores n<sub>t</sub>r, value mixing "
        "n<sub>t</sub>d; 2n<sub>t</sub>d for AttnRes), summed over the 2L reads after each write; the "
        "embedding-only first read is free. Block boundaries are ceil(2Lj/N). Projected keys add "
        "r[L(d + m) + d]. Normalisation and softmax are not counted. Parameter percentages use "
        "P<sub>base</sub> = L(4d² + 3dm), the non-embedding core.</p>"
    )
    if result is None:
        out.append("<p><em>The accounting stage has not run; the published numbers are shown alone.</em></p>")

    out.append(_table5(ctx, result))

    other = [c for cid, c in ctx.claims.items()
             if ctx.published.get(cid, {}).get("stage") == "accounting" and not cid.startswith("table5.")]
    out.append("<h3>Cost reductions, worked numbers of F.6, parameters (F.5) and memory (F.4)</h3>")
    out.append(claims_table(other, "Accounting claims stated in the text (Sections 4.2, 4.8, Appendices C.2, C.3, "
                                   "F.4-F.6; the 0.5B parameter count of the author's repository)."))

    if result:
        tables = result.get("tables", {})
        worked = tables.get("worked", {})
        if worked:
            rows = [[esc(k.replace("_", " ")), esc(fmt(v))] for k, v in worked.items()]
            out.append(table(["quantity", "value"], rows, "Appendix F.6 worked example (d = 1024, r = 32, L = 24, "
                                                          "m = 2816), computed.", raw=True))
        out.append("<h3>The paper's architectures</h3>")
        out.append(
            "<p>Per configuration: added FLOPs, the saving relative to AttnRes at the same N (the source count "
            "cancels: (d − r)/(2d) for sliced keys), routing-query parameters (2Ld for AttnRes, 2Lr for "
            "LR-AttnRes), projected-key parameters, parameter deltas, and the retained source memory per token "
            "for the largest source set (K<sub>src</sub>·d, or K<sub>src</sub>·(d + r) for projected keys).</p>"
        )
        for name, arch in tables.get("paper", {}).items():
            out.append(_paper_arch_table(name, arch))
        extra = tables.get("extra", {})
        if extra:
            out.append(f"<h3>This scale's architectures ({esc(ctx.scale)})</h3>")
            out.append(f"<p>Ranks {esc(tables.get('ranks'))}, block settings {esc(tables.get('blocks'))}.</p>")
            for name, arch in extra.items():
                out.append(_paper_arch_table(name, arch))
            for name, why in (tables.get("skipped") or {}).items():
                out.append(f"<p><em>{esc(name)}: skipped {esc('; '.join(why))}.</em></p>")
    return "\n".join(out)
