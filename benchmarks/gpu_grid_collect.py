"""Collect the runs of one benchmarks/gpu_grid.sh call into gpu_grid.json, the file the report reads
(config ``recorded.gpu_grid``).

    python benchmarks/gpu_grid_collect.py OUT [--manifest results/gpu/data/manifest.json]

OUT holds ``runs/<run>/{result.json,metrics.jsonl,spec.json,train.log}`` and ``snakemake.log``.  For each
finished run (one with result.json) the file keeps the result, its validation curve, the mean training
cross-entropy over its last 50 updates (set beside the validation loss, it shows memorisation) and how
many times the run read its training split.  Runs that started but did not finish are listed with the
last update they logged, so a reader sees what the call's deadline cut off.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

TAIL_UPDATES = 50


def read_metrics(path: Path) -> list[dict]:
    """The JSON lines of a metrics file; a torn last line (a killed run) is skipped."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_summary(run_dir: Path, train_split_tokens: int | None) -> dict:
    """Result (or, for an unfinished run, what its metrics show) plus the curves the report plots."""
    metrics = read_metrics(run_dir / "metrics.jsonl")
    train = [m for m in metrics if m.get("kind") == "train"]
    val = [{"step": m["step"], "tokens": m.get("tokens"), "ce": m["val_ce"]}
           for m in metrics if m.get("kind") in ("val", "final_val") and m.get("val_ce") is not None]
    tail = [m["ce"] for m in train[-TAIL_UPDATES:] if m.get("ce") is not None]
    spec = json.loads((run_dir / "spec.json").read_text()) if (run_dir / "spec.json").exists() else {}
    out = {
        "val_curve": val,
        "train_ce_tail": statistics.fmean(tail) if tail else None,
        "train_ce_tail_updates": len(tail),
        "method": (spec.get("model_config") or {}).get("method"),
    }
    result_path = run_dir / "result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        out = {**result, **out, "method": result.get("model_config", {}).get("method", out["method"])}
        if out.get("data_epochs") is None and train_split_tokens:
            out["train_split_tokens"] = train_split_tokens
            out["data_epochs"] = result["tokens"] / train_split_tokens
    else:
        out["last_step"] = train[-1]["step"] if train else 0
        out["steps_planned"] = spec.get("total_steps")
    return out


def call_timings(log: Path) -> dict[str, dict]:
    """Per run: exit status and seconds, from gpu_grid.sh's own log lines."""
    out = {}
    if log.exists():
        for m in re.finditer(r"\[gpu_grid\] (\S+) exit (\d+) after (\d+)s", log.read_text()):
            out[m.group(1)] = {"exit": int(m.group(2)), "seconds": int(m.group(3))}
    return out


def collect(out_dir: Path, manifest: Path | None) -> dict:
    train_split_tokens = None
    if manifest is not None and manifest.exists():
        train_split_tokens = int(json.loads(manifest.read_text())["splits"]["train"]["tokens"])
    runs, incomplete = {}, {}
    for run_dir in sorted(p for p in (out_dir / "runs").glob("*") if p.is_dir()):
        summary = run_summary(run_dir, train_split_tokens)
        (runs if "final_val_ce" in summary else incomplete)[run_dir.name] = summary
    return {"runs": runs, "incomplete": incomplete, "call": call_timings(out_dir / "snakemake.log"),
            "train_split_tokens": train_split_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the gpu_grid.sh output folder")
    p.add_argument("--manifest", type=Path, default=Path("results/gpu/data/manifest.json"),
                   help="the data manifest the runs trained on (for the epoch count of older results)")
    args = p.parse_args(argv)
    if not (args.out / "runs").is_dir():
        print(f"{args.out}: no runs/ folder (expected the output of benchmarks/gpu_grid.sh)", file=sys.stderr)
        return 2
    doc = collect(args.out, args.manifest)
    tmp = args.out / "gpu_grid.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out / "gpu_grid.json")
    for k, v in doc["runs"].items():
        print(k, {x: v.get(x) for x in ("final_val_ce", "train_ce_tail", "data_epochs", "tokens_per_s")})
    for k, v in doc["incomplete"].items():
        print(k, "incomplete at step", v["last_step"], "of", v["steps_planned"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
