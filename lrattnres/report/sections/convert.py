"""Report section: checkpoint conversion without retraining (Section 4.8, Appendix B, Table 2)."""

from __future__ import annotations

from typing import Any

from lrattnres.report.html import badge, claims_table, esc, figure, table

TITLE = "Checkpoint conversion (Section 4.8, Appendix B, Table 2)"
ORDER = 40

SIZE_NAMES = {"0.5b": "0.5B", "1b": "1B", "4b": "4B"}


def conversions(ctx) -> list[dict]:
    """Every per-checkpoint conversion among the convert results (aggregated or single)."""
    out: list[dict] = []
    for r in ctx.results("convert"):
        if isinstance(r.get("conversions"), list):
            out.extend(r["conversions"])
        elif "fp64_max_logit_err" in r:
            out.append(r)
    return out


def _sci(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}e}"


def _signed(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:+.{digits}e}"


def _ce(x: Any) -> str:
    return "–" if x is None else f"{x:.4f}"


def _routing(N: Any) -> str:
    return "Full" if N == "full" else f"N = {N}"


def _row_key(cid: str) -> str:
    return cid.split(".", 2)[2]  # table2.fp64_max_err.<size>.<n> -> <size>.<n>


def _published_rows(ctx) -> list[tuple[str, dict]]:
    return [(_row_key(cid), rec) for cid, rec in ctx.published.items() if cid.startswith("table2.fp64_max_err.")]


def _pub(ctx, quantity: str, key: str) -> Any:
    rec = ctx.published.get(f"table2.{quantity}.{key}")
    return None if rec is None else rec.get("published")


def _badges(ctx, key: str) -> str:
    cells = []
    for q, label in (("fp64_max_err", "FP64"), ("delta_ce", "ΔCE")):
        c = ctx.claims.get(f"table2.{q}.{key}")
        if c is not None and c.get("verdict") != "not run":
            cells.append(f"{esc(label)} {badge(c.get('verdict'))}")
    return " ".join(cells) or badge("not run")


def _our_row(c: dict, label: str) -> list[str]:
    rel = c.get("fp64_rel_logit_err")
    return [
        esc(label),
        esc(c.get("run_id")),
        esc(_routing(c.get("blocks"))),
        esc(f"{c.get('d')} → {c.get('rank')}"),
        esc(f"{c.get('joint_rank')} / {c.get('active_queries')}"),
        esc(_sci(c.get("fp64_max_logit_err"))),
        esc(_sci(rel, 2)),
        esc(_sci(c.get("fp64_noise_floor"), 2)),
        esc(_ce(c.get("original_ce"))),
        esc(_ce(c.get("converted_ce"))),
        esc(_signed(c.get("delta_ce"))),
    ]


def _table2(ctx, convs: list[dict]) -> str:
    rows = []
    used: set[int] = set()
    for key, rec in _published_rows(ctx):
        row = rec["row"]
        size = row.get("size", "")
        jr = ctx.published.get(f"appB.2.joint_rank.{size}", {})
        rank_cell = f"{jr.get('published', '–')} / {jr.get('row', {}).get('active_queries', '–')}" if jr else "–"
        rows.append([
            esc("paper"),
            esc(SIZE_NAMES.get(size, size)),
            esc(_routing(row.get("N"))),
            esc(f"{row.get('d')} → {row.get('r')}"),
            esc(rank_cell),
            esc(_sci(rec["published"])),
            "–",
            "–",
            esc(_ce(_pub(ctx, "orig_ce", key))),
            esc(_ce(_pub(ctx, "conv_ce", key))),
            esc(_signed(_pub(ctx, "delta_ce", key))),
            "",
        ])
        mine = [(i, c) for i, c in enumerate(convs) if str(c.get("claim_row") or "").lower() == key]
        if not mine:
            rows.append([esc("ours"), "", "", "", "", "", "", "", "", "", "", badge("not run")])
        for i, c in mine:
            used.add(i)
            rows.append(_our_row(c, "ours") + [_badges(ctx, key)])
    for i, c in enumerate(convs):
        if i not in used:
            rows.append(_our_row(c, "ours (no paper row)") + [""])
    caption = (
        "Table 2, published rows beside this run's conversions. FP64 max. error: the largest absolute logit "
        "difference between the original and the converted model, both in float64, on one full-length validation "
        "sequence; 'rel.' divides it by the largest |logit|; the noise floor is how far the original model's float64 "
        "logits move when every weight is perturbed by one float64 rounding (the model's own sensitivity). CE: paired evaluation over the same validation "
        "tokens (the paper: 100M tokens, BF16 computation; here the scale's validation split, bf16 on a GPU and "
        "fp32 on the CPU), fp32 per-token CE, fp64 sums; ΔCE = converted − original. k / 2L: joint query rank "
        "over the number of active queries. At scales other than 'paper' a checkpoint stands for the paper's row "
        "with the same routing (N), so the CEs are of a different model and only the invariants compare."
    )
    headers = ["", "model", "routing", "d → r", "k / 2L", "FP64 max. error", "rel.", "FP64 noise floor", "original CE",
               "converted CE", "ΔCE", "verdicts"]
    return table(headers, rows, caption, raw=True)


def _drift_table(convs: list[dict]) -> str:
    rows = []
    for c in convs:
        s = c.get("slice_drift") or {}
        rows.append([
            c.get("run_id"), _routing(c.get("blocks")), f"{c.get('d')} → {c.get('rank')}",
            _sci(c.get("fp64_max_logit_err")), _sci(s.get("max_logit_err")), _sci(s.get("rel_logit_err"), 2),
            _ce(c.get("original_ce")), _ce(s.get("ce")), _signed(c.get("delta_ce")), _signed(s.get("delta_ce")),
        ])
    caption = ("The converted weights run with slice normalisation (method lr: RMS over the last r coordinates "
               "only) instead of the full-width RMS the theorem needs. Proposition 1 does not cover this; the "
               "drift shows how much the normalisation denominator matters for these checkpoints.")
    headers = ["checkpoint", "routing", "d → r", "full-RMS FP64 error", "slice FP64 error", "slice rel.",
               "original CE", "slice CE", "ΔCE full RMS", "ΔCE slice"]
    return table(headers, rows, caption)


def _spectrum_figure(convs: list[dict]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    lo = None
    for c in convs:
        sv = [s for s in c.get("singular_values") or []]
        if not sv or sv[0] <= 0:
            continue
        rel = [max(s / sv[0], 1e-18) for s in sv]
        lo = min(rel) if lo is None else min(lo, min(rel))
        ax.semilogy(range(1, len(rel) + 1), rel, marker="o", ms=3, label=f"{c.get('run_id')} (k = {c.get('joint_rank')})")
        if c.get("rtol"):
            ax.axhline(c["rtol"], color="grey", ls=":", lw=0.8)
    ax.set_xlabel("singular value index")
    ax.set_ylabel("σ_i / σ_1 of the stacked queries")
    ax.legend(fontsize=7)
    return figure(fig, "Singular values of each checkpoint's stacked active queries (relative to the largest); the "
                       "dotted line is the rank tolerance. The joint rank k counts those above it.")


def _summary(convs: list[dict]) -> str:
    errs = [c["fp64_max_logit_err"] for c in convs if c.get("fp64_max_logit_err") is not None]
    rels = [c["fp64_rel_logit_err"] for c in convs if c.get("fp64_rel_logit_err") is not None]
    dces = [c["delta_ce"] for c in convs if c.get("delta_ce") is not None]
    ranks = [(c.get("joint_rank"), c.get("active_queries")) for c in convs]
    parts = [f"{len(convs)} checkpoint(s) converted."]
    if errs:
        parts.append(f"Largest FP64 logit difference {max(errs):.3e} (relative {max(rels):.2e}); "
                     f"the paper's largest is 8.251e-13.")
    if dces:
        lo, hi = min(dces), max(dces)
        parts.append(f"ΔCE from {lo:+.3e} to {hi:+.3e} (the paper: +6.086e-05 to +8.865e-05 in BF16).")
    if ranks:
        parts.append("Joint query ranks " + ", ".join(f"{k}/{t}" for k, t in ranks) + " (k / active queries).")
    return "<p>" + esc(" ".join(parts)) + "</p>"


def build(ctx) -> str:
    convs = conversions(ctx)
    out: list[str] = []
    out.append(
        "<p>Static queries span a fixed subspace of rank k ≤ 2L. An orthogonal change of residual coordinates R "
        "(absorbed into the embedding, every residual-facing input projection W R<sup>T</sup>, every output "
        "projection R W and the head) puts that span into the last r ≥ k coordinates; full-width RMS is invariant "
        "under R, so the standard AttnRes checkpoint becomes a full-width-RMS LR-AttnRes checkpoint of rank r with "
        "the same routing distributions and logits in exact arithmetic (Proposition 1). The conversion stage "
        "computes k (numerical rank of the stacked queries in float64, tolerance max(d, 2L)·ε<sub>64</sub>·σ<sub>1</sub>), "
        "builds R from the SVD, rotates every weight, and checks the result as in Table 2 and Appendix B.2.</p>"
    )
    if not convs:
        out.append("<p><em>The convert stage has not run; the published numbers are shown alone.</em></p>")
    else:
        out.append(_summary(convs))
    out.append(_table2(ctx, convs))
    if convs:
        out.append("<h3>Slice normalisation on the converted weights</h3>")
        out.append(_drift_table(convs))
        try:
            out.append(_spectrum_figure(convs))
        except Exception as e:  # a figure must not take the section down
            out.append(f"<p><em>spectrum figure failed: {esc(e)}</em></p>")
    claims = [c for cid, c in ctx.claims.items() if ctx.published.get(cid, {}).get("stage") == "convert"]
    claims.sort(key=lambda c: (c.get("kind") != "invariant", c["id"]))
    out.append("<h3>Claims</h3>")
    out.append(claims_table(claims, "Conversion claims: the invariants (FP64 error at most 1e-9, |ΔCE| at most "
                                    "1e-3, joint rank at most the number of active queries) hold at any scale; "
                                    "the CEs are values compared at the paper scale only."))
    return "\n".join(out)
