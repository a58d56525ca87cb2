"""Full production training-step throughput: baseline vs AttnRes vs LR-AttnRes, reference vs fused router.

What one timed update is (the trainer's own code path, ``lrattnres.train.loop``):
host-to-device copy of ``grad_accum`` micro-batches of ``micro_batch x seq_len`` random tokens with
synthetic document boundaries (document masking on), bf16 autocast forward, CE + z-loss (1e-5),
backward, gradient accumulation, clipping at 1.0 (pre-clip norm read back), Muon (bf16
Newton-Schulz) + fused AdamW, zero_grad, CUDA synchronise.  The model is ``torch.compile``d
(``dynamic=False``).  Compilation and warm-up updates are excluded; every config starts from the
same seed, so the shared backbone weights are identical.

Configs (``--configs``, in this order by default):
  baseline         the same backbone, PreNorm residual sum, no routing
  lr-fused         LR-AttnRes, N = --blocks, r = d/4, kernels.attnres (compiled: the triton_op that
                   Inductor launches from its own code)
  attnres-fused    AttnRes, N = --blocks, r = d, kernels.attnres
  lr-ref           LR-AttnRes with the reference router (lrattnres.routing.route)
  attnres-ref      AttnRes with the reference router
  lr-fused-op, attnres-fused-op   the fused kernels behind the opaque custom op (kernels.Settings compiled_path "op")

Goal: on one H200 with the 1B preset, lr-fused >= 90% of baseline tokens/s and >= 62,000
tokens/s.

Run (about 8 minutes at the default settings; results are written after every config, so a cut-off
run still leaves the finished rows):

    python benchmarks/train_step_bench.py --out "$OUT"            # GPU: 1B, mb 2 x 2048, accum 16
    python benchmarks/train_step_bench.py --out "$OUT" --configs baseline,lr-fused --grad-accum 64   # paper's accum
    python benchmarks/train_step_bench.py --smoke --out /tmp/x    # CPU check: tiny shapes, 2 updates

Writes ``train_step_bench.json`` (device, versions, date, settings, one row per config, peak
memory, ratios to the baseline) and ``train_step_bench.md`` (the table) to ``--out``
(``train_step_bench_smoke.*`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from collections import namedtuple  # noqa: E402

Batch = namedtuple("Batch", "inputs targets doc_ids")  # the fields the trainer reads (lrattnres.data.Batch)

CONFIGS = {
    "baseline": {"method": "baseline", "router": "reference"},
    "lr-fused": {"method": "lr", "router": "fused", "rank": "d/4"},
    "attnres-fused": {"method": "attnres", "router": "fused", "rank": "d"},
    "lr-ref": {"method": "lr", "router": "reference", "rank": "d/4"},
    "attnres-ref": {"method": "attnres", "router": "reference", "rank": "d"},
    # the fused kernels behind the opaque custom op in the compiled graph (the earlier compiled path)
    "lr-fused-op": {"method": "lr", "router": "fused", "rank": "d/4", "compiled_path": "op"},
    "attnres-fused-op": {"method": "attnres", "router": "fused", "rank": "d", "compiled_path": "op"},
}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 updates, CPU if no GPU (checks the script)")
    p.add_argument("--preset", default="1B")
    p.add_argument("--vocab", type=int, default=100277)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--blocks", default="8", help="routing blocks N ('full' or an int)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=16,
                   help="micro-batches per update (the paper: 64; 16 keeps a 5-config run under 8 minutes "
                        "while amortising the optimiser step)")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates after compilation")
    p.add_argument("--updates", type=int, default=5, help="timed updates")
    p.add_argument("--mean-doc-len", type=float, default=1000.0, help="mean synthetic document length (geometric)")
    p.add_argument("--attention", default="auto")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--force-compile", action="store_true", help="compile on the CPU too (to check the compiled path)")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True), as the paper")
    p.add_argument("--budget-s", type=float, default=450.0, help="start no new config after this many seconds")
    p.add_argument("--profile", default="baseline,lr-fused,attnres-fused",
                   help="configs to profile for one extra update after timing (torch.profiler; '' for none): "
                        "where the time goes, as the top kernels by device time (attnres-fused: its 2026-11-29 "
                        "update took 0.21 s longer than lr-fused's although the kernel times the same at r = d and d/4)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--host-profile", default="",
                   help="configs to run for one more update under cProfile: where the host's time goes "
                        "(the Python launch path of a step the host cannot keep ahead of)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    p.add_argument("--stem", default="train_step_bench", help="output file name stem")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write one table (--stem in --out) from these recorded runs of equal settings; runs nothing")
    p.add_argument("--merge-note", default="", help="with --merge: how the runs relate (recorded in the output)")
    p.add_argument("--merge-commit", default=None, help="with --merge: the commit the runs measured, where their "
                   "own git field is wrong (each run's field is kept under merged_from)")
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.vocab, a.seq_len, a.micro_batch, a.grad_accum = "smoke", 1000, 64, 2, 2
        a.warmup, a.updates, a.blocks, a.mean_doc_len = 1, 2, "2", 20.0
    return a


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _batches(n, B, T, V, mean_doc, gen):
    """Random tokens [B, T+1]; doc_ids from geometric document lengths (new doc after each 'EOT')."""
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T + 1), generator=gen)
        ends = torch.rand(B, T, generator=gen) < (1.0 / mean_doc)
        doc = torch.cumsum(ends.int(), dim=1, dtype=torch.int32) - ends.int()
        out.append(Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous(), doc.contiguous()))
    return out


def _names(csv: str) -> list[str]:
    return [n.strip() for n in csv.split(",") if n.strip()]


# Kernel-name classes for the profile's summary, first match wins (lower-case substrings).
CATEGORIES = (
    ("routing kernel", ("_attnres_",)),
    ("attention", ("flash", "cudnn", "sdpa", "flex", "fmha", "attention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "wgmma", "sm90_", "splitk")),
    ("inductor fused", ("triton_",)),
    ("optimizer", ("muon", "adam", "foreach", "multi_tensor")),
    ("torch elementwise/reduce", ("at::native", "elementwise", "reduce_kernel")),
)


def _category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def _profile(update, device, top: int) -> dict:
    """One more update under torch.profiler: the top kernels (or CPU ops) by self device time,
    device time per kernel class (CATEGORIES), and the routing kernels' launch shapes."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    try:
        import kernels.launch as launch
    except ImportError:  # pragma: no cover
        launch = None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    seen = Counter(launch.CALLS) if launch is not None else None
    with profile(activities=acts) as prof:
        update()
    stats = (Counter(launch.CALLS) - seen) if launch is not None else None
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if device.type == "cuda":
        # device kernels only: an operator's self device time repeats its kernels' (counted twice)
        from torch.autograd import DeviceType

        events = [e for e in events if e.device_type == DeviceType.CUDA]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    cats: dict = {}
    for e in events:
        c = cats.setdefault(_category(e.key), {"ms": 0.0, "calls": 0})
        c["ms"] += getattr(e, attr) / 1e3
        c["calls"] += e.count
    launches = [{"kind": k[0], "S": k[1], "tokens": k[2], "d": k[3], "r": k[4], "align": k[5], "count": n}
                for k, n in sorted((stats or {}).items())]
    return {
        "by": attr, "total_ms": total / 1e3,
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["ms"])),
        "routing_launches": launches,
        "top": [{"name": e.key[:160], "ms": getattr(e, attr) / 1e3, "share": getattr(e, attr) / max(total, 1e-9),
                 "calls": e.count} for e in events[:top]],
    }


def run_config(name, a, device):
    from lrattnres.model import build_model
    from lrattnres.presets import get_preset
    from lrattnres.train.loop import LossModule, accumulate_gradients, apply_update
    from lrattnres.train.optim import build_optimizers
    from lrattnres.train.spec import resolve

    c = CONFIGS[name]
    shape = get_preset(a.preset)
    d = shape["d_model"]
    m = {"preset": a.preset, "vocab_size": a.vocab, "method": c["method"], "router": c["router"],
         "attention": a.attention, "max_seq_len": max(a.seq_len, shape["max_seq_len"])}
    if c["method"] != "baseline":
        m["blocks"] = a.blocks if a.blocks == "full" else int(a.blocks)
        m["rank"] = d if c["rank"] == "d" else d // 4
    spec = resolve({"model": m, "steps": 1, "micro_batch": a.micro_batch, "seq_len": a.seq_len,
                    "grad_accum": a.grad_accum, "precision": "bf16" if device.type == "cuda" else "fp32"})
    torch.manual_seed(a.seed)
    with torch.device(device):  # initialise on the GPU: same seed, same backbone weights in every config
        model = build_model(m)
    n_params = model.num_parameters()
    opts = build_optimizers(model, spec["optim"], device.type)
    params = [p for p in model.parameters() if p.requires_grad]
    lm = LossModule(model, spec["precision"])
    compile_ = (device.type == "cuda" or a.force_compile) and not a.no_compile
    kernel_settings = None
    if c["router"] == "fused":
        import functools

        import kernels

        kernel_settings = kernels.DEFAULT.replace(compiled_path=c.get("compiled_path", "triton_op"))
        router = functools.partial(kernels.attnres, settings=kernel_settings)
        model._fused_router = lambda device: router  # this configuration's settings in every read
    fwd = torch.compile(lm, dynamic=False, fullgraph=a.fullgraph) if compile_ else lm
    from lrattnres.attention import warn_compiled_flex

    warn_compiled_flex(a.attention, device, compile_)
    gen = torch.Generator().manual_seed(a.seed + 1)

    split = []  # (forward/backward/clip seconds, optimiser seconds) per update

    def update():
        t = time.perf_counter()
        batches = _batches(a.grad_accum, a.micro_batch, a.seq_len, a.vocab, a.mean_doc_len, gen)
        ce, zl, gn = accumulate_gradients(fwd, lm, batches, params, device, spec["z_loss"], spec["grad_clip"])
        t_mid = time.perf_counter()  # accumulate_gradients ends with a host sync (loss and norm read back)
        apply_update(opts, device)  # ends with torch.cuda.synchronize
        split.append((t_mid - t, time.perf_counter() - t_mid))
        return ce, zl, gn

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    first = update()  # compilation happens here
    compile_s = time.perf_counter() - t0
    for _ in range(a.warmup):
        update()
    times, losses = [], []
    for _ in range(a.updates):
        t = time.perf_counter()
        ce, zl, gn = update()
        times.append(time.perf_counter() - t)
        losses.append(ce + zl)
    profile = _profile(update, device, a.profile_top) if name in _names(a.profile) else None
    host_profile = None
    if name in _names(a.host_profile):
        from host_overhead import cprofile_top  # benchmarks/host_overhead.py, beside this script

        host_profile = cprofile_top(update, 1, top=30)
    tok = a.grad_accum * a.micro_batch * a.seq_len
    mean_t = sum(times) / len(times)
    sd = math.sqrt(sum((x - mean_t) ** 2 for x in times) / max(1, len(times) - 1))
    row = {
        "config": name, "method": c["method"], "router": c["router"] if c["method"] != "baseline" else None,
        "rank": m.get("rank"), "blocks": m.get("blocks"), "parameters": n_params,
        "tokens_per_update": tok, "update_s": times, "update_s_mean": mean_t, "update_s_cv": sd / mean_t,
        "tokens_per_s": tok / mean_t, "first_update_s": compile_s,
        "fwd_bwd_clip_s_mean": sum(x[0] for x in split[-a.updates:]) / a.updates,
        "optimizer_s_mean": sum(x[1] for x in split[-a.updates:]) / a.updates, "loss_first": first[0] + first[1],
        "loss_last": losses[-1], "finite": all(math.isfinite(x) for x in losses),
    }
    if profile is not None:
        row["profile"] = profile
    if host_profile is not None:
        row["host_profile"] = host_profile
    if kernel_settings is not None:
        from kernels import dispatch

        row["compiled_path"] = kernel_settings.compiled_path if compile_ else None
        row["kernel_configs"] = dispatch.tuned_configs()  # the table kernels' autotuned choices
        lay = {k: dispatch.layout(k, d, m.get("rank"), kernel_settings) for k in ("fwd", "bwd")}
        row["args_kernel_configs"] = {k: dict(dispatch.args_config(k, *lay[k], (), kernel_settings), layout=lay[k])
                                      for k in ("fwd", "bwd")}
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    del fwd, lm, opts, params, model
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _router(row) -> str:
    """The router, and for the fused one how a compiled graph reaches the kernels."""
    if not row["router"]:
        return "-"
    return row["router"] + (f" ({row['compiled_path']})" if row.get("compiled_path") else "")


def _table(rows) -> str:
    lines = ["| config | method | router | r | N | tokens/s | vs baseline | update s (cv) | of which optimiser s "
             "| peak GiB | first update s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error'][:80]} ||||||||||")
            continue
        rel = f"{100 * r['vs_baseline']:.1f}%" if r.get("vs_baseline") else "-"
        lines.append(
            f"| {r['config']} | {r['method']} | {_router(r)} | {r['rank'] or '-'} | {r['blocks'] or '-'} | "
            f"{r['tokens_per_s']:,.0f} | {rel} | {r['update_s_mean']:.3f} ({100 * r['update_s_cv']:.1f}%) | "
            f"{r['optimizer_s_mean']:.3f} | "
            f"{r.get('peak_allocated_gib', float('nan')):.1f} | {r['first_update_s']:.1f} |")
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        lines += ["", f"Where one update of {r['config']} spends device time ({prof['total_ms']:.1f} ms, "
                  f"{prof['by']}, top {min(10, len(prof['top']))}):", "", "| kernel / op | ms | share | calls |",
                  "|---|---|---|---|"]
        for e in prof["top"][:10]:
            lines.append(f"| {e['name'][:90].replace('|', '/')} | {e['ms']:.2f} | {100 * e['share']:.1f}% | {e['calls']} |")
        if prof.get("categories"):
            lines += ["", f"By kernel class ({r['config']}):", "", "| class | ms | calls |", "|---|---|---|"]
            for cat, v in prof["categories"].items():
                lines.append(f"| {cat} | {v['ms']:.2f} | {v['calls']} |")
    return "\n".join(lines) + "\n"


def _finish(doc: dict) -> None:
    """Ratios to the baseline row, and the goal (module docstring)."""
    base = next((r for r in doc["rows"] if r["config"] == "baseline" and "error" not in r), None)
    for r in doc["rows"]:
        r.pop("vs_baseline", None)
        if base and "error" not in r:
            r["vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
    lr = next((r for r in doc["rows"] if r["config"] == "lr-fused" and "error" not in r), None)
    if lr and base:
        doc["goal"]["lr_fused_vs_baseline"] = lr["vs_baseline"]
        doc["goal"]["lr_fused_tokens_per_s"] = lr["tokens_per_s"]
        doc["goal"]["met"] = bool(lr["vs_baseline"] >= 0.90 and lr["tokens_per_s"] >= 62000)


def _write(doc: dict, out: Path, stem: str) -> None:
    """``stem``.json and ``stem``.md, each written atomically."""
    _finish(doc)
    st = doc["settings"]
    md = (f"# Training-step throughput ({doc['device']}, {st['preset']}, mb {st['micro_batch']} x {st['seq_len']}, "
          f"accum {st['grad_accum']}, attention {st['attention']}, {doc['date']})\n\n"
          + ("Smoke run: checks that the script works; the numbers mean nothing.\n\n" if doc.get("smoke") else "")
          + "".join(f"- rows {', '.join(m['configs'])}: {m['file']} ({m['date']}, {m['note']})\n"
                    for m in doc.get("merged_from", []))
          + ("\n" if doc.get("merged_from") else "")
          + _table(doc["rows"]))
    from lrattnres.io import atomic_write_text

    for name, text in ((f"{stem}.json", json.dumps(doc, indent=2) + "\n"), (f"{stem}.md", md)):
        atomic_write_text(out / name, text)


# Settings that may differ between merged runs (which configs, the budget, what was profiled).
_MERGE_FREE = {"configs", "stem", "budget_s", "profile", "profile_top", "host_profile"}


def merge(paths: list[str], out: Path, stem: str, note: str, commit: str | None = None) -> dict:
    """One table from runs of the same settings (e.g. two runs at once, one GPU each): rows in
    order, ratios against the first file's baseline.  Refuses runs whose settings differ."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    ref = {k: v for k, v in docs[0]["settings"].items() if k not in _MERGE_FREE}
    for p, d in zip(paths[1:], docs[1:]):
        diff = {k for k in set(ref) | set(d["settings"]) if k not in _MERGE_FREE
                and d["settings"].get(k) != ref.get(k)}
        if diff:
            raise SystemExit(f"{p}: settings differ from {paths[0]} in {sorted(diff)}")
    doc = dict(docs[0])
    doc["rows"] = [r for d in docs for r in d["rows"]]
    doc["skipped"] = [x for d in docs for x in d.get("skipped", [])]
    doc["merged_from"] = [{"file": os.path.basename(p), "date": d["date"], "git": d.get("git"), "note": note,
                           "configs": [r["config"] for r in d["rows"]]} for p, d in zip(paths, docs)]
    if commit:  # the runs' own git field may be wrong (a copied tree with a stale .git)
        doc["git"] = {"commit": commit, "dirty": None, "named_by": "--merge-commit"}
    out.mkdir(parents=True, exist_ok=True)
    _write(doc, out, stem)
    return doc


def main(argv=None) -> int:
    from lrattnres.provenance import git_state

    a = _args(argv)
    if a.merge:
        doc = merge(a.merge, Path(a.out), a.stem, a.merge_note, a.merge_commit)
        print(_table(doc["rows"]))
        return 0
    t_start = time.perf_counter()
    if a.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = _names(a.configs)
    for n in names:
        if n not in CONFIGS:
            print(f"unknown config {n!r}; expected some of {list(CONFIGS)}", file=sys.stderr)
            return 2
    doc = {
        "benchmark": "train_step", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {platform.machine()}",
        "host": platform.node(), "versions": _versions(), "git": git_state(), "smoke": a.smoke,
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "goal": {"lr_fused_vs_baseline_min": 0.90, "lr_fused_tokens_per_s_min": 62000, "applies_to": "1B on one H200"},
        "rows": [], "skipped": [],
    }
    try:
        from lrattnres.attention import resolve_backend

        doc["attention_backend"] = resolve_backend(a.attention, device, torch.bfloat16)
        doc["attention_note"] = ("'auto' is masked SDPA on every device; 'flex' compiled on CUDA has gradients under "
                                 "investigation (lrattnres.attention, docs/attention.md)")
    except Exception as e:  # pragma: no cover
        doc["attention_backend"] = f"unknown ({e})"
    try:
        import kernels  # noqa: F401

        doc["kernels_import"] = True
    except Exception as e:
        doc["kernels_import"] = f"{type(e).__name__}: {e}"

    def write():
        doc["wall_s"] = time.perf_counter() - t_start
        _write(doc, out, a.stem + ("_smoke" if a.smoke else ""))

    longest = 0.0
    for n in names:
        elapsed = time.perf_counter() - t_start
        if elapsed + longest > a.budget_s:
            doc["skipped"].append({"config": n, "why": f"time budget {a.budget_s}s ({elapsed:.0f}s used)"})
            print(f"[bench] skip {n}: budget", file=sys.stderr)
            continue
        t = time.perf_counter()
        print(f"[bench] {n} ...", file=sys.stderr, flush=True)
        try:
            row = run_config(n, a, device)
        except Exception as e:  # keep the other rows
            import traceback

            traceback.print_exc()
            row = {"config": n, "error": f"{type(e).__name__}: {e}"}
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        longest = max(longest, time.perf_counter() - t)
        doc["rows"].append(row)
        if "error" not in row:
            print(f"[bench] {n}: {row['tokens_per_s']:,.0f} tokens/s, first update {row['first_update_s']:.1f}s",
                  file=sys.stderr, flush=True)
        write()
    write()
    print(_table(doc["rows"]))
    return 0 if all("error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
