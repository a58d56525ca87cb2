"""``python -m lrattnres jobs [--scale paper] [--partition P]``: what each training job of a scale asks
of a cluster (lrattnres/jobplan.py): placement, launcher, wall time, signal lead, jobs per run."""

from __future__ import annotations

import argparse
import shlex

from lrattnres.config import load_and_resolve
from lrattnres.jobplan import partition_limit_min, plan_rows, runtime_cap_min


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres jobs", description="what each training job asks of a "
                                "cluster: placement, launcher, wall time, signal lead")
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--scale", default="paper")
    p.add_argument("--partition", default=None, metavar="NAME",
                   help="cap the jobs at this Slurm partition's time limit (sinfo); '' for the default partition")
    args = p.parse_args(argv)
    settings = load_and_resolve(args.config, {"scale": args.scale})
    part = partition_limit_min(args.partition or None) if args.partition is not None else None
    if args.partition is not None:
        print(f"partition {args.partition or '(default)'}: time limit "
              + (f"{part:,} min" if part else "unlimited or unknown (sinfo)"))
    rows = plan_rows(settings, part)
    cap = runtime_cap_min(settings, part)
    print(f"longest job: {cap:,} min" if cap else "longest job: no limit")
    print("| size | updates | tokens | GPUs | update | checkpoint | signal lead | estimate | wall time per job | jobs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def fmt(x, unit, nd=1):
            return "-" if x is None else f"{x:,.{nd}f} {unit}"

        print(f"| {r['preset']} | {r['steps']:,} | {r['tokens'] / 1e9:.1f}B | {r['nodes']} x {r['gpus_per_node']} | "
              f"{fmt(r['update_s'], 's', 2)} | {fmt(r['checkpoint_s'], 's')} | {fmt(r['lead_s'], 's', 0)} | "
              f"{r['estimate_h']:.1f} h | {fmt(r['runtime_min'], 'min', 0)} | {r['jobs'] or '-'} |")
    for r in rows:
        print(f"\n{r['preset']}: {r['command']} ...\n  Slurm: {shlex.join(f'{k}={v}' for k, v in r['slurm'].items())}")
    return 0
