"""Depth-routing kernels side by side: this project's fused Triton op, FLA's fused_attnres, fast-attnres,
the eager reference and torch.compile of the reference.

    python benchmarks/kernel_bench.py --out DIR            # check, then the full grid
    python benchmarks/kernel_bench.py --quick --out DIR    # a few shapes
    python benchmarks/kernel_bench.py --shapes 8192x2560x9x2560,4096x1536x2x384 --out DIR   # these shapes
    python benchmarks/kernel_bench.py --merge A.json B.json ... --out DIR --stem NAME   # one table from
                                                           # runs that each measured part of the grid

Every row: median microseconds of triton.testing.do_bench (which clears the L2 before each call) for the
forward and for forward+backward, called eagerly as a user would (host-side dispatch counts where it
outlasts the L2 flush); the same two as CUDA-graph replays (GPU time alone, no dispatch; None where an
implementation cannot be captured) and as replays from a flushed L2 ("cold": every input from DRAM, as
in a training step; plain replays let small inputs stay in the L2); and the fraction of the copy
bandwidth measured in the same run, with roofline bytes forward (S+1)*tokens*d*2 and forward+backward
(3S+2)*tokens*d*2.  Rows of ours and the peers also carry each kernel's GPU time in one eager
forward+backward (torch.profiler: which kernel the time goes to; --no-kernel-times leaves it out).
The bf16 correctness check (|x - ref| <= 0.05 + 0.05|ref|) runs first.  Writes
kernel_bench.json and kernel_bench.md to --out, rewritten after every row so a cut-off run keeps what
it measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

import dataclasses  # noqa: E402

import kernels  # noqa: E402
import kernels.launch as launch  # noqa: E402
from kernels import DEFAULT, dispatch  # noqa: E402
from lrattnres.routing import route  # noqa: E402

DTYPE = torch.bfloat16
EPS = 1e-6


def _bench(fn, warmup=5, rep=25):
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3  # us


def _bench_graph(fn):
    """Median us of CUDA-graph replays of ``fn``: GPU time without host-side dispatch, None if ``fn``
    cannot be captured (a host sync inside, say)."""
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3
    except Exception as e:  # pragma: no cover - depends on the implementation
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


def _bench_graph_cold(fn):
    """Median us of CUDA-graph replays of ``fn`` with the L2 flushed before each (do_bench's flush; the
    timed region is the replay alone): GPU time with every input read from DRAM, as in a training step,
    where a layer's sources were written long before.  Plain graph replays let inputs that fit in the
    L2 (at S = 2, two 25 MB sources) be read from it on the next replay, which favours an
    implementation whose reads leave them there.  None if ``fn`` cannot be captured."""
    try:
        fn()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e3
    except Exception as e:  # pragma: no cover - depends on the implementation
        print(f"  (cold graph timing failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30  # 2 GiB of bf16
    a = torch.empty(n, dtype=DTYPE, device="cuda").normal_()
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), warmup=20, rep=200, return_mode="median") * 1e-3
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / t


# ---------------------------------------------------------------------------------------- impls


def _impls(want_compile: bool):
    impls = {"ours": lambda srcs, q, d: kernels.attnres(srcs, q, norm="slice", eps=EPS), "ours-kernels-only": "kernels-only"}
    try:
        from fla.ops.attnres import fused_attnres

        ones = {}

        def fla(srcs, q, d):
            if q.shape[0] != d:
                return None
            w = ones.get(d)
            if w is None:
                w = ones[d] = torch.ones(d, device="cuda", dtype=q.dtype)
            return fused_attnres(q, srcs, w, rms_eps=EPS)

        impls["fla"] = fla
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"FLA unavailable: {e!r}", flush=True)
    try:
        from attnres import attnres as fast

        impls["fast-attnres"] = lambda srcs, q, d: fast(list(srcs), q, eps=EPS)
    except Exception as e:  # pragma: no cover
        print(f"fast-attnres unavailable: {e!r}", flush=True)
    impls["eager"] = lambda srcs, q, d: route(srcs, q, norm="slice", eps=EPS)
    if want_compile:
        compiled = torch.compile(route, dynamic=False)
        impls["compiled"] = lambda srcs, q, d: compiled(srcs, q, norm="slice", eps=EPS)
    return impls


def _inputs(S, N, d, r, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    srcs = [torch.randn(N, d, device="cuda", dtype=DTYPE, generator=gen) for _ in range(S)]
    q = (torch.randn(r, device="cuda", generator=gen) * 0.5).to(DTYPE)
    g = torch.randn(N, d, device="cuda", generator=gen).to(DTYPE)
    return srcs, q, g


def time_kernels_only(srcs, q, g):
    """Our two kernels called directly (no custom-op dispatch, no autograd): (fwd us, fwd+bwd us).

    The difference from the "ours" row is host-side dispatch that do_bench counts whenever it exceeds
    the L2 flush that precedes each timed call."""
    h, lse, res = launch.fwd(srcs, q, "slice", EPS, DEFAULT)
    t_f = _bench(lambda: launch.fwd(srcs, q, "slice", EPS, DEFAULT))

    def fb():
        h, lse, res = launch.fwd(srcs, q, "slice", EPS, DEFAULT)
        return launch.bwd(srcs, q, h, lse, res, g, "slice", EPS, DEFAULT)

    fb()
    fwd = lambda: launch.fwd(srcs, q, "slice", EPS, DEFAULT)  # noqa: E731
    return t_f, _bench(fb), _bench_graph(fwd), _bench_graph(fb), _bench_graph_cold(fwd), _bench_graph_cold(fb)


def _variant(spec: str) -> tuple[str, dict]:
    """--variant LABEL:FIELD=VALUE[;FIELD=VALUE]: a row "ours[LABEL]" timed with these kernels.Settings
    fields (VALUE as JSON: 0, 9, false), e.g. ``scaled:res_bits=false`` or ``defer9:defer_max_s=9``."""
    label, sep, body = spec.partition(":")
    if not label or not sep or not body:
        raise argparse.ArgumentTypeError(f"--variant: {spec!r} is not LABEL:FIELD=VALUE[;FIELD=VALUE]")
    fields = {f.name for f in dataclasses.fields(kernels.Settings) if f.init}
    settings = {}
    for item in body.split(";"):
        attr, eq, value = item.partition("=")
        if not eq or attr not in fields:
            raise argparse.ArgumentTypeError(f"--variant {label}: {attr!r} is not a kernels.Settings field "
                                             f"({', '.join(sorted(fields))})")
        try:
            settings[attr] = json.loads(value)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"--variant {label}: {attr}={value!r} is not a JSON value") from None
    try:
        DEFAULT.replace(**settings)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--variant {label}: {e}") from None
    return label, settings


def _fwdbwd(fn, srcs, q, g, d):
    """A call of forward and backward of implementation ``fn`` (gradients of every source and the query)."""
    srcs_g = [s.detach().requires_grad_() for s in srcs]
    q_g = q.detach().requires_grad_()
    leaves = srcs_g + [q_g]

    def fb():
        out = fn(srcs_g, q_g, d)
        return torch.autograd.grad(out, leaves, g)

    return fb


def kernel_times(fn, calls: int = 10) -> dict:
    """GPU time per call of each CUDA kernel that ``fn()`` launches (torch.profiler over ``calls``
    calls, after one outside it): which kernel a forward+backward spends its time in, ours and the
    peers' alike (a query-gradient sum, a cast, a memset show up as their own rows)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:  # older torch
            t = getattr(e, "cuda_time_total", 0.0)
        if t and str(getattr(e, "device_type", "")).endswith("CUDA"):
            out[e.key[:80]] = round(t / calls, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def time_impl(fn, S, N, d, r, srcs, q, g):
    """(fwd us, fwd+bwd us, the same two as CUDA-graph replays, and as replays from a flushed L2) for
    one implementation, None where it cannot run."""
    if fn == "kernels-only":
        return time_kernels_only(srcs, q, g)
    if fn(srcs, q, d) is None:
        return None, None, None, None, None, None
    t_f = _bench(lambda: fn(srcs, q, d))
    fb = _fwdbwd(fn, srcs, q, g, d)
    fb()
    t_fb = _bench(fb)
    fwd = lambda: fn(srcs, q, d)  # noqa: E731
    return t_f, t_fb, _bench_graph(fwd), _bench_graph(fb), _bench_graph_cold(fwd), _bench_graph_cold(fb)


# ---------------------------------------------------------------------------------------- check


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bf16_check(shapes, N=4096):
    """Ours against the reference in bf16 at ``shapes`` with the default (untuned) configurations, fresh
    outputs poisoned so that an unwritten element fails."""
    checked = DEFAULT.replace(autotune=False, poison=True)
    rows = []
    for d, r, S, norm in shapes:
        srcs, q, g = _inputs(S, N, d, r, seed=d + r + S)
        q = q.float()
        out = {}
        for name, fn in (("ours", kernels.attnres), ("ref", route)):
            ss = [s.detach().requires_grad_() for s in srcs]
            qq = q.detach().requires_grad_()
            if name == "ours":
                h = fn(ss, qq, norm=norm, eps=EPS, settings=checked)
                res = kernels.attnres_fwd(ss, qq, norm, EPS, checked.key)[2]
                if dispatch.res_kept(ss[0].dtype, d, r, norm, S, checked):
                    res_written = res.shape == h.shape and bool((res > -128).all())
                else:  # the deferred backward: no residual kept
                    res_written = res.numel() == 0
            else:
                h = fn(ss, qq, norm=norm, eps=EPS)
            gr = torch.autograd.grad(h, ss + [qq], g)
            out[name] = (h, gr[:-1], gr[-1])
        (h, gs, gq), (hr, gsr, gqr) = out["ours"], out["ref"]

        def ok(x, ref):
            x, ref = x.float(), ref.float()
            return bool(torch.isfinite(x).all()) and bool(((x - ref).abs() <= 0.05 + 0.05 * ref.abs()).all())

        row = {
            "d": d, "r": r, "S": S, "norm": norm, "tokens": N,
            "pass": ok(h, hr) and all(ok(a, b) for a, b in zip(gs, gsr)) and ok(gq, gqr) and res_written,
            "out_rel_l2": _rel(h, hr),
            "src_grad_rel_l2": max(_rel(a, b) for a, b in zip(gs, gsr)),
            "query_grad_rel_l2": _rel(gq, gqr),
        }
        rows.append(row)
        print(f"check d={d} r={r} S={S} {norm}: pass={row['pass']} out={row['out_rel_l2']:.2e} "
              f"dsrc={row['src_grad_rel_l2']:.2e} dq={row['query_grad_rel_l2']:.2e}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------- output


def _env():
    from lrattnres.provenance import git_state

    return {
        "git": git_state(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }


def _write(out_dir, stem, payload, md):
    from lrattnres.io import atomic_write_text

    for ext, text in (("json", json.dumps(payload, indent=1)), ("md", md)):
        atomic_write_text(os.path.join(out_dir, f"{stem}.{ext}"), text)


def _md(payload):
    e = payload["env"]
    lines = [
        f"# Depth-routing kernels: {e['device']}, torch {e['torch']}, triton {e['triton']}, {e['date']}",
        "",
        f"Copy bandwidth (read + write): {payload['copy_bw_TBps']:.2f} TB/s. Median of triton do_bench; "
        "% = roofline bytes / (time x copy bandwidth); fwd bytes (S+1)Nd2, fwd+bwd bytes (3S+2)Nd2. bf16.",
        "",
    ]
    if payload.get("merged_from"):
        lines += [f"Merged from {len(payload['merged_from'])} runs ({payload['shapes_measured']} of the grid's "
                  f"{payload['shapes_in_grid']} shapes). {payload.get('note', '')}", ""]
        lines += [f"- `{m['file']}`: tree {m['env'].get('git', {}).get('commit')}, {m['env']['date']}, copy bandwidth "
                  f"{m['copy_bw_TBps']:.3f} TB/s{' (cut off by its time budget)' if m['truncated'] else ''}"
                  for m in payload["merged_from"]]
        lines.append("")
    if payload.get("check"):
        lines += ["## bf16 check (|x-ref| <= 0.05 + 0.05|ref|)", "",
                  "| d | r | S | norm | pass | out rel L2 | src grad rel L2 | query grad rel L2 |", "|---|---|---|---|---|---|---|---|"]
        for c in payload["check"]:
            lines.append(f"| {c['d']} | {c['r']} | {c['S']} | {c['norm']} | {c['pass']} | {c['out_rel_l2']:.2e} | "
                         f"{c['src_grad_rel_l2']:.2e} | {c['query_grad_rel_l2']:.2e} |")
        lines.append("")
    lines += ["## Timings", "",
              "| tokens | d | S | r | impl | fwd us | fwd % | fwd+bwd us | fwd+bwd % | ours speedup fwd+bwd "
              "| graph fwd us | graph fwd % | graph fwd+bwd us | graph fwd+bwd % | ours speedup graph fwd+bwd "
              "| cold graph fwd / fwd+bwd us | ours speedup cold graph fwd+bwd |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        def f(x, p=0):
            return "-" if x is None else f"{x:.{p}f}"
        impl = row["impl"] + (f" (from {row['from_run']})" if row.get("from_run") else "")
        lines.append(f"| {row['tokens']} | {row['d']} | {row['S']} | {row['r']} | {impl} | {f(row['fwd_us'])} | "
                     f"{f(row['fwd_pct'])} | {f(row['fwdbwd_us'])} | {f(row['fwdbwd_pct'])} | {f(row.get('ours_speedup_fwdbwd'), 2)} | "
                     f"{f(row.get('fwd_graph_us'))} | {f(row.get('fwd_graph_pct'))} | {f(row.get('fwdbwd_graph_us'))} | "
                     f"{f(row.get('fwdbwd_graph_pct'))} | {f(row.get('ours_speedup_fwdbwd_graph'), 2)} | "
                     f"{f(row.get('fwd_graph_cold_us'))} / {f(row.get('fwdbwd_graph_cold_us'))} | "
                     f"{f(row.get('ours_speedup_fwdbwd_graph_cold'), 2)} |")
    broken = [row for row in payload["rows"] if row.get("kernels_fwdbwd_us")]
    if broken:
        lines += ["", "## GPU time per kernel (torch.profiler, one eager forward+backward, us)", "",
                  "| tokens | d | S | r | impl | sum | kernels |", "|---|---|---|---|---|---|---|"]
        for row in broken:
            ks = row["kernels_fwdbwd_us"]
            lines.append(f"| {row['tokens']} | {row['d']} | {row['S']} | {row['r']} | {row['impl']} | "
                         f"{sum(ks.values()):.1f} | " + "; ".join(f"{k[:48]} {v:.1f}" for k, v in ks.items()) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- main


# The shapes a cut-off run should keep, in order (d, S, r = d // divisor): the goals' S = 9 at every
# width (r = d/4, and r = d where FLA runs), then every other S at the 1B model's width.  A new shape
# costs about a minute (the peers autotune per shape), so one 9-minute device call measures about 8.
FIRST = ((1536, 9, 4), (1536, 9, 1), (2560, 9, 4), (1024, 9, 4), (1536, 49, 4), (1536, 2, 4), (1536, 25, 4),
         (1536, 5, 4), (2560, 49, 4), (1024, 49, 4), (2560, 9, 1), (1024, 9, 1))


def full_grid(tokens) -> list[tuple[int, int, int, int]]:
    """The 90-shape grid (d in {1024, 1536, 2560}, S in {2, 5, 9, 25, 49}, r in {d, d/4, d/8}) per token
    count, FIRST's shapes first."""
    out = []
    for N in tokens:
        first = [(N, d, S, d // k) for d, S, k in FIRST]
        rest = [(N, d, S, r) for S in (9, 25, 49, 5, 2) for d in (1536, 1024, 2560) for r in (d // 4, d, d // 8)]
        out += first + [x for x in rest if x not in first]
    return out


def measured_shapes(paths: str) -> set:
    """The (tokens, d, S, r) shapes kernel_bench JSONs (comma-separated paths) have rows for."""
    out = set()
    for path in paths.split(","):
        try:
            with open(path) as f:
                rows = json.load(f)["rows"]
            out |= {(r["tokens"], r["d"], r["S"], r["r"]) for r in rows}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"kernel_bench: --skip-measured {path}: expected a kernel_bench JSON with rows "
                             f"(tokens, d, S, r): {e!r}")
    return out


def _shape_list(text: str) -> list[tuple[int, int, int, int]]:
    """--shapes: "8192x1536x9x384,4096x2560x2x640" as (tokens, d, S, r) tuples."""
    out = []
    for spec in (x for x in text.split(",") if x):
        try:
            N, d, S, r = (int(v) for v in spec.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes: {spec!r} is not TOKENSxDxSxR (four integers)") from None
        if not (N > 0 and d > 0 and S > 0 and 0 < r <= d):
            raise argparse.ArgumentTypeError(f"--shapes: {spec!r} needs positive sizes and r <= d")
        out.append((N, d, S, r))
    return out


def fits(elapsed: float, longest: float, budget: float) -> bool:
    """Whether another shape may start: the time spent plus the longest shape so far stays within the
    budget.  Why: a shape that starts within the budget but outlasts it is cut off by an outer time
    limit, losing the minutes it had run."""
    return elapsed + longest <= budget


# A row's times: forward and forward+backward called eagerly, as CUDA-graph replays, and as replays
# from a flushed L2 (the row keys are these with "_us"; each has a speedup of ours, "ours_speedup_").
_TIMES = ("fwd", "fwdbwd", "fwd_graph", "fwdbwd_graph", "fwd_graph_cold", "fwdbwd_graph_cold")


def _speedups(times, ours_times) -> dict:
    """ours_speedup_<time> for each of _TIMES: an implementation's time over ours (None where either was
    not timed)."""
    return {f"ours_speedup_{t}": None if a is None or b is None else a / b
            for t, a, b in zip(_TIMES, times, ours_times)}


def run_grid(args):
    t0 = time.time()
    payload = {"env": _env(), "rows": [], "check": []}
    bw = copy_bandwidth()
    payload["copy_bw_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    if not args.no_check:
        payload["check"] = bf16_check([
            (1536, 1536, 9, "slice"), (1536, 384, 9, "slice"), (1536, 192, 9, "full"), (2560, 640, 25, "slice"),
            (1024, 128, 49, "slice"), (513, 7, 2, "full"), (1536, 384, 5, "slice"),  # the last: deferred
        ], N=2048)
        print(f"check done at {time.time() - t0:.0f}s", flush=True)
    compile_at = {(8192, 1536, 9, 384)}  # the shapes that time torch.compile of the reference
    if args.quick:
        grid = [(8192, 1536, S, r) for S in (5, 9, 25) for r in (1536, 384)] + [(4096, 2560, 9, 320), (8192, 1024, 49, 1024)]
    elif args.shapes:
        grid = args.shapes
    else:
        grid = full_grid(args.tokens)[args.skip:]
        if args.skip_measured:
            measured = measured_shapes(args.skip_measured)
            grid = [x for x in grid if x not in measured or x[1] in args.redo_widths]
    impls = _impls(want_compile=not args.no_compile)
    variants = dict(args.variant or [])
    if variants:  # right after "ours", so that each variant's row sits beside it
        ours = impls.pop("ours")

        def with_settings(s):
            return lambda srcs, q, d: kernels.attnres(srcs, q, norm="slice", eps=EPS, settings=s)

        impls = {"ours": ours, **{f"ours[{label}]": with_settings(DEFAULT.replace(**v)) for label, v in variants.items()},
                 **impls}
        payload["variants"] = variants
    longest = 0.0  # the longest shape so far (s): a shape is started only if one that long still fits
    for N, d, S, r in grid:
        if not fits(time.time() - t0, longest, args.budget_s):
            print(f"time budget reached ({time.time() - t0:.0f} s of {args.budget_s:.0f}, longest shape "
                  f"{longest:.0f} s); stopping the grid", flush=True)
            payload["truncated"] = True
            break
        t_shape = time.time()
        srcs, q, g = _inputs(S, N, d, r)
        res, ktimes = {}, {}
        for name, fn in impls.items():
            if name == "compiled" and (N, d, S, r) not in compile_at:
                continue
            if name == "eager" and not args.eager_all and (N == 4096 or r != d // 4):
                continue
            try:
                times = time_impl(fn, S, N, d, r, srcs, q, g)
                t_f = times[0]
            except Exception as e:
                print(f"{name} failed at N={N} d={d} S={S} r={r}: {e!r}", flush=True)
                traceback.print_exc(limit=2)
                continue
            if t_f is None:
                continue
            res[name] = times
            if args.kernel_times and name in ("ours", "fast-attnres", "fla"):
                try:
                    ktimes[name] = kernel_times(_fwdbwd(fn, srcs, q, g, d))
                except Exception as e:  # noqa: BLE001 - a profiler that cannot run costs the breakdown only
                    print(f"kernel times of {name} failed: {e!r}", flush=True)
        fwd_bytes = (S + 1) * N * d * 2
        fb_bytes = (3 * S + 2) * N * d * 2
        def pct(nbytes, t):
            return None if t is None else 100 * nbytes / (t * 1e-6 * bw)

        for name, (t_f, t_fb, tg_f, tg_fb, tc_f, tc_fb) in res.items():
            row = {
                "tokens": N, "d": d, "S": S, "r": r, "impl": name,
                "fwd_us": t_f, "fwdbwd_us": t_fb, "fwd_pct": pct(fwd_bytes, t_f), "fwdbwd_pct": pct(fb_bytes, t_fb),
                "fwd_graph_us": tg_f, "fwdbwd_graph_us": tg_fb,
                "fwd_graph_pct": pct(fwd_bytes, tg_f), "fwdbwd_graph_pct": pct(fb_bytes, tg_fb),
                "fwd_graph_cold_us": tc_f, "fwdbwd_graph_cold_us": tc_fb,
                "fwd_graph_cold_pct": pct(fwd_bytes, tc_f), "fwdbwd_graph_cold_pct": pct(fb_bytes, tc_fb),
                "fwd_bytes": fwd_bytes, "fwdbwd_bytes": fb_bytes,
            }
            if name in ktimes:
                row["kernels_fwdbwd_us"] = ktimes[name]
            if name != "ours" and "ours" in res:
                row.update(_speedups((t_f, t_fb, tg_f, tg_fb, tc_f, tc_fb), res["ours"]))
            payload["rows"].append(row)
        def us(x):
            return "-" if x is None else f"{x:.0f}"

        line = " ".join(f"{k}={us(v[0])}/{us(v[1])} (graph {us(v[2])}/{us(v[3])}, cold {us(v[4])}/{us(v[5])})"
                        for k, v in res.items())
        if "ours" in res:
            o = payload["rows"][-len(res)]
            line += f"  ours {us(o['fwd_pct'])}%/{us(o['fwdbwd_pct'])}% (graph {us(o['fwd_graph_pct'])}%/{us(o['fwdbwd_graph_pct'])}%)"
        print(f"[{time.time() - t0:.0f}s] N={N} d={d} S={S} r={r}: {line}", flush=True)
        payload["tuned_configs"] = kernels.tuned_configs()
        _write(args.out, args.stem, payload, _md(payload))
        del srcs, q, g
        longest = max(longest, time.time() - t_shape)
    payload["elapsed_s"] = time.time() - t0
    payload["tuned_configs"] = kernels.tuned_configs()
    _write(args.out, args.stem, payload, _md(payload))


# The reference implementations, timed at a few shapes only (the eager reference at 8192 tokens and
# r = d/4, torch.compile of it at one shape): their times do not depend on this project's kernels, so a
# merge keeps them from an earlier run where the shape's latest run did not time them.
REFERENCES = ("eager", "compiled")


def _times(row) -> list:
    """A row's six times (us) in _TIMES order, None where not timed."""
    return [row.get(f"{t}_us") for t in _TIMES]


def _carried_references(shape, shape_rows, refs) -> list[dict]:
    """The reference rows an earlier run timed at ``shape`` that its latest run did not, each naming its
    run (from_run) and with its speedups taken against the latest run's row of ours."""
    have = {r["impl"] for r in shape_rows}
    ours = next((r for r in shape_rows if r["impl"] == "ours"), None)
    out = []
    for impl in REFERENCES:
        if impl in have or (shape, impl) not in refs:
            continue
        row, run = refs[(shape, impl)]
        row = {k: v for k, v in row.items() if not k.startswith("ours_speedup_")}
        row["from_run"] = run
        if ours:
            row.update(_speedups(_times(row), _times(ours)))
        out.append(row)
    return out


def merge(paths, out_dir, stem, note):
    """One document from runs that measured parts of the grid (runs on several GPUs at once, or runs
    that continued a cut-off grid with --skip): the rows in grid order (a shape several runs measured: the
    last run's; a reference implementation's row from an earlier run where the last did not time it,
    _carried_references), the first bf16 check, the last run's environment (so the table's date is its
    newest measurement; every run's under merged_from).  Each row keeps the percentages its own run
    computed against its own copy bandwidth.  Refuses runs of different devices or software versions."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    keys = [(d["env"]["device"], d["env"]["torch"], d["env"]["triton"]) for d in docs]
    if len(set(keys)) != 1:
        raise SystemExit(f"--merge: runs differ in device or versions: {sorted(set(keys))}")
    order = {shape: i for i, shape in enumerate(full_grid([8192, 4096]))}
    latest = {}  # a shape measured by several runs keeps the last run's rows (e.g. after a kernel change)
    refs = {}  # (shape, impl) -> (row, file): the last run's row of each reference implementation
    for p, d in zip(paths, docs):
        for shape in {(r["tokens"], r["d"], r["S"], r["r"]) for r in d["rows"]}:
            latest[shape] = [r for r in d["rows"] if (r["tokens"], r["d"], r["S"], r["r"]) == shape]
        for r in d["rows"]:
            if r["impl"] in REFERENCES:
                refs[((r["tokens"], r["d"], r["S"], r["r"]), r["impl"])] = (r, r.get("from_run") or os.path.basename(p))
    for shape, shape_rows in latest.items():
        shape_rows += _carried_references(shape, shape_rows, refs)
    rows = [r for shape_rows in latest.values() for r in shape_rows]
    rows.sort(key=lambda r: order.get((r["tokens"], r["d"], r["S"], r["r"]), len(order)))
    shapes = {(r["tokens"], r["d"], r["S"], r["r"]) for r in rows}
    out = {"env": dict(docs[-1]["env"]), "note": note, "rows": rows,
           "check": next((d["check"] for d in docs if d.get("check")), []),
           "copy_bw_TBps": sum(d["copy_bw_TBps"] for d in docs) / len(docs),
           "truncated": len(shapes) < len(order), "shapes_measured": len(shapes), "shapes_in_grid": len(order),
           "merged_from": [{"file": os.path.basename(p), "env": d["env"], "copy_bw_TBps": d["copy_bw_TBps"],
                            "truncated": bool(d.get("truncated")), "tuned_configs": d.get("tuned_configs")}
                           for p, d in zip(paths, docs)]}
    _write(out_dir, stem, out, _md(out))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--eager-all", action="store_true", help="also time the eager reference at 4096 tokens for S > 9")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--tokens", type=lambda x: [int(v) for v in x.split(",")], default=[8192, 4096],
                   help="token counts of the full grid, in order (split a run across GPUs with this)")
    p.add_argument("--stem", default="kernel_bench", help="output file name stem")
    p.add_argument("--skip", type=int, default=0, help="leave out the grid's first SKIP shapes (measured by an earlier run)")
    p.add_argument("--skip-measured", metavar="JSON[,JSON]",
                   help="leave out the shapes earlier results (kernel_bench JSONs) have, except those of --redo-widths")
    p.add_argument("--redo-widths", type=lambda x: {int(v) for v in x.split(",") if v}, default=set(),
                   help="comma-separated widths d to measure again even where --skip-measured has them")
    p.add_argument("--shapes", type=_shape_list, help="comma-separated NxdxSxr: measure these instead of the grid")
    p.add_argument("--variant", type=_variant, action="append",
                   help="LABEL:FIELD=VALUE[;FIELD=VALUE]: also time ours with these kernels.Settings fields (repeatable)")
    p.add_argument("--no-kernel-times", dest="kernel_times", action="store_false",
                   help="leave out the per-kernel GPU times (torch.profiler) of ours and the peers")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these runs' results into --out/--stem (no GPU)")
    p.add_argument("--note", default="", help="with --merge: what the merged runs were")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        doc = merge(args.merge, args.out, args.stem, args.note)
        print(f"merged {len(args.merge)} runs: {doc['shapes_measured']} of {doc['shapes_in_grid']} shapes", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    run_grid(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
