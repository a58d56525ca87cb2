"""Launch-configuration sweep of this project's two Triton kernels, kernel time only.

    python benchmarks/kernel_sweep.py --out DIR [--budget-s 120]

For a few shapes (default: 8192 tokens, d in {1024, 1536, 2560}, S = 9, r = d/4; ``--shapes``) it
times the forward kernel and the backward kernel separately under every candidate launch
configuration (forward: tokens per program BLOCK_T; backward: sources per step SB on the persistent
grid, or BLOCK_T tokens per program on the token-tile grid; num_warps, PREFETCH), under each column
layout compared (_layouts: the width's own from kernels.configs.col_layout, one power-of-two chunk, and three
equal chunks where they pad less); then, for the two best of each kernel, the evict-first hint, Triton's
software pipelining of the source loop (STAGES 2 and 3, without the hand-written prefetch), the
key-chunk specialisation KEYCH (where the key starts past the first chunk), two sources per step in the
token-tile backward (PAIR) and the persistent grid's programs per SM; all
pinned through kernels.Settings (fwd, bwd), for either kernel pair (``:table``, ``:args`` after a shape;
see PATHS).  Each timing replays
a CUDA graph of the launch (no host-side dispatch in the number; the inputs are several times the L2,
so the cache helps little), median of ``triton.testing.do_bench_cudagraph``.  Every row also gives
the fraction of the measured copy bandwidth for the bytes this design moves:
forward S + 1.5 units of N*d*2 bytes (sources, h, int8 residual), backward 2S + 2.5 (g, h, residual,
sources, source gradients); without the residual (the deferred backward, DEFER, and its forward) S + 1
and 2S + 1.  Why: the autotuner only says which candidate won; this says by how much,
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

import kernels.launch as launch  # noqa: E402
from kernels import DEFAULT, configs, dispatch  # noqa: E402
from lrattnres.io import atomic_write_text  # noqa: E402
from kernel_bench import copy_bandwidth  # noqa: E402  (the same ceiling as the side-by-side benchmark)

EPS = 1e-6


def _candidates(kind: str, block_d: int, nch: int, warps=(2, 4, 8, 16)) -> list[dict]:
    """Forward: BLOCK_T tokens per program; backward: SB sources per step (persistent grid) and the
    token-tile grid (_tile_candidates); each with num_warps and
    PREFETCH (Triton's own loop pipelining, num_stages, changed nothing on the H200: it does not
    pipeline these loops), for the column layout of ``nch`` chunks of ``block_d`` (4 to 64 elements
    per thread over the whole row)."""
    out = []
    key = "BLOCK_T" if kind == "fwd" else "SB"
    for n in (1, 2, 4):
        for nw in warps:
            for pf in (1, 0):
                per_thread = n * block_d // (32 * nw)
                if 4 <= per_thread and per_thread * nch <= 64:
                    out.append({key: n, "num_warps": nw, "PREFETCH": pf, "SPLIT": nch})
    return out + (_tile_candidates(block_d, nch) if kind == "bwd" else [])


def _tile_candidates(block_d: int, nch: int, warps=(2, 4, 8)) -> list[dict]:
    """The backward's token-tile grid (BLOCK_T tokens per program, no persistent loop): 1-2 tokens,
    4 to 32 elements per thread and chunk."""
    out = []
    for n in (1, 2):
        for nw in warps:
            for pf in (1, 0):
                per_thread = n * block_d // (32 * nw)
                if 4 <= per_thread <= 32:
                    out.append({"BLOCK_T": n, "num_warps": nw, "PREFETCH": pf, "SPLIT": nch})
    return out


def _quick(kind: str, block_d: int, nch: int, default: bool = True) -> list[dict]:
    """The candidates worth timing on a short budget (--quick): the shipped ones; for the width's own
    layout (``default``) with several chunks also 2-8 warps (smaller tiles per chunk) and the
    backward's token-tile grid; for another layout only the shipped ones (the comparison)."""
    shipped = [dict(c, SPLIT=nch) for c in configs.candidates(kind, block_d, nch)]
    if not default:
        return shipped
    tiles = _tile_candidates(block_d, nch) if kind == "bwd" else []
    if nch == 1:
        return shipped + [c for c in tiles if c not in shipped]
    return shipped + [c for c in _candidates(kind, block_d, nch, warps=(2, 4, 8)) if c not in shipped]


def _layouts(d: int, r: int | None = None) -> list[tuple[int, int]]:
    """The column layouts to compare at width d (key width r): its own (kernels.configs.col_layout),
    one chunk, the least-padded layout nearest 512-column chunks (its own where the key allows the
    specialisation), and three chunks where those pad less than one."""
    out = [configs.col_layout(d, True, r), configs.col_layout(d, False), configs.col_layout(d, True)]
    three = configs.col_layout(d, 3)
    if three[0] * 3 < out[1][0]:
        out.append(three)
    return list(dict.fromkeys(out))


def _deferred_candidates(d: int, r: int, S: int, layouts) -> list[dict]:
    """The deferred backward's candidates (no residual) for each layout: the resident pair's at
    S <= kernels.configs.PAIR_MAX_S (any key position), the two-pass form's where the key starts past the
    layout's first chunk."""
    out = []
    for lay in layouts:
        forms = (("pair",) if S <= configs.PAIR_MAX_S else ()) + (("passes",) if configs.key_pos(d, r, *lay) > 0 else ())
        out += [dict(c, SPLIT=lay[1]) for c in configs.candidates("bwd", *lay, forms)] if forms else []
    return out


def _fwd_pair_candidates(S: int, layouts) -> list[dict]:
    """The pair forward's candidates at S = 2 (kernels.dispatch.fwd_forms) for each layout: the shipped ones,
    then one and two tokens with 1 to 16 warps (2 to 64 elements per thread and chunk), keyed, with the
    evict-first hint."""
    if "pair" not in dispatch.fwd_forms(S, DEFAULT):
        return []
    out = [dict(c, SPLIT=lay[1]) for lay in layouts for c in configs.configs("FWD_PAIR", lay[0])]
    for block_d, nch in layouts:
        for n in (1, 2):
            for nw in (1, 2, 4, 8, 16):
                c = {"BLOCK_T": n, "num_warps": nw, "PREFETCH": 0, "KEYCH": True, "PAIR": True, "EVICT": True, "SPLIT": nch}
                if 2 <= n * block_d // (32 * nw) <= 64 and c not in out:
                    out.append(c)
    return out


PROGRAMS_PER_SM = (2, 4, 6, 12, 16, 24, 32)  # the backward's persistent grid, tried for the best configurations
STAGES = (2, 3)  # Triton's software pipelining of the source loop, tried for the best configurations


def _time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3  # us


# The two kernel pairs: "table" (sources through a device table; eager calls and S > 16) and "args" (one
# pointer argument per source, S unrolled at compile time; what torch.compile launches, S <= 16).
PATHS = {"table": (launch.fwd, launch.bwd), "args": (launch.fwd_args, launch.bwd_args)}


def sweep_shape(N, d, S, r, bw, budget_end, path="table", quick=False, only=None, shape_s=None, extra=None):
    """Time every candidate configuration of both kernels at one shape (within ``shape_s`` seconds
    when given: 40% for the forward; the shipped candidates of every layout go first, ``extra``'s
    configurations per kernel last, in the width's own layout unless they name SPLIT)."""
    if shape_s:
        t_start = time.time()
        bwd_end = min(budget_end, t_start + shape_s)
        budget_end = min(budget_end, t_start + (0.4 * shape_s if only is None else shape_s))
    fwd_fn, bwd_fn = PATHS[path]
    gen = torch.Generator(device="cuda").manual_seed(d + S + r)
    srcs = [torch.randn(N, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(S)]
    q = (torch.randn(r, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    g = torch.randn(N, d, device="cuda", generator=gen).to(torch.bfloat16)
    unit = N * d * 2
    layouts = _layouts(d, r)

    def deferred(kind):  # the forward's pair (S = 2), the backward's deferred forms
        return _fwd_pair_candidates(S, layouts) if kind == "fwd" else _deferred_candidates(d, r, S, layouts)

    def pick(kind):  # every layout's shipped candidates first (quick), then the rest, then the extra ones
        if not quick:
            out = [c for lay in layouts for c in _candidates(kind, *lay)] + deferred(kind)
        else:
            out = [dict(c, SPLIT=lay[1]) for lay in layouts for c in configs.candidates(kind, *lay)] + deferred(kind)
            out += [c for lay in layouts for c in _quick(kind, *lay, lay == layouts[0]) if c not in out]
        more = [{"SPLIT": layouts[0][1], **c} for c in (extra or {}).get(kind, ())]
        return out + [c for c in more if c not in out]
    rows = []
    cur = [DEFAULT.replace(autotune=False)]  # the settings the timed calls run with

    def pct(kind, t, res):  # res: the forward writes, the backward reads h and the rounding residual
        if kind == "fwd":
            design, formula = (S + 1.5 if res else S + 1), S + 1
        else:
            design, formula = (2 * S + 2.5 if res else 2 * S + 1), 2 * S + 1
        return {"pct_design": 100 * design * unit / (t * 1e-6 * bw), "pct_formula": 100 * formula * unit / (t * 1e-6 * bw)}

    def run(kind, cfg, fn, ppsm=None, also=None):
        # ``also``: e.g. a backward without DEFER, so that the forward keeps the residual
        cur[0] = DEFAULT.replace(autotune=False, bwd_programs_per_sm=ppsm or DEFAULT.bwd_programs_per_sm,
                                 **{**(also or {}), kind: cfg})
        res = dispatch.res_kept(torch.bfloat16, d, r, "slice", S, cur[0]) if kind == "fwd" else not cfg.get("DEFER")
        try:
            t = _time(fn)
        except Exception as e:  # a configuration that does not compile (registers, shared memory)
            rows.append({"kernel": kind, **cfg, "error": repr(e)[:200]})
            return
        row = {"kernel": kind, **cfg, "layout": "%dx%d" % dispatch.layout(kind, d, r, cur[0]), "us": t, "res": res,
               **pct(kind, t, res)}
        if ppsm is not None and not cfg.get("BLOCK_T"):
            row["programs_per_sm"] = ppsm
        rows.append(row)

    def best(kind, n):
        return sorted((x for x in rows if x["kernel"] == kind and "us" in x), key=lambda x: x["us"])[:n]

    def cfg_of(row):
        return {k: row[k] for k in ("BLOCK_T", "SB", "num_warps", "PREFETCH", "EVICT", "STAGES", "SPLIT", "KEYCH", "PAIR",
                                    "DEFER", "PERSIST") if k in row}

    def keyed(kind, fn, ppsm=None):  # the best two multi-chunk configurations with KEYCH
        for b in best(kind, 2):
            block_d, nch = configs.col_layout(d, b.get("SPLIT"))
            if nch == 1 or configs.key_pos(d, r, block_d, nch) == 0:
                continue  # the key starts in the first chunk: nothing to leave out
            if not b.get("KEYCH") and time.time() < budget_end:
                run(kind, dict(cfg_of(b), KEYCH=True), fn, ppsm)

    def paired(fn, ppsm=None):  # the best two token-tile backward configurations two sources per step
        for b in best("bwd", 2):
            if b.get("BLOCK_T") and not b.get("PAIR") and not b.get("DEFER") and time.time() < budget_end:
                run("bwd", dict(cfg_of(b), PAIR=True), fn, ppsm)

    def pipelined(kind, fn, ppsm=None):  # the best two with Triton's pipeliner instead of PREFETCH
        for b in best(kind, 2):
            if kind == "fwd" and b.get("PAIR"):
                continue  # the pair forward has no source loop
            for stages in STAGES:
                if time.time() < budget_end:
                    run(kind, dict(cfg_of(b), PREFETCH=0, STAGES=stages), fn, ppsm)

    fwd = lambda: fwd_fn(srcs, q, "slice", EPS, cur[0])  # noqa: E731
    for cfg in pick("fwd") if only != "bwd" else ():
        if time.time() > budget_end:
            break
        run("fwd", cfg, fwd)
    for b in best("fwd", 2):
        if time.time() < budget_end:
            run("fwd", dict(cfg_of(b), EVICT=True), fwd)
    pipelined("fwd", fwd)
    keyed("fwd", fwd)
    for b in best("fwd", 2):  # the forward's cost of the rounding residual: the best two with it toggled
        if time.time() < budget_end:  # (a backward without DEFER keeps it, one with DEFER leaves it out)
            run("fwd", cfg_of(b), fwd, also={"bwd": {"BLOCK_T": 1, "KEYCH": True, "DEFER": b["res"]}})
    if only == "fwd":
        return {"tokens": N, "d": d, "S": S, "r": r, "kernels": path, "rows": rows}
    # a backward without DEFER: the forward keeps the residual, so that every backward can run
    h, stats, res = launch.fwd(srcs, q, "slice", EPS, DEFAULT.replace(autotune=False, bwd={"BLOCK_T": 1}))
    bwd = lambda: bwd_fn(srcs, q, h, stats, res, g, "slice", EPS, cur[0])  # noqa: E731
    default_ppsm = DEFAULT.bwd_programs_per_sm
    if shape_s:
        budget_end = bwd_end
    for cfg in pick("bwd"):
        if time.time() > budget_end:
            break
        run("bwd", cfg, bwd, default_ppsm)
    pipelined("bwd", bwd, default_ppsm)
    keyed("bwd", bwd, default_ppsm)
    paired(bwd, default_ppsm)
    for b in best("bwd", 2):
        if time.time() < budget_end:
            run("bwd", dict(cfg_of(b), EVICT=True), bwd, default_ppsm)
        for ppsm in PROGRAMS_PER_SM:  # the persistent grid
            if ppsm == default_ppsm or time.time() > budget_end or b.get("BLOCK_T"):
                continue
            run("bwd", cfg_of(b), bwd, ppsm)
    return {"tokens": N, "d": d, "S": S, "r": r, "kernels": path, "rows": rows}


def _md(doc) -> str:
    e = doc["env"]
    lines = [f"# Kernel launch-configuration sweep: {e['device']}, torch {e['torch']}, triton {e['triton']}, {e['date']}",
             "", f"Copy bandwidth {doc['copy_bw_TBps']:.2f} TB/s. CUDA-graph replay, median. % design = bytes this "
             "design moves (fwd S+1.5, bwd 2S+2.5 units of N d 2 with the rounding residual, S+1 and 2S+1 without) / "
             "(time x copy bandwidth); % formula = the "
             "roofline's bytes (fwd S+1, bwd 2S+1).", ""]
    for shp in doc["shapes"]:
        lines += [f"## {shp.get('kernels', 'table')} kernels: {shp['tokens']} tokens, d={shp['d']}, S={shp['S']}, r={shp['r']}", "",
                  "| kernel | columns | grid | tokens or sources per step | warps | prefetch | stages | evict | key chunks | programs/SM | residual | us | % design | % formula |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(shp["rows"], key=lambda x: (x["kernel"] != "fwd", x.get("us", 1e9))):
            grid = "tokens" if r["kernel"] == "fwd" or r.get("BLOCK_T") else "persistent"
            grid += ", 2 sources/step" if r.get("PAIR") else ""
            grid += ", deferred (2 passes)" if r.get("DEFER") else ""
            head = (f"| {r['kernel']} | {r.get('layout', '-')} | {grid} | {r.get('BLOCK_T', r.get('SB', '-'))} | {r['num_warps']} | {r['PREFETCH']} | "
                    f"{r.get('STAGES', 1)} | "
                    f"{r.get('EVICT', False)} | {r.get('KEYCH', False)} | {r.get('programs_per_sm', '-')} | "
                    f"{r.get('res', '-')} |")
            if "error" in r:
                lines.append(head + " error | | |")
            else:
                lines.append(head + f" {r['us']:.1f} | {r['pct_design']:.0f} | {r['pct_formula']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def _parse_extra(specs: list[str]) -> dict:
    """--extra KIND=JSON options as {kind: [configuration, ...]}, with a clear error for a bad one."""
    out: dict = {}
    for spec in specs:
        kind, sep, text = spec.partition("=")
        if not sep or kind not in ("fwd", "bwd"):
            raise SystemExit(f"--extra {spec!r}: expected KIND=JSON with KIND fwd or bwd")
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--extra {spec!r}: the configuration is not JSON ({e})") from None
        if not isinstance(cfg, dict) or not ({"BLOCK_T", "SB"} & set(cfg)) or "num_warps" not in cfg:
            raise SystemExit(f"--extra {spec!r}: expected an object naming BLOCK_T or SB, and num_warps")
        out.setdefault(kind, []).append({"PREFETCH": 0, **cfg})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--shapes", default="8192x1536x9x384,8192x1024x9x256,8192x2560x9x640",
                   help="comma-separated NxdxSxr, each optionally suffixed :table or :args (default :table)")
    p.add_argument("--stem", default="kernel_sweep", help="output file name stem")
    p.add_argument("--quick", action="store_true", help="fewer candidate configurations (4 and 8 warps)")
    p.add_argument("--only", choices=("fwd", "bwd"), help="sweep one kernel (the backward's inputs come from the default forward)")
    p.add_argument("--shape-budget-s", type=float, help="at most this long per shape (40%% of it for the forward)")
    p.add_argument("--extra", action="append", default=[], metavar="KIND=JSON",
                   help='also time this configuration of kernel KIND (fwd or bwd) at every shape, e.g. '
                        'bwd={"BLOCK_T":1,"num_warps":4,"PREFETCH":0,"STAGES":2}; SPLIT defaults to the width\'s own layout')
    a = p.parse_args(argv)
    extra = _parse_extra(a.extra)
    if not torch.cuda.is_available():
        print("kernel_sweep needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.time()
    end = t0 + a.budget_s
    from lrattnres.provenance import git_state

    doc = {"env": {"git": git_state(), "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
           "shapes": []}
    bw = copy_bandwidth()
    doc["copy_bw_TBps"] = bw / 1e12
    for spec in a.shapes.split(","):
        shape, _, path = spec.partition(":")
        N, d, S, r = (int(x) for x in shape.split("x"))
        if time.time() > end:
            break
        doc["shapes"].append(sweep_shape(N, d, S, r, bw, end, path or "table", a.quick, a.only, a.shape_budget_s, extra))
        best = {k: min((x for x in doc["shapes"][-1]["rows"] if x["kernel"] == k and "us" in x),
                       key=lambda x: x["us"], default=None) for k in ("fwd", "bwd")}
        print(f"[{time.time() - t0:.0f}s] {spec}: " + "  ".join(
            f"{k} best {x['us']:.0f}us ({x['pct_design']:.0f}% design) {x}" for k, x in best.items() if x), flush=True)
        doc["elapsed_s"] = time.time() - t0
        for ext, text in (("json", json.dumps(doc, indent=1)), ("md", _md(doc))):
            atomic_write_text(os.path.join(a.out, f"{a.stem}.{ext}"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
