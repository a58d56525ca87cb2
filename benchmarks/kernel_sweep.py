"""Launch-configuration sweep of this project's two Triton kernels, kernel time only.

    python benchmarks/kernel_sweep.py --out DIR [--budget-s 120]

For a few shapes (default: 8192 tokens, d in {1024, 1536, 2560}, S = 9, r = d/4; ``--shapes``) it
times the forward kernel and the backward kernel separately under every candidate launch
configuration (BLOCK_T, num_warps, PREFETCH depth; for the backward DQ2D and, for its two best
configurations, the persistent grid's programs per SM), through ``kernels.op.CONFIG_OVERRIDE``, for
either kernel pair (``:table``, ``:args`` after a shape; see PATHS).  Each timing replays
a CUDA graph of the launch (no host-side dispatch in the number; the inputs are several times the L2,
so the cache helps little), median of ``triton.testing.do_bench_cudagraph``.  Every row also gives
the fraction of the measured copy bandwidth for the bytes this design moves:
forward S + 1.5 units of N*d*2 bytes (sources, h, int8 residual), backward 2S + 2.5 (g, h, residual,
sources, source gradients).  Why: the autotuner only says which candidate won; this says by how much,
and whether any candidate reaches the bandwidth, which is what decides the next kernel change.

Writes kernel_sweep.json and kernel_sweep.md to --out, rewritten after every shape.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import kernels.op as kop  # noqa: E402
from lrattnres.io import atomic_write_text  # noqa: E402
from kernel_bench import copy_bandwidth  # noqa: E402  (the same ceiling as the side-by-side benchmark)

EPS = 1e-6


def _fwd_candidates(block_d: int) -> list[dict]:
    out = []
    for bt in (1, 2, 4):
        for nw in (2, 4, 8, 16):
            for pf in (0, 1, 2):
                per_thread = bt * block_d // (32 * nw)
                if 4 <= per_thread <= 64:
                    out.append(dict(BLOCK_T=bt, num_warps=nw, PREFETCH=pf))
    return out


def _bwd_candidates(block_d: int) -> list[dict]:
    out = []
    for bt in (1, 2):
        for nw in (4, 8, 16):
            for pf in (0, 1, 2):
                per_thread = bt * block_d // (32 * nw)
                if 4 <= per_thread <= 64:
                    out.append(dict(BLOCK_T=bt, num_warps=nw, PREFETCH=pf, DQ2D=bt > 1))
    return out


def _quick(cands: list[dict], kind: str) -> list[dict]:
    """The candidates worth timing for every kernel variant (--quick): 2-8 warps, prefetch 1-2."""
    return [c for c in cands if c["PREFETCH"] >= 1 and 2 <= c["num_warps"] <= 8 and c["BLOCK_T"] <= 2]


# Kernel variants (kernels.op.VARIANT), fwd and bwd switches; "+evict" after a name adds the
# evict-first hint on the source reads.
VARIANTS = {
    "old": ({"TAIL": False, "SPLIT": False}, {"ZR": False, "TAIL": False, "SPLIT": False}),
    "zr": ({"TAIL": False, "SPLIT": False}, {"ZR": True, "TAIL": False, "SPLIT": False}),
    "tail": ({"TAIL": True, "SPLIT": False}, {"ZR": True, "TAIL": True, "SPLIT": False}),
    "split": ({"TAIL": True, "SPLIT": True}, {"ZR": True, "TAIL": True, "SPLIT": True}),
}


def _variant(name: str) -> tuple[dict, dict]:
    base, _, extra = name.partition("+")
    fwd, bwd = (dict(v) for v in VARIANTS[base])
    if extra == "evict":
        fwd["EVICT"] = bwd["EVICT"] = True
    elif extra:
        raise ValueError(f"unknown variant suffix {extra!r} in {name!r}")
    return fwd, bwd


PROGRAMS_PER_SM = (2, 3, 4, 6, 12, 16)  # the backward's persistent grid, tried for the best configurations


def _time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3  # us


# The two kernel pairs: "table" (sources through a device table; eager calls and S > 16) and "args" (one
# pointer argument per source, S unrolled at compile time; what torch.compile launches, S <= 16).
PATHS = {"table": (kop._fwd_triton, kop._bwd_triton), "args": (kop._fwd_args, kop._bwd_args)}


def sweep_shape(N, d, S, r, bw, budget_end, path="table", variant=None, quick=False, fwd_done=None):
    """Time every candidate configuration of both kernels at one shape under one kernel variant
    (None: the default policy).  ``fwd_done`` (a set) skips forward variants already timed."""
    fwd_fn, bwd_fn = PATHS[path]
    vf, vb = _variant(variant) if variant else ({}, {})
    gen = torch.Generator(device="cuda").manual_seed(d + S + r)
    srcs = [torch.randn(N, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(S)]
    q = (torch.randn(r, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    g = torch.randn(N, d, device="cuda", generator=gen).to(torch.bfloat16)
    unit = N * d * 2
    block_d = kop._next_pow2(d)
    rows = []
    kop.CONFIG_OVERRIDE.clear()
    kop.VARIANT.clear()
    kop.VARIANT.update(vf)
    fwd_key = (N, d, S, r, path, tuple(sorted(vf.items())))
    fcands = _fwd_candidates(block_d)
    if fwd_done is not None and fwd_key in fwd_done:
        fcands = []
    elif fwd_done is not None:
        fwd_done.add(fwd_key)
    for cfg in (_quick(fcands, "fwd") if quick else fcands):
        if time.time() > budget_end:
            break
        kop.CONFIG_OVERRIDE["fwd"] = cfg
        try:
            t = _time(lambda: fwd_fn(srcs, q, "slice", EPS))
        except Exception as e:  # a configuration that does not compile (registers, shared memory)
            rows.append({"kernel": "fwd", **cfg, "error": repr(e)[:200]})
            continue
        rows.append({"kernel": "fwd", **cfg, "us": t, "pct_design": 100 * (S + 1.5) * unit / (t * 1e-6 * bw),
                     "pct_formula": 100 * (S + 1) * unit / (t * 1e-6 * bw)})
    kop.CONFIG_OVERRIDE.clear()
    h, lse, res = kop._fwd_triton(srcs, q, "slice", EPS)
    kop.VARIANT.clear()
    kop.VARIANT.update(vb)

    def bwd_row(cfg, ppsm, t):
        return {"kernel": "bwd", **cfg, "programs_per_sm": ppsm, "us": t,
                "pct_design": 100 * (2 * S + 2.5) * unit / (t * 1e-6 * bw),
                "pct_formula": 100 * (2 * S + 1) * unit / (t * 1e-6 * bw)}
    bcands = _bwd_candidates(block_d)
    for cfg in (_quick(bcands, "bwd") if quick else bcands):
        if time.time() > budget_end:
            break
        kop.CONFIG_OVERRIDE["bwd"] = cfg
        try:
            t = _time(lambda: bwd_fn(srcs, q, h, lse, res, g, "slice", EPS))
        except Exception as e:
            rows.append({"kernel": "bwd", **cfg, "error": repr(e)[:200]})
            continue
        rows.append(bwd_row(cfg, kop.BWD_PROGRAMS_PER_SM, t))
    # the persistent backward's grid: the two best configurations again at other program counts per SM
    default_ppsm = kop.BWD_PROGRAMS_PER_SM
    best = sorted((x for x in rows if x["kernel"] == "bwd" and "us" in x), key=lambda x: x["us"])[:0 if quick else 2]
    try:
        for b in best:
            cfg = {k: b[k] for k in ("BLOCK_T", "num_warps", "PREFETCH", "DQ2D")}
            kop.CONFIG_OVERRIDE["bwd"] = cfg
            for ppsm in PROGRAMS_PER_SM:
                if ppsm == default_ppsm or time.time() > budget_end:
                    continue
                kop.BWD_PROGRAMS_PER_SM = ppsm
                t = _time(lambda: bwd_fn(srcs, q, h, lse, res, g, "slice", EPS))
                rows.append(bwd_row(cfg, ppsm, t))
    finally:
        kop.BWD_PROGRAMS_PER_SM = default_ppsm
        kop.VARIANT.clear()
    kop.CONFIG_OVERRIDE.clear()
    return {"tokens": N, "d": d, "S": S, "r": r, "kernels": path, "variant": variant or "default",
            "variant_fwd": vf, "variant_bwd": vb, "rows": rows}


def _md(doc) -> str:
    e = doc["env"]
    lines = [f"# Kernel launch-configuration sweep: {e['device']}, torch {e['torch']}, triton {e['triton']}, {e['date']}",
             "", f"Copy bandwidth {doc['copy_bw_TBps']:.2f} TB/s. CUDA-graph replay, median. % design = bytes this "
             "design moves (fwd S+1.5, bwd 2S+2.5 units of N d 2) / (time x copy bandwidth); % formula = the "
             "issue's bytes (fwd S+1, bwd 2S+1).", ""]
    for shp in doc["shapes"]:
        lines += [f"## {shp.get('kernels', 'table')} kernels, variant {shp.get('variant', 'default')}: {shp['tokens']} tokens, "
                  f"d={shp['d']}, S={shp['S']}, r={shp['r']}", "",
                  "| kernel | BLOCK_T | warps | prefetch | DQ2D | programs/SM | us | % design | % formula |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(shp["rows"], key=lambda x: (x["kernel"] != "fwd", x.get("us", 1e9))):
            if "error" in r:
                lines.append(f"| {r['kernel']} | {r['BLOCK_T']} | {r['num_warps']} | {r['PREFETCH']} | {r.get('DQ2D', '-')} | "
                             f"{r.get('programs_per_sm', '-')} | error | | |")
            else:
                lines.append(f"| {r['kernel']} | {r['BLOCK_T']} | {r['num_warps']} | {r['PREFETCH']} | {r.get('DQ2D', '-')} | "
                             f"{r.get('programs_per_sm', '-')} | {r['us']:.1f} | {r['pct_design']:.0f} | {r['pct_formula']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--shapes", default="8192x1536x9x384,8192x1024x9x256,8192x2560x9x640",
                   help="comma-separated NxdxSxr, each optionally suffixed :table or :args (default :table)")
    p.add_argument("--variants", default="",
                   help="comma-separated kernel variants to time at every shape (" + ", ".join(VARIANTS)
                   + "; '+evict' after a name adds the cache hint); default: the default policy only")
    p.add_argument("--stem", default="kernel_sweep", help="output file name stem")
    p.add_argument("--quick", action="store_true", help="fewer candidate configurations (2-8 warps, prefetch 1-2)")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v] or [None]
    for v in variants:
        if v:
            _variant(v)  # fail early on a bad name
    if not torch.cuda.is_available():
        print("kernel_sweep needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.time()
    end = t0 + a.budget_s
    doc = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
           "shapes": []}
    bw = copy_bandwidth()
    fwd_done: set = set()
    doc["copy_bw_TBps"] = bw / 1e12
    for spec in a.shapes.split(","):
        shape, _, path = spec.partition(":")
        N, d, S, r = (int(x) for x in shape.split("x"))
        if time.time() > end:
            break
        for v in variants:
            if time.time() > end:
                break
            doc["shapes"].append(sweep_shape(N, d, S, r, bw, end, path or "table", v, a.quick, fwd_done))
            best = {k: min((x for x in doc["shapes"][-1]["rows"] if x["kernel"] == k and "us" in x),
                           key=lambda x: x["us"], default=None) for k in ("fwd", "bwd")}
            print(f"[{time.time() - t0:.0f}s] {spec} {v or 'default'}: " + "  ".join(
                f"{k} best {x['us']:.0f}us ({x['pct_design']:.0f}% design) {x}" for k, x in best.items() if x), flush=True)
            doc["elapsed_s"] = time.time() - t0
            for ext, text in (("json", json.dumps(doc, indent=1)), ("md", _md(doc))):
                atomic_write_text(os.path.join(a.out, f"{a.stem}.{ext}"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
