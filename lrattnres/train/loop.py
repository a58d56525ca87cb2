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
from lrattnres.attention import describe as describe_attention
from lrattnres.attention import warn_compiled_flex
from lrattnres.data import TokenLoader, iter_eval_batches, load_manifest
from lrattnres.devices import resolve_device
from lrattnres.errors import UserError
from lrattnres.io import atomic_write_json
from lrattnres.model import build_model, model_config
from lrattnres.progress import interactive
from lrattnres.provenance import git_state, now, provenance
from lrattnres.train import checkpoint as ckpt
from lrattnres.train import spec as spec_mod
from lrattnres.train.code import changed_code_files, code_files, code_fingerprint
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
    run = _Run(spec, data, out, log)
    run.resume(resume, on_code_change)
    run.wrap()
    stopped = run.loop(stop, stop_after, progress)
    return run.finish(stopped)


class _Run:
    """One training run in this process, from its spec to its result: the data, the model and its
    optimisers (:meth:`__init__`), the checkpoint it continues (:meth:`resume`), the wrapped forward
    (:meth:`wrap`), the updates (:meth:`loop`) and the final weights and result (:meth:`finish`)."""

    def __init__(self, spec: dict, data: str | os.PathLike, out: str | os.PathLike, log=None):
        self.started = now()
        self.t_process = time.perf_counter()
        self.cpu_process = time.process_time()
        self.out, self.data = Path(out), data
        self.s = spec_mod.resolve(spec)
        self.rank, self.world, local_rank = _dist_env()
        if self.world > 1 and not dist.is_initialized():
            backend = "nccl" if (self.s["device"] != "cpu" and torch.cuda.is_available()) else "gloo"
            dist.init_process_group(backend=backend)
        self.master = self.rank == 0
        self.device = _device(self.s["device"], local_rank)
        self._read_data()
        self._build_model()
        # the progress a resumed run carries on from
        self.step, self.tokens, self.train_s, self.grad_norms, self.wall_prev, self.cpu_prev = 0, 0, 0.0, [], 0.0, 0.0
        self.ck_path = self.out / ckpt.CHECKPOINT_FILE
        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.resumed = False

    def _read_data(self) -> None:
        """The data manifest (its shards checked), the model config it implies, and the run's length."""
        s, world = self.s, self.world
        manifest = load_manifest(self.data, verify="size")
        if sum(manifest["splits"][k]["tokens"] for k in ("train", "val")) <= 2_000_000_000:
            manifest = load_manifest(self.data, verify=True)  # hash the shards too, unless that takes minutes
        self.manifest, self.manifest_sha = manifest, manifest["_sha256"]
        self.mcfg = resolve_model_config(s["model"], int(manifest["vocab_size"]), s["seq_len"])
        self.mcfg_dict = ckpt.model_config_dict(self.mcfg)
        self.steps_total = spec_mod.total_steps(s, world)
        self.tokens_per_step = s["micro_batch"] * s["seq_len"] * s["grad_accum"] * world
        if s.get("tokens_per_update") and self.tokens_per_step != s["tokens_per_update"]:
            raise spec_mod.SpecError(
                f"spec key 'tokens_per_update' is {s['tokens_per_update']:,} but micro_batch {s['micro_batch']} x seq_len "
                f"{s['seq_len']} x grad_accum {s['grad_accum']} x {world} ranks = {self.tokens_per_step:,}: the job runs on "
                "another GPU count than its spec was made for (set resources.train.gpu and nodes in config.yaml)")
        self.train_split_tokens = int(manifest["splits"]["train"]["tokens"])

    def _build_model(self) -> None:
        """The seeded model, its optimisers (this rank's share where they are sharded) and the loader."""
        s, device, world = self.s, self.device, self.world
        _seed_all(s["seed"])
        if device.type == "cuda":
            with torch.device(device):  # initialise on the GPU (a 4B model takes long on the CPU)
                model = build_model(self.mcfg)
        else:
            model = build_model(self.mcfg)
        model.activation_checkpointing = bool(s.get("activation_checkpointing"))
        self.model = model
        self.attention = describe_attention(self.mcfg.attention, device)  # what the forward runs (auto resolved), recorded
        shard = bool(s.get("shard_optimizer")) and world > 1
        self.optimizers = build_optimizers(model, s["optim"], device.type, shard=shard)
        self.local_opts = {k: local_optimizer(o) for k, o in self.optimizers.items()}  # the state this rank keeps
        param_names = {id(p): n for n, p in model.named_parameters()}
        self.owner = owners(self.optimizers, param_names, world)  # who writes which weights and state
        if shard:
            mine = {param_names[id(p)] for o in self.local_opts.values() for g in o.param_groups for p in g["params"]}
            if mine != {n for n, r in self.owner.items() if r == self.rank}:
                raise RuntimeError("ZeroRedundancyOptimizer's partition differs from lrattnres.train.optim.owners")
        self.lrs = base_lrs(s["optim"])
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loader = TokenLoader(self.manifest, "train", s["micro_batch"], s["seq_len"], s["seed"], rank=self.rank,
                                  world_size=world)

    # ---- resume -------------------------------------------------------------------------------

    def resume(self, resume: str, on_code_change: str) -> None:
        """Continue the run's checkpoint where it continues this run (``resume`` and ``on_code_change``
        as :func:`train` describes them), else move it aside and start over."""
        if resume not in ("auto", "never", "must", "force"):
            raise ValueError(f"resume must be auto, never, must or force, got {resume!r}")
        if on_code_change not in ON_CODE_CHANGE:
            raise ValueError(f"on_code_change must be one of {', '.join(ON_CODE_CHANGE)}, got {on_code_change!r}")
        self.fingerprint, self.files_now, self.commit_now = code_fingerprint(), code_files(), git_state()
        self.code_changes = []
        st, stale, stale_step = self._checkpoint_to_continue(resume, on_code_change)
        if resume in ("must", "force") and st is None:
            raise FileNotFoundError(f"{self.ck_path}: --resume {resume}, but there is no checkpoint to continue")
        if stale is not None:
            self._move_aside(stale, stale_step)
        planned_epochs = self.steps_total * self.tokens_per_step / max(self.train_split_tokens, 1)
        if self.master and planned_epochs > 1:
            self.say(f"[train] warning: {self.steps_total} updates of {self.tokens_per_step:,} tokens read the "
                     f"{self.train_split_tokens:,}-token training split {planned_epochs:.1f} times; past one epoch the "
                     "validation loss measures memorisation as well as modelling (point the scale's data stage at a "
                     "larger corpus)")
        self.guard = GradGuard(**self.s["grad_guard"])
        if st is not None:
            self._restore(st)

    def _checkpoint_to_continue(self, resume: str, on_code_change: str) -> tuple[dict | None, str | None, int | None]:
        """(the checkpoint record to continue or None, why the checkpoint is stale or None, its step);
        a run continued across a code change adds it to :attr:`code_changes`."""
        out, s = self.out, self.s
        st, stale, stale_step = None, None, None
        if not ckpt.has_checkpoint(out):
            return st, stale, stale_step
        if resume == "never":
            return st, "--resume never", stale_step
        if not self.ck_path.exists():
            return st, f"{', '.join(n for n in ckpt.LEGACY_FILES if (out / n).exists())} is an earlier checkpoint format", stale_step
        rec = ckpt.verify_files(out, self.rank, self.world)  # a file that fails its check stops the run (CheckpointError)
        stale_step = rec["step"]
        problems, code_differs = resume_problems(rec, s, self.mcfg_dict, self.manifest_sha, self.world, self.fingerprint)
        if rec["format"] != ckpt.FORMAT:
            problems.append(f"written in the earlier format {rec['format']}")
        change = _code_change(rec, self.files_now, self.commit_now) if code_differs else None
        keep_going = resume == "force" or (resume == "auto" and on_code_change == "continue")
        if code_differs and not problems and resume == "auto" and on_code_change == "refuse":
            raise CodeChanged(
                f"{self.ck_path}: the checkpoint at step {rec['step']} was written by other training code "
                f"({_describe_change(change)}); refusing to continue or discard it. Continue it with this code "
                "(--resume force; in the workflow train.on_code_change: continue) or start over (--resume "
                "never; train.on_code_change: restart); docs/slurm.md, 'After a code edit'")
        if code_differs and not keep_going:
            problems.append(f"written by other training code ({_describe_change(change)}; a run must not mix two "
                            "code versions unless told to)")
        if problems and resume in ("must", "force"):
            raise ResumeMismatch(f"{self.ck_path}: refusing to resume: " + "; ".join(problems)
                                 + " (--resume auto or never starts over)")
        if problems:
            return st, "; ".join(problems), stale_step
        self.code_changes = list(rec.get("code_changes") or []) + ([change] if change else [])
        if change and self.master:
            self.say(f"[train] {out.name}: continuing the checkpoint at step {rec['step']} with other training code "
                     f"({_describe_change(change)}); recorded in the result")
        return rec, stale, stale_step

    def _move_aside(self, stale: str, stale_step: int | None) -> None:
        """Move a checkpoint that does not continue this run into ``<out>/stale/`` (rank 0, every rank
        having read it first)."""
        if self.world > 1:
            dist.barrier()  # every rank has read the checkpoint before it moves
        if self.master:
            dest = ckpt.move_aside(self.out, f"{stale}\n")
            at = f" at step {stale_step}" if stale_step is not None else ""
            self.say(f"[train] {self.out.name}: the checkpoint{at} does not continue this run ({stale}); "
                     f"moved it aside to {dest} and starting over")
        if self.world > 1:
            dist.barrier()

    def _restore(self, st: dict) -> None:
        """Weights, and the optimiser state of the parameters this rank owns now, read by name from
        whichever rank's file holds them: another world size reshards the state."""
        out, rank, world = self.out, self.rank, self.world
        ckpt.restore_training(out, st, self.model, self.local_opts)
        world_then = int(st["world_size"])
        mine = ckpt.read_state(out, st, rank if rank < world_then else 0)
        self.step, self.tokens, self.train_s = st["step"], st["tokens"], st["train_s"]
        self.wall_prev, self.cpu_prev = st["wall_s"], st["cpu_s"]
        self.grad_norms = list(mine["grad_norms"] if rank == 0 else ckpt.read_state(out, st, 0)["grad_norms"])
        self.loader.load_state_dict(mine["loader"], reshard=world_then != world)
        ckpt.set_rng_state(mine["rng"])  # a rank the checkpoint did not have starts from rank 0's states
        self.guard.replay(self.grad_norms)  # the guard's history and outliers, as the uninterrupted run has them
        self.resumed = True
        if self.master and world_then != world:
            self.say(f"[train] {out.name}: the checkpoint at step {self.step} was written by {world_then} ranks; "
                     f"resharded onto {world} (micro_batch {self.s['micro_batch']} x grad_accum {self.s['grad_accum']} "
                     "per rank)")

    # ---- wrap ---------------------------------------------------------------------------------

    def wrap(self) -> None:
        """The loss module (DDP-wrapped on several ranks, compiled where the spec says), the metrics
        file (cut at the resumed step) and the run's spec.json."""
        s, out, world, step = self.s, self.out, self.world, self.step
        self.lm = LossModule(self.model, s["precision"])
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.lm = DDP(self.lm, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                          gradient_as_bucket_view=True)
        self.fwd = torch.compile(self.lm, dynamic=False) if s["compile"] else self.lm
        self.metrics = MetricsWriter(out / "metrics.jsonl", enabled=self.master)
        if not self.master:
            return
        self.metrics.truncate_after(step if self.resumed else -1)
        atomic_write_json(out / "spec.json", {"spec": s, "model_config": self.mcfg_dict, "data": str(self.data),
                                              "manifest_sha256": self.manifest_sha, "world_size": world,
                                              "total_steps": self.steps_total, "tokens_per_step": self.tokens_per_step})
        self.say(f"[train] {out.name}: {self.model.num_parameters():,} parameters, {self.steps_total} steps of "
                 f"{self.tokens_per_step:,} tokens, device {self.device}, world {world}, attention "
                 f"{self.attention['backend']} ({self.attention['version']})"
                 + (f", resumed at step {step}" if self.resumed else ""))
        warn_compiled_flex(self.mcfg.attention, self.device, s["compile"], self.say)

    def val_batches(self):
        val_bs = self.s["val"]["batch_size"] or self.s["micro_batch"]
        return iter_eval_batches(self.manifest, "val", val_bs, self.s["seq_len"])

    def save_checkpoint(self) -> float:
        """Every rank writes its share side by side (lrattnres/train/checkpoint.py); returns seconds."""
        t0 = time.perf_counter()
        if self.master:
            self.metrics.flush()
        ckpt.save_checkpoint(
            self.out, tensors=ckpt.training_tensors(self.model, self.local_opts, self.owner, self.rank),
            state={"rng": ckpt.rng_state(), "loader": self.loader.state_dict(),
                   "grad_norms": self.grad_norms if self.master else []},
            meta={"step": self.step, "tokens": self.tokens, "train_s": self.train_s,
                  "wall_s": self.wall_prev + time.perf_counter() - self.t_process,
                  "cpu_s": self.cpu_prev + time.process_time() - self.cpu_process,
                  "world_size": self.world, "spec": self.s, "model_config": self.mcfg_dict,
                  "manifest_sha256": self.manifest_sha, "code_sha256": self.fingerprint, "code_files": self.files_now,
                  "commit": self.commit_now, "code_changes": self.code_changes},
            rank=self.rank, world=self.world,
        )
        return time.perf_counter() - t0

    # ---- the updates --------------------------------------------------------------------------

    def loop(self, stop: _StopFlag, stop_after: int | None, progress: bool) -> dict | None:
        """Update until the run's last step; None, or the non-finite update that ended the run
        (spec ``record_nonfinite``). A signal, a deadline or ``stop_after`` raises :class:`Preempted`
        with the checkpoint written."""
        s, name = self.s, self.out.name or "train"
        self.live = self.master and progress and interactive(sys.stderr)
        self.bar = progress_bar(self.steps_total, self.step, enabled=self.live, desc=name)
        # where no live bar is drawn (a log file, a batch job, --no-progress): plain status lines
        self.status = (StatusLines(name, self.steps_total, self.step, s["log_every_s"], self.say)
                       if self.master and not self.live and s["log_every_s"] > 0 else None)
        self.last_step_s, self.last_save_s = 0.0, 0.0
        first_step = self.step
        stopped = None
        try:
            while self.step < self.steps_total:
                self._stop_if_asked(stop, stop_after, first_step)
                stopped = self._update()
                if stopped is not None:
                    break
                self._validate_and_checkpoint()
        finally:
            self.bar.close()
            if self.status is not None:
                self.status.close()
            self.metrics.flush()
        return stopped

    def _stop_if_asked(self, stop: _StopFlag, stop_after: int | None, first_step: int) -> None:
        """Preemption, a deadline (LRATTNRES_DEADLINE: the next update and a checkpoint would end after
        it) or a requested stop, on any rank (all ranks agree): checkpoint, then :class:`Preempted`."""
        ddp, step = self.world > 1, self.step
        rest = deadline_mod.left()
        due = rest is not None and rest < self.last_step_s + self.last_save_s + 1.0
        flag = torch.tensor([2.0 if stop.signum is not None else 1.0 if due else 0.0],
                            device=self.device if ddp else "cpu")
        if ddp:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 or (stop_after is not None and step >= stop_after):
            self.save_checkpoint()
            why = ("signal" + (f" {stop.signum}" if stop.signum is not None else " on another rank")
                   if flag.item() >= 2 else deadline_mod.ENV if flag.item() > 0 else f"stop_after={stop_after}")
            reason = "signal" if flag.item() >= 2 else "deadline" if flag.item() > 0 else "stop_after"
            raise Preempted(f"stopped at step {step} ({why}); checkpoint {self.ck_path} written; rerun to resume",
                            reason=reason, updates=step - first_step)

    def _update(self) -> dict | None:
        """One optimiser update, recorded; None, or the record of a non-finite update that ends the run
        before it is applied (``record_nonfinite``; without it :class:`NonFiniteLoss`)."""
        s, master, bar = self.s, self.master, self.bar
        t0 = time.perf_counter()
        mult = lr_multiplier(self.step, self.steps_total, s["schedule"]["warmup_steps"], s["schedule"]["warmdown_frac"],
                             s["schedule"]["final_lr_frac"])
        lr_now = apply_lr(self.optimizers, self.lrs, mult)
        batches = [next(self.loader) for _ in range(s["grad_accum"])]
        ce, zl, gn = accumulate_gradients(self.fwd, self.lm, batches, self.params, self.device, float(s["z_loss"]),
                                          s["grad_clip"], self.world, segments=self.attention["backend"] == "flash")
        event = self.guard.observe(self.step, gn)  # every rank sees the same norm; rank 0 reports it
        if event is not None and master:
            (bar.write if self.live else self.say)(self.guard.line(self.out.name or "train", event))
            self.metrics.write({"kind": "grad_outlier", "step": self.step + 1, **event})
        bad = next(((term, v) for term, v in (("cross-entropy", ce), ("z-loss", zl), ("gradient norm", gn))
                    if not math.isfinite(v)), None)
        if bad is not None:
            step = self.step
            why = f"non-finite {bad[0]} ({bad[1]}) at step {step + 1} (update index {step}); stopped before the update"
            if not s.get("record_nonfinite"):
                raise NonFiniteLoss(f"{why}; the last good checkpoint {self.ck_path} (if any) is kept")
            stopped = {"update": step + 1, "term": bad[0], "value": str(bad[1]), "reason": why}
            self.metrics.write({"kind": "stopped", "step": step, "tokens": self.tokens, **stopped})
            if master:
                bar.write(f"[train] {why}; recorded as the run's result (record_nonfinite)")
            return stopped
        apply_update(self.optimizers, self.device)
        dt = time.perf_counter() - t0
        self.last_step_s = dt
        self.train_s += dt
        self.step += 1
        self.tokens += self.tokens_per_step
        self.grad_norms.append(gn)
        tps = self.tokens_per_step
        self.metrics.write({"kind": "train", "step": self.step, "tokens": self.tokens, "loss": ce + zl, "ce": ce,
                            "zloss": zl, "grad_norm": gn, "lr": lr_now, "lr_mult": mult, "tokens_per_s": tps / dt,
                            "step_s": dt, "memory": memory_stats(self.device)})
        bar.update(1)
        if self.status is not None:
            self.status.update(self.step, ce + zl, tps)
        if master and (self.step % 10 == 0 or self.step == self.steps_total):
            bar.set_postfix(loss=f"{ce + zl:.3f}", tok_s=f"{tps / dt:,.0f}", refresh=False)
        return None

    def _validate_and_checkpoint(self) -> None:
        """The periodic validation and checkpoint after an update (not after the last one)."""
        s, step = self.s, self.step
        ve = s["val"]["every"]
        if ve and step % ve == 0 and step < self.steps_total:
            r = evaluate(self.model, self.val_batches(), self.device, s["precision"], s["val"]["batches"], self.rank,
                         self.world)
            self.metrics.write({"kind": "val", "step": step, "tokens": self.tokens, "val_ce": r["ce"],
                                "val_tokens": r["tokens"]})
            if self.master:
                self.bar.write(f"[train] step {step}: val ce {r['ce']:.4f} ({r['tokens']} tokens)")
        ce_every = s["checkpoint"]["every"]
        if ce_every and step % ce_every == 0 and step < self.steps_total:
            self.last_save_s = self.save_checkpoint()

    # ---- end ----------------------------------------------------------------------------------

    def finish(self, stopped: dict | None) -> dict[str, Any]:
        """Final checkpoint, weights, final validation, and the result (written last)."""
        s, out, step, tokens, master = self.s, self.out, self.step, self.tokens, self.master
        if stopped is None:
            self.save_checkpoint()
        if master:
            ckpt.save_model(self.model.state_dict(), {"model_config": self.mcfg_dict, "spec": s,
                                                      "manifest_sha256": self.manifest_sha, "step": step,
                                                      "tokens": tokens}, out / ckpt.MODEL_FILE)
        final = {"ce": None, "tokens": 0}
        if s["val"]["final"] and stopped is None:
            final = evaluate(self.model, self.val_batches(), self.device, s["precision"], None, self.rank, self.world)
            self.metrics.write({"kind": "final_val", "step": step, "tokens": tokens, "val_ce": final["ce"],
                                "val_tokens": final["tokens"]})
        self.metrics.close()
        end = end_of_run_summary(out / "metrics.jsonl") if master else {}
        train_s, split = self.train_s, self.train_split_tokens
        result = {
            "stage": "train",
            "run_id": out.name,
            "final_val_ce": final["ce"],
            "val_tokens": final["tokens"],
            **end,  # final_train_ce (mean of the last updates), steady_tokens_per_s (compilation excluded)
            "steps": step,
            "tokens": tokens,
            "train_split_tokens": split,
            "data_epochs": tokens / max(split, 1),  # > 1: the run saw its training data more than once
            "wall_s": self.wall_prev + time.perf_counter() - self.t_process,  # all processes of the run, start-up included
            "train_s": train_s,  # time inside optimiser steps (no start-up, validation or checkpoints)
            "cpu_s": self.cpu_prev + time.process_time() - self.cpu_process,  # process CPU time (rank 0)
            "resumed": self.resumed,
            # runs continued across a change of the training code: both commits and the changed files
            "code_changes": self.code_changes,
            "tokens_per_s": tokens / train_s if train_s > 0 else None,
            "steps_per_s": step / train_s if train_s > 0 else None,
            "grad_norm": grad_norm_summary(self.grad_norms, s["grad_clip"], self.guard),
            "stopped": stopped,  # None, or the non-finite update that ended the run (record_nonfinite)
            "parameters": self.model.num_parameters(),
            "model_config": self.mcfg_dict,
            "world_size": self.world,
            "memory": memory_stats(self.device),
            "provenance": provenance(s, started=self.started, attention=self.attention),
        }
        if master:
            atomic_write_json(out / "result.json", result)
            self.say(f"[train] {out.name}: done, {step} steps, final val ce {final['ce']}, "
                     f"{result['tokens_per_s'] or 0:,.0f} tokens/s")
        return result
