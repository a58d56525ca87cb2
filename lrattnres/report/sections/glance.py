"""Report section: "Results at a glance", the paper's main conclusions with their verdicts.

The conclusions are the records of reports/published.yaml that carry ``glance`` (their short text),
in the file's order.  Each row gives the published effect, the reproduced effect with its interval
(a 95% interval, or a single run's threshold band, named as such) and n, where that value comes from
(this run at its scale, or a result recorded on another machine: ``reports/recorded.yaml``), the
verdict (with the reason where the evidence could not resolve the effect) and a link to the section
that shows it; a conclusion this scale has no run for shows the runs of the same measure it has.
With a recorded report (key ``gpu_report``) its verdict stands in an extra column. Below the table,
every claim that does not match is listed.
"""

from __future__ import annotations

from lrattnres.report.html import effect, esc, fmt, fmt_interval, unit, verdict_cell

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


def _value(c: dict, quantity: str) -> str:
    if c.get("reproduced") is None:
        return "–"
    if c.get("kind") not in ("direction", "shape"):
        return esc(fmt(c["reproduced"]) + unit(quantity))
    iv = fmt_interval(c.get("interval"), c.get("n"), c.get("interval_kind"))
    return esc(effect(c["reproduced"], quantity)) + (f'<br><span class="iv">{esc(iv)}</span>' if iv else "")


def source(ctx, cid: str) -> str:
    """Where claim ``cid``'s reproduced value comes from: this run at its scale, or the result recorded
    on another machine that produced it (``reports/recorded.yaml``)."""
    for name, res in ctx.recorded.items():
        if cid in (res.get("claims") or {}):
            device = (res.get("provenance") or {}).get("device") or "another machine"
            return f"recorded on {device}: {res.get('_path', name)}"
    return f"this run ({ctx.scale} scale)"


def same_measure(ctx, cid: str, rec: dict) -> list[dict]:
    """The claims of the same measure (same source, quantity and kind) that this scale did produce:
    what stands for a row the scale has no run of (e.g. the conversion of another N)."""
    return [c for other, c in ctx.claims.items() if other != cid and c.get("verdict") != "not run"
            and c.get("source") == rec["source"] and c.get("quantity") == rec["quantity"]
            and c.get("kind") == rec["kind"]]


def _reproduced(ctx, cid: str, rec: dict, c: dict) -> str:
    if c.get("verdict", "not run") != "not run":
        return _value(c, rec["quantity"]) + f'<br><span class="iv">{esc(source(ctx, cid))}</span>'
    others = same_measure(ctx, cid, rec)
    if not others:
        return "–"
    ran = "; ".join(f"{_beyond(cid, c2['id'])}: {fmt(c2.get('reproduced'))}{unit(rec['quantity'])} ({c2['verdict']})"
                    for c2 in others[:4]) + (f"; {len(others) - 4} more" if len(others) > 4 else "")
    return (f'<span class="iv">no run of this row at the {esc(ctx.scale)} scale; the same measure, '
            f"{esc(source(ctx, others[0]['id']))}: {esc(ran)}</span>")


def _beyond(cid: str, other: str) -> str:
    """What of claim id ``other`` differs from ``cid`` (their common dotted start left out)."""
    a, b = cid.split("."), other.split(".")
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return ".".join(b[k:]) or other


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


def mismatches(ctx) -> str:
    """Every claim that does not match (exact, invariant and value claims), and how many directions
    are contradicted."""
    bad = [c for c in ctx.claims.values() if c.get("verdict") == "mismatch"]
    against = sum(c.get("verdict") == "contradicted" for c in ctx.claims.values())
    seen = (f' {against} direction or shape claims are contradicted: <a href="?verdict=contradicted#all-claims">'
            "the table of all claims, filtered</a>." if against else "")
    if not bad:
        return f'<p id="glance-mismatches">No claim mismatches.{seen}</p>'
    items = "".join(f'<li><a href="#claim-{esc(c["id"])}">{esc(c["id"])}</a>: {esc(fmt(c.get("reproduced")))} '
                    f"against {esc(fmt(c.get('published')))} ({esc(source(ctx, c['id']))}); {esc(c.get('note', ''))}</li>"
                    for c in bad)
    one = len(bad) == 1
    return (f'<p id="glance-mismatches"><b>{len(bad)} claim{"" if one else "s"} {"does" if one else "do"} not match</b> '
            f"(exact, invariant or value claims):{seen}</p><ul>{items}</ul>")


def build(ctx) -> str:
    items = rows(ctx)
    rep = ctx.recorded_report
    head = ["conclusion", "paper", "published effect", "reproduced: effect, interval, n; where measured", "verdict"]
    if rep:
        head.append(f"recorded: {rep['label']}")
    out = [
        f"<p>The paper's main conclusions and what this run ({esc(ctx.scale)} scale) finds; a value recorded on "
        "another machine (<code>reports/recorded.yaml</code>) says so under it. A direction is <b>reproduced</b> "
        "only when its 95% interval excludes zero on the paper's side (paired intervals over at least three "
        "seeds, repeats or configurations; single runs by the noise of the same scale's seed replicates, or, "
        "without it, by the claim's threshold: a threshold band, not an interval), <b>contradicted</b> when it "
        "excludes zero on the other side, and <b>inconclusive</b> otherwise, with the reason where the evidence "
        "cannot resolve an effect whatever its value. Effects are signed so that a positive value is the paper's "
        "direction. Every row links to the section that shows it and to its line in the table of all claims.</p>",
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
            _reproduced(ctx, it["id"], rec, c),
            verdict_cell(c),
        ]
        if rep:
            r = it["recorded"]
            cells.append("–" if r is None else verdict_cell(r) + "<br>" + _value(r, rec["quantity"]))
        out.append(f'<tr data-claim="{esc(it["id"])}">' + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    out.append("</tbody></table>")
    if not items:
        out.append('<p class="notrun">No conclusion of reports/published.yaml carries a glance text.</p>')
    out.append(mismatches(ctx))
    return "\n".join(out)
