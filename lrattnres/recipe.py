"""``python -m lrattnres recipe``: the learning-rate check and the noise at the chosen rates, from a
scale's run results or from piece archives, before the whole scale has run.

The report shows the same (the grid result's ``lr_check`` and ``noise``) once every run of the scale
has its result; this command reads whatever runs there are:

    python -m lrattnres recipe --config scale=gpu --restore OUT/recipe.tar.xz [OUT/seeds.tar.xz]
    python -m lrattnres recipe --config scale=gpu --runs results/gpu/runs

It prints the check's table, its winner by the rule of :mod:`lrattnres.lrcheck` and whether the
configured rates are the winner's, then the noise of the runs at the configured rates
(:mod:`lrattnres.noise`). From archives it reads only the runs' ``result.json`` and ``metrics.jsonl``
(nothing is extracted into the working tree), and it says when the archives were made on different
data manifests.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from lrattnres import lrcheck, noise
from lrattnres.config import load_and_resolve
from lrattnres.errors import UserError
from lrattnres.grid import LR_CHECK, plan, run_row
from lrattnres.gridplan import plan
from lrattnres.io import atomic_write_json

RUN_FILES = ("result.json", "metrics.jsonl")


def from_archives(settings: dict, archives: list[str], dest: Path) -> dict[str, Any]:
    """Copy the planned runs' result and metrics files out of piece archives into ``dest/<run id>/``
    (later archives win); returns ``{"runs": [ids], "manifests": {archive: sha256 or None}}``."""
    R = settings["results"].rstrip("/")
    ids = [r.run_id for r in plan(settings)]
    found: set[str] = set()
    manifests: dict[str, str | None] = {}
    for arc in archives:
        try:
            tar = tarfile.open(arc, "r:xz")
        except (OSError, tarfile.TarError) as e:
            raise UserError(f"{arc}: not a piece archive ({e})") from None
        with tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            man = members.get(f"{R}/data/manifest.json")
            manifests[arc] = hashlib.sha256(tar.extractfile(man).read()).hexdigest() if man else None
            for run_id in ids:
                for name in RUN_FILES:
                    m = members.get(f"{R}/runs/{run_id}/{name}")
                    if m is None:
                        continue
                    (dest / run_id).mkdir(parents=True, exist_ok=True)
                    (dest / run_id / name).write_bytes(tar.extractfile(m).read())
                    found.add(run_id)
    return {"runs": [i for i in ids if i in found], "manifests": manifests}


def collect(settings: dict, runs_dir: Path) -> dict[str, Any]:
    """``{"lr_check", "noise"}`` from the runs under ``runs_dir`` that have a result."""
    rows = [run_row(r, runs_dir / r.run_id) for r in plan(settings) if (runs_dir / r.run_id / "result.json").is_file()]
    check_rows = [r for r in rows if LR_CHECK in r["roles"]]
    table = [r for r in rows if LR_CHECK not in r["roles"]]
    check = lrcheck.summarize(settings, check_rows)
    return {"lr_check": check, "noise": noise.summarize(settings, table, check), "runs_with_results": len(rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", dest="config_args", nargs="+", default=[],
                   help="Snakemake-style --config entries, e.g. scale=gpu (applied to config.yaml)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--runs", help="a scale's runs folder (results/<scale>/runs)")
    src.add_argument("--restore", nargs="+", help="piece archives (read, not extracted)")
    p.add_argument("--json", default=None, help="also write the result as JSON")
    args = p.parse_args(argv)
    overrides = {}
    for entry in args.config_args:
        key, _, value = entry.partition("=")
        if not value:
            p.error(f"--config {entry!r}: expected KEY=VALUE")
        overrides[key] = value
    settings = load_and_resolve("config.yaml", overrides)
    with tempfile.TemporaryDirectory() as tmp:
        info = None
        if args.restore:
            info = from_archives(settings, args.restore, Path(tmp))
            runs_dir = Path(tmp)
        else:
            runs_dir = Path(args.runs)
            if not runs_dir.is_dir():
                raise UserError(f"{runs_dir}: not a folder of runs (expected results/<scale>/runs)")
        out = collect(settings, runs_dir)
    if info is not None:
        out["archives"] = info["manifests"]
        shas = {v for v in info["manifests"].values() if v}
        if len(shas) > 1:
            print("warning: the archives were made on different data manifests: "
                  + ", ".join(f"{Path(a).name} {str(v)[:12]}" for a, v in info["manifests"].items()), file=sys.stderr)
    print("\n".join(lrcheck.describe(out["lr_check"]) + noise.describe(out["noise"])))
    if args.json:
        atomic_write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
