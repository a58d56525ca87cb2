"""Two trees of the routing kernels side by side in one run: before (a git revision) and after (the
working tree), timed the same way on the same GPU, with the ratio after / before per shape.

    python benchmarks/kernel_compare.py --before 01fce22 --out DIR              # grid shapes, then the 1B step
    python benchmarks/kernel_compare.py --before main --only shapes --tokens 8192 --out DIR
    python benchmarks/kernel_compare.py --before main --only step --out DIR
    python benchmarks/kernel_compare.py --smoke --before HEAD --out /tmp/x       # CPU: interpreter, tiny shapes

The before tree is the revision's kernels/ folder extracted with ``git archive`` into a temporary
folder (or --before-dir: a folder that holds a kernels/ package); everything else (lrattnres, these
scripts) is the working tree's, so only the kernels differ.  Each tree runs in its own process
(two copies of the package cannot register the same torch.library ops in one), and the rounds
alternate the order (before, after; after, before; ...) so that drift in the GPU's clocks falls on
both.

Shapes: the kernel grid's S = 9 shapes (benchmarks/kernel_bench.py: tokens 4096 and 8192, d 1024,
1536 and 2560, r = d, d/4 and d/8), bf16, each timed as kernel_bench times ours: the forward and the
forward+backward of ``kernels.attnres`` (autotuned on the first call) as CUDA-graph replays
(triton.testing.do_bench_cudagraph, median microseconds).  Per tree and shape the median over the
rounds is kept.  The step: benchmarks/train_step_bench.py's 1B configuration lr-fused (LR-AttnRes,
r = d/4, compiled; --step-configs adds attnres-fused, r = d), tokens/s per tree.

Writes kernel_compare.json and kernel_compare.md (kernel_compare_smoke.* with --smoke) to --out:
every round's times, the medians, the ratio after / before (time; for the step, before's tokens/s
over after's), and a flag on every shape more than --tolerance (3%) slower.  Exit status 0 whether or
not a shape is flagged; the table says which.

Duration on one H200 (estimate): a tree's first pass over the 18 shapes 4-6 minutes (it compiles and
tunes every shape class), later passes 2-3 minutes (Triton's cache); the step about 2.5 minutes per
tree (compile 2 minutes).  Two rounds of shapes and the step: about 20 minutes; --only and --tokens
split it into runs of under 10 minutes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GRID_TOKENS = (4096, 8192)
GRID_WIDTHS = (1024, 1536, 2560)
GRID_RANKS = (1, 4, 8)  # r = d / k
GRID_S = 9
SMOKE_SHAPES = [(21, 64, 3, 16), (21, 96, 2, 96)]  # (tokens, d, S, r): unaligned, the pair at S = 2


def grid_shapes(tokens=GRID_TOKENS) -> list[tuple[int, int, int, int]]:
    """(tokens, d, S, r) of the kernel grid at S = 9."""
    return [(n, d, GRID_S, d // k) for n in tokens for d in GRID_WIDTHS for k in GRID_RANKS]


# ---------------------------------------------------------------------------------------------- worker


def _import_kernels(root: str):
    """``kernels`` from ``root`` (before anything else imports it), the working tree for the rest."""
    sys.path[:0] = [root, str(REPO), str(REPO / "benchmarks")]
    import kernels

    where = Path(kernels.__file__).resolve()
    if Path(root).resolve() not in where.parents:
        raise SystemExit(f"kernel_compare: kernels imported from {where}, not from {root}")
    return kernels


def _time_shapes_gpu(kernels, shapes) -> list[dict]:
    import torch

    import kernel_bench as kb  # benchmarks/kernel_bench.py: its inputs and its graph timing

    rows = []
    for n, d, S, r in shapes:
        srcs, q, g = kb._inputs(S, n, d, r)

        def ours(s, qq, dd):
            return kernels.attnres(s, qq, norm="slice", eps=kb.EPS)

        fwd = lambda: ours(srcs, q, d)  # noqa: E731
        fb = kb._fwdbwd(ours, srcs, q, g, d)
        fwd()
        fb()  # the first calls tune; the timings below replay the chosen configurations
        torch.cuda.synchronize()
        rows.append({"tokens": n, "d": d, "S": S, "r": r, "fwd_us": kb._bench_graph(fwd),
                     "fwdbwd_us": kb._bench_graph(fb)})
        print(f"  {n}x{d}x{S}x{r}: fwd {rows[-1]['fwd_us']} us, fwd+bwd {rows[-1]['fwdbwd_us']} us", flush=True)
        del srcs, q, g
    return rows


def _time_shapes_smoke(kernels, shapes) -> list[dict]:
    """The interpreter on the CPU, fp32: wall-clock medians (the numbers mean nothing)."""
    import torch

    import kernels.op as kop

    kop.set_cpu_triton(True)
    rows = []
    for n, d, S, r in shapes:
        gen = torch.Generator().manual_seed(n + d + S + r)
        srcs = [torch.randn(n, d, generator=gen).requires_grad_() for _ in range(S)]
        q = torch.randn(r, generator=gen).requires_grad_()
        g = torch.randn(n, d, generator=gen)

        def fwd():
            return kernels.attnres_triton(srcs, q)

        def fb():
            return torch.autograd.grad(fwd(), [*srcs, q], g)

        times = {}
        for name, fn in (("fwd_us", fwd), ("fwdbwd_us", fb)):
            fn()
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e6)
            times[name] = statistics.median(ts)
        rows.append({"tokens": n, "d": d, "S": S, "r": r, **times})
    return rows


def _step(configs: list[str], smoke: bool) -> list[dict]:
    import torch

    import train_step_bench as tsb  # benchmarks/train_step_bench.py

    argv = ["--smoke"] if smoke else ["--grad-accum", "16", "--warmup", "2", "--updates", "5"]
    a = tsb._args(argv + ["--profile", ""])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rows = []
    for name in configs:
        row = tsb.run_config(name, a, device)
        rows.append({k: row.get(k) for k in ("config", "rank", "blocks", "tokens_per_s", "update_s_mean",
                                             "update_s_cv", "first_update_s", "compiled_path",
                                             "args_kernel_configs")})
        print(f"  step {name}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    return rows


def worker(a) -> int:
    kernels = _import_kernels(a.kernels_root)
    import kernels.op as kop

    out = {"kernels": str(Path(kernels.__file__).resolve().parent)}
    if a.what == "shapes":
        shapes = [tuple(s) for s in json.loads(a.shapes)]
        out["rows"] = (_time_shapes_smoke if a.smoke else _time_shapes_gpu)(kernels, shapes)
        out["tuned_configs"] = kop.tuned_configs()
    else:
        out["step"] = _step(a.step_configs.split(","), a.smoke)
    Path(a.result).write_text(json.dumps(out, indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------------------------- parent


def extract(rev: str, dest: Path) -> Path:
    """The revision's kernels/ folder under ``dest`` (git archive)."""
    archive = subprocess.run(["git", "archive", rev, "kernels"], cwd=REPO, capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _run_worker(root: Path, what: str, a, tmp: Path, tag: str) -> dict:
    result = tmp / f"{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--kernels-root", str(root), "--what", what,
           "--result", str(result), "--step-configs", a.step_configs]
    if what == "shapes":
        cmd += ["--shapes", json.dumps(a.shape_list)]
    if a.smoke:
        cmd.append("--smoke")
    env = dict(os.environ)
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    print(f"[{tag}] {what} with kernels from {root}", flush=True)
    t = time.time()
    proc = subprocess.run(cmd, env=env, cwd=str(REPO))
    if proc.returncode != 0:
        raise SystemExit(f"kernel_compare: the {tag} worker failed ({proc.returncode})")
    out = json.loads(result.read_text())
    out["wall_s"] = time.time() - t
    return out


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def compare(runs: dict, tolerance: float) -> tuple[list[dict], list[dict]]:
    """Per shape: each tree's median over the rounds, the ratio after / before, the flag; per step
    config: tokens/s and the ratio before / after (time)."""
    shapes = []
    first = runs["before"]["shapes"][0]["rows"] if runs["before"].get("shapes") else []
    for i, base in enumerate(first):
        row = {k: base[k] for k in ("tokens", "d", "S", "r")}
        for t in ("fwd_us", "fwdbwd_us"):
            for tree in ("before", "after"):
                vals = [rnd["rows"][i][t] for rnd in runs[tree]["shapes"] if rnd["rows"][i][t] is not None]
                row[f"{tree}_{t}"] = statistics.median(vals) if vals else None
            b, a = row[f"before_{t}"], row[f"after_{t}"]
            row[f"ratio_{t}"] = a / b if (a and b) else None
        row["slower"] = any(row[f"ratio_{t}"] is not None and row[f"ratio_{t}"] > 1 + tolerance
                            for t in ("fwd_us", "fwdbwd_us"))
        shapes.append(row)
    steps = []
    for i, base in enumerate(runs["before"].get("step", [])):
        after = runs["after"]["step"][i]
        row = {"config": base["config"], "before_tokens_per_s": base["tokens_per_s"],
               "after_tokens_per_s": after["tokens_per_s"]}
        row["ratio_time"] = base["tokens_per_s"] / after["tokens_per_s"]
        row["slower"] = row["ratio_time"] > 1 + tolerance
        steps.append(row)
    return shapes, steps


def markdown(doc: dict) -> str:
    def f(x, p=1):
        return "-" if x is None else f"{x:.{p}f}"

    lines = [f"# Routing kernels before and after ({doc['device']}, {doc['date']})", ""]
    if doc.get("smoke"):
        lines += ["Smoke run (CPU, Triton's interpreter, fp32, wall-clock): checks the script; the numbers mean "
                  "nothing.", ""]
    lines += [f"Before: {doc['before']['name']}; after: {doc['after']['name']}. {doc['rounds']} round(s), order "
              f"alternating; per tree the median over the rounds. Flagged: more than {100 * doc['tolerance']:.0f}% "
              "slower after.", ""]
    if doc["shapes"]:
        lines += ["| tokens | d | S | r | fwd before us | fwd after us | fwd ratio | fwd+bwd before us | "
                  "fwd+bwd after us | fwd+bwd ratio | flag |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["shapes"]:
            lines.append(f"| {r['tokens']} | {r['d']} | {r['S']} | {r['r']} | {f(r['before_fwd_us'])} | "
                         f"{f(r['after_fwd_us'])} | {f(r['ratio_fwd_us'], 3)} | {f(r['before_fwdbwd_us'])} | "
                         f"{f(r['after_fwdbwd_us'])} | {f(r['ratio_fwdbwd_us'], 3)} | {'SLOWER' if r['slower'] else ''} |")
        lines.append("")
    if doc["steps"]:
        lines += ["| step config | before tokens/s | after tokens/s | time ratio after / before | flag |",
                  "|---|---|---|---|---|"]
        for r in doc["steps"]:
            lines.append(f"| {r['config']} | {r['before_tokens_per_s']:,.0f} | {r['after_tokens_per_s']:,.0f} | "
                         f"{r['ratio_time']:.3f} | {'SLOWER' if r['slower'] else ''} |")
        lines.append("")
    flagged = [r for r in doc["shapes"] + doc["steps"] if r["slower"]]
    lines.append(f"Shapes or steps more than {100 * doc['tolerance']:.0f}% slower after: {len(flagged)}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the git revision whose kernels/ is 'before'")
    p.add_argument("--before-dir", help="a folder holding the 'before' kernels/ package (instead of --before)")
    p.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    p.add_argument("--stem", default="kernel_compare")
    p.add_argument("--rounds", type=int, default=2, help="passes over the shapes per tree, order alternating")
    p.add_argument("--only", choices=("shapes", "step"), help="time only the grid shapes or only the step")
    p.add_argument("--tokens", type=lambda x: tuple(int(v) for v in x.split(",")), default=GRID_TOKENS,
                   help="token counts of the grid shapes (e.g. 8192)")
    p.add_argument("--step-configs", default="lr-fused", help="train_step_bench configurations (comma-separated)")
    p.add_argument("--tolerance", type=float, default=0.03, help="flag a ratio after / before above 1 + this")
    p.add_argument("--smoke", action="store_true", help="CPU: the interpreter on tiny shapes, one round")
    # a worker: one tree, one kind of timing (run by the parent)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernels-root", help=argparse.SUPPRESS)
    p.add_argument("--what", choices=("shapes", "step"), help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if bool(a.before) == bool(a.before_dir):
        p.error("name the 'before' kernels with exactly one of --before REV and --before-dir DIR")
    if a.smoke:
        a.rounds = 1
    else:
        import torch

        if not torch.cuda.is_available():
            print("kernel_compare needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 1
    a.shape_list = SMOKE_SHAPES if a.smoke else grid_shapes(a.tokens)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kernel_compare_") as tmp:
        tmp = Path(tmp)
        roots = {"before": Path(a.before_dir).resolve() if a.before_dir else extract(a.before, tmp / "before"),
                 "after": REPO}
        runs = {"before": {"shapes": [], "step": []}, "after": {"shapes": [], "step": []}}
        if a.only != "step":
            for rnd in range(a.rounds):
                for tree in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                    runs[tree]["shapes"].append(_run_worker(roots[tree], "shapes", a, tmp, f"{tree}-{rnd}"))
        if a.only != "shapes":
            for tree in ("before", "after"):
                runs[tree]["step"] = _run_worker(roots[tree], "step", a, tmp, f"{tree}-step")["step"]
    shapes, steps = compare(runs, a.tolerance)
    device = "cpu (interpreter)" if a.smoke else __import__("torch").cuda.get_device_name()
    doc = {
        "benchmark": "kernel_compare", "smoke": a.smoke, "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "before": {"name": a.before or a.before_dir, "commit": _git("rev-parse", a.before) if a.before else None},
        "after": {"name": "working tree", "commit": _git("rev-parse", "HEAD"),
                  "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))},
        "rounds": a.rounds, "tolerance": a.tolerance, "shapes": shapes, "steps": steps, "runs": runs,
        "wall_s": time.time() - t0,
    }
    from lrattnres.io import atomic_write_text

    stem = a.stem + ("_smoke" if a.smoke else "")
    atomic_write_text(out / f"{stem}.json", json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write_text(out / f"{stem}.md", markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
