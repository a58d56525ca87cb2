"""Hardware counters of the depth-routing kernels, ours beside fast-attnres, under Nsight Compute.

    # on a GPU machine, one ncu run per implementation (ours, fast-attnres) and S, each into LABEL_S<S>.csv:
    ncu --clock-control none --profile-from-start off --csv --page raw --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
        python benchmarks/ncu_profile.py run --impl ours --S 9 > DIR/ours_S9.csv
    # anywhere: the per-kernel summary of the CSVs those runs wrote
    python benchmarks/ncu_profile.py summarize DIR --out DIR

Why: timings say how close each kernel comes to the copy bandwidth, not why.  The counters say it:
registers and occupancy, DRAM throughput, and where the warps stall.

``run`` builds one shape's inputs, runs forward and backward until autotuning has chosen, then
brackets exactly one forward+backward with cudaProfilerStart/Stop, so that ``ncu
--profile-from-start off`` profiles only those kernels.  ``summarize`` reads ncu's raw CSV pages
(``*.csv`` in DIR, one per run, named LABEL_S<S>.csv: the implementation, or a variant of ours) and writes ncu_summary.json and .md: one row per
kernel with its duration, DRAM bytes and throughput, registers, occupancy and the largest stall
reasons (cycles per issued instruction).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import io
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EPS = 1e-6

# raw-page metric name -> summary column (ncu 2025 names; a missing one leaves its column empty)
METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__bytes_read.sum": "dram_read_MB",
    "dram__bytes_write.sum": "dram_write_MB",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_peak",
    "launch__registers_per_thread": "registers",
    "launch__block_size": "block",
    "launch__grid_size": "grid",
    "launch__occupancy_limit_registers": "blocks_per_sm_by_registers",
    "launch__occupancy_limit_shared_mem": "blocks_per_sm_by_smem",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
    "smsp__inst_executed.sum": "instructions",
    "sm__issue_active.avg.pct_of_peak_sustained_elapsed": "issue_active_pct",
}
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


# ---------------------------------------------------------------------------------------------- run (GPU)


def _settings(override: str):
    """Our settings: the defaults, with --override's pinned configurations."""
    from kernels import DEFAULT

    return DEFAULT.replace(**json.loads(override)) if override else DEFAULT


def _step(impl: str, srcs, q, g, override: str = ""):
    """One forward+backward of ``impl`` as a callable (kernels only for ours, as in kernel_sweep)."""
    import torch

    if impl == "ours":
        import kernels.launch as launch

        s = _settings(override)

        def fb():
            h, st, res = launch.fwd(srcs, q, "slice", EPS, s)
            return launch.bwd(srcs, q, h, st, res, g, "slice", EPS, s)

        return fb
    if impl == "fast-attnres":
        from attnres import attnres as fast

        srcs_g = [s.detach().requires_grad_() for s in srcs]
        q_g = q.detach().requires_grad_()

        def fb():
            out = fast(list(srcs_g), q_g, eps=EPS)
            return torch.autograd.grad(out, srcs_g + [q_g], g)

        return fb
    raise ValueError(f"--impl: expected ours or fast-attnres, got {impl!r}")


def _chosen(impl: str, override: str = "") -> dict:
    """The launch configurations autotuning chose (or the override), to read beside the counters."""
    if impl == "ours":
        import kernels

        return {"override": json.loads(override) if override else {}, "tuned": kernels.tuned_configs()}
    from attnres._kernels import fla_full_sources as fs

    out = {}
    for name in dir(fs):
        best = getattr(getattr(fs, name), "best_config", None)
        if best is not None:
            out[name] = str(best)
    return out


def run(a) -> int:
    import torch

    from kernel_bench import _inputs  # the side-by-side benchmark's inputs (bf16, the same seed)

    srcs, q, g = _inputs(a.S, a.tokens, a.d, a.r)
    fb = _step(a.impl, srcs, q, g, a.override)  # --override: pinned configurations instead of tuned ones
    for _ in range(3):  # autotuning and compilation happen here, outside the profiled window
        fb()
    torch.cuda.synchronize()
    print(f"launch configurations: {json.dumps(_chosen(a.impl, a.override), default=str)}", flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    fb()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {a.impl} S={a.S} tokens={a.tokens} d={a.d} r={a.r}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- summarize


def _num(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """Rows of ncu's ``--csv --page raw`` output (a header row, a units row, one row per kernel;
    ncu's own "==PROF==" lines and the program's output may come first)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, units, body = rows[0], rows[1], rows[2:]
    unit_of = dict(zip(header, units))
    out = []
    for r in body:
        rec = dict(zip(header, r))
        if "Kernel Name" not in rec:
            continue
        row = {"kernel": rec["Kernel Name"]}
        for metric, col in METRICS.items():
            v = _num(rec.get(metric, ""))
            if v is None:
                continue
            unit = unit_of.get(metric, "")
            if col == "us":  # duration: ncu reports ns, us or ms
                v = v / 1e3 if unit in ("nsecond", "ns") else v * 1e3 if unit in ("msecond", "ms") else v
            if col.endswith("_MB"):
                scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(unit, 1e-6)
                v = v * scale
            row[col] = v
        stalls = {}
        for key, val in rec.items():
            m = _STALL.match(key)
            v = _num(val)
            if m and v is not None and m.group(1) not in ("selected", "not_selected"):
                stalls[m.group(1)] = v
        row["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
        out.append(row)
    return out


def _short(name: str) -> str:
    name = name.split("(")[0]
    return name if len(name) <= 40 else name[:37] + "..."


def summarize(in_dir: str, out_dir: str) -> dict:
    """Per-kernel summary of every IMPL_S<S>.csv in ``in_dir`` (the routing kernels: those at least 5%
    of their run's kernel time)."""
    from lrattnres.io import atomic_write_text

    runs = []
    for fn in sorted(os.listdir(in_dir)):
        m = re.match(r"(.+)_S(\d+)\.csv$", fn)
        if not m:
            continue
        with open(os.path.join(in_dir, fn)) as f:
            kernels = parse_raw_csv(f.read())
        total = sum(k.get("us", 0.0) for k in kernels)
        kernels = [k for k in kernels if k.get("us", 0.0) >= 0.05 * total]
        runs.append({"impl": m.group(1), "S": int(m.group(2)), "file": fn, "kernel_us_total": total, "kernels": kernels})
    if not runs:
        raise SystemExit(f"ncu_profile summarize: no IMPL_S<S>.csv files in {in_dir}")
    doc = {"summarized": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "runs": runs}
    meta = os.path.join(in_dir, "meta.json")
    if os.path.exists(meta):
        with open(meta) as f:
            doc["env"] = json.load(f)
    cols = ["us", "dram_read_MB", "dram_write_MB", "dram_pct_peak", "registers", "block", "grid",
            "blocks_per_sm_by_registers", "theoretical_occupancy_pct", "achieved_occupancy_pct", "cycles_per_issue",
            "issue_active_pct", "instructions"]
    env = doc.get("env", {})
    lines = [f"# Nsight Compute counters: {env.get('device', '?')}, {env.get('shape', '')}, {env.get('date', '')}", "",
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, tree {env.get('commit', '?')}.", "",
             "One forward+backward per row group (ncu --clock-control none; kernel replay). Stalls: the five largest "
             "reasons, in cycles per issued instruction.", "",
             "| impl | S | kernel | " + " | ".join(cols) + " | top stalls |",
             "|" + "---|" * (len(cols) + 4)]
    for run_ in runs:
        for k in run_["kernels"]:
            vals = []
            for c in cols:
                v = k.get(c)
                vals.append("-" if v is None else f"{v:.1f}" if isinstance(v, float) and v % 1 else f"{v:.0f}")
            stalls = ", ".join(f"{n} {v:.1f}" for n, v in k["stalls"].items())
            lines.append(f"| {run_['impl']} | {run_['S']} | {_short(k['kernel'])} | " + " | ".join(vals) + f" | {stalls} |")
    for ext, text in (("json", json.dumps(doc, indent=1)), ("md", "\n".join(lines) + "\n")):
        atomic_write_text(os.path.join(out_dir, f"ncu_summary.{ext}"), text)
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one profiled forward+backward (under ncu --profile-from-start off)")
    r.add_argument("--impl", required=True, choices=("ours", "fast-attnres"))
    r.add_argument("--S", type=int, required=True)
    r.add_argument("--tokens", type=int, default=8192)
    r.add_argument("--d", type=int, default=1536)
    r.add_argument("--r", type=int, default=384)
    r.add_argument("--override", default="", help='ours only: pinned configurations as JSON kernels.Settings fields, e.g. {"fwd": {...}}')
    s = sub.add_parser("summarize", help="per-kernel table of the raw CSVs in a folder")
    s.add_argument("dir")
    s.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.cmd == "run":
        return run(a)
    summarize(a.dir, a.out or a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
