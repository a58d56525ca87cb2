"""Several small trainings side by side on one GPU: total throughput against one alone.

A one-GPU scale trains many small models. One process alone leaves the GPU idle while its host
dispatches kernels and reads losses back; processes side by side fill those gaps. This benchmark
starts K identical trainings at once (``python -m lrattnres train``, the trainer the pipeline uses,
compiled, bf16) for each K of ``--jobs``, and reports per K:

* ``steady_tokens_per_s``: the sum over the K processes of each one's median tokens/s over the
  middle half of its updates (all K are then training; compilation and the tail are left out);
* ``end_to_end_tokens_per_s``: all tokens trained over the wall time from the start to the last
  process's end (compilation, start-up and validation included);
* ``gain``: each of the two over K = 1's.

    python benchmarks/gpu_share_bench.py --data results/gpu/data/manifest.json --out OUT
    python benchmarks/gpu_share_bench.py --smoke --out /tmp/x      # CPU check: tiny model, 3 updates

Writes ``gpu_share_bench.json`` (device, versions, date, settings, one row per K) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lrattnres.io import atomic_write_json  # noqa: E402
from lrattnres.provenance import now, provenance  # noqa: E402

# The gpu scale's training of its headline configuration (config.yaml, scales.gpu), shortened.
GPU_SPEC = {
    "checkpoint": {"every": 0}, "compile": True, "device": "cuda", "grad_accum": 1, "grad_clip": 1.0,
    "micro_batch": 32, "seq_len": 512, "precision": "bf16", "seed": 0, "z_loss": 1e-05,
    "model": {"preset": "gpu-small", "method": "lr", "blocks": 8, "rank": 48},
    "optim": {"adam": {"betas": [0.9, 0.95], "lr": 0.0003, "weight_decay": 0.0},
              "muon": {"lr": 0.001, "momentum": 0.95, "weight_decay": 0.1}},
    "schedule": {"warmdown_frac": 0.2, "warmup_steps": 20},
    "val": {"every": 0, "batches": 1, "final": False},
}
SMOKE_SPEC = {**GPU_SPEC, "compile": False, "device": "cpu", "precision": "fp32", "micro_batch": 2,
              "seq_len": 32, "model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}}


def train_records(metrics: Path) -> list[dict]:
    out = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out.append(rec)
    return out


def middle_median(values: list[float]) -> float:
    """Median of the middle half (all of them when there are fewer than 4)."""
    n = len(values)
    mid = values[n // 4: n - n // 4] if n >= 4 else values
    return statistics.median(mid)


def run_k(k: int, spec: dict, data: str, work: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs, outs = [], []
    t0 = time.monotonic()
    for i in range(k):
        out = work / f"k{k}_{i}"
        outs.append(out)
        cmd = [sys.executable, "-m", "lrattnres", "train", "--spec", json.dumps({**spec, "seed": i}),
               "--data", data, "--out", str(out), "--threads", str(threads), "--no-progress"]
        log = open(work / f"k{k}_{i}.log", "w", encoding="utf-8")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    codes = []
    for p, log in procs:
        codes.append(p.wait())
        log.close()
    wall = time.monotonic() - t0
    if any(codes):
        bad = [i for i, c in enumerate(codes) if c]
        tail = (work / f"k{k}_{bad[0]}.log").read_text(encoding="utf-8")[-2000:]
        raise RuntimeError(f"K={k}: processes {bad} failed (exit {[codes[i] for i in bad]}):\n{tail}")
    per = []
    tokens = 0
    for out in outs:
        recs = train_records(out / "metrics.jsonl")
        tokens += recs[-1]["tokens"]
        per.append(middle_median([r["tokens_per_s"] for r in recs]))
    return {"jobs": k, "steady_tokens_per_s": sum(per), "per_process_tokens_per_s": per,
            "end_to_end_tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a data manifest (the gpu scale's: results/gpu/data/manifest.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", default="1,4,7", help="comma-separated numbers of processes side by side")
    p.add_argument("--steps", type=int, default=200, help="updates per process")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny model on a tiny corpus made here")
    args = p.parse_args(argv)
    started = now()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_share_"))
    spec = dict(SMOKE_SPEC if args.smoke else GPU_SPEC)
    spec["steps"] = args.steps
    data = args.data
    if args.smoke and data is None:
        from lrattnres.data import prepare

        data = str(work / "data")
        prepare({"source": "embedded", "embedded": {"packages": ["json"], "max_tokens": 20000},
                 "val_tokens": 1000, "vocab": "compact"}, data, progress=False)
    if data is None:
        p.error("--data is required (the gpu scale's manifest)")
    rows = []
    for k in [int(x) for x in args.jobs.split(",")]:
        row = run_k(k, spec, data, work, args.threads)
        rows.append(row)
        print(f"[gpu_share] K={k}: steady {row['steady_tokens_per_s']:,.0f} tokens/s, end to end "
              f"{row['end_to_end_tokens_per_s']:,.0f} tokens/s ({row['wall_s']:.0f} s)", flush=True)
    base = rows[0]
    for row in rows:
        row["steady_gain"] = row["steady_tokens_per_s"] / base["steady_tokens_per_s"]
        row["end_to_end_gain"] = row["end_to_end_tokens_per_s"] / base["end_to_end_tokens_per_s"]
    try:  # the device in the provenance
        import torch  # noqa: F401
    except ImportError:
        pass
    result = {"benchmark": "gpu_share", "spec": spec, "data": data, "rows": rows,
              "note": "gain = K processes side by side over one alone; steady = sum of per-process medians "
                      "over the middle half of the updates",
              "provenance": provenance({"spec": spec, "jobs": args.jobs}, started=started)}
    name = "gpu_share_bench_smoke.json" if args.smoke else "gpu_share_bench.json"
    atomic_write_json(out / name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
