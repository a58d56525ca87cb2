"""The report stage: every table and figure of the paper beside the reproduced one, with verdicts.

``python -m lrattnres report --settings S.json --published reports/published.yaml
--recorded reports/recorded.yaml --results a.json b.json ... --html reports/paper.html
--json reports/paper.json --tsv reports/claims.tsv``

Result files name their stage (``"stage": ...``) and may carry ``claims``; the claims engine
(:mod:`lrattnres.claims`) turns them into verdicts, and every published claim no result produced is
listed as "not run" with the stage that will produce it.  Sections live in
:mod:`lrattnres.report.sections` (one module each, ordered by ``ORDER``); the page opens with
"Results at a glance" (the records of reports/published.yaml that carry ``glance``).

Bad stage data never stops the render: a result file that is not JSON or names no stage, a claim
whose value is malformed (wrong type, NaN, an unknown id, produced twice) and a section that fails
are listed on the page with the file and key, and the claims concerned are "not run".  Every output
is written to a temporary file and renamed, so an older report survives any failure.

Results measured on another machine are listed in ``reports/recorded.yaml`` (:mod:`lrattnres.recorded`)
and shown in their sections.  A report recorded elsewhere (its key ``gpu_report``: the paper.json of
another scale, e.g. the gpu scale on an H200) is shown beside this one's verdicts, labelled with its
scale, device, commit and date; an absent file leaves the column out.  The list never stops the
report: a missing or malformed list, a bad entry and a listed file that does not exist are notes on
the page (``recorded_notes`` in paper.json), naming the file and the key.
"""

from __future__ import annotations

import argparse
import html as html_lib
import importlib
import json
import logging
import pkgutil
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from lrattnres import claims as claims_engine
from lrattnres import run_health
from lrattnres.io import atomic_path, atomic_write_text, read_json
from lrattnres.provenance import now, provenance
from lrattnres.recorded import REPORT as RECORDED_REPORT
from lrattnres.recorded import load as load_recorded_list
from lrattnres.recorded import resolve_path as resolve_recorded_path
from lrattnres.report import html, sections
from lrattnres.report.context import ReportContext
from lrattnres.throughput.summary import claims_for as throughput_claims_for

log = logging.getLogger("lrattnres.report")
TEMPLATE_DIR = Path(__file__).parent / "templates"
TSV_COLUMNS = ("id", "source", "section", "origin", "kind", "quantity", "published", "reproduced", "verdict",
               "interval_lo", "interval_hi", "interval_kind", "n", "note")


def _problem(problems: list[str] | None, text: str) -> None:
    if problems is None:
        raise ValueError(text)
    log.warning("%s", text)
    problems.append(text)


def load_results(paths: list[str], problems: list[str] | None = None) -> dict[str, list[dict]]:
    """Result JSONs by stage.  A file that cannot be read or names no stage raises ValueError, or,
    with ``problems`` given, is recorded there and skipped."""
    by_stage: dict[str, list[dict]] = {}
    for path in paths:
        try:
            data = read_json(path)
        except (OSError, ValueError) as e:
            _problem(problems, f"{path}: cannot be read ({e}); its claims are not run")
            continue
        stage = data.get("stage") if isinstance(data, dict) else None
        if not stage or not isinstance(stage, str):
            _problem(problems, f"{path}: result file has no 'stage' field; expected a stage's result JSON")
            continue
        data.setdefault("_path", str(path))
        by_stage.setdefault(stage, []).append(data)
    return by_stage


def _note(notes: list[str] | None, text: str) -> None:
    log.info("%s", text)
    if notes is not None:
        notes.append(text)


def load_recorded(recorded: dict[str, str], root: Path, problems: list[str] | None = None,
                  notes: list[str] | None = None) -> dict[str, dict]:
    """Result files measured elsewhere (e.g. on a GPU); a missing one is skipped with a note.
    The recorded report (key ``gpu_report``) is not a result file: :func:`load_recorded_report`."""
    out = {}
    for name, listed in recorded.items():
        if name == RECORDED_REPORT:
            continue
        rel = resolve_recorded_path(listed, root) or listed  # a pattern: its newest recording
        path = root / rel
        if not path.exists():
            _note(notes, f"recorded result {name!r}: {rel} does not exist, so its section shows no recording; record "
                         "it (benchmarks/README.md says how each file is made) or take the line out of "
                         "reports/recorded.yaml")
            continue
        try:
            data = read_json(path)
        except (OSError, ValueError) as e:
            _problem(problems, f"{rel}: recorded result {name!r} cannot be read ({e}); skipped: record it again "
                               "or take its line out of reports/recorded.yaml")
            continue
        if not isinstance(data, dict):
            _problem(problems, f"{rel}: recorded result {name!r}: expected a JSON object; skipped: record it again "
                               "or take its line out of reports/recorded.yaml")
            continue
        data.setdefault("_path", str(rel))
        out[name] = data
    return out


def recorded_label(report: dict) -> str:
    """"gpu scale, NVIDIA H200, 1a2b3c4d, 2026-12-01": a recorded report's scale, device, commit and date."""
    prov = report.get("provenance") if isinstance(report.get("provenance"), dict) else {}
    commit = str(prov.get("commit") or "?")[:8] + (" (dirty)" if prov.get("dirty") else "")
    date = str(prov.get("finished") or prov.get("started") or "?")[:10]
    device = str(prov.get("device") or "?")
    return f"{report.get('scale', '?')} scale, {device}, {commit}, {date}"


def load_recorded_report(rel: str | None, root: Path, problems: list[str] | None = None,
                         notes: list[str] | None = None) -> dict | None:
    """``{"label", "path", "claims": {id: claim}}`` of a paper.json made elsewhere, or None when the
    config names none, the file is absent (a note), or it is not a report (a problem)."""
    if not rel:
        return None
    path = root / rel
    if not path.exists():
        _note(notes, f"recorded report ({RECORDED_REPORT!r} in reports/recorded.yaml): {rel} does not exist, so the "
                     "page has no column of the verdicts of a report made elsewhere beside this run's (nothing is "
                     "wrong with this run). It is made from a scale's pieces with `python -m lrattnres piece report "
                     f"--into {Path(rel).parent}` (docs/gpu-scale.md); to drop the note, take the line out of "
                     "reports/recorded.yaml")
        return None
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        _problem(problems, f"{rel}: recorded report cannot be read ({e}); its column is left out: render it again "
                           "(python -m lrattnres piece report, docs/gpu-scale.md) or take its line out of "
                           "reports/recorded.yaml")
        return None
    items = data.get("claims") if isinstance(data, dict) else None
    if not isinstance(items, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str)
                                              and isinstance(c.get("verdict"), str) for c in items):
        _problem(problems, f"{rel}: recorded report: key 'claims': expected a list of claims with 'id' and "
                           "'verdict' (a paper.json); its column is left out: point the entry at a report's "
                           "paper.json, or take its line out of reports/recorded.yaml")
        return None
    return {"label": recorded_label(data), "path": str(rel), "scale": data.get("scale"),
            "claims": {c["id"]: c for c in items}}


def rederive_claims(recorded: dict[str, dict], ids: set[str], problems: list[str] | None = None) -> None:
    """Derive the claims of recorded throughput results again with this code: the measurements are
    kept as recorded, and a recorded file and a local run are judged by the same rules (and notes)."""
    for res in recorded.values():
        if res.get("stage") == "throughput" and isinstance(res.get("spec"), dict):
            try:
                res["claims"] = throughput_claims_for(res, res["spec"], ids)
            except (KeyError, TypeError, ValueError) as e:
                _problem(problems, f"{res['_path']}: throughput claims cannot be derived ({type(e).__name__}: {e}); "
                                   "the recorded claims are used as they are")


def collect_produced(by_stage: dict[str, list[dict]], recorded: dict[str, dict],
                     published: dict[str, dict] | None = None,
                     problems: dict[str, str] | None = None) -> dict[str, dict]:
    """Merge the ``claims`` of every result.

    Without ``problems`` a claim produced twice is an error.  With it (the report), a malformed
    claim, an id the published file does not know, and a claim produced twice are recorded there
    (claim id -> the file and key) and left out, so the claim is "not run" with that note."""
    produced: dict[str, dict] = {}
    origin: dict[str, str] = {}
    sources = [(r["_path"], r, None) for rs in by_stage.values() for r in rs]
    sources += [(r["_path"], r, (r.get("provenance") or {}).get("device")) for r in recorded.values()]
    twice: set[str] = set()
    for path, result, device in sources:
        items = result.get("claims") or {}
        if not isinstance(items, dict):
            if problems is None:
                raise ValueError(f"{path}: key 'claims': expected a mapping of claim ids, got {type(items).__name__}")
            problems[f"{path}:claims"] = f"{path}: key 'claims': expected a mapping of claim ids, got {type(items).__name__}"
            continue
        for cid, claim in items.items():
            if cid in produced or cid in twice:
                text = f"claim {cid!r} produced twice: by {origin[cid]} and by {path}"
                if problems is None:
                    raise ValueError(text)
                problems[cid] = text
                produced.pop(cid, None)
                twice.add(cid)
                continue
            if published is not None and problems is not None:
                if cid not in published:
                    problems[f"{path}:{cid}"] = f"{path}: claims[{cid!r}]: not a claim id of the published-numbers file"
                    continue
                claim, problem = claims_engine.check_produced(published[cid], claim, path)
                if problem:
                    problems[cid] = problem
                    origin[cid] = path
                    continue
            claim = dict(claim)
            if device:
                claim["note"] = ((claim.get("note") or "") + f" (recorded on {device}, {path})").strip()
            produced[cid] = claim
            origin[cid] = path
    return produced


def discover_sections() -> list[Any]:
    mods = [importlib.import_module(f"{sections.__name__}.{m.name}") for m in pkgutil.iter_modules(sections.__path__)]
    return sorted((m for m in mods if hasattr(m, "build")), key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def section_id(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def build_section(mod, ctx: ReportContext) -> str:
    """A section's HTML; a section that fails on its stage data says so instead of stopping the page."""
    try:
        return mod.build(ctx)
    except Exception as e:  # a section must never take the page down with it
        where = traceback.extract_tb(e.__traceback__)[-1]
        text = (f"section {section_id(mod)!r} could not be drawn from its stage data: {type(e).__name__}: {e} "
                f"({Path(where.filename).name}:{where.lineno})")
        log.error("%s", text)
        ctx.problems.append(text)
        return f'<p class="notrun">This section could not be drawn: {html_lib.escape(text)}</p>'


def _counts(claims: list[dict]) -> dict[str, Counter]:
    """The verdicts of the paper's claims and of the supplementary ones, counted apart: the page's
    summary shows the first, paper.json's ``verdict_counts`` and the log line both."""
    out = {"paper": Counter(), "supplementary": Counter()}
    for c in claims:
        out["paper" if c.get("origin", "paper") == "paper" else "supplementary"][c["verdict"]] += 1
    return out


def _count_text(counts: Counter) -> str:
    return ", ".join(f"{v} {counts[v]}" for v in claims_engine.VERDICTS if counts.get(v)) or "none"


def render(ctx: ReportContext, claims: list[dict], prov: dict) -> str:
    import jinja2

    html.matplotlib_setup()
    sections = []
    for mod in discover_sections():
        log.info("section %s", section_id(mod))
        sections.append({"id": section_id(mod), "title": mod.TITLE, "html": build_section(mod, ctx)})
    by_kind: dict[str, Counter] = {}
    for c in claims:
        by_kind.setdefault(c["kind"], Counter())[c["verdict"]] += 1
    sections_of = sorted({c["section"] for c in claims}, key=_section_key)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
    return env.get_template("paper.html.j2").render(
        scale=ctx.scale,
        sections=sections,
        claims=claims,
        counts=_counts(claims),
        by_kind=by_kind,
        kinds=claims_engine.KINDS,
        verdicts=claims_engine.VERDICTS,
        paper_sections=sections_of,
        provenance=prov,
        problems=ctx.problems,
        recorded_notes=ctx.recorded_notes,
        recorded=ctx.recorded_report,
        badge=html.badge,
        verdict_cell=html.verdict_cell,
        fmt=html.fmt,
        reproduced_cell=html.reproduced_cell,
    )


def _section_key(s: str) -> tuple:
    """Paper sections in reading order: 1, 3.2, 4.2 ... then appendices A, B.2, ..."""
    head = s.split(".")[0]
    return (0, [int(x) if x.isdigit() else 0 for x in s.split(".")]) if head.isdigit() else (1, [s])


def claims_frame(claims: list[dict], recorded: dict | None = None):
    """The claims as a pandas DataFrame, one row per claim (the columns of reports/claims.tsv)."""
    import pandas as pd

    rows = []
    for c in claims:
        iv = c.get("interval") if isinstance(c.get("interval"), list) else [None, None]
        row = {k: c.get(k) for k in TSV_COLUMNS if k not in ("interval_lo", "interval_hi")}
        row.update(interval_lo=iv[0], interval_hi=iv[1])
        for k in ("published", "reproduced"):
            if isinstance(row[k], (dict, list)):
                row[k] = json.dumps(row[k])
        if recorded is not None:
            rc = recorded["claims"].get(c["id"])
            row["recorded_verdict"] = rc.get("verdict") if rc else None
        rows.append(row)
    cols = list(TSV_COLUMNS) + (["recorded_verdict"] if recorded is not None else [])
    return pd.DataFrame(rows, columns=cols).astype({"n": "Int64"})


def write_tsv(path: str, claims: list[dict], recorded: dict | None = None) -> None:
    frame = claims_frame(claims, recorded)
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, sep="\t", index=False, lineterminator="\n")


def write_json_strict(path: str, obj: Any) -> None:
    """JSON without NaN or Infinity (a value that cannot be written strictly is an error)."""
    atomic_write_text(path, json.dumps(claims_engine.json_safe(obj), indent=2, allow_nan=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres report", description="render the paper report")
    p.add_argument("--settings", required=True, help="resolved settings JSON of the scale")
    p.add_argument("--published", required=True)
    p.add_argument("--recorded", default=None,
                   help="the list of results measured elsewhere (reports/recorded.yaml); without it none")
    p.add_argument("--results", nargs="*", default=[])
    p.add_argument("--html", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--tsv", default=None, help="the claims as a tab-separated table (pandas)")
    p.add_argument("--root", default=".", help="repository root (for recorded results)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    started = now()

    settings = read_json(args.settings)
    scale = settings["scale"]
    published = claims_engine.load_published(args.published)
    problems: list[str] = []
    by_stage = load_results(args.results, problems)
    root = Path(args.root)
    rec_cfg, recorded_notes = load_recorded_list(args.recorded) if args.recorded else ({}, [])
    recorded = load_recorded(rec_cfg, root, problems, recorded_notes)
    recorded_report = load_recorded_report(rec_cfg.get(RECORDED_REPORT), root, problems, recorded_notes)
    rederive_claims(recorded, set(published), problems)
    claim_problems: dict[str, str] = {}
    produced = collect_produced(by_stage, recorded, published, claim_problems)
    # claims of the stages that read trained weights name the runs with gradient-norm outliers among
    # theirs (the grid stage names its own: lrattnres/run_health.py)
    run_health.annotate_claims(produced, [r for rs in by_stage.values() for r in rs] + list(recorded.values()),
                               run_health.flagged_runs(by_stage.get("grid", [])))
    claims = claims_engine.evaluate_claims(published, produced, scale,
                                           {k: v for k, v in claim_problems.items() if k in published},
                                           paper_runs=bool(settings.get("paper_runs")))
    problems += list(dict.fromkeys(claim_problems.values()))
    ctx = ReportContext(
        scale=scale,
        published=published,
        claims={c["id"]: c for c in claims},
        settings=settings,
        by_stage=by_stage,
        recorded=recorded,
        recorded_report=recorded_report,
        problems=problems,
        recorded_notes=recorded_notes,
    )
    starts = [r.get("provenance", {}).get("started") for rs in by_stage.values() for r in rs
              if isinstance(r.get("provenance"), dict)]
    prov = provenance(settings, started=min([s for s in starts if isinstance(s, str)] or [started]))
    page = render(ctx, claims, prov)
    atomic_write_text(args.html, page)
    grid = next(iter(by_stage.get("grid", [])), {})
    recipe = {"lr_check": grid.get("lr_check"), "noise": grid.get("noise")}  # the grid's; None before it ran
    counts = _counts(claims)
    write_json_strict(args.json, {"scale": scale, "provenance": prov, "claims": claims, "recipe": recipe,
                                  "verdict_counts": {k: dict(v) for k, v in counts.items()},
                                  "problems": problems, "recorded_notes": recorded_notes})
    if args.tsv:
        write_tsv(args.tsv, claims, recorded_report)
    log.info("wrote %s and %s: %d claims of the paper (%s; the page's summary counts these) and %d supplementary "
             "(%s); %d problems", args.html, args.json, sum(counts["paper"].values()), _count_text(counts["paper"]),
             sum(counts["supplementary"].values()), _count_text(counts["supplementary"]), len(problems))
    return 0
