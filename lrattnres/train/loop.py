"""The trainer: the paper's recipe, resumable, measured, data-parallel.

One optimiser update ("step") = ``grad_accum`` micro-batches of ``micro_batch`` x ``seq_len`` tokens
on each of ``world_size`` ranks.  Per step:

1. the learning rate of every group is set from the schedule (``schedule.lr_multiplier``);
2. the micro-batches are fetched and their valid target tokens counted over the whole global batch;
3. each micro-batch's loss ``(sum CE + z_loss * sum lse^2) / N_global`` is back-propagated (scaled
   by ``world_size`` because DDP averages gradients over ranks), so the update is exactly the
   gradient of the token-averaged loss of the global batch, whatever the split into ranks and
   micro-batches; the z-loss is counted once and reported separately from the cross-entropy;
4. gradients are clipped to ``grad_clip`` and the pre-clip norm is logged; the gradient-norm guard
   (``lrattnres.train.guard``) reports a norm far above its running median, or not finite, in one
   line and records it (metrics.jsonl ``grad_outlier``; result.json ``grad_norm.outliers``);
5. a non-finite CE, z-loss or gradient norm stops the run before the update (no checkpoint is
   written, so the last good one stays); with the spec's ``record_nonfinite`` the run ends there
   instead, writing its weights and a result whose ``stopped`` names the update (no final
   validation: ``final_val_ce`` is null);
6. Muon and AdamW step.

Exit paths (``cli.py`` maps them to exit codes): normal end; SIGTERM/SIGINT (Slurm preemption), or
a deadline (``LRATTNRES_DEADLINE``, lrattnres/deadline.py) that the next update and a checkpoint
would pass: checkpoint at the next step boundary, then :class:`Preempted` (exit code 75,
EX_TEMPFAIL: rerun the same command to resume); non-finite loss: :class:`NonFiniteLoss` (exit code 3).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lrattnres import deadline as deadline_mod
from lrattnres.devices import resolve_device
from lrattnres.errors import UserError
from lrattnres.io import atomic_write_json
from lrattnres.provenance import now, provenance
from lrattnres.train import checkpoint as ckpt
from lrattnres.train import spec as spec_mod
from lrattnres.train.guard import GradGuard
from lrattnres.train.metrics import (MetricsWriter, StatusLines, end_of_run_summary, grad_norm_summary, memory_stats,
                                     progress_bar)
from lrattnres.train.optim import base_lrs, build_optimizers, local_optimizer, owners
from lrattnres.train.schedule import apply_lr, lr_multiplier
from lrattnres.train.val import IGNORE_INDEX, evaluate, loss_sums

EXIT_PREEMPTED = 75
EXIT_NONFINITE = 3


class NonFiniteLoss(RuntimeError):
    pass


class Preempted(Exception):
    """The run stopped at a step boundary with its checkpoint written. ``reason``: ``signal``
    (SIGTERM/SIGINT), ``deadline`` (LRATTNRES_DEADLINE) or ``stop_after``; ``updates``: the updates
    this process made (a job that stops at its deadline before any update cannot continue itself)."""

    def __init__(self, message: str, reason: str = "signal", updates: int = 0):
        super().__init__(message)
        self.reason = reason
        self.updates = updates


class ResumeMismatch(UserError, ValueError):
    pass


class CodeChanged(ResumeMismatch):
    """A checkpoint written by other training code, with ``on_code_change: refuse`` (exit 2)."""


ON_CODE_CHANGE = ("restart", "refuse", "continue")


class LossModule(nn.Module):
    """model + loss sums in one module, so DDP and torch.compile see the whole forward."""

    def __init__(self, model: nn.Module, precision: str):
        super().__init__()
        self.model = model
        self.precision = precision

    def forward(self, inputs, targets, doc_ids, segments=None):
        with torch.autocast(device_type=inputs.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            logits = self.model(inputs, doc_ids, segments=segments)
        return loss_sums(logits, targets)


def accumulate_gradients(fwd, lm, batches, params, device, z_loss: float, clip: float | None, world: int = 1,
                         segments: bool = False):
    """Forward/backward of one global batch, then clipping: returns (ce, z-loss term, pre-clip norm).

    ``fwd`` is ``lm`` or its compiled form; ``lm`` is the (DDP-wrapped) :class:`LossModule`.  Every
    micro-batch's loss is ``(sum CE + z_loss * sum lse^2) * world / N_global``, so the gradient is
    that of the token-averaged loss of the whole global batch.  One host sync at the end.
    ``segments``: hand each batch's host-built document offsets to the model (attention ``flash``
    reads them; the other backends do not, and a compiled model is not given what it does not read).
    """
    ddp = world > 1
    n_valid = torch.zeros((), dtype=torch.float64)
    for b in batches:
        n_valid += (b.targets != IGNORE_INDEX).sum()
    if ddp:
        n_valid = n_valid.to(device)
        dist.all_reduce(n_valid)
    n_tok = n_valid.item()
    scale = world / n_tok
    sums = torch.zeros(2, dtype=torch.float32, device=device)
    for i, b in enumerate(batches):
        inputs = b.inputs.to(device, non_blocking=True)
        targets = b.targets.to(device, non_blocking=True)
        doc_ids = b.doc_ids.to(device, non_blocking=True)
        segs = b.segments.to(device, non_blocking=True) if segments else None
        sync = contextlib.nullcontext() if (not ddp or i == len(batches) - 1) else lm.no_sync()
        with sync:
            ce_sum, z_sum = fwd(inputs, targets, doc_ids, segs)
            loss = (ce_sum + z_loss * z_sum) * scale
            loss.backward()
        sums += torch.stack([ce_sum.detach(), z_sum.detach()])
    max_norm = clip if clip is not None else float("inf")
    gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=device.type == "cuda" or None)
    if ddp:
        dist.all_reduce(sums)
    vals = torch.cat([sums.double(), gnorm.detach().double().reshape(1)]).tolist()
    return vals[0] / n_tok, z_loss * vals[1] / n_tok, vals[2]


def apply_update(optimizers: dict, device: torch.device) -> None:
    for opt in optimizers.values():
        opt.step()
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dist_env() -> tuple[int, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def _device(choice: str, local_rank: int) -> torch.device:
    """The rank's device: its local GPU where the spec's device resolves to CUDA. (No CUDA where it
    was asked for is a RuntimeError, not a spec error: on a cluster another node may have it.)"""
    if resolve_device(choice, where="spec key 'device'", error=RuntimeError).type == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


_REPO = Path(__file__).resolve().parent.parent.parent
CODE_FILES = ("lrattnres/train/*.py", "lrattnres/model.py", "lrattnres/routing.py", "lrattnres/attention.py",
              "lrattnres/segments.py",
              "lrattnres/presets.py", "lrattnres/data/loader.py", "kernels/*.py")


def _code_sources():
    for pattern in CODE_FILES:
        for f in sorted(_REPO.glob(pattern)):
            yield f.relative_to(_REPO).as_posix(), f.read_bytes()


def code_fingerprint() -> str:
    """sha256 over the source of the training stack (a resumed run must not mix two versions)."""
    h = hashlib.sha256()
    for rel, data in _code_sources():
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def code_files() -> dict[str, str]:
    """The sha256 of each source file of the training stack, by its path in the repository: what a
    checkpoint records, so that a refusal can name the files that changed."""
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in _code_sources()}


def changed_code_files(old: dict | None, new: dict[str, str]) -> list[str] | None:
    """The files whose source differs between two :func:`code_files` records (added and removed ones
    too); None where the checkpoint records no per-file hashes."""
    if not isinstance(old, dict):
        return None
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def tokens_per_update(spec: dict, world: int) -> int:
    return spec["micro_batch"] * spec["seq_len"] * spec["grad_accum"] * world


# The batch split of an update: another split of the same tokens per update (another GPU count, with
# grad_accum auto) makes the same update, so a run resumes across it.
BATCH_SPLIT = ("micro_batch", "grad_accum")


def resume_problems(rec: dict, s: dict, mcfg_dict: dict, manifest_sha: str, world: int,
                    fingerprint: str) -> tuple[list[str], bool]:
    """Why checkpoint record ``rec`` cannot continue this run (spec, architecture, data or the tokens
    of an update differ), and whether it was written by other training code. Another world size with
    the same tokens per update is no obstacle: the state is kept by parameter name and resharded."""
    problems = []
    keys = spec_mod.diff_keys(rec["spec"], s)
    then, now_ = tokens_per_update(rec["spec"], int(rec["world_size"])), tokens_per_update(s, world)
    if then == now_:
        keys = [k for k in keys if k not in BATCH_SPLIT]
    else:
        problems.append(f"tokens per update differ: checkpoint {rec['spec']['micro_batch']} x {rec['spec']['seq_len']} x "
                        f"{rec['spec']['grad_accum']} x {rec['world_size']} ranks = {then:,} != now {s['micro_batch']} x "
                        f"{s['seq_len']} x {s['grad_accum']} x {world} ranks = {now_:,}")
    if keys:
        problems.append("spec differs: " + spec_mod.describe_diff(rec["spec"], s, keys))
    mkeys = spec_mod.diff_keys(rec["model_config"], mcfg_dict, ignore=("router", "attention"))
    if mkeys:
        problems.append("model architecture differs: " + spec_mod.describe_diff(rec["model_config"], mcfg_dict, mkeys))
    if rec["manifest_sha256"] != manifest_sha:
        problems.append(f"data manifest differs (sha256 {str(rec['manifest_sha256'])[:12]} != {manifest_sha[:12]})")
    return problems, rec.get("code_sha256") != fingerprint


def _code_change(rec: dict, files_now: dict[str, str], commit_now: dict) -> dict:
    """The record of a run continued across a code change: both commits, the files that differ."""
    return {"step": rec["step"], "checkpoint_commit": (rec.get("commit") or {}).get("commit"),
            "checkpoint_dirty": (rec.get("commit") or {}).get("dirty"), "commit": commit_now.get("commit"),
            "dirty": commit_now.get("dirty"), "checkpoint_code_sha256": rec.get("code_sha256"),
            "changed_files": changed_code_files(rec.get("code_files"), files_now)}


def _describe_change(change: dict) -> str:
    files = change["changed_files"]
    what = ("the checkpoint records no per-file hashes" if files is None
            else ", ".join(files) if files else "no file differs by content (the fingerprint does)")
    return (f"changed: {what}; checkpoint commit {str(change['checkpoint_commit'])[:12]}"
            + (" (dirty)" if change["checkpoint_dirty"] else "")
            + f", now {str(change['commit'])[:12]}" + (" (dirty)" if change["dirty"] else ""))


def resolve_model_config(model_spec: dict, vocab_size: int, seq_len: int):
    """The ModelConfig of a run: the spec's model fields plus the manifest's vocabulary size."""
    from lrattnres.model import model_config

    m = dict(model_spec)
    if m.get("vocab_size") is not None and m["vocab_size"] != vocab_size:
        raise spec_mod.SpecError(
            f"spec key 'model.vocab_size' is {m['vocab_size']} but the data manifest's vocab_size is {vocab_size}"
        )
    m["vocab_size"] = vocab_size
    try:
        cfg = model_config(m)
    except (ValueError, TypeError) as e:
        raise spec_mod.SpecError(f"spec key 'model': {e}") from None
    if seq_len > cfg.max_seq_len:
        raise spec_mod.SpecError(f"spec key 'seq_len' is {seq_len} but the model's max_seq_len is {cfg.max_seq_len}")
    return cfg


def _seed_all(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints at the next step boundary."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame):
        self.signum = signum

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


def train(spec: dict, data: str | os.PathLike, out: str | os.PathLike, **kw) -> dict[str, Any]:
    """Train one run; returns the result dict (also written to ``<out>/result.json`` by rank 0).

    Keywords: ``resume``: ``auto`` (continue from ``<out>/checkpoint.json`` when it was written for
    the same spec, architecture, data manifest and tokens per update, on any world size, and by the
    same training code; a checkpoint of another spec, architecture or data is moved aside into
    ``<out>/stale/`` and the run starts over; one of other training code is handled as
    ``on_code_change`` says), ``never`` (move any checkpoint aside and start over), ``must`` (fail
    unless the checkpoint continues this run, code included), ``force`` (continue even if the
    training code changed; the rest must still match).  ``on_code_change`` (with ``auto``):
    ``restart`` (move the checkpoint aside and start over), ``refuse`` (stop with
    :class:`CodeChanged`, naming the changed files) or ``continue`` (as ``force``); a run continued
    across a code change records both commits and the changed files in its result
    (``code_changes``).  A checkpoint whose files fail their sha256 check stops the run with
    :class:`CheckpointError` in every mode but ``never``.  ``stop_after``: stop after that many
    total updates, writing a checkpoint as on preemption (for tests and time-sliced jobs; raises
    :class:`Preempted`).  ``progress``: a live tqdm bar when stderr is a terminal; otherwise (or
    without ``progress``) plain status lines every ``log_every_s`` seconds of the spec.  SIGTERM/SIGINT are caught from the start (a signal during
    start-up still stops at the first step boundary with a checkpoint).
    """
    stop = _StopFlag().install()
    try:
        return _train(spec, data, out, stop=stop, **kw)
    finally:
        stop.restore()


def _train(
    spec: dict,
    data: str | os.PathLike,
    out: str | os.PathLike,
    *,
    resume: str = "auto",
    on_code_change: str = "restart",
    stop_after: int | None = None,
    progress: bool = True,
    log=None,
    stop: _StopFlag,
) -> dict[str, Any]:
    started = now()
    t_process = time.perf_counter()
    cpu_process = time.process_time()
    out = Path(out)
    s = spec_mod.resolve(spec)
    rank, world, local_rank = _dist_env()
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if (s["device"] != "cpu" and torch.cuda.is_available()) else "gloo"
        dist.init_process_group(backend=backend)
    master = rank == 0
    device = _device(s["device"], local_rank)

    from lrattnres.data import TokenLoader, iter_eval_batches, load_manifest

    manifest = load_manifest(data, verify="size")
    if sum(manifest["splits"][k]["tokens"] for k in ("train", "val")) <= 2_000_000_000:
        manifest = load_manifest(data, verify=True)  # hash the shards too, unless that takes minutes
    manifest_sha = manifest["_sha256"]
    mcfg = resolve_model_config(s["model"], int(manifest["vocab_size"]), s["seq_len"])
    mcfg_dict = ckpt.model_config_dict(mcfg)
    steps_total = spec_mod.total_steps(s, world)
    tokens_per_step = s["micro_batch"] * s["seq_len"] * s["grad_accum"] * world
    if s.get("tokens_per_update") and tokens_per_step != s["tokens_per_update"]:
        raise spec_mod.SpecError(
            f"spec key 'tokens_per_update' is {s['tokens_per_update']:,} but micro_batch {s['micro_batch']} x seq_len "
            f"{s['seq_len']} x grad_accum {s['grad_accum']} x {world} ranks = {tokens_per_step:,}: the job runs on "
            "another GPU count than its spec was made for (set resources.train.gpu and nodes in config.yaml)")
    train_split_tokens = int(manifest["splits"]["train"]["tokens"])

    _seed_all(s["seed"])
    from lrattnres.model import build_model

    if device.type == "cuda":
        with torch.device(device):  # initialise on the GPU (a 4B model takes long on the CPU)
            model = build_model(mcfg)
    else:
        model = build_model(mcfg)
    model.activation_checkpointing = bool(s.get("activation_checkpointing"))
    from lrattnres.attention import describe as describe_attention

    attention = describe_attention(mcfg.attention, device)  # what the forward runs (auto resolved), recorded
    shard = bool(s.get("shard_optimizer")) and world > 1
    optimizers = build_optimizers(model, s["optim"], device.type, shard=shard)
    local_opts = {k: local_optimizer(o) for k, o in optimizers.items()}  # the state this rank keeps
    param_names = {id(p): n for n, p in model.named_parameters()}
    owner = owners(optimizers, param_names, world)  # who writes which weights and state
    if shard:
        mine = {param_names[id(p)] for o in local_opts.values() for g in o.param_groups for p in g["params"]}
        if mine != {n for n, r in owner.items() if r == rank}:
            raise RuntimeError("ZeroRedundancyOptimizer's partition differs from lrattnres.train.optim.owners")
    lrs = base_lrs(s["optim"])
    params = [p for p in model.parameters() if p.requires_grad]
    loader = TokenLoader(manifest, "train", s["micro_batch"], s["seq_len"], s["seed"], rank=rank, world_size=world)

    # ---- resume -------------------------------------------------------------------------------
    step, tokens, train_s, grad_norms, wall_prev, cpu_prev = 0, 0, 0.0, [], 0.0, 0.0
    ck_path = out / ckpt.CHECKPOINT_FILE
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if resume not in ("auto", "never", "must", "force"):
        raise ValueError(f"resume must be auto, never, must or force, got {resume!r}")
    if on_code_change not in ON_CODE_CHANGE:
        raise ValueError(f"on_code_change must be one of {', '.join(ON_CODE_CHANGE)}, got {on_code_change!r}")
    from lrattnres.provenance import git_state

    fingerprint, files_now, commit_now = code_fingerprint(), code_files(), git_state()
    st, stale, stale_step, code_changes = None, None, None, []
    if ckpt.has_checkpoint(out):
        if resume == "never":
            stale = "--resume never"
        elif not ck_path.exists():
            stale = f"{', '.join(n for n in ckpt.LEGACY_FILES if (out / n).exists())} is an earlier checkpoint format"
        else:
            rec = ckpt.verify_files(out, rank, world)  # a file that fails its check stops the run (CheckpointError)
            stale_step = rec["step"]
            problems, code_differs = resume_problems(rec, s, mcfg_dict, manifest_sha, world, fingerprint)
            if rec["format"] != ckpt.FORMAT:
                problems.append(f"written in the earlier format {rec['format']}")
            change = _code_change(rec, files_now, commit_now) if code_differs else None
            keep_going = resume == "force" or (resume == "auto" and on_code_change == "continue")
            if code_differs and not problems and resume == "auto" and on_code_change == "refuse":
                raise CodeChanged(
                    f"{ck_path}: the checkpoint at step {rec['step']} was written by other training code "
                    f"({_describe_change(change)}); refusing to continue or discard it. Continue it with this code "
                    "(--resume force; in the workflow train.on_code_change: continue) or start over (--resume "
                    "never; train.on_code_change: restart); docs/slurm.md, 'After a code edit'")
            if code_differs and not keep_going:
                problems.append(f"written by other training code ({_describe_change(change)}; a run must not mix two "
                                "code versions unless told to)")
            if problems and resume in ("must", "force"):
                raise ResumeMismatch(f"{ck_path}: refusing to resume: " + "; ".join(problems)
                                     + " (--resume auto or never starts over)")
            if problems:
                stale = "; ".join(problems)
            else:
                st = rec
                code_changes = list(rec.get("code_changes") or []) + ([change] if change else [])
                if change and master:
                    say(f"[train] {out.name}: continuing the checkpoint at step {rec['step']} with other training code "
                        f"({_describe_change(change)}); recorded in the result")
    if resume in ("must", "force") and st is None:
        raise FileNotFoundError(f"{ck_path}: --resume {resume}, but there is no checkpoint to continue")
    if stale is not None:
        if world > 1:
            dist.barrier()  # every rank has read the checkpoint before it moves
        if master:
            dest = ckpt.move_aside(out, f"{stale}\n")
            at = f" at step {stale_step}" if stale_step is not None else ""
            say(f"[train] {out.name}: the checkpoint{at} does not continue this run ({stale}); "
                f"moved it aside to {dest} and starting over")
        if world > 1:
            dist.barrier()
    planned_epochs = steps_total * tokens_per_step / max(train_split_tokens, 1)
    if master and planned_epochs > 1:
        say(f"[train] warning: {steps_total} updates of {tokens_per_step:,} tokens read the {train_split_tokens:,}-token "
            f"training split {planned_epochs:.1f} times; past one epoch the validation loss measures memorisation "
            "as well as modelling (point the scale's data stage at a larger corpus)")
    resumed, world_then = False, world
    guard = GradGuard(**s["grad_guard"])
    if st is not None:
        # weights, and the optimiser state of the parameters this rank owns now, read by name from
        # whichever rank's file holds them: another world size reshards the state
        ckpt.restore_training(out, st, model, local_opts)
        world_then = int(st["world_size"])
        mine = ckpt.read_state(out, st, rank if rank < world_then else 0)
        step, tokens, train_s = st["step"], st["tokens"], st["train_s"]
        wall_prev, cpu_prev = st["wall_s"], st["cpu_s"]
        grad_norms = list(mine["grad_norms"] if rank == 0 else ckpt.read_state(out, st, 0)["grad_norms"])
        loader.load_state_dict(mine["loader"], reshard=world_then != world)
        ckpt.set_rng_state(mine["rng"])  # a rank the checkpoint did not have starts from rank 0's states
        guard.replay(grad_norms)  # the guard's history and outliers, as the uninterrupted run has them
        resumed = True
        if master and world_then != world:
            say(f"[train] {out.name}: the checkpoint at step {step} was written by {world_then} ranks; resharded "
                f"onto {world} (micro_batch {s['micro_batch']} x grad_accum {s['grad_accum']} per rank)")
        del st, mine

    # ---- wrap ---------------------------------------------------------------------------------
    lm = LossModule(model, s["precision"])
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        lm = DDP(lm, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    fwd = torch.compile(lm, dynamic=False) if s["compile"] else lm

    metrics = MetricsWriter(out / "metrics.jsonl", enabled=master)
    if master:
        if resumed:
            metrics.truncate_after(step)
        else:
            metrics.truncate_after(-1)
        atomic_write_json(out / "spec.json", {"spec": s, "model_config": mcfg_dict, "data": str(data),
                                              "manifest_sha256": manifest_sha, "world_size": world,
                                              "total_steps": steps_total, "tokens_per_step": tokens_per_step})
        say(f"[train] {out.name}: {model.num_parameters():,} parameters, {steps_total} steps of "
            f"{tokens_per_step:,} tokens, device {device}, world {world}, attention {attention['backend']} "
            f"({attention['version']})"
            + (f", resumed at step {step}" if resumed else ""))
        from lrattnres.attention import warn_compiled_flex

        warn_compiled_flex(mcfg.attention, device, s["compile"], say)

    val_bs = s["val"]["batch_size"] or s["micro_batch"]

    def val_batches():
        return iter_eval_batches(manifest, "val", val_bs, s["seq_len"])

    def save_checkpoint():
        """Every rank writes its share side by side (lrattnres/train/checkpoint.py); returns seconds."""
        t0 = time.perf_counter()
        if master:
            metrics.flush()
        ckpt.save_checkpoint(
            out, tensors=ckpt.training_tensors(model, local_opts, owner, rank),
            state={"rng": ckpt.rng_state(), "loader": loader.state_dict(), "grad_norms": grad_norms if master else []},
            meta={"step": step, "tokens": tokens, "train_s": train_s,
                  "wall_s": wall_prev + time.perf_counter() - t_process,
                  "cpu_s": cpu_prev + time.process_time() - cpu_process,
                  "world_size": world, "spec": s, "model_config": mcfg_dict,
                  "manifest_sha256": manifest_sha, "code_sha256": fingerprint, "code_files": files_now,
                  "commit": commit_now, "code_changes": code_changes},
            rank=rank, world=world,
        )
        return time.perf_counter() - t0

    from lrattnres.progress import interactive

    live = master and progress and interactive(sys.stderr)
    bar = progress_bar(steps_total, step, enabled=live, desc=out.name or "train")
    # where no live bar is drawn (a log file, a batch job, --no-progress): plain status lines
    status = (StatusLines(out.name or "train", steps_total, step, s["log_every_s"], say)
              if master and not live and s["log_every_s"] > 0 else None)
    zc = float(s["z_loss"])
    clip = s["grad_clip"]
    ddp = world > 1
    last_step_s, last_save_s = 0.0, 0.0
    stopped = None  # a non-finite loss recorded as the result (spec record_nonfinite)
    first_step = step
    try:
        while step < steps_total:
            # preemption, a deadline (LRATTNRES_DEADLINE: the next update and a checkpoint would end after
            # it) or a requested stop, on any rank (all ranks agree): checkpoint, then leave
            rest = deadline_mod.left()
            due = rest is not None and rest < last_step_s + last_save_s + 1.0
            flag = torch.tensor([2.0 if stop.signum is not None else 1.0 if due else 0.0],
                                device=device if ddp else "cpu")
            if ddp:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0 or (stop_after is not None and step >= stop_after):
                save_checkpoint()
                why = ("signal" + (f" {stop.signum}" if stop.signum is not None else " on another rank")
                       if flag.item() >= 2 else deadline_mod.ENV if flag.item() > 0 else f"stop_after={stop_after}")
                reason = "signal" if flag.item() >= 2 else "deadline" if flag.item() > 0 else "stop_after"
                raise Preempted(f"stopped at step {step} ({why}); checkpoint {ck_path} written; rerun to resume",
                                reason=reason, updates=step - first_step)

            t0 = time.perf_counter()
            mult = lr_multiplier(step, steps_total, s["schedule"]["warmup_steps"], s["schedule"]["warmdown_frac"],
                                 s["schedule"]["final_lr_frac"])
            lr_now = apply_lr(optimizers, lrs, mult)

            batches = [next(loader) for _ in range(s["grad_accum"])]
            ce, zl, gn = accumulate_gradients(fwd, lm, batches, params, device, zc, clip, world,
                                              segments=attention["backend"] == "flash")
            event = guard.observe(step, gn)  # every rank sees the same norm; rank 0 reports it
            if event is not None and master:
                (bar.write if live else say)(guard.line(out.name or "train", event))
                metrics.write({"kind": "grad_outlier", "step": step + 1, **event})
            bad = next(((term, v) for term, v in (("cross-entropy", ce), ("z-loss", zl), ("gradient norm", gn))
                        if not math.isfinite(v)), None)
            if bad is not None:
                why = f"non-finite {bad[0]} ({bad[1]}) at step {step + 1} (update index {step}); stopped before the update"
                if not s.get("record_nonfinite"):
                    raise NonFiniteLoss(f"{why}; the last good checkpoint {ck_path} (if any) is kept")
                stopped = {"update": step + 1, "term": bad[0], "value": str(bad[1]), "reason": why}
                metrics.write({"kind": "stopped", "step": step, "tokens": tokens, **stopped})
                if master:
                    bar.write(f"[train] {why}; recorded as the run's result (record_nonfinite)")
                break
            apply_update(optimizers, device)
            dt = time.perf_counter() - t0
            last_step_s = dt
            train_s += dt
            step += 1
            tokens += tokens_per_step
            grad_norms.append(gn)
            rec = {"kind": "train", "step": step, "tokens": tokens, "loss": ce + zl, "ce": ce, "zloss": zl,
                   "grad_norm": gn, "lr": lr_now, "lr_mult": mult, "tokens_per_s": tokens_per_step / dt,
                   "step_s": dt, "memory": memory_stats(device)}
            metrics.write(rec)
            bar.update(1)
            if status is not None:
                status.update(step, ce + zl, tokens_per_step)
            if master and (step % 10 == 0 or step == steps_total):
                bar.set_postfix(loss=f"{ce + zl:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)

            ve = s["val"]["every"]
            if ve and step % ve == 0 and step < steps_total:
                r = evaluate(model, val_batches(), device, s["precision"], s["val"]["batches"], rank, world)
                metrics.write({"kind": "val", "step": step, "tokens": tokens, "val_ce": r["ce"], "val_tokens": r["tokens"]})
                if master:
                    bar.write(f"[train] step {step}: val ce {r['ce']:.4f} ({r['tokens']} tokens)")
            ce_every = s["checkpoint"]["every"]
            if ce_every and step % ce_every == 0 and step < steps_total:
                last_save_s = save_checkpoint()
    finally:
        bar.close()
        if status is not None:
            status.close()
        metrics.flush()

    # ---- end: final checkpoint, weights, final validation, result (last) -----------------------
    if stopped is None:
        save_checkpoint()
    if master:
        ckpt.save_model(model.state_dict(), {"model_config": mcfg_dict, "spec": s, "manifest_sha256": manifest_sha,
                                             "step": step, "tokens": tokens}, out / ckpt.MODEL_FILE)
    final = {"ce": None, "tokens": 0}
    if s["val"]["final"] and stopped is None:
        final = evaluate(model, val_batches(), device, s["precision"], None, rank, world)
        metrics.write({"kind": "final_val", "step": step, "tokens": tokens, "val_ce": final["ce"],
                       "val_tokens": final["tokens"]})
    metrics.close()
    end = end_of_run_summary(out / "metrics.jsonl") if master else {}
    result = {
        "stage": "train",
        "run_id": out.name,
        "final_val_ce": final["ce"],
        "val_tokens": final["tokens"],
        **end,  # final_train_ce (mean of the last updates), steady_tokens_per_s (compilation excluded)
        "steps": step,
        "tokens": tokens,
        "train_split_tokens": train_split_tokens,
        "data_epochs": tokens / max(train_split_tokens, 1),  # > 1: the run saw its training data more than once
        "wall_s": wall_prev + time.perf_counter() - t_process,  # all processes of the run, start-up included
        "train_s": train_s,  # time inside optimiser steps (no start-up, validation or checkpoints)
        "cpu_s": cpu_prev + time.process_time() - cpu_process,  # process CPU time (rank 0)
        "resumed": resumed,
        # runs continued across a change of the training code: both commits and the changed files
        "code_changes": code_changes,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "steps_per_s": step / train_s if train_s > 0 else None,
        "grad_norm": grad_norm_summary(grad_norms, clip, guard),
        "stopped": stopped,  # None, or the non-finite update that ended the run (record_nonfinite)
        "parameters": model.num_parameters(),
        "model_config": mcfg_dict,
        "world_size": world,
        "memory": memory_stats(device),
        "provenance": provenance(s, started=started, attention=attention),
    }
    if master:
        atomic_write_json(out / "result.json", result)
        say(f"[train] {out.name}: done, {step} steps, final val ce {final['ce']}, "
            f"{result['tokens_per_s'] or 0:,.0f} tokens/s")
    return result
