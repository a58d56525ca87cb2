"""``python -m lrattnres diagnostics``: one run (``--run``), the figures and claims from the per-run
rows (``--aggregate``), or every run of the grid in one process."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from lrattnres.claims import load_published
from lrattnres.data import load_manifest
from lrattnres.diagnostics.analyse import _device, _missing_inputs, analyse_run
from lrattnres.diagnostics.settings import DiagnosticsError, validate_settings
from lrattnres.diagnostics.summary import aggregate, claims, figures_data
from lrattnres.gridplan import plan
from lrattnres.io import atomic_write_json, read_json
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.diagnostics")


def diagnose(settings: dict, runs_root: Path, manifest: dict | None, known_ids=None, *, skip_missing: bool = False) -> dict:
    """The diagnostics result (without provenance) for every planned run under ``runs_root``."""
    diag = validate_settings(settings.get("diagnostics"), "settings.diagnostics")
    device = _device(diag["device"])
    rows = []
    planned = plan(settings)
    for i, run in enumerate(planned):
        folder = runs_root / run.run_id
        missing = _missing_inputs(run, folder)
        if missing:
            if skip_missing:
                log.warning("%s: %s missing; skipped (train the run first: snakemake makes it)", run.run_id,
                            ", ".join(str(p) for p in missing))
                continue
            raise DiagnosticsError(f"{missing[0]}: not found (run {run.run_id} of the grid; train it first, "
                                   "or pass --skip-missing)")
        log.info("[%d/%d] %s", i + 1, len(planned), run.run_id)
        rows.append(analyse_run(run, folder, manifest, settings, diag, device))
    table = {r["run_id"]: r for r in rows}
    return {
        "stage": "diagnostics",
        "scale": settings.get("scale"),
        "settings": diag,
        "runs": table,
        "figures_data": figures_data(rows, settings),
        "claims": claims(rows, settings, known_ids),
    }


def run_attention(result: dict) -> dict | None:
    """The attention each diagnosed run's forward used, by run id (for the provenance), or None."""
    used = {rid: row["attention"] for rid, row in result.get("runs", {}).items() if row.get("attention")}
    return used or None


def _read_settings(path: str) -> dict:
    settings = read_json(path)
    for key in ("grid", "presets"):
        if key not in settings:
            raise DiagnosticsError(f"{path}: settings lack {key!r} (expected the resolved settings of a scale)")
    return settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lrattnres diagnostics",
        description="routing diagnostics: N_eff, heatmaps, gradient norms, query utilisation. "
                    "--run ID analyses one run (needs its model); --aggregate ROWS... makes the figures "
                    "and claims from the per-run rows; with neither, every run of the grid in one process.")
    p.add_argument("--settings", required=True, help="resolved settings JSON of the scale")
    p.add_argument("--runs", help="folder holding one sub-folder per run id")
    p.add_argument("--data", help="data manifest (manifest.json or its folder)")
    p.add_argument("--published", help="reports/published.yaml (claim ids)")
    p.add_argument("--out", required=True, help="diagnostics result JSON (with --run: that run's row)")
    p.add_argument("--run", help="analyse this run of the grid only")
    p.add_argument("--aggregate", nargs="+", metavar="ROW_JSON", help="per-run rows written by --run")
    p.add_argument("--skip-missing", action="store_true", help="skip runs whose folder lacks the model or metrics.jsonl")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    started = now()
    settings = _read_settings(args.settings)
    if args.run and args.aggregate:
        p.error("--run and --aggregate exclude each other")
    needs = {"run": ("runs", "data"), "aggregate": ("published",), "whole": ("runs", "data", "published")}
    mode = "run" if args.run else "aggregate" if args.aggregate else "whole"
    for opt in needs[mode]:
        if getattr(args, opt) is None:
            p.error(f"--{opt} is required {'with --' + mode if mode != 'whole' else ''}".strip())

    if mode == "aggregate":
        rows = []
        for path in args.aggregate:
            row = read_json(path)
            if not isinstance(row, dict) or "run_id" not in row:
                raise DiagnosticsError(f"{path}: not a diagnostics row (expected an object with 'run_id')")
            row.pop("provenance", None)
            rows.append(row)
        result = aggregate(settings, rows, set(load_published(args.published)))
        result["provenance"] = provenance(settings, started=started, attention=run_attention(result))
        atomic_write_json(args.out, result)
        log.info("diagnostics: %d runs, %d claims -> %s", len(result["runs"]), len(result["claims"]), args.out)
        return 0

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    manifest = load_manifest(args.data, verify="size")
    if mode == "run":
        runs = {r.run_id: r for r in plan(settings)}
        if args.run not in runs:
            raise DiagnosticsError(f"--run {args.run}: not a run of the {settings.get('scale')} grid")
        run = runs[args.run]
        folder = Path(args.runs) / run.run_id
        missing = _missing_inputs(run, folder)
        if missing:
            raise DiagnosticsError(f"{missing[0]}: not found (train run {run.run_id} first)")
        diag = validate_settings(settings.get("diagnostics"), "settings.diagnostics")
        row = analyse_run(run, folder, manifest, settings, diag, _device(diag["device"]))
        row["provenance"] = provenance({"run": run.run_id, "diagnostics": diag}, started=started,
                                       attention=row.get("attention"))
        atomic_write_json(args.out, row)
        log.info("diagnostics: %s -> %s", run.run_id, args.out)
        return 0

    known = set(load_published(args.published))
    result = diagnose(settings, Path(args.runs), manifest, known, skip_missing=args.skip_missing)
    result["provenance"] = provenance(settings, started=started, attention=run_attention(result))
    atomic_write_json(args.out, result)
    log.info("diagnostics: %d runs, %d claims -> %s", len(result["runs"]), len(result["claims"]), args.out)
    return 0
