"""Small HTML builders for report sections: tables, embedded figures, verdict badges."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Iterable, Sequence
from typing import Any

VERDICT_CLASS = {
    "match": "ok",
    "reproduced": "ok",
    "mismatch": "bad",
    "contradicted": "bad",
    "inconclusive": "warn",
    "different scale": "info",
    "not run": "muted",
}
UNITS = (("_pct", "%"), ("_pp", " pp"))


def esc(text: Any) -> str:
    return html.escape("" if text is None else str(text))


def fmt(value: Any, digits: int = 4) -> str:
    """Numbers to a readable precision; everything else as text."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0:
            return "0"
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:,.{digits}g}"
    return str(value)


def fmt_interval(interval: Any, n: Any = None, kind: str | None = None) -> str:
    """``95% interval [lo, hi], n = 5`` of a statistical verdict ('' without an interval or n). A
    single run's band (``kind`` "threshold": the effect plus and minus the claim's threshold) is
    called a threshold band, not an interval; an interval without width says that the values did not
    spread; ``kind`` None (a claim that does not say) shows the bare bounds."""
    parts = []
    if isinstance(interval, (list, tuple)) and len(interval) == 2 and all(isinstance(x, (int, float)) for x in interval):
        lo, hi = interval
        if lo == hi:
            parts.append(f"no spread: every value {lo:+.3g}")
        elif kind == "threshold":
            return f"threshold band [{lo:+.3g}, {hi:+.3g}] (a single run: its effect must clear the threshold)"
        else:
            parts.append(("95% interval " if kind == "95%" else "") + f"[{lo:+.3g}, {hi:+.3g}]")
    if n is not None:
        parts.append(f"n = {n}")
    return ", ".join(parts)


def verdict_cell(c: dict) -> str:
    """A claim's verdict badge, with the reason where the evidence could not resolve the effect
    (e.g. fewer than three settings), whatever side its interval lies on."""
    why = c.get("unresolved") if c.get("verdict") == "inconclusive" else None
    return badge(c.get("verdict")) + (f'<br><span class="iv">{esc(why)}</span>' if why else "")


def unit(quantity: str | None) -> str:
    for suffix, u in UNITS:
        if quantity and quantity.endswith(suffix):
            return u
    return ""


def effect(value: Any, quantity: str | None = None) -> str:
    """A signed effect with its unit ("+0.0301", "+19.5%"); other values as :func:`fmt`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return fmt(value)
    if isinstance(value, float) and not math.isfinite(value):
        return fmt(value)
    return f"{value:+.4g}{unit(quantity)}"


def badge(verdict: str | None) -> str:
    verdict = verdict or "not run"
    return f'<span class="badge {VERDICT_CLASS.get(verdict, "muted")}">{esc(verdict)}</span>'


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], caption: str | None = None, *, raw: bool = False) -> str:
    """An HTML table. Cells are escaped and formatted unless ``raw`` (for cells holding badges)."""
    cell = (lambda v: v if isinstance(v, str) else fmt(v)) if raw else (lambda v: esc(fmt(v)))
    out = ['<table class="data">']
    if caption:
        out.append(f"<caption>{esc(caption)}</caption>")
    out.append("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def figure(fig, caption: str, *, fig_id: str | None = None) -> str:
    """Embed a matplotlib figure as a base64 PNG (the page stays self-contained) and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    ident = f' id="{esc(fig_id)}"' if fig_id else ""
    return (
        f'<figure{ident}><img alt="{esc(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{esc(caption)}</figcaption></figure>"
    )


def reproduced_cell(c: dict) -> str:
    """The reproduced value of a claim dict with its interval and n where the verdict is statistical."""
    value = fmt(c.get("reproduced"))
    extra = (fmt_interval(c.get("interval"), c.get("n"), c.get("interval_kind"))
             if c.get("kind") in ("direction", "shape") else "")
    return esc(value) + (f' <span class="iv">{esc(extra)}</span>' if extra else "")


def claims_table(claims: Iterable[dict], caption: str | None = None) -> str:
    """Published vs reproduced for a list of claim dicts (paper.json shape), with verdict badges."""
    rows = []
    for c in claims:
        rows.append(
            [
                f'<a href="#claim-{esc(c["id"])}">{esc(c["id"])}</a>',
                esc(c.get("source", "")),
                esc(c.get("kind", "")),
                esc(fmt(c.get("published"))),
                reproduced_cell(c),
                verdict_cell(c),
                esc(c.get("note", "")),
            ]
        )
    headers = ["claim", "source", "kind", "published", "reproduced", "verdict", "note"]
    return table(headers, rows, caption, raw=True)


def matplotlib_setup() -> None:
    """Headless backend with a consistent look."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.figsize": (6.4, 4.0), "axes.grid": True, "grid.alpha": 0.3, "font.size": 10})
