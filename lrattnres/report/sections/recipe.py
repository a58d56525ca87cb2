"""The scale's recipe: the learning-rate check with its rule and winner, whether the scale trains with
the winner's rates, and the noise at those rates (clipping, outliers, the paired SD and the seeds
rule, what each direction claim could resolve)."""

from __future__ import annotations

from lrattnres import lrcheck
from lrattnres.checks import is_number
from lrattnres.report.html import badge, esc, fmt, table

TITLE = "The scale's recipe: learning-rate check and noise"
ORDER = 15


def _num(v, spec: str = ".4f") -> str:
    return "–" if not is_number(v) else format(v, spec)


def _rule(check: dict) -> str:
    items = "".join(f"<li>{esc(line)}</li>" for line in lrcheck.RULE)
    return (f"<p>The rule, fixed in config.yaml before the check's runs (tie margin {check['tie_margin']:g} nats):</p>"
            f"<ol>{items}</ol>")


def _check_table(result: dict) -> str:
    win = (result.get("winner") or {}).get("multiplier")
    low = min((r["final_val_ce"] for r in result["runs"] if r["status"] == "eligible"), default=None)
    rows = []
    for r in result["runs"]:
        out = ("not recorded" if not r["outliers_recorded"] else str(len(r["outliers"] or [])))
        status = r["status"] + (" (winner)" if r["multiplier"] == win else "")
        rows.append([esc(f"x{r['multiplier']:g}"), esc(f"{r['muon_lr']:.3g}"), esc(f"{r['adam_lr']:.3g}"),
                     esc(_num(r["final_val_ce"])),
                     esc("–" if low is None or not is_number(r["final_val_ce"]) else f"{r['final_val_ce'] - low:+.4f}"),
                     esc(_num(r["above_clip_pct"], ".1f")), esc(_num(r["max_grad_norm"], ".3g")), esc(out),
                     esc(status) + (f" <small>{esc(r['why'])}</small>" if r["why"] else "")])
    return table(["multiplier", "Muon lr", "Adam lr", "final val. CE", "vs lowest", "clipped (%)", "largest norm",
                  "outliers", "status"], rows, "The learning-rate check: the baseline at each multiple of the "
                 "reference rates", raw=True)


def _configured(result: dict) -> str:
    c = result["configured"]
    if c["matches_winner"] is None:
        return f"<p>{esc(c['note'])}.</p>"
    verdict = "match" if c["matches_winner"] else "mismatch"
    return f'<p>{badge(verdict)} {esc(c["note"])}.</p>'


def _check(ctx, grid: dict | None) -> str:
    check = lrcheck.settings_of(ctx.settings)
    optim = (ctx.settings.get("recipe") or {}).get("optim") or {}
    rates = f"Muon {fmt((optim.get('muon') or {}).get('lr'))}, Adam {fmt((optim.get('adam') or {}).get('lr'))}"
    if check is None:
        return (f"<p>This scale has no learning-rate check (<code>grid.lr_check</code>): every method trains with the "
                f"rates of its recipe ({esc(rates)}).</p>")
    result = (grid or {}).get("lr_check")
    ref = check["reference"]
    head = (f"<p>The baseline alone, at {', '.join(f'x{m:g}' for m in check['multipliers'])} the reference rates "
            f"(Muon {ref['muon']:g}, Adam {ref['adam']:g}), scaled together, with the rest of the recipe kept; every "
            f"method then trains with the winner's rates, unchanged. The configured rates: {esc(rates)}.</p>")
    if not result or result["state"] == "not run":
        return head + _rule(check) + '<p class="notrun">The learning-rate check has not run at this scale.</p>'
    parts = [head, _rule(check), _check_table(result)]
    w = result.get("winner")
    if result["state"] != "done":
        parts.append('<p class="notrun">The learning-rate check is incomplete: some multipliers have no result; '
                     "it has no winner yet.</p>")
    elif w is None:
        parts.append('<p class="notrun">No multiplier is eligible: the check has no winner, and the scale cannot take '
                     "its rates from it.</p>")
    else:
        ties = ", ".join(f"x{m:g}" for m in w["near_ties"])
        text = (f"Winner: <b>x{w['multiplier']:g}</b> (Muon {w['muon_lr']:g}, Adam {w['adam_lr']:g}), final validation "
                f"CE {w['final_val_ce']:.4f}; lowest x{w['lowest']['multiplier']:g} ({w['lowest']['final_val_ce']:.4f}); "
                f"near-ties: {esc(ties)}.")
        if w["edge"]:
            text += " The winner is the largest multiplier tried: a larger rate might be lower still (the grid is not extended)."
        parts.append(f"<p>{text}</p>")
    parts.append(_configured(result))
    return "\n".join(parts)


def _noise_runs(noise: dict) -> str:
    rows = []
    for r in noise["runs"]:
        out = "not recorded" if not r["outliers_recorded"] else str(len(r["outliers"] or []))
        flags = "; ".join(r["flags"])
        rows.append([esc(r["run_id"]), esc(_num(r["final_val_ce"])), esc(_num(r["above_clip_pct"], ".1f")),
                     esc(_num(r["max_grad_norm"], ".3g")), esc(out),
                     (f'<span class="badge bad">flagged</span> {esc(flags)}' if flags else '<span class="badge ok">ok</span>')])
    return table(["run", "final val. CE", "clipped (%)", "largest norm", "outliers", "fewer than half clipped, no outlier"],
                 rows, "Clipping and gradient-norm outliers of the baseline and the seed pairs", raw=True)


def _paired(noise: dict) -> str:
    p = noise["paired"]
    rows = [[x["seed"], f"{x['lr']:.4f}", f"{x['attnres']:.4f}", f"{x['difference']:+.4f}"] for x in noise["pairs"]]
    out = [table(["seed", "LR-AttnRes", "AttnRes", "LR-AttnRes minus AttnRes"], rows,
                 "The headline pair per seed (final validation CE)")] if rows else []
    if p["sd"] is not None:
        lo, hi = p["sd_interval"]
        out.append(f"<p>Paired differences: mean {p['mean']:+.4f} nats, SD <b>{p['sd']:.4f}</b> nats, "
                   f"{p['level']:.0%} interval [{lo:.4f}, {hi:.4f}] (chi-square), n = {p['n']}.</p>")
    else:
        out.append(f"<p>Paired differences: n = {p['n']}; an SD needs two seed pairs.</p>")
    rule = noise.get("rule")
    if rule:
        flag = ('<span class="badge muted">not evaluated</span>' if rule["exceeded"] is None else
                '<span class="badge ok">enough seeds</span>' if not rule["exceeded"] or rule["planned_seeds"] >= rule["seeds"]
                else '<span class="badge bad">more seeds needed</span>')
        out.append(f"<p>Rule: where the SD exceeds {rule['max_paired_sd']:g} nats the headline pair needs "
                   f"{rule['seeds']} seeds. {flag} {esc(rule['text'])}.</p>")
    return "\n".join(out)


def _reference(noise: dict) -> str:
    ref = noise.get("against_reference")
    if not ref:
        return ""
    if ref["difference"] is None:
        return (f"<p>The baseline at the configured rates (<code>{esc(ref['baseline_run'])}</code>) against the "
                f"reference rates (<code>{esc(ref['reference_run'])}</code>): no finite pair of losses.</p>")
    k = ref.get("configured_multiplier")
    at = f"x{k:g}" if k is not None else "the configured rates"
    out = (f"<p>The baseline at {esc(at)}: final validation CE {ref['final_val_ce']:.4f}, against "
           f"{ref['reference_final_val_ce']:.4f} at the reference rates (x1): <b>{ref['difference']:+.4f}</b> nats.")
    if ref.get("repeat_difference") is not None:
        out += (f" It has the spec and seed of the check's run <code>{esc(ref['repeat_run'])}</code> "
                f"({ref['repeat_final_val_ce']:.4f}): the two differ by {ref['repeat_difference']:+.4f} nats, this "
                "device's run-to-run noise for one spec.")
    return out + "</p>"


def _resolvable(ctx) -> str:
    rows = []
    for cid, c in ctx.claims.items():
        if c.get("kind") != "direction" or c.get("mdd") is None:
            continue
        pub = c.get("published")
        seen = "–"
        if is_number(pub) and not isinstance(pub, bool):
            seen = "yes" if abs(pub) >= c["mdd"] else "no"
        rows.append([f'<a href="#claim-{esc(cid)}">{esc(cid)}</a>', esc(c.get("source")), esc(fmt(pub)),
                     esc(fmt(c.get("reproduced"))), esc(fmt(c.get("n"))), esc(fmt(c["mdd"])), esc(seen),
                     badge(c.get("verdict"))])
    if not rows:
        return "<p>No direction claim has an interval at this scale yet.</p>"
    return ("<details><summary>What each direction claim could resolve at this noise</summary>"
            "<p>The minimum detectable difference: the true effect that the claim's own test (its interval, at its n) "
            "resolves with 80% power; a single-run design with a threshold resolves exactly beyond it. Where the "
            "paper's effect is smaller, the claim cannot be reproduced at this scale whatever the truth.</p>"
            + table(["claim", "source", "paper's effect", "reproduced", "n", "detectable (80%)",
                     "paper's effect detectable", "verdict"], rows, "Minimum detectable differences", raw=True)
            + "</details>")


def build(ctx) -> str:
    grids = ctx.results("grid")
    grid = grids[0] if grids else None
    parts = ["<h3>The learning-rate check</h3>", _check(ctx, grid), "<h3>Noise at the configured rates</h3>"]
    noise = (grid or {}).get("noise")
    if not noise or not noise.get("runs"):
        parts.append('<p class="notrun">The training grid has not run at this scale yet.</p>')
    else:
        parts += [_noise_runs(noise), _reference(noise), _paired(noise)]
    parts.append(_resolvable(ctx))
    return "\n".join(p for p in parts if p)
