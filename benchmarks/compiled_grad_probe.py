"""Where the compiled flex attention's gradients go wrong: gradient checks per variant, then trainings.

A compiled training step with flex attention computed wrong gradients on CUDA with the tensor-op
block mask traced into the model's graph (docs/attention.md; the recorded run of this probe,
benchmarks/results/compiled_grad_probe_h200_2026-12-05.json, found it); the flex path now traces
``create_block_mask`` there.  lrattnres.attention selects a variant of the flex path for each
candidate cause (``LRATTNRES_FLEX_VARIANT``): the strided q/k/v views the model passes, the
tensor-op mask, flex compiled into the model's graph at all.  This probe runs, on one CUDA
machine, in one command:

1. ``grads`` (minutes; isolates the cause even if the trainings do not finish): for each variant,
   one process checks the compiled training step against the eager one, parameter by parameter,
   against an fp64 reference (lrattnres/compiled_grads.py: compiled error <= 4 x eager error + a
   floor), at initialisation and after the weights moved, for ``--grad-methods`` in fp32 and bf16,
   on the gpu-small shape with ``--grad-layers`` layers.  A variant that crashes its process (an
   illegal memory access) is recorded with its exit status.
2. ``train``: the 150-update runs of the gpu scale's spec for gpu-small (config.yaml, scale gpu:
   the baseline, LR-AttnRes N = 8, r = 48 and AttnRes N = 8 of the ``seeds`` piece, ``steps``
   150, nothing else changed but what a row names), compiled with the default attention (masked
   SDPA) and with each flex variant, and eager (``compile: false``), at Muon/Adam 0.005/0.001 and
   0.02/0.003; ``--parallel`` at a time, each its own ``python -m lrattnres train`` process, in
   the order of :func:`plan_runs` (the default attention and eager first), until ``--budget-s``.
   Every run stops at the budget (``LRATTNRES_DEADLINE``: a checkpoint, exit 75), so a cut run
   still gives its largest gradient norm so far.  Per run: the largest pre-clip gradient norm, the
   first update above 10, the trainer's gradient-norm outliers (lrattnres/train/guard.py), the
   final validation CE.

Data: ``--data`` the gpu scale's manifest (results/gpu/data/manifest.json; the data stage builds it
from the Debian documentation pack), else synthetic documents made here (random sentences over a
Zipfian vocabulary, prepared by the data stage: the validation CE is then not comparable with the
gpu scale's, the gradient norms are).

    python benchmarks/compiled_grad_probe.py --out OUT --data results/gpu/data/manifest.json
    python benchmarks/compiled_grad_probe.py --out OUT                           # synthetic documents
    python benchmarks/compiled_grad_probe.py --out OUT --stages grads             # the checks alone
    python benchmarks/compiled_grad_probe.py --smoke --out /tmp/x                 # CPU check of the script

Writes ``compiled_grad_probe_<gpu>_<date>.json`` (device, versions, commit, settings, every check
and run) and ``.md`` (the tables) to ``--out``, after every finished check and run.

Time on one H200, estimated from this project's measurements (docs/results.md, benchmarks/README.md),
not measured for this script: a gpu-small training process compiles in 12-83 s with others compiling
beside it, and 150 updates of 16,384 tokens take about 19 s with seven processes side by side
(132k tokens/s each); eager runs compile nothing.  The ``grads`` stage runs its five variant
processes at once, each four cases of a 2-layer model of gpu-small's width (a compile of 15-30 s and
about 10 s of measuring each): 2-3 minutes, cut at ``--grad-timeout-s`` (240 s).  The ``train``
stage then starts ``--parallel`` (9) processes, each 2-3 minutes from start to result (compiling
beside eight others, 150 updates, the final validation, the checkpoint): with the default budget of
540 s its first nine runs finish, the default attention at both learning rates and eager beside it
at the higher ones (:func:`plan_runs`); the next are cut at the budget or not started, and the JSON
says which.  ``--stages train --lrs 0.005/0.001 --train-variants eager,flex,flex-contiguous`` and
``--train-variants flex-outside,flex-tensor_mask`` run the rest in commands of their own.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The ways the probe runs the model: attention, compiled or not, LRATTNRES_FLEX_VARIANT.
VARIANTS = {
    "sdpa": {"attention": "auto", "compile": True, "flex_variant": "",
             "what": "the default attention (masked SDPA), compiled"},
    "flex": {"attention": "flex", "compile": True, "flex_variant": "",
             "what": "flex in the compiled graph, its mask from create_block_mask (the default flex path)"},
    "flex-contiguous": {"attention": "flex", "compile": True, "flex_variant": "contiguous",
                        "what": "as flex, with q, k, v made contiguous first"},
    "flex-tensor_mask": {"attention": "flex", "compile": True, "flex_variant": "tensor_mask",
                         "what": "as flex, with the tensor-op document_block_mask (the path measured wrong)"},
    "flex-outside": {"attention": "flex", "compile": True, "flex_variant": "outside",
                     "what": "flex compiled on its own outside the model's graph (a graph break per call)"},
    "eager": {"attention": "auto", "compile": False, "flex_variant": "",
              "what": "compile: false, the default attention (masked SDPA)"},
}
GRAD_VARIANTS = ("sdpa", "flex", "flex-contiguous", "flex-tensor_mask", "flex-outside")
# The gpu scale's runs of the `seeds` piece that stand for each method.
METHOD_RUNS = {"baseline": "gpu-small-baseline-s0", "lr": "gpu-small-lr-n8-r48-s0",
               "attnres": "gpu-small-attnres-n8-r384-s0"}
DEFAULT_LRS = "0.005/0.001,0.02/0.003"
NORM_BOUND = 10.0  # the bound at Muon/Adam 0.005/0.001: every run's largest norm below it
EXIT_MEANING = {0: "done", 3: "stopped: non-finite loss or gradient norm", 75: "stopped at the budget (checkpoint)"}


# ----------------------------------------------------------------------------------------- arguments


def _names(csv: str, known, what: str) -> list[str]:
    names = [n.strip() for n in csv.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--{what}: unknown {unknown}; expected some of {list(known)}")
    return names


def parse_lrs(text: str) -> list[tuple[float, float]]:
    """"0.005/0.001,0.02/0.003" -> [(muon, adam), ...]; anything else is an error naming the item."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split("/")
        try:
            muon, adam = (float(p) for p in parts)
        except ValueError:
            raise SystemExit(f"--lrs: {item!r} is not MUON/ADAM (e.g. 0.005/0.001)") from None
        if not (muon > 0 and adam > 0):
            raise SystemExit(f"--lrs: {item!r}: learning rates must be positive")
        out.append((muon, adam))
    if not out:
        raise SystemExit("--lrs: expected at least one MUON/ADAM pair")
    return out


def lr_label(lrs: tuple[float, float]) -> str:
    return f"{lrs[0]:g}/{lrs[1]:g}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for compiled_grad_probe_<gpu>_<date>.{json,md}")
    p.add_argument("--data", default=None, help="a data manifest (the gpu scale's: results/gpu/data/manifest.json); "
                                                "default: synthetic documents made here")
    p.add_argument("--stages", default="grads,train")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole command's time, start to last write")
    p.add_argument("--grad-variants", default=",".join(GRAD_VARIANTS))
    p.add_argument("--grad-methods", default="baseline,lr")
    p.add_argument("--grad-precisions", default="fp32,bf16")
    p.add_argument("--grad-layers", type=int, default=2, help="layers of the gpu-small shape in the gradient checks")
    p.add_argument("--grad-micro-batch", type=int, default=4)
    p.add_argument("--grad-timeout-s", type=float, default=240.0, help="the gradient stage's time, all variants at once")
    p.add_argument("--train-variants", default="sdpa,eager,flex,flex-contiguous,flex-outside,flex-tensor_mask")
    p.add_argument("--methods", default="baseline,lr,attnres", help="the training stage's methods")
    p.add_argument("--lrs", default=DEFAULT_LRS, help="Muon/Adam learning rates of the trainings")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--parallel", type=int, default=9, help="training processes at once on the GPU")
    p.add_argument("--min-run-s", type=float, default=120.0,
                   help="start no training with less than this much of the budget left")
    p.add_argument("--stem", default=None, help="output name (default compiled_grad_probe_<gpu>_<date>)")
    p.add_argument("--work", default=None, help="folder for the runs, their logs and the synthetic corpus "
                                                "(default: a new temporary folder)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check: tiny model and corpus, eager trainings of 3 updates, one gradient check")
    p.add_argument("--grads-worker", default=None, help=argparse.SUPPRESS)  # internal: one variant's checks
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.stage_list = _names(a.stages, ("grads", "train"), "stages")
    a.grad_variant_list = _names(a.grad_variants, GRAD_VARIANTS, "grad-variants")
    a.grad_method_list = _names(a.grad_methods, METHOD_RUNS, "grad-methods")
    a.grad_precision_list = _names(a.grad_precisions, ("fp32", "bf16"), "grad-precisions")
    a.train_variant_list = _names(a.train_variants, VARIANTS, "train-variants")
    a.method_list = _names(a.methods, METHOD_RUNS, "methods")
    a.lr_list = parse_lrs(a.lrs)
    for k in ("steps", "parallel", "grad_layers", "grad_micro_batch"):
        if getattr(a, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')}: expected a positive int, got {getattr(a, k)}")
    if a.smoke:
        a.grad_variant_list, a.grad_method_list, a.grad_precision_list = ["sdpa"], ["lr"], ["fp32"]
        a.train_variant_list = [v for v in a.train_variant_list if v in ("sdpa", "eager")] or ["eager"]
        a.method_list, a.lr_list, a.steps = a.method_list[:2], a.lr_list[:1], min(a.steps, 3)
    return a


# ---------------------------------------------------------------------------------------- the plan


def _priority(variant: str, lr_index: int) -> int:
    """0: what the default attention must show (its runs at every learning rate, and eager beside it
    at the higher ones); 1: eager and flex at the first learning rates; 2: the rest."""
    if variant == "sdpa" or (variant == "eager" and lr_index > 0):
        return 0
    if variant in ("eager", "flex") and lr_index == 0:
        return 1
    return 2


def plan_runs(methods: list[str], variants: list[str], lrs: list[tuple[float, float]]) -> list[dict]:
    """Every (learning rates, variant, method) run, most telling first (:func:`_priority`; then by
    learning rates, variant and method as given): the default attention at each learning rate and
    eager beside it at the higher ones, then eager and flex at the first, then the other variants."""
    runs = [{"method": m, "variant": v, "lrs": lr, "name": f"{m}-{v}-{lr_label(lr).replace('/', '_')}",
             "_key": (_priority(v, li), li, vi, mi)}
            for li, lr in enumerate(lrs) for vi, v in enumerate(variants) for mi, m in enumerate(methods)]
    runs.sort(key=lambda r: r["_key"])
    for r in runs:
        del r["_key"]
    return runs


def train_spec(settings: dict, method: str, variant: str, lrs: tuple[float, float], steps: int,
               smoke: bool = False) -> dict:
    """The gpu scale's training spec of ``method``'s run, with ``steps`` updates, the learning rates,
    the variant's attention and compilation; validation at the end only, no periodic checkpoint."""
    from lrattnres.gridplan import plan, train_spec as grid_spec

    runs = {r.run_id: r for r in plan(settings)}
    run_id = METHOD_RUNS[method]
    if smoke:  # the smoke scale's run of the method
        run_id = next(r for r in runs if r.startswith(f"smoke-{method}-") and r.endswith("-s0"))
    spec = grid_spec(settings, runs[run_id])
    spec.pop("tokens", None)
    spec["steps"] = steps
    spec["optim"] = {**spec.get("optim", {}), "muon": {**spec.get("optim", {}).get("muon", {}), "lr": lrs[0]},
                     "adam": {**spec.get("optim", {}).get("adam", {}), "lr": lrs[1]}}
    v = VARIANTS[variant]
    spec["model"] = {**spec["model"], "attention": v["attention"]}
    spec["compile"] = v["compile"] and not smoke
    spec["val"] = {**spec.get("val", {}), "every": 0, "final": True}
    spec["checkpoint"] = {"every": 0}
    spec["log_every_s"] = 15.0
    if smoke:
        spec.update(device="cpu", precision="fp32")
    return spec


# ------------------------------------------------------------------------------------- run records


def _float(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def read_run(folder: Path, exit_code: int | None) -> dict:
    """What one training run says: from metrics.jsonl (every update's pre-clip norm, the guard's
    records) and result.json where the run finished."""
    norms, ces, outliers = [], [], []
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if rec.get("kind") == "train":
                norms.append(_float(rec.get("grad_norm")))
                ces.append(_float(rec.get("ce")))
            elif rec.get("kind") == "grad_outlier":
                outliers.append({"update": rec.get("update"), "norm": _float(rec.get("norm")), "median": rec.get("median")})
    result = None
    if (folder / "result.json").is_file():
        result = json.loads((folder / "result.json").read_text(encoding="utf-8"))
    finite = [n for n in norms if math.isfinite(n)]
    nonfinite = next((e["update"] for e in outliers if not math.isfinite(e["norm"])), None)
    above = next((i for i, n in enumerate(norms) if not (n <= NORM_BOUND)), None)
    if above is None and nonfinite is not None:
        above = nonfinite
    rec = {
        "status": EXIT_MEANING.get(exit_code, "not started" if exit_code is None else f"failed (exit {exit_code})"),
        "exit_code": exit_code,
        "updates": len(norms),
        "max_grad_norm": (math.inf if nonfinite is not None else (max(finite) if finite else None)),
        "first_update_above_bound": above,
        "nonfinite_update": nonfinite,
        "outliers": len(outliers) if result is None else len((result.get("grad_norm") or {}).get("outliers") or []),
        "first_outliers": (outliers if result is None else (result.get("grad_norm") or {}).get("outliers") or [])[:5],
        "final_val_ce": None if result is None else result.get("final_val_ce"),
        "final_train_ce": None if result is None else result.get("final_train_ce"),
        "last_train_ce": ces[-1] if ces else None,
        "tokens_per_s": None if result is None else result.get("steady_tokens_per_s"),
        "attention": None if result is None else (result.get("provenance") or {}).get("attention"),
    }
    return rec


def criteria(runs: list[dict], lrs: list[tuple[float, float]]) -> dict:
    """The issue's reading of the trainings: at the first learning rates, is every run of the default
    attention finished with its largest norm below 10 (None while any has not finished)."""
    low = lr_label(lrs[0])
    default = [r for r in runs if r["variant"] == "sdpa" and r["lrs"] == low]
    done = [r for r in default if r["exit_code"] == 0]
    ok = None if not default or len(done) < len(default) else all(
        r["max_grad_norm"] is not None and r["max_grad_norm"] < NORM_BOUND for r in done)
    return {"default_attention_below_bound_at": low, "bound": NORM_BOUND, "holds": ok,
            "runs_finished": f"{len(done)} of {len(default)}"}


# --------------------------------------------------------------------------------------- outputs


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _fmt(x, spec=".3g") -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return format(x, spec) if math.isfinite(x) else str(x)
    return str(x)


def markdown(doc: dict) -> str:
    lines = [f"# Compiled-gradient probe ({doc['device']}, {doc['date']})", "",
             f"Data: {doc['data']}. Commit {str((doc['provenance'] or {}).get('commit'))[:12]}.", ""]
    if doc.get("grads"):
        lines += ["## Gradient checks: compiled against eager, relative L2 against fp64", "",
                  "| variant | method | precision | weights | pass | worst parameter | compiled err | eager err | "
                  "grad norm compiled / eager / fp64 |", "|---|---|---|---|---|---|---|---|---|"]
        for v, res in doc["grads"].items():
            if res.get("error"):
                lines.append(f"| {v} | error: {res['error'][:120]} ||||||||")
            for c in res.get("cases", []):
                if c.get("error"):
                    lines.append(f"| {v} | {c['method']} | {c['precision']} | | error: {c['error'][:100]} |||||")
                    continue
                for when in ("init", "moved"):
                    s = c[when]
                    lines.append(f"| {v} | {c['method']} | {c['precision']} | {when} | {'yes' if s['pass'] else 'NO'} | "
                                 f"{s['worst_param']} | {_fmt(s['worst_compiled'])} | {_fmt(s['worst_eager'])} | "
                                 f"{_fmt(s['compiled']['norm'])} / {_fmt(s['eager']['norm'])} / "
                                 f"{_fmt(s['reference']['norm'])} |")
        lines.append("")
    if doc.get("runs"):
        lines += [f"## Trainings: {doc['settings']['steps']} updates of the {doc.get('scale')} scale's spec", "",
                  "| lr (Muon/Adam) | variant | method | status | updates | largest norm | first update > 10 | "
                  "outliers | val CE |", "|---|---|---|---|---|---|---|---|---|"]
        for r in doc["runs"]:
            lines.append(f"| {r['lrs']} | {r['variant']} | {r['method']} | {r['status']} | {r['updates']} | "
                         f"{_fmt(r['max_grad_norm'])} | {_fmt(r['first_update_above_bound'])} | {r['outliers']} | "
                         f"{_fmt(r['final_val_ce'], '.4f')} |")
        c = doc.get("criteria") or {}
        lines += ["", f"Default attention at {c.get('default_attention_below_bound_at')}: every run's largest norm "
                      f"below {c.get('bound')}: {c.get('holds')} ({c.get('runs_finished')} finished)."]
    return "\n".join(lines) + "\n"


def write(doc: dict, out: Path, stem: str) -> None:
    from lrattnres.io import atomic_write_text

    atomic_write_text(out / f"{stem}.json", json.dumps(_json_safe(doc), indent=2) + "\n")
    atomic_write_text(out / f"{stem}.md", markdown(doc))


def gpu_word(name: str) -> str:
    """"NVIDIA H200" -> "h200" (as run_gpu_benchmarks.sh names results)."""
    n = name.lower().removeprefix("nvidia ")
    return re.sub(r"[^a-z0-9]+", "-", n).strip("-") or "gpu"


# ------------------------------------------------------------------------------ stage 1: the checks


def grads_worker(a) -> int:
    """One variant's gradient checks in this process (started by the probe); writes --worker-out
    after every case."""
    import torch

    from lrattnres import compiled_grads as cg
    from lrattnres.attention import set_flex_variant
    from lrattnres.model import build_model
    from lrattnres.presets import get_preset

    v = VARIANTS[a.grads_worker]
    set_flex_variant(v["flex_variant"])
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if a.smoke:
        shape, seq, mb, backend = cg.CPU_SHAPE, 64, 2, "aot_eager"
    else:
        shape = {**get_preset("gpu-small"), "n_layers": a.grad_layers, "vocab_size": 32768}
        seq, mb, backend = 512, a.grad_micro_batch, "inductor"
    out = {"variant": a.grads_worker, "what": v["what"], "shape": shape, "seq_len": seq, "micro_batch": mb,
           "compile_backend": backend, "cases": []}
    for method in a.grad_method_list:
        for precision in a.grad_precision_list:
            case = {"method": method, "precision": precision}
            t0 = time.perf_counter()
            try:
                torch._dynamo.reset()
                torch.manual_seed(0)
                over = {} if method == "baseline" else {"blocks": min(8, 2 * shape["n_layers"]),
                                                        "rank": shape["d_model"] if method == "attnres" else shape["d_model"] // 8}
                with torch.device(device):
                    model = build_model(cg.model_spec(method, v["attention"], shape, **over))
                batches = cg.document_batches(2, mb, seq, shape["vocab_size"], 150.0, seed=1)
                init = cg.measure(model, batches, device, precision, backend=backend)
                cg.move_weights(model, cg.document_batches(3, mb, seq, shape["vocab_size"], 150.0, seed=2), device)
                moved = cg.measure(model, batches, device, precision, fwd_compiled=init["fwd_compiled"])
                case.update(init=cg.summary(init, precision), moved=cg.summary(moved, precision))
            except Exception as e:  # keep the other cases
                import traceback

                traceback.print_exc()
                case["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            case["seconds"] = time.perf_counter() - t0
            out["cases"].append(case)
            Path(a.worker_out).write_text(json.dumps(_json_safe(out), indent=1))
            print(f"[probe] {a.grads_worker} {method} {precision}: "
                  + ("error" if "error" in case else f"init {case['init']['pass']}, moved {case['moved']['pass']}")
                  + f" ({case['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return 0


def run_grads(a, work: Path, deadline: float, on_update) -> dict:
    """One worker process per variant, all at once; their results as they finish."""
    procs = {}
    for v in a.grad_variant_list:
        res = work / f"grads-{v}.json"
        cmd = [sys.executable, __file__, "--out", str(work), "--grads-worker", v, "--worker-out", str(res),
               "--grad-methods", ",".join(a.grad_method_list), "--grad-precisions", ",".join(a.grad_precision_list),
               "--grad-layers", str(a.grad_layers), "--grad-micro-batch", str(a.grad_micro_batch)] + (["--smoke"] if a.smoke else [])
        log = open(work / f"grads-{v}.log", "w", encoding="utf-8")
        env = {**os.environ, "LRATTNRES_FLEX_VARIANT": VARIANTS[v]["flex_variant"], "PYTHONPATH": str(REPO)}
        procs[v] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, res)
    results = {}
    end = min(deadline, time.time() + a.grad_timeout_s)
    while procs:
        for v, (proc, log, res) in list(procs.items()):
            code = proc.poll()
            if code is None and time.time() < end:
                continue
            if code is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                code = "timeout"
            log.close()
            got = json.loads(res.read_text()) if res.is_file() else {"variant": v, "cases": []}
            got["exit_code"] = code
            if code != 0:
                tail = (work / f"grads-{v}.log").read_text(encoding="utf-8", errors="replace")[-1500:]
                got["error"] = f"worker exit {code}: {tail.strip().splitlines()[-1] if tail.strip() else ''}"
                got["log_tail"] = tail
            results[v] = got
            del procs[v]
            on_update(results)
        time.sleep(1.0)
    return results


# --------------------------------------------------------------------------- stage 2: the trainings


def synthetic_manifest(work: Path, tokens: int, seed: int = 0) -> str:
    """A corpus of random sentences over a Zipfian vocabulary of made-up words, each word's successor
    often fixed (something to learn), prepared by the data stage; the manifest's path."""
    import random

    from lrattnres.data import prepare

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    follow = [rng.randrange(len(words)) for _ in words]
    src = work / "synthetic.jsonl"
    n_words = 0
    with open(src, "w", encoding="utf-8") as f:
        while n_words < tokens // 2:  # about two cl100k tokens per made-up word
            k = rng.choices(range(len(words)), weights)[0]
            doc = []
            for _ in range(int(rng.expovariate(1 / 300)) + 20):
                doc.append(words[k])
                k = follow[k] if rng.random() < 0.6 else rng.choices(range(len(words)), weights)[0]
            f.write(json.dumps({"text": " ".join(doc) + "."}) + "\n")
            n_words += len(doc)
    prepare({"source": "local", "local": {"glob": str(src)}, "val_tokens": max(tokens // 20, 2000),
             "shard_tokens": 50_000_000, "vocab": "compact"}, work / "data", progress=False)
    return str(work / "data" / "manifest.json")


def run_trainings(a, settings: dict, data: str, work: Path, deadline: float, on_update) -> list[dict]:
    """The planned runs, ``--parallel`` at a time, until the budget; every run's record."""
    planned = plan_runs(a.method_list, a.train_variant_list, a.lr_list)
    records = [{"name": r["name"], "method": r["method"], "variant": r["variant"], "lrs": lr_label(r["lrs"]),
                **read_run(work / "none", None)} for r in planned]
    threads = max(1, (os.cpu_count() or 2) // max(1, a.parallel))
    queue = list(range(len(planned)))
    running: dict[int, tuple] = {}
    while queue or running:
        while queue and len(running) < a.parallel and deadline - time.time() > a.min_run_s:
            i = queue.pop(0)
            r = planned[i]
            spec = train_spec(settings, r["method"], r["variant"], r["lrs"], a.steps, smoke=a.smoke)
            folder = work / "runs" / r["name"]
            folder.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "PYTHONPATH": str(REPO), "LRATTNRES_FLEX_VARIANT": VARIANTS[r["variant"]]["flex_variant"],
                   "LRATTNRES_DEADLINE": f"{deadline - 5:.0f}", "KERNELS_AUTOTUNE": "0",
                   "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", str(threads))}
            cmd = [sys.executable, "-m", "lrattnres", "train", "--spec", json.dumps(spec), "--data", data,
                   "--out", str(folder), "--threads", str(threads), "--no-progress", "--resume", "never"]
            log = open(work / "runs" / f"{r['name']}.log", "w", encoding="utf-8")
            running[i] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, time.time())
            records[i].update(status="running", spec=spec)
            print(f"[probe] started {r['name']}", file=sys.stderr, flush=True)
        if not running:
            break  # no time left to start the rest
        for i, (proc, log, t0) in list(running.items()):
            code = proc.poll()
            if code is None and time.time() < deadline + 30:
                continue
            if code is None:  # past the deadline and its checkpoint: stop it
                proc.terminate()
                try:
                    code = proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
            log.close()
            name = planned[i]["name"]
            records[i].update(read_run(work / "runs" / name, code), wall_s=time.time() - t0)
            del running[i]
            print(f"[probe] {name}: {records[i]['status']}, largest norm {_fmt(records[i]['max_grad_norm'])}",
                  file=sys.stderr, flush=True)
            on_update(records)
        time.sleep(2.0)
    for i in queue:
        records[i]["status"] = "not started: budget"
    return records


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.grads_worker:
        return grads_worker(a)
    t_start = time.time()
    deadline = t_start + a.budget_s
    import torch

    from lrattnres.config import load_and_resolve
    from lrattnres.provenance import now, provenance

    started = now()
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        print("compiled_grad_probe: no CUDA GPU visible (use --smoke for the CPU check of the script)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if cuda else f"cpu: {platform.machine()}"
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    stem = a.stem or (f"compiled_grad_probe_{gpu_word(device)}_{date}" if cuda else f"compiled_grad_probe_smoke_{date}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="grad_probe_"))
    work.mkdir(parents=True, exist_ok=True)
    settings = load_and_resolve(REPO / "config.yaml", {"scale": "smoke" if a.smoke else "gpu"})
    doc = {"benchmark": "compiled_grad_probe", "date": date, "device": device, "host": platform.node(),
           "scale": settings["scale"],
           "data": a.data or "synthetic documents (made here)", "work": str(work),
           "settings": {k: v for k, v in vars(a).items() if k not in ("out",)},
           "variants": {k: v for k, v in VARIANTS.items()}, "grads": {}, "runs": [], "criteria": None,
           "provenance": None}
    doc["settings"]["lr_list"] = [lr_label(x) for x in a.lr_list]

    def save():
        doc["wall_s"] = time.time() - t_start
        doc["provenance"] = provenance(doc["settings"], started=started)
        write(doc, out, stem)

    if "grads" in a.stage_list:
        print(f"[probe] gradient checks: {', '.join(a.grad_variant_list)}", file=sys.stderr, flush=True)
        run_grads(a, work, deadline, lambda res: (doc["grads"].update(res), save()))
    if "train" in a.stage_list:
        data = a.data
        if data is None:
            tokens = a.steps * 32 * 512 + 500_000 if not a.smoke else 20_000
            data = synthetic_manifest(work, tokens)
        print(f"[probe] trainings on {data}", file=sys.stderr, flush=True)

        def update(records):
            doc["runs"] = [{k: v for k, v in r.items() if k != "spec"} for r in records]
            doc["criteria"] = criteria(doc["runs"], a.lr_list)
            # the first run's spec; the others differ in their row's learning rates, attention, compile
            doc["train_spec"] = next((r["spec"] for r in records if "spec" in r), None)
            save()

        update(run_trainings(a, settings, data, work, deadline, update))
    save()
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
