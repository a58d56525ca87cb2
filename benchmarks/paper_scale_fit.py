"""Does the paper scale fit its GPUs? One rank's peak memory, the 4B checkpoint write, Appendix I on a
trained gpu-scale pair: measured on one GPU, beside the estimates the configuration is planned with.

Parts (``--parts``, any of them, in this order):

``memory``     For each size (``--presets``, default 0.5B 1B 4B) and its configurations (``--configs``:
               ``attnres``, r = d, with N = full at 0.5B, the sweep's widest routing, else N = 8; ``lr``,
               r = d/4, N = 8), one training rank of the paper scale's job exactly as config.yaml plans it
               (lrattnres/batch.py): its micro-batch of 2,048-token sequences, bf16, torch.compile, the
               trainer's own step (LossModule, accumulate_gradients, apply_update), Muon + AdamW over the
               parameters the rank owns (all of them replicated; rank 0's share of
               ZeroRedundancyOptimizer's partition over the job's GPUs where the size shards its optimiser
               state), two micro-batches per update (the peak does not grow with more), then a validation
               batch of the size's validation batch size. ``--checkpointing off on`` measures each
               configuration without and with activation checkpointing (its memory and its cost per
               update); ``--ddp`` wraps the model in DistributedDataParallel on a one-rank process group,
               as the job does (its gradient buckets stay allocated through validation). Records the peak
               allocated and reserved memory, the CUDA context, the time of a micro-batch and of the
               optimiser step, the speed one GPU of the plan trains at (its accumulation of micro-batches
               and one optimiser step, communication left out), and lrattnres/memory.py's estimate for the
               same rank; ``fits`` says whether the peak (reserved + context) leaves the configured margin
               of an 80 GB GPU (cluster.gpu_memory_gib). ``check`` holds ``python -m lrattnres memory
               --check``'s comparison: each peak's error against the estimate.
``checkpoint`` The 4B checkpoint (weights and optimiser state, random values): rank 0's share of an
               8-rank job written with lrattnres/train/checkpoint.py (safetensors + sha256), the time to
               write and the time to hash, and the resulting signal lead (lrattnres/jobplan.py) with those
               speeds; ``--whole`` also writes the whole state from one rank (34 GB of disk).
``appendix-i`` Appendix I's check (lrattnres/kernel_reads.py) on a gpu-scale checkpoint: the gpu
               scale's larger pair (AttnRes r = d and LR-AttnRes r = d/4, N = 8) trained ``--steps``
               updates with the gpu scale's recipe on docstrings of the installed packages (no network),
               or the checkpoints given by ``--checkpoint``; every routing read against the reference.

Writes ``<out>/paper_scale_fit_<parts>[_<presets>_<configs>].json`` (device, versions, date, commit, the
cluster settings, results), rewritten after every configuration, so a run cut short keeps what
finished. On one H200, in commands of under 10 minutes (each configuration compiles its model; the
4B's compilation alone takes about 270 s):

    python benchmarks/paper_scale_fit.py --out "$OUT" --parts memory --presets 0.5B                 # ~5 min
    python benchmarks/paper_scale_fit.py --out "$OUT" --parts memory --presets 1B --configs lr \
        --checkpointing off on                                                                       # ~5 min
    python benchmarks/paper_scale_fit.py --out "$OUT" --parts memory --presets 1B --configs lr --ddp # ~4 min
    python benchmarks/paper_scale_fit.py --out "$OUT" --parts memory --presets 4B --configs lr       # ~5 min
    python benchmarks/paper_scale_fit.py --out "$OUT" --parts memory --presets 4B --configs attnres  # ~5 min
    python benchmarks/paper_scale_fit.py --out "$OUT" --parts checkpoint appendix-i                 # ~5 min
    python benchmarks/paper_scale_fit.py --smoke --out /tmp/fit                                      # CPU check, every part
    python -m lrattnres memory --check "$OUT"/paper_scale_fit_memory_*.json                         # the model's errors
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PARTS = ("memory", "checkpoint", "appendix-i")
SMOKE_PRESETS = {"0.5B": "smoke", "1B": "tiny", "4B": "tiny-large"}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the result JSON")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--presets", nargs="+", default=["0.5B", "1B", "4B"])
    p.add_argument("--configs", nargs="+", default=["attnres", "lr"], choices=["attnres", "lr"])
    p.add_argument("--checkpointing", nargs="+", default=["off"], choices=["off", "on"],
                   help="memory part: without and/or with activation checkpointing")
    p.add_argument("--ddp", action="store_true",
                   help="memory part: wrap the model in DistributedDataParallel on a one-rank process group, as the "
                        "job's ranks are (where the plan is data-parallel)")
    p.add_argument("--ckpt-dir", default=None, help="where the checkpoint part writes (default: a temporary folder)")
    p.add_argument("--whole", action="store_true", help="checkpoint part: also write the whole 4B state from one rank")
    p.add_argument("--steps", type=int, default=300, help="appendix-i: updates of each gpu-scale training")
    p.add_argument("--checkpoint", nargs="*", default=None, help="appendix-i: model.safetensors files to check instead")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny presets, every part, seconds")
    return p.parse_args(argv)


def _versions() -> dict:
    import platform
    from importlib import metadata

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "numpy", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def paper_settings() -> dict:
    from lrattnres.config import load_and_resolve

    return load_and_resolve(REPO / "config.yaml", {"scale": "paper"})


# ------------------------------------------------------------------------------------------ memory


def _configs(preset: str, which: list[str]) -> list[dict]:
    from lrattnres.presets import get_preset

    shape = get_preset(preset)
    d, n = shape["d_model"], min(8, 2 * shape["n_layers"])
    out = []
    if "attnres" in which:
        out.append({"name": "attnres", "method": "attnres", "blocks": "full" if preset in ("0.5B", "smoke") else n, "rank": d})
    if "lr" in which:
        out.append({"name": "lr", "method": "lr", "blocks": n, "rank": d // 4})
    return out


def _owned_only(optimizers: dict, owner: dict, names: dict, rank: int = 0) -> None:
    """Restrict each optimiser to the parameters ``rank`` owns: the state one rank of a sharded job keeps."""
    for opt in optimizers.values():
        for g in opt.param_groups:
            g["params"] = [p for p in g["params"] if owner[names[id(p)]] == rank]


def _one_rank_group(device) -> None:
    """A process group of this process alone (what DistributedDataParallel needs to wrap a model)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def measure_memory(settings: dict, preset: str, cfg: dict, device, smoke: bool, checkpointing: bool = False,
                   ddp: bool = False) -> dict:
    import torch

    from lrattnres import batch, memory
    from lrattnres.model import build_model, model_config
    from lrattnres.presets import PAPER_VOCAB, get_preset
    from lrattnres.throughput.matched import synthetic_buffer
    from lrattnres.train.loop import LossModule, accumulate_gradients, apply_update
    from lrattnres.train.optim import build_optimizers, owners
    from lrattnres.train.spec import DEFAULTS
    from lrattnres.train.val import evaluate

    paper_preset = {v: k for k, v in SMOKE_PRESETS.items()}.get(preset, preset) if smoke else preset
    b = batch.split(settings, paper_preset)
    shape = get_preset(preset)
    vocab = 512 if smoke else PAPER_VOCAB
    seq = min(settings["train"]["seq_len"], shape["max_seq_len"])
    mb, val_bs = (2, 2) if smoke else (b["micro_batch"], b["val_batch_size"] or b["micro_batch"])
    accum = min(b["grad_accum"], 2)
    cuda = device.type == "cuda"
    precision = "bf16" if cuda else "fp32"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    mc = model_config({"preset": preset, "vocab_size": vocab, "method": cfg["method"], "blocks": cfg["blocks"],
                       "rank": cfg["rank"], "max_seq_len": max(seq, shape["max_seq_len"])})
    with torch.device(device):
        model = build_model(mc)
    model.activation_checkpointing = checkpointing
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {k: dict(v) for k, v in DEFAULTS["optim"].items()}
    opts = build_optimizers(model, optim, device.type)
    owner = owners(opts, names, b["world"])
    if b["shard_optimizer"] and b["world"] > 1:
        _owned_only(opts, owner, names, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    lm = LossModule(model, precision)
    ddp = ddp and b["world"] > 1
    if ddp:  # as in the job (lrattnres/train/loop.py): the gradients are views into DDP's buckets
        from torch.nn.parallel import DistributedDataParallel as DDP

        _one_rank_group(device)
        lm = DDP(lm, device_ids=[device.index or 0] if cuda else None, gradient_as_bucket_view=True)
    fwd = torch.compile(lm, dynamic=False) if (cuda and not smoke) else lm
    eot = 100257 if vocab == PAPER_VOCAB else vocab - 1
    batches = synthetic_buffer(accum, mb, seq, vocab, eot, 512, 0)
    times, grads_s, opt_s = [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        accumulate_gradients(fwd, lm, batches, params, device, 1e-5, 1.0)
        if cuda:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        apply_update(opts, device)
        t2 = time.perf_counter()
        times.append(t2 - t0)
        grads_s.append(t1 - t0)
        opt_s.append(t2 - t1)
    best = min(range(1, 3), key=lambda i: times[i])
    micro_s, step_s = grads_s[best] / accum, opt_s[best]
    row = {"preset": paper_preset, "shape": preset, "config": cfg["name"], "method": cfg["method"], "blocks": cfg["blocks"],
           "rank": cfg["rank"], "vocab": vocab, "micro_batch": mb, "seq_len": seq, "grad_accum_measured": accum,
           "grad_accum_planned": b["grad_accum"], "world_planned": b["world"], "shard_optimizer": b["shard_optimizer"],
           "ddp": ddp, "activation_checkpointing": checkpointing,
           "optimizer_params": sum(p.numel() for o in opts.values() for g in o.param_groups for p in g["params"]),
           "parameters": sum(p.numel() for p in params), "val_batch_size": val_bs, "compiled": fwd is not lm,
           "first_update_s": times[0], "update_s": times[best], "tokens_per_s": accum * mb * seq / times[best],
           "micro_batch_s": micro_s, "optimizer_s": step_s,
           # one GPU of the plan: its accumulation of micro-batches and one optimiser step (no communication)
           "tokens_per_s_planned": b["grad_accum"] * mb * seq / (b["grad_accum"] * micro_s + step_s)}
    if cuda:
        row["train_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["train_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    val = synthetic_buffer(1, val_bs, seq, vocab, eot, 512, 1)
    evaluate(model, val, device, precision)
    if cuda:
        row["val_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["val_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        free, total = torch.cuda.mem_get_info(device)
        row["context_gib"] = max(0.0, (total - free) / 2**30 - torch.cuda.memory_reserved(device) / 2**30)
        row["gpu_total_gib"] = total / 2**30
        peak = max(row["train_peak_reserved_gib"], row["val_peak_reserved_gib"]) + row["context_gib"]
        cl = settings["cluster"]
        row["peak_process_gib"] = peak
        row["of_80gb"] = peak / cl["gpu_memory_gib"]
        row["fits"] = peak <= cl["gpu_memory_gib"] * (1 - cl["memory_margin"])
    if not smoke:
        est = memory.estimate(dict(shape, vocab_size=vocab), micro_batch=mb, seq_len=seq, world=b["world"],
                              shard=b["shard_optimizer"], val_batch_size=val_bs, cluster=settings["cluster"],
                              method=cfg["method"], rank=cfg["rank"], ddp=ddp, checkpointing=checkpointing)
        row["estimate"] = est
    del opts, fwd, lm, model, params, batches
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


# -------------------------------------------------------------------------------------- checkpoint


def measure_checkpoint(settings: dict, preset: str, device, folder: Path, whole: bool, smoke: bool) -> dict:
    import torch

    from lrattnres import jobplan
    from lrattnres.io import sha256_file
    from lrattnres.model import build_model, model_config
    from lrattnres.presets import PAPER_VOCAB, get_preset
    from lrattnres.train import checkpoint as ckpt
    from lrattnres.train.optim import build_optimizers, owners
    from lrattnres.train.spec import DEFAULTS

    vocab = 512 if smoke else PAPER_VOCAB
    d = get_preset(preset)["d_model"]
    with torch.device(device):
        model = build_model(model_config({"preset": preset, "vocab_size": vocab, "method": "lr", "blocks": 8,
                                          "rank": d // 4}))
    names = {id(p): n for n, p in model.named_parameters()}
    opts = build_optimizers(model, DEFAULTS["optim"], device.type)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # the state a training run holds: Muon's momentum, AdamW's two moments
        for name, opt in opts.items():
            for p in (q for grp in opt.param_groups for q in grp["params"]):
                rnd = lambda: torch.randn(p.shape, generator=g, device=device, dtype=p.dtype)  # noqa: E731
                opt.state[p] = ({"momentum_buffer": rnd()} if name == "muon" else
                                {"step": torch.tensor(1.0), "exp_avg": rnd(), "exp_avg_sq": rnd().abs()})
    world = 8
    owner = owners(opts, names, world)
    out = {"preset": preset, "world": world, "folder": str(folder)}

    def write(tag: str, rank: int, owner_: dict) -> dict:
        target = folder / tag
        target.mkdir(parents=True, exist_ok=True)
        tensors = ckpt.training_tensors(model, opts, owner_, rank)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if shutil.disk_usage(folder).free < 1.2 * nbytes:
            return {"skipped": f"{shutil.disk_usage(folder).free / 1e9:.1f} GB free, {nbytes / 1e9:.1f} GB to write"}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ckpt.save_checkpoint(target, tensors=tensors, state={"rng": ckpt.rng_state(), "loader": {}, "grad_norms": []},
                             meta={"step": 1, "tokens": 0, "world_size": world, "spec": {}, "model_config": {},
                                   "manifest_sha256": "", "code_sha256": ""})
        total = time.perf_counter() - t0
        rec = ckpt.read_record(target, verify=False)
        files = [target / e["file"] for e in rec["files"]["tensors"] + rec["files"]["state"]]
        t0 = time.perf_counter()
        for f in files:
            sha256_file(f)
        hash_s = time.perf_counter() - t0  # a second hash: read back from the page cache, as the writer hashes
        size = sum(f.stat().st_size for f in files)
        res = {"bytes": size, "seconds": total, "hash_s": hash_s, "write_s": max(total - hash_s, 1e-9),
               "write_gbps": size / 1e9 / max(total - hash_s, 1e-9), "hash_gbps": size / 1e9 / max(hash_s, 1e-9)}
        shutil.rmtree(target)
        return res

    out["rank0_share"] = write("share", 0, owner)
    if whole:
        out["whole_one_rank"] = write("whole", 0, {n: 0 for n in owner})
    share = out["rank0_share"]
    if "write_gbps" in share and not smoke:
        cl = dict(settings["cluster"], checkpoint_write_gbps=share["write_gbps"], checkpoint_hash_gbps=share["hash_gbps"])
        measured = dict(settings, cluster=cl)
        out["lead_s_with_these_speeds"] = jobplan.lead_s(measured, preset)
        out["lead_s_configured"] = jobplan.lead_s(settings, preset)
        out["checkpoint_s_configured"] = jobplan.checkpoint_write_s(settings, preset)
        out["note"] = ("local disk of the measuring machine; a cluster's shared file system sets "
                       "cluster.checkpoint_write_gbps and checkpoint_hash_gbps")
    del opts, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# -------------------------------------------------------------------------------------- Appendix I


def appendix_i(args, work: Path, smoke: bool) -> dict:
    from lrattnres import kernel_reads
    from lrattnres.config import load_and_resolve
    from lrattnres.data import prepare
    from lrattnres.grid import plan, train_spec
    from lrattnres.train.loop import train

    scale = "smoke" if smoke else "gpu"
    settings = load_and_resolve(REPO / "config.yaml", {"scale": scale})
    manifest = work / "data" / "manifest.json"
    if not manifest.exists():
        embedded = {"packages": ["lrattnres"], "max_tokens": 60_000} if smoke else {"max_tokens": 4_000_000, "workers": 8}
        prepare({"source": "embedded", "embedded": embedded,
                 "val_tokens": 4_000 if smoke else 262_144, "shard_tokens": 50_000_000, "vocab": "compact",
                 "vocab_max": settings["data"].get("vocab_max"), "seed": 0}, work / "data", progress=False)
    out = {"scale": scale, "data": "docstrings of the installed packages (embedded source)", "runs": []}
    if args.checkpoint:
        checkpoints = [Path(c) for c in args.checkpoint]
    else:
        checkpoints = []
        for run in (r for r in plan(settings) if "pair-large" in r.roles):
            spec = train_spec(settings, run)
            spec.update(steps=args.steps if not smoke else 6, val={"every": 0, "final": False},
                        checkpoint={"every": 0}, schedule={"warmup_steps": 10 if not smoke else 1, "warmdown_frac": 0.2})
            spec.pop("tokens", None)
            t0 = time.perf_counter()
            res = train(spec, str(manifest), work / "runs" / run.run_id, progress=False)
            out["runs"].append({"run_id": run.run_id, "steps": res["steps"], "final_train_ce": res.get("final_train_ce"),
                                "train_wall_s": time.perf_counter() - t0})
            checkpoints.append(work / "runs" / run.run_id / "model.safetensors")
    out["checks"] = []
    for c in checkpoints:
        r = kernel_reads.run(str(c), str(manifest), {})
        out["checks"].append({k: r.get(k) for k in ("run_id", "method", "d", "r", "N", "tokens", "device", "precision",
                                                    "how", "criterion_max", "passed", "rel_err_pct_max", "note")}
                             | {"reads": len(r.get("reads", []))})
    out["all_pass"] = all(c["passed"] == c["reads"] > 0 for c in out["checks"])
    return out


# ------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = _args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from lrattnres.provenance import git_state, now

    smoke = args.smoke
    device = torch.device("cuda" if cuda and not smoke else "cpu")
    settings = paper_settings()
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    name = "paper_scale_fit" + ("_smoke" if smoke else "") + "_" + "_".join(p.replace("-", "") for p in args.parts)
    if "memory" in args.parts and (args.presets != ["0.5B", "1B", "4B"] or args.configs != ["attnres", "lr"]):
        name += "_" + "-".join(args.presets) + "_" + "-".join(args.configs)  # one file per command
    if "memory" in args.parts and (args.checkpointing != ["off"] or args.ddp):
        name += ("_ckpt-" + "-".join(args.checkpointing) if args.checkpointing != ["off"] else "") + ("_ddp" if args.ddp else "")
    path = outdir / f"{name}.json"
    result = {"benchmark": "paper_scale_fit", "date": now(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "versions": _versions(), "git": git_state(), "smoke": smoke, "args": vars(args),
              "cluster": settings["cluster"], "results": {}}

    def save():
        result["finished"] = now()
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, path)
        print(f"[fit] wrote {path}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    if "memory" in args.parts:
        rows = result["results"]["memory"] = []
        from lrattnres import memory

        for paper_preset in args.presets:
            preset = SMOKE_PRESETS.get(paper_preset, paper_preset) if smoke else paper_preset
            for cfg in _configs(preset, args.configs):
                for ac in args.checkpointing:
                    t0 = time.perf_counter()
                    try:
                        row = measure_memory(settings, preset, cfg, device, smoke, checkpointing=ac == "on", ddp=args.ddp)
                    except Exception as e:  # an out-of-memory is a result too
                        row = {"preset": paper_preset, "config": cfg["name"], "activation_checkpointing": ac == "on",
                               "error": f"{type(e).__name__}: {str(e)[:400]}"}
                        gc.collect()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    row["wall_s"] = time.perf_counter() - t0
                    rows.append(row)
                    print(f"[fit] memory {paper_preset} {cfg['name']} checkpointing {ac}: " + json.dumps(
                        {k: row.get(k) for k in ("train_peak_allocated_gib", "val_peak_allocated_gib", "peak_process_gib",
                                                 "fits", "update_s", "tokens_per_s_planned", "error")}, default=str),
                          file=sys.stderr, flush=True)
                    if not smoke:  # the estimate against this measurement (python -m lrattnres memory --check)
                        result["check"] = memory.compare(rows, settings["cluster"])
                    save()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if "checkpoint" in args.parts:
        folder = Path(args.ckpt_dir) if args.ckpt_dir else Path(tempfile.mkdtemp(prefix="lrattnres-ckpt-"))
        try:
            result["results"]["checkpoint"] = measure_checkpoint(settings, "tiny" if smoke else "4B", device, folder,
                                                                 args.whole, smoke)
        finally:
            if not args.ckpt_dir:
                shutil.rmtree(folder, ignore_errors=True)
        print(f"[fit] checkpoint: {json.dumps(result['results']['checkpoint'], default=str)}", file=sys.stderr, flush=True)
        save()
    if "appendix-i" in args.parts:
        work = Path(tempfile.mkdtemp(prefix="lrattnres-appI-"))
        try:
            result["results"]["appendix_i"] = appendix_i(args, work, smoke)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"[fit] appendix-i: all pass {result['results']['appendix_i']['all_pass']}", file=sys.stderr, flush=True)
        save()
    result["wall_s"] = time.perf_counter() - t_start
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
