"""Report section: "Results at a glance", the paper's main conclusions with their verdicts.

The conclusions are the records of reports/published.yaml that carry ``glance`` (their short text),
in the file's order.  Each row gives the published effect, the reproduced effect with its 95%
interval and n, the verdict and a link to the section that shows it; with a recorded report
(``reports/recorded.yaml``, key ``gpu_report``) its verdict stands in an extra column.
"""

from __future__ import annotations

from lrattnres.report.html import badge, effect, esc, fmt, fmt_interval, unit

TITLE = "Results at a glance"
ORDER = 0

# the report section that shows a stage's claims
STAGE_SECTION = {"accounting": "accounting", "grid": "grid", "convert": "convert", "evaluate": "evaluate",
                 "throughput": "throughput", "diagnostics": "diagnostics", "kernel": "kernel"}


def _where(rec: dict) -> str:
    page = rec.get("page")
    return rec["source"] + (f", p. {page}" if page else "")


def _published(rec: dict) -> str:
    if rec["published"] is True:
        return "yes (no number printed)"
    if rec["kind"] in ("direction", "shape"):
        return effect(rec["published"], rec["quantity"])
    return fmt(rec["published"]) + unit(rec["quantity"])


def _reproduced(c: dict, quantity: str) -> str:
    if c.get("reproduced") is None:
        return "–"
    if c.get("kind") not in ("direction", "shape"):
        return esc(fmt(c["reproduced"]) + unit(quantity))
    iv = fmt_interval(c.get("interval"), c.get("n"))
    return esc(effect(c["reproduced"], quantity)) + (f'<br><span class="iv">{esc(iv)}</span>' if iv else "")


def rows(ctx) -> list[dict]:
    """One dict per glance conclusion: id, text, where, section, published, claim, recorded."""
    out = []
    rec_claims = (ctx.recorded_report or {}).get("claims", {})
    for cid, rec in ctx.published.items():
        if "glance" not in rec:
            continue
        out.append({"id": cid, "text": rec["glance"], "where": _where(rec), "section": STAGE_SECTION.get(rec["stage"]),
                    "record": rec, "claim": ctx.claims.get(cid, {}), "recorded": rec_claims.get(cid)})
    return out


def build(ctx) -> str:
    items = rows(ctx)
    rep = ctx.recorded_report
    head = ["conclusion", "paper", "published effect", f"reproduced ({ctx.scale} scale): effect, 95% interval, n",
            "verdict"]
    if rep:
        head.append(f"recorded: {rep['label']}")
    out = [
        f"<p>The paper's main conclusions and what this run ({esc(ctx.scale)} scale) finds. A direction is "
        "<b>reproduced</b> only when its 95% interval excludes zero on the paper's side (paired intervals over at "
        "least three seeds, repeats or configurations; single runs by the noise of the same scale's seed "
        "replicates), <b>contradicted</b> when it excludes zero on the other side, and <b>inconclusive</b> "
        "otherwise. Effects are signed so that a positive value is the paper's direction. Every row links to "
        "the section that shows it and to its line in the table of all claims.</p>",
        '<table class="data" id="glance-table"><thead><tr>' + "".join(f"<th>{esc(h)}</th>" for h in head)
        + "</tr></thead><tbody>",
    ]
    for it in items:
        c, rec = it["claim"], it["record"]
        link = f'<a href="#{it["section"]}">{esc(it["text"])}</a>' if it["section"] else esc(it["text"])
        cells = [
            f'{link}<br><a class="cid" href="#claim-{esc(it["id"])}">{esc(it["id"])}</a>',
            esc(it["where"]),
            esc(_published(rec)),
            _reproduced(c, rec["quantity"]),
            badge(c.get("verdict")),
        ]
        if rep:
            r = it["recorded"]
            cells.append("–" if r is None else badge(r.get("verdict")) + "<br>" + _reproduced(r, rec["quantity"]))
        out.append(f'<tr data-claim="{esc(it["id"])}">' + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    out.append("</tbody></table>")
    if not items:
        out.append('<p class="notrun">No conclusion of reports/published.yaml carries a glance text.</p>')
    return "\n".join(out)
