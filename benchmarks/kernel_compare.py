"""The routing kernels before (a git revision) and after (the working tree), in one process, shape by
shape, with a pass/fail per shape.

    python benchmarks/kernel_compare.py --before 63bb3a0 --out DIR            # the 12 shapes, GPU
    python benchmarks/kernel_compare.py --before 63bb3a0 --shapes grid --out DIR   # all 90 shapes
    python benchmarks/kernel_compare.py --smoke --before HEAD --out DIR        # CPU: outputs compared

The before tree is the revision's kernels/ folder (``git archive``, or --before-dir: a folder that
holds a kernels/ package), imported beside the working tree's as the package ``kernels_before``, its
torch.library ops under the namespace ``lrattnres_kernels_before``.  Both run on the same inputs in
the same process.

GPU (bf16): per shape, the before tree's first forward+backward tunes; the after tree runs the
configurations the before tree chose (pinned through kernels.Settings, the query-gradient sum's
method too), so that the code, not the tuner's noise, is compared (--tune-both: each tree tunes).
Then --rounds rounds, the trees' order alternating, each timing the forward and the forward+backward
as CUDA-graph replays (triton.testing.do_bench_cudagraph, median us).  Per tree the median over the
rounds; the ratio after / before; a shape fails when either ratio exceeds 1 + --tolerance (2%).
Exit status 1 when a shape fails.

CPU (--smoke, fp32): both trees' CPU fallback (bitwise equal expected) and their Triton kernels
through the interpreter (equal to within 1e-5 expected) on small unaligned shapes; a shape fails
otherwise.

Writes kernel_compare.json and kernel_compare.md (kernel_compare_smoke.* with --smoke) to --out.
Duration on one H200 (estimate from the grid's tuning, 10-40 s per shape class): the 12 shapes with
5 rounds in about 5 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (tokens, d, S, r) from the 90-shape grid: small and large S, r = d and r < d, every width, both token
# counts; the deferred backward (S <= 8, r < d), the resident pair (S = 2) and the residual one.
SUBSET = [
    (8192, 1536, 9, 384), (8192, 1536, 9, 1536), (8192, 2560, 9, 640), (8192, 2560, 49, 2560),
    (8192, 1024, 49, 256), (8192, 1024, 2, 1024), (8192, 2560, 2, 320), (4096, 1536, 5, 192),
    (4096, 1024, 25, 1024), (4096, 2560, 25, 640), (4096, 1536, 49, 1536), (4096, 1024, 9, 128),
]
# (tokens, d, S, r): the deferred two passes and the resident pair in bf16, the residual at S = 9
SMOKE_SHAPES = [(9, 64, 3, 16), (9, 96, 2, 96), (9, 300, 5, 40), (9, 513, 9, 513), (9, 1536, 9, 384)]
EPS = 1e-6


def grid_shapes() -> list[tuple[int, int, int, int]]:
    """The 90-shape grid (benchmarks/kernel_bench.py)."""
    return [(n, d, S, d // k) for n in (8192, 4096) for S in (2, 5, 9, 25, 49) for d in (1024, 1536, 2560)
            for k in (1, 4, 8)]


# ---------------------------------------------------------------------------------------------- the two trees


def extract(rev: str, dest: Path) -> Path:
    """The revision's kernels/ folder under ``dest`` (git archive)."""
    archive = subprocess.run(["git", "archive", rev, "kernels"], cwd=REPO, capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


@contextlib.contextmanager
def _ops_renamed(old: str, new: str):
    """torch.library.custom_op / triton_op register ``old::name`` as ``new::name`` inside the block."""
    import torch

    real = {k: getattr(torch.library, k) for k in ("custom_op", "triton_op")}

    def renamed(fn):
        return lambda name, *a, **k: fn(name.replace(old + "::", new + "::"), *a, **k)

    for k, fn in real.items():
        setattr(torch.library, k, renamed(fn))
    try:
        yield
    finally:
        for k, fn in real.items():
            setattr(torch.library, k, fn)


def import_before(root: Path):
    """The kernels/ package under ``root`` as ``kernels_before``."""
    folder = root / "kernels"
    spec = importlib.util.spec_from_file_location("kernels_before", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels_before"] = module
    with _ops_renamed("lrattnres_kernels", "lrattnres_kernels_before"):
        spec.loader.exec_module(module)
    return module


def tuned(pkg) -> dict:
    """A tree's tuned choices (kernels.tuned_configs; kernels.op.tuned_configs in a tree whose kernels/
    keeps its launchers in op.py, such as 63bb3a0)."""
    fn = getattr(pkg, "tuned_configs", None)
    if fn is None:
        fn = importlib.import_module(pkg.__name__ + ".op").tuned_configs
    return fn()


def pinned_like(before_tuned: dict, N: int, d: int, S: int, r: int, device):
    """Settings that run the configurations the before tree chose for this shape (None if it chose
    none, e.g. without tuning)."""
    import torch

    from kernels import DEFAULT, configs, dispatch, launch

    def name(kind, forms):
        bd, nch = dispatch.layout(kind, d, r, DEFAULT)
        return dispatch.class_name(kind, bd, nch, configs.key_pos(d, r, bd, nch), forms, S, configs.next_pow2(N))

    fwd = before_tuned.get(name("fwd", dispatch.fwd_forms(S, DEFAULT)))
    bwd = before_tuned.get(name("bwd", dispatch.defer_kinds(torch.bfloat16, d, r, "slice", S, DEFAULT)))
    if fwd is None or bwd is None:
        return None
    s = DEFAULT.replace(fwd=fwd, bwd=bwd)
    bd, nch = dispatch.layout("bwd", d, r, s)
    kw = dispatch.launch_kwargs(bwd, "bwd", configs.key_pos(d, r, bd, nch))
    programs = launch._bwd_scratch(kw, N, S, r, device, s)[0].shape[0]
    method = before_tuned.get(f"sum/{programs}x{r}/bfloat16", {}).get("method")
    return s.replace(dq_sum=method) if method else s


# ---------------------------------------------------------------------------------------------- timing


def compare_gpu(before, shapes, rounds: int, tune_both: bool) -> list[dict]:
    import torch
    from triton.testing import do_bench_cudagraph

    import kernels

    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernel_bench as kb  # its inputs and its forward+backward callable

    def graph_us(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3

    rows = []
    for N, d, S, r in shapes:
        srcs, q, g = kb._inputs(S, N, d, r)
        b_fn = lambda s, qq, dd: before.attnres(s, qq, norm="slice", eps=EPS)  # noqa: E731
        kb._fwdbwd(b_fn, srcs, q, g, d)()  # the before tree tunes this shape's classes
        torch.cuda.synchronize()
        s = None if tune_both else pinned_like(tuned(before), N, d, S, r, srcs[0].device)
        a_fn = lambda x, qq, dd: kernels.attnres(x, qq, norm="slice", eps=EPS, settings=s or kernels.DEFAULT)  # noqa: E731
        calls = {"before": (lambda: b_fn(srcs, q, d), kb._fwdbwd(b_fn, srcs, q, g, d)),
                 "after": (lambda: a_fn(srcs, q, d), kb._fwdbwd(a_fn, srcs, q, g, d))}
        times = {(t, k): [] for t in calls for k in ("fwd", "fwdbwd")}
        for rnd in range(rounds):
            for tree in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                fwd, fb = calls[tree]
                times[(tree, "fwd")].append(graph_us(fwd))
                times[(tree, "fwdbwd")].append(graph_us(fb))
        row = {"tokens": N, "d": d, "S": S, "r": r, "pinned": s is not None,
               "configs": {k: dict(v) for k, v in (("fwd", s.fwd), ("bwd", s.bwd)) if s is not None and v},
               "times": {f"{t}_{k}": v for (t, k), v in times.items()}}
        for k in ("fwd", "fwdbwd"):
            row[f"before_{k}_us"] = statistics.median(times[("before", k)])
            row[f"after_{k}_us"] = statistics.median(times[("after", k)])
            row[f"ratio_{k}"] = row[f"after_{k}_us"] / row[f"before_{k}_us"]
        rows.append(row)
        print(f"{N}x{d}x{S}x{r}: fwd {row['before_fwd_us']:.1f} -> {row['after_fwd_us']:.1f} us "
              f"({row['ratio_fwd']:.3f}), fwd+bwd {row['before_fwdbwd_us']:.1f} -> {row['after_fwdbwd_us']:.1f} us "
              f"({row['ratio_fwdbwd']:.3f})", flush=True)
        del srcs, q, g
    return rows


def compare_cpu(before, shapes) -> list[dict]:
    """Both trees' CPU fallback and interpreted kernels on the same fp32 inputs."""
    import torch

    import kernels

    rows = []
    for N, d, S, r in shapes:
        gen = torch.Generator().manual_seed(N + d + S + r)
        srcs = [torch.randn(N, d, generator=gen) for _ in range(S)]
        q = torch.randn(r, generator=gen)
        g = torch.randn(N, d, generator=gen)
        row = {"tokens": N, "d": d, "S": S, "r": r}
        for path in ("fallback", "fallback_bf16", "interpreter"):  # bf16: the residual's code, the deferred form
            outs = {}
            dt = torch.bfloat16 if path == "fallback_bf16" else torch.float32
            for tree, pkg in (("before", before), ("after", kernels)):
                fn = pkg.attnres_triton if path == "interpreter" else pkg.attnres
                xs = [x.to(dt).requires_grad_() for x in srcs]
                qq = q.to(dt).requires_grad_()
                t = time.perf_counter()
                h = fn(xs, qq, norm="slice", eps=EPS)
                outs[tree] = [h.detach(), *torch.autograd.grad(h, xs + [qq], g.to(dt))]
                row[f"{tree}_{path}_s"] = time.perf_counter() - t
            pairs = list(zip(outs["before"], outs["after"]))
            row[f"{path}_bitwise"] = all(torch.equal(a, b) for a, b in pairs)
            row[f"{path}_max_abs"] = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
        row["pass"] = row["fallback_bitwise"] and row["fallback_bf16_bitwise"] and row["interpreter_max_abs"] <= 1e-5
        rows.append(row)
        print(f"{N}x{d}x{S}x{r}: fallback bitwise {row['fallback_bitwise']} (bf16 {row['fallback_bf16_bitwise']}), "
              f"interpreter max |diff| "
              f"{row['interpreter_max_abs']:.1e}", flush=True)
    return rows


def markdown(doc: dict) -> str:
    lines = [f"# Routing kernels before and after ({doc['device']}, {doc['date']})", "",
             f"Before: {doc['before']['name']} ({doc['before'].get('commit')}); after: the working tree at "
             f"{doc['after']['commit']}{' (dirty)' if doc['after']['dirty'] else ''}. One process."]
    if doc["smoke"]:
        lines += ["CPU, fp32: the CPU fallback (bitwise equal expected) and the interpreted kernels (within 1e-5).",
                  "", "| tokens | d | S | r | fallback bitwise | bf16 fallback bitwise | interpreter max abs | pass |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in doc["shapes"]:
            lines.append(f"| {r['tokens']} | {r['d']} | {r['S']} | {r['r']} | {r['fallback_bitwise']} | "
                         f"{r['fallback_bf16_bitwise']} | {r['interpreter_max_abs']:.1e} | {'pass' if r['pass'] else 'FAIL'} |")
    else:
        lines += [f"{doc['rounds']} rounds, order alternating, CUDA-graph replays, median per tree; "
                  f"{'each tree tuned' if doc['tune_both'] else 'after pinned to the configurations before chose'}; "
                  f"fail: more than {100 * doc['tolerance']:.0f}% slower after.", "",
                  "| tokens | d | S | r | fwd before us | fwd after us | ratio | fwd+bwd before us | fwd+bwd after us "
                  "| ratio | pass |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["shapes"]:
            lines.append(f"| {r['tokens']} | {r['d']} | {r['S']} | {r['r']} | {r['before_fwd_us']:.1f} | "
                         f"{r['after_fwd_us']:.1f} | {r['ratio_fwd']:.3f} | {r['before_fwdbwd_us']:.1f} | "
                         f"{r['after_fwdbwd_us']:.1f} | {r['ratio_fwdbwd']:.3f} | {'pass' if r['pass'] else 'FAIL'} |")
    failed = sum(not r["pass"] for r in doc["shapes"])
    lines += ["", f"{len(doc['shapes']) - failed} of {len(doc['shapes'])} shapes pass."]
    return "\n".join(lines) + "\n"


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the git revision whose kernels/ is 'before'")
    p.add_argument("--before-dir", help="a folder holding the 'before' kernels/ package (instead of --before)")
    p.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    p.add_argument("--stem", default="kernel_compare")
    p.add_argument("--shapes", default="subset", help="'subset' (12 shapes), 'grid' (90) or NxDxSxR,...")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds per shape, the trees' order alternating")
    p.add_argument("--tolerance", type=float, default=0.02, help="fail a shape whose ratio after / before exceeds 1 + this")
    p.add_argument("--tune-both", action="store_true", help="each tree tunes (default: after runs before's choices)")
    p.add_argument("--smoke", action="store_true", help="CPU: compare the trees' outputs (fallback and interpreter)")
    a = p.parse_args(argv)
    if bool(a.before) == bool(a.before_dir):
        p.error("name the 'before' kernels with exactly one of --before REV and --before-dir DIR")
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("kernel_compare needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1
    if a.shapes in ("subset", "grid"):
        shapes = SMOKE_SHAPES if a.smoke else (SUBSET if a.shapes == "subset" else grid_shapes())
    else:
        shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes.split(",") if x]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kernel_compare_") as tmp:
        root = Path(a.before_dir).resolve() if a.before_dir else extract(a.before, Path(tmp) / "before")
        before = import_before(root)
        rows = compare_cpu(before, shapes) if a.smoke else compare_gpu(before, shapes, a.rounds, a.tune_both)
    for r in rows:
        if not a.smoke:
            r["pass"] = max(r["ratio_fwd"], r["ratio_fwdbwd"]) <= 1 + a.tolerance
    doc = {"benchmark": "kernel_compare", "smoke": a.smoke,
           "device": "cpu (interpreter)" if a.smoke else torch.cuda.get_device_name(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "before": {"name": a.before or a.before_dir, "commit": _git("rev-parse", a.before) if a.before else None},
           "after": {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))},
           "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
           "rounds": a.rounds, "tolerance": a.tolerance, "tune_both": a.tune_both, "shapes": rows,
           "wall_s": time.time() - t0}
    from lrattnres.io import atomic_write_text

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = a.stem + ("_smoke" if a.smoke else "")
    atomic_write_text(out / f"{stem}.json", json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write_text(out / f"{stem}.md", markdown(doc))
    print(markdown(doc))
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
