"""The batch split of each model size: sequences per GPU, accumulation and GPUs.

One optimiser update reads ``micro_batch x seq_len x grad_accum x world`` tokens, where ``world``
is the data-parallel world size of a training job: the GPUs of each node
(``resources.train.gpu``, at least 1) times its nodes (``resources.train.nodes``, default 1).

Each model size has its own split, so that each fits its GPUs' memory (lrattnres/memory.py): the
main preset takes ``train``'s ``micro_batch``, ``grad_accum``, ``shard_optimizer`` and
``val.batch_size``; the size pair's presets take those of ``grid.pair.small`` and
``grid.pair.large`` where given (else ``train``'s). ``grad_accum: auto`` derives the accumulation
from ``train.tokens_per_update``, so that a change of the GPU count lowers or raises the
accumulation and never the tokens of an update (nor, with a fixed number of updates, of a run).

:func:`check` refuses a split whose tokens per update differ from ``train.tokens_per_update``, and
at the paper scale any split that is not the paper's 262,144 tokens per update (Section 4.1: "All
scales use a global batch size of 262,144 tokens"), for every run and at the configured GPU count.
"""

from __future__ import annotations

from typing import Any

from lrattnres.errors import UserError

PAPER_TOKENS_PER_UPDATE = 262_144  # Section 4.1
SIZE_ROLES = ("small", "large")  # grid.pair.<role>: the size pair's presets
BATCH_KEYS = ("micro_batch", "grad_accum", "shard_optimizer", "val_batch_size", "activation_checkpointing")
CHECKPOINTING = ("auto", True, False)


class BatchError(UserError, ValueError):
    """A batch split that is not the scale's tokens per update; the message names the field."""


def world_size(settings: dict) -> int:
    """The data-parallel world size of a training job: GPUs per node (at least 1) x nodes."""
    train = settings.get("resources", {}).get("train", {})
    return max(1, int(train.get("gpu", 0) or 0)) * max(1, int(train.get("nodes", 1) or 1))


def _preset_role(settings: dict, preset: str) -> str | None:
    """``grid.pair``'s role (small | large) whose preset is ``preset`` and that sets a batch, else None."""
    presets, pair = settings.get("presets", {}), settings.get("grid", {}).get("pair") or {}
    for role in SIZE_ROLES:
        if presets.get(role) == preset and any(k in (pair.get(role) or {}) for k in BATCH_KEYS):
            return role
    return None


def split(settings: dict, preset: str) -> dict[str, Any]:
    """The batch split of runs of ``preset``: ``micro_batch``, ``grad_accum`` (an int),
    ``shard_optimizer``, ``val_batch_size`` (None: the trainer's default), ``activation_checkpointing``
    (auto, true or false as configured; lrattnres/memory.py resolves auto), ``world``,
    ``tokens_per_update`` and ``where`` (the config field that sets it)."""
    train = settings["train"]
    role = _preset_role(settings, preset)
    if role is None:
        block, where = train, "train"
        out = {"micro_batch": train["micro_batch"], "grad_accum": train.get("grad_accum", 1),
               "shard_optimizer": bool(train.get("shard_optimizer", False)),
               "val_batch_size": (train.get("val") or {}).get("batch_size"),
               "activation_checkpointing": train.get("activation_checkpointing", "auto")}
    else:
        block, where = settings["grid"]["pair"][role], f"grid.pair.{role}"
        out = {"micro_batch": block.get("micro_batch", train["micro_batch"]),
               "grad_accum": block.get("grad_accum", train.get("grad_accum", 1)),
               "shard_optimizer": bool(block.get("shard_optimizer", train.get("shard_optimizer", False))),
               "val_batch_size": block.get("val_batch_size", (train.get("val") or {}).get("batch_size")),
               "activation_checkpointing": block.get("activation_checkpointing",
                                                     train.get("activation_checkpointing", "auto"))}
    world = world_size(settings)
    seq = train["seq_len"]
    target = train.get("tokens_per_update")
    per_step = out["micro_batch"] * seq * world
    if out["grad_accum"] == "auto":
        if target is None:
            raise BatchError(f"{where}.grad_accum: 'auto' derives the accumulation from train.tokens_per_update, "
                             "which is not set; expected an integer or a train.tokens_per_update")
        if target % per_step:
            raise BatchError(
                f"{where}.grad_accum: auto: train.tokens_per_update {target:,} is not a multiple of micro_batch "
                f"{out['micro_batch']} x seq_len {seq} x {world} GPUs = {per_step:,}; expected a micro_batch or GPU "
                f"count that divides it")
        out["grad_accum"] = target // per_step
    out.update(world=world, tokens_per_update=per_step * out["grad_accum"], where=where)
    return out


def check(settings: dict, where: str) -> None:
    """Every preset of the scale's runs updates with the scale's tokens per update (see the module)."""
    train = settings["train"]
    target = train.get("tokens_per_update")
    if settings.get("paper_runs") and target != PAPER_TOKENS_PER_UPDATE:
        raise BatchError(f"{where}.train.tokens_per_update: {target!r}; a scale of the paper's own runs (paper_runs: "
                         f"true) updates with the paper's {PAPER_TOKENS_PER_UPDATE:,} tokens (Section 4.1); expected "
                         f"{PAPER_TOKENS_PER_UPDATE}")
    presets = settings.get("presets", {})
    pair = settings.get("grid", {}).get("pair") or {}
    for role in SIZE_ROLES:
        if presets.get(role) == presets.get("main") and any(k in (pair.get(role) or {}) for k in BATCH_KEYS):
            raise BatchError(f"{where}.grid.pair.{role}: preset {presets.get(role)!r} is also the main preset, whose "
                             "batch is train's; expected the batch keys in train only")
    for preset in dict.fromkeys(p for p in (presets.get("main"), *(presets.get(r) for r in SIZE_ROLES)) if p):
        try:
            b = split(settings, preset)
        except BatchError as e:
            raise BatchError(f"{where}.{e}") from None
        if target is not None and b["tokens_per_update"] != target:
            raise BatchError(
                f"{where}.{b['where']}: micro_batch {b['micro_batch']} x seq_len {train['seq_len']} x grad_accum "
                f"{b['grad_accum']} x {b['world']} GPUs = {b['tokens_per_update']:,} tokens per update ({preset}); "
                f"expected train.tokens_per_update = {target:,} (grad_accum: auto keeps it for any GPU count)")
