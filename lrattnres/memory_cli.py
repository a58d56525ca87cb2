"""``python -m lrattnres memory [--scale paper] [--json] [--check RESULT ...]``: the estimated GPU
memory of each size's training ranks (lrattnres/memory.py), or the estimates against measurements."""

from __future__ import annotations

import argparse
import json
import sys

from lrattnres.config import load_and_resolve
from lrattnres.io import read_json
from lrattnres.memory import CHECK_TOLERANCE, compare, plan


def _check_files(paths: list[str], cluster: dict) -> int:
    """The estimates against the measurements in ``paths`` (benchmarks/paper_scale_fit.py results):
    a table, and exit 1 where one outside the anchors is off by more than CHECK_TOLERANCE."""
    rows = []
    for path in paths:
        try:
            rec = read_json(path)
        except (OSError, ValueError) as e:
            print(f"memory: {path}: not a readable result file ({e})", file=sys.stderr)
            return 2
        measured = (rec.get("results") or {}).get("memory") if isinstance(rec, dict) else None
        if not measured:
            print(f"memory: {path}: field 'results.memory' missing or empty; expected the memory part of "
                  "benchmarks/paper_scale_fit.py", file=sys.stderr)
            return 2
        for r in compare(measured, cluster):
            rows.append({"file": path, **r})
    print("| size | configuration | micro-batch | optimiser | checkpointing | peak | measured | estimated | error | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("measured_gib") is None:
            print(f"| {r['preset']} | {r['config']} | - | - | - | - | - | - | - | not measured: {r['note']} |")
            continue
        verdict = "fitted (an anchor)" if r["fitted"] else "ok" if r["ok"] else f"over {100 * CHECK_TOLERANCE:.0f}%"
        print(f"| {r['preset']} | {r['config']} | {r['micro_batch']} | {'sharded' if r['shard_optimizer'] else 'replicated'}"
              f"{' + DDP' if r['ddp'] else ''} | {'yes' if r['activation_checkpointing'] else 'no'} | {r['part']} | "
              f"{r['measured_gib']:.2f} GiB | {r['estimated_gib']:.2f} GiB | {100 * r['error']:+.1f}% | {verdict} |")
    checked = [r for r in rows if r.get("measured_gib") is not None and not r["fitted"]]
    if not checked:
        print("memory: no measurement outside the anchors to check the model against", file=sys.stderr)
        return 2
    bad = [r for r in checked if not r["ok"]]
    if bad:
        worst = max(bad, key=lambda r: abs(r["error"]))
        print(f"memory: {len(bad)} of {len(checked)} estimates are off by more than {100 * CHECK_TOLERANCE:.0f}% "
              f"(worst: {worst['preset']} {worst['config']} {worst['part']} {100 * worst['error']:+.1f}%): refit "
              "cluster.memory_anchors and state the error", file=sys.stderr)
        return 1
    print(f"memory: {len(checked)} estimates within {100 * CHECK_TOLERANCE:.0f}% of measurements they were not fitted to")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres memory",
                                description="the estimated peak GPU memory of each size's training ranks")
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--scale", default="paper")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--check", nargs="+", metavar="RESULT", default=None,
                   help="compare the estimates with these results of benchmarks/paper_scale_fit.py (memory part); "
                        f"exit 1 where one is off by more than {100 * CHECK_TOLERANCE:.0f}%")
    args = p.parse_args(argv)
    settings = load_and_resolve(args.config, {"scale": args.scale})
    if args.check:
        return _check_files(args.check, settings.get("cluster") or {})
    rows = plan(settings)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"scale {args.scale!r} has no cluster.memory_anchors: nothing to estimate", file=sys.stderr)
        return 0
    print("| size | micro-batch x accumulation x GPUs | optimiser | activation checkpointing | weights+grads "
          "| optimiser state | activations | training peak | validation peak | of the GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ac = ("yes" if r["activation_checkpointing"] else "no") + (
            " (auto)" if r["activation_checkpointing_setting"] == "auto" else "")
        print(f"| {r['preset']} | {r['micro_batch']} x {r['grad_accum']} x {r['world']} | "
              f"{'sharded' if r['shard_optimizer'] else 'replicated'} | {ac} | {r['weights_gib'] + r['grads_gib']:.1f} GiB | "
              f"{r['optimizer_gib']:.1f} GiB | {r['activations_gib']:.1f} GiB | {r['train_peak_gib']:.1f} GiB | "
              f"{r['val_peak_gib']:.1f} GiB | {100 * r['peak_gib'] / r['gpu_memory_gib']:.0f}% |")
    return 0
