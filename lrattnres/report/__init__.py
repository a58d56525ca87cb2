"""The report stage: every table and figure of the paper beside the reproduced one, with verdicts.

``python -m lrattnres report --settings S.json --published reports/published.yaml
--results a.json b.json ... --html reports/paper.html --json reports/paper.json``

Result files name their stage (``"stage": ...``) and may carry ``claims``; the claims engine
(:mod:`lrattnres.claims`) turns them into verdicts, and every published claim no result produced is
listed as "not run" with the stage that will produce it.  Sections live in
:mod:`lrattnres.report.sections` (one module each, ordered by ``ORDER``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from lrattnres import claims as claims_engine
from lrattnres.io import atomic_write_json, atomic_write_text, read_json
from lrattnres.provenance import now, provenance
from lrattnres.report.context import ReportContext

log = logging.getLogger("lrattnres.report")
TEMPLATE_DIR = Path(__file__).parent / "templates"


def load_results(paths: list[str]) -> dict[str, list[dict]]:
    by_stage: dict[str, list[dict]] = {}
    for path in paths:
        data = read_json(path)
        stage = data.get("stage") if isinstance(data, dict) else None
        if not stage:
            raise ValueError(f"{path}: result file has no 'stage' field; expected a stage's result JSON")
        data.setdefault("_path", str(path))
        by_stage.setdefault(stage, []).append(data)
    return by_stage


def load_recorded(recorded: dict[str, str], root: Path) -> dict[str, dict]:
    """Result files measured elsewhere (e.g. on a GPU); missing ones are skipped with a log line."""
    out = {}
    for name, rel in recorded.items():
        path = root / rel
        if path.exists():
            data = read_json(path)
            data.setdefault("_path", str(rel))
            out[name] = data
        else:
            log.info("recorded result %s not found at %s; skipped", name, path)
    return out


def rederive_claims(recorded: dict[str, dict], ids: set[str]) -> None:
    """Derive the claims of recorded throughput results again with this code: the measurements are
    kept as recorded, and a recorded file and a local run are judged by the same rules (and notes)."""
    from lrattnres import throughput

    for res in recorded.values():
        if res.get("stage") == "throughput" and isinstance(res.get("spec"), dict):
            res["claims"] = throughput.claims_for(res, res["spec"], ids)


def collect_produced(by_stage: dict[str, list[dict]], recorded: dict[str, dict]) -> dict[str, dict]:
    """Merge the ``claims`` of every result; two results producing one claim is an error."""
    produced: dict[str, dict] = {}
    origin: dict[str, str] = {}
    sources = [(r["_path"], r, None) for rs in by_stage.values() for r in rs]
    sources += [(r["_path"], r, r.get("provenance", {}).get("device")) for r in recorded.values()]
    for path, result, device in sources:
        for cid, claim in (result.get("claims") or {}).items():
            if cid in produced:
                raise ValueError(f"claim {cid!r} produced twice: by {origin[cid]} and by {path}")
            claim = dict(claim)
            if device:
                claim["note"] = (claim.get("note", "") + f" (recorded on {device}, {path})").strip()
            produced[cid] = claim
            origin[cid] = path
    return produced


def discover_sections() -> list[Any]:
    from lrattnres.report import sections

    mods = [importlib.import_module(f"{sections.__name__}.{m.name}") for m in pkgutil.iter_modules(sections.__path__)]
    return sorted((m for m in mods if hasattr(m, "build")), key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def section_id(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def render(ctx: ReportContext, claims: list[dict], prov: dict) -> str:
    import jinja2

    from lrattnres.report import html

    html.matplotlib_setup()
    sections = []
    for mod in discover_sections():
        log.info("section %s", section_id(mod))
        sections.append({"id": section_id(mod), "title": mod.TITLE, "html": mod.build(ctx)})
    counts = Counter(c["verdict"] for c in claims)
    by_kind: dict[str, Counter] = {}
    for c in claims:
        by_kind.setdefault(c["kind"], Counter())[c["verdict"]] += 1
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
    return env.get_template("paper.html.j2").render(
        scale=ctx.scale,
        sections=sections,
        claims=claims,
        counts=counts,
        by_kind=by_kind,
        provenance=prov,
        claims_table=html.claims_table,
        badge=html.badge,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres report", description="render the paper report")
    p.add_argument("--settings", required=True, help="resolved settings JSON of the scale")
    p.add_argument("--published", required=True)
    p.add_argument("--results", nargs="*", default=[])
    p.add_argument("--html", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--root", default=".", help="repository root (for recorded results)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    started = now()

    settings = read_json(args.settings)
    scale = settings["scale"]
    published = claims_engine.load_published(args.published)
    by_stage = load_results(args.results)
    recorded = load_recorded(settings.get("recorded", {}), Path(args.root))
    rederive_claims(recorded, set(published))
    produced = collect_produced(by_stage, recorded)
    claims = claims_engine.evaluate_claims(published, produced, scale)
    ctx = ReportContext(
        scale=scale,
        published=published,
        claims={c["id"]: c for c in claims},
        settings=settings,
        by_stage=by_stage,
        recorded=recorded,
    )
    starts = [r.get("provenance", {}).get("started") for rs in by_stage.values() for r in rs]
    prov = provenance(settings, started=min([s for s in starts if s] or [started]))
    page = render(ctx, claims, prov)
    atomic_write_text(args.html, page)
    atomic_write_json(args.json, {"scale": scale, "provenance": prov, "claims": claims})
    log.info("wrote %s and %s: %d claims (%s)", args.html, args.json, len(claims), dict(Counter(c["verdict"] for c in claims)))
    return 0
