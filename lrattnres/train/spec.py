"""The training spec: defaults (the paper's recipe, Section 4.1), validation, resume comparison.

The spec is one JSON object (``--spec``).  Every hyper-parameter of a run is a key of it; the
defaults below are the paper's values and are written, resolved, into the run's ``spec.json``.
Unknown keys and wrong types stop the run with a message naming the key.
"""

from __future__ import annotations

import math
from typing import Any

from lrattnres.checks import is_int, is_number
from lrattnres.merge import deep_merge
from lrattnres.errors import SpecError
from lrattnres.train import guard

# The paper's recipe (Section 4.1; the author's repository, jon123boss/LR-AttnRes).  Shape/size keys
# (model, steps or tokens, micro_batch, seq_len) have no default: the scale's config must give them.
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "grad_accum": 1,
    "optim": {
        "muon": {"lr": 1e-3, "momentum": 0.95, "weight_decay": 0.1, "nesterov": True, "ns_steps": 5,
                 "adjust_lr_fn": "original", "ns_dtype": "auto"},
        "adam": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.0, "eps": 1e-8},
    },
    "schedule": {"warmup_steps": 2000, "warmdown_frac": 0.2, "final_lr_frac": 0.0},
    "z_loss": 1e-5,
    "grad_clip": 1.0,
    "val": {"every": 0, "batches": 4, "batch_size": None, "final": True},
    "checkpoint": {"every": 0},
    "precision": "fp32",
    "compile": False,
    "device": "auto",
    # seconds between two plain status lines (step, loss, tokens/s, elapsed, ETA) where no live bar is
    # drawn: a log file, a batch job; 0: none.  An execution setting, not science.
    "log_every_s": 60.0,
    # the gradient-norm guard (lrattnres/train/guard.py): a pre-clip norm above factor x the running
    # median of the last `window` norms (once `min_history` are known), or not finite, is reported in
    # one line and recorded in result.json.  It only observes: an execution setting, not science.
    "grad_guard": {"factor": 100.0, "window": 100, "min_history": 10},
}

# Keys that may change between a run and its resumption (they do not change the trajectory).
# ``shard_optimizer`` (ZeroRedundancyOptimizer over the data-parallel ranks) makes the same update;
# the checkpoint keeps the optimiser state by parameter name, so either kind of run resumes the other.
# ``activation_checkpointing`` (recompute each layer's activations in the backward) gives the same
# gradients with less memory.
RESUMABLE_CHANGES = ("device", "compile", "val", "checkpoint", "shard_optimizer", "log_every_s", "grad_guard",
                     "activation_checkpointing")
# Keys without a default: absent is the same as false, so that specs written before them still match.
# ``record_nonfinite``: a non-finite loss or gradient norm ends the run with a result that says so
# (``stopped``, no final validation) instead of failing it; the learning-rate check's runs set it,
# since a diverged learning rate is one of the check's outcomes (lrattnres/lrcheck.py).
OPTIONAL_FLAGS = ("shard_optimizer", "record_nonfinite", "activation_checkpointing")
# Keys without a default that a scale gives where it fixes its global batch: the trainer refuses a
# world size whose micro_batch x seq_len x grad_accum x ranks differs from it.
OPTIONAL_INTS = ("tokens_per_update",)

_MODEL_KEYS = {
    "preset", "vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "max_seq_len", "method", "blocks",
    "rank", "norm_eps", "rope_base", "init_std", "router", "attention", "stream_dtype",
}


def _check(cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise SpecError(f"spec key {key!r}: expected {expected}, got {got!r}")


def _check_known(d: dict, allowed: set, prefix: str) -> None:
    for k in d:
        if k not in allowed:
            where = f"{prefix}.{k}" if prefix else k
            raise SpecError(f"spec key {where!r} is not known; expected one of {sorted(allowed)}")


def resolve(spec: dict) -> dict:
    """Defaults merged in, every key validated; returns a new dict."""
    if not isinstance(spec, dict):
        raise SpecError(f"spec: expected a JSON object, got {type(spec).__name__}")
    allowed_top = set(DEFAULTS) | {"model", "steps", "tokens", "micro_batch", "seq_len", *OPTIONAL_FLAGS, *OPTIONAL_INTS}
    _check_known(spec, allowed_top, "")
    s = deep_merge(DEFAULTS, spec)

    for k in ("model", "micro_batch", "seq_len"):
        if k not in s:
            raise SpecError(f"spec key {k!r} is missing")
    m = s["model"]
    if isinstance(m, str):
        m = s["model"] = {"preset": m}
    _check(isinstance(m, dict), "model", "an object {preset or shape fields, method, blocks, rank, ...}", m)
    _check_known(m, _MODEL_KEYS, "model")

    has_steps, has_tokens = s.get("steps") is not None, s.get("tokens") is not None
    if has_steps == has_tokens:
        raise SpecError("spec: give exactly one of 'steps' and 'tokens'")
    if has_steps:
        _check(is_int(s["steps"]) and s["steps"] >= 1, "steps", "a positive int", s["steps"])
    else:
        _check(is_int(s["tokens"]) and s["tokens"] >= 1, "tokens", "a positive int", s["tokens"])
    for k in ("micro_batch", "grad_accum", "seq_len"):
        _check(is_int(s[k]) and s[k] >= 1, k, "a positive int", s[k])
    _check(is_int(s["seed"]) and s["seed"] >= 0, "seed", "a non-negative int", s["seed"])

    o = s["optim"]
    _check(isinstance(o, dict), "optim", "an object {muon, adam}", o)
    _check_known(o, {"muon", "adam"}, "optim")
    _check_known(o["muon"], set(DEFAULTS["optim"]["muon"]), "optim.muon")
    _check_known(o["adam"], set(DEFAULTS["optim"]["adam"]), "optim.adam")
    for g in ("muon", "adam"):
        for k in ("lr", "weight_decay"):
            v = o[g][k]
            _check(is_number(v) and v >= 0, f"optim.{g}.{k}", "a non-negative number", v)
    mu = o["muon"]
    _check(is_number(mu["momentum"]) and 0 <= mu["momentum"] < 1, "optim.muon.momentum", "a number in [0, 1)", mu["momentum"])
    _check(isinstance(mu["nesterov"], bool), "optim.muon.nesterov", "a bool", mu["nesterov"])
    _check(is_int(mu["ns_steps"]) and 1 <= mu["ns_steps"] < 100, "optim.muon.ns_steps", "an int in [1, 100)", mu["ns_steps"])
    _check(mu["adjust_lr_fn"] in ("original", "match_rms_adamw", None), "optim.muon.adjust_lr_fn",
           "'original', 'match_rms_adamw' or null", mu["adjust_lr_fn"])
    _check(mu["ns_dtype"] in ("auto", "bf16", "fp32"), "optim.muon.ns_dtype", "'auto', 'bf16' or 'fp32'", mu["ns_dtype"])
    b = o["adam"]["betas"]
    _check(isinstance(b, (list, tuple)) and len(b) == 2 and all(is_number(x) and 0 <= x < 1 for x in b),
           "optim.adam.betas", "two numbers in [0, 1)", b)
    o["adam"]["betas"] = list(b)
    _check(is_number(o["adam"]["eps"]) and o["adam"]["eps"] > 0, "optim.adam.eps", "a positive number", o["adam"]["eps"])

    sc = s["schedule"]
    _check(isinstance(sc, dict), "schedule", "an object", sc)
    _check_known(sc, set(DEFAULTS["schedule"]), "schedule")
    _check(is_int(sc["warmup_steps"]) and sc["warmup_steps"] >= 0, "schedule.warmup_steps", "a non-negative int", sc["warmup_steps"])
    _check(is_number(sc["warmdown_frac"]) and 0 <= sc["warmdown_frac"] <= 1, "schedule.warmdown_frac", "a number in [0, 1]", sc["warmdown_frac"])
    _check(is_number(sc["final_lr_frac"]) and 0 <= sc["final_lr_frac"] <= 1, "schedule.final_lr_frac", "a number in [0, 1]", sc["final_lr_frac"])

    _check(is_number(s["z_loss"]) and s["z_loss"] >= 0, "z_loss", "a non-negative number", s["z_loss"])
    gc = s["grad_clip"]
    _check(gc is None or (is_number(gc) and gc > 0), "grad_clip", "a positive number or null", gc)

    v = s["val"]
    _check(isinstance(v, dict), "val", "an object", v)
    _check_known(v, set(DEFAULTS["val"]), "val")
    _check(is_int(v["every"]) and v["every"] >= 0, "val.every", "a non-negative int (0: never)", v["every"])
    _check(is_int(v["batches"]) and v["batches"] >= 1, "val.batches", "a positive int", v["batches"])
    _check(v["batch_size"] is None or (is_int(v["batch_size"]) and v["batch_size"] >= 1), "val.batch_size",
           "a positive int or null (micro_batch)", v["batch_size"])
    _check(isinstance(v["final"], bool), "val.final", "a bool", v["final"])

    c = s["checkpoint"]
    _check(isinstance(c, dict), "checkpoint", "an object", c)
    _check_known(c, set(DEFAULTS["checkpoint"]), "checkpoint")
    _check(is_int(c["every"]) and c["every"] >= 0, "checkpoint.every", "a non-negative int (0: only final)", c["every"])

    _check(s["precision"] in ("fp32", "bf16"), "precision", "'fp32' or 'bf16'", s["precision"])
    _check(isinstance(s["compile"], bool), "compile", "a bool", s["compile"])
    _check(s["device"] in ("auto", "cpu", "cuda"), "device", "'auto', 'cpu' or 'cuda'", s["device"])
    _check(is_number(s["log_every_s"]) and s["log_every_s"] >= 0, "log_every_s",
           "a number of seconds >= 0 (0: no status lines)", s["log_every_s"])
    try:
        s["grad_guard"] = guard.check_settings(s["grad_guard"])
    except ValueError as e:
        key, _, what = str(e).partition(": ")
        raise SpecError(f"spec key {key!r}: {what}") from None
    for k in OPTIONAL_FLAGS:
        _check(isinstance(s.get(k, False), bool), k, "a bool", s.get(k))
    for k in OPTIONAL_INTS:
        _check(k not in s or (is_int(s[k]) and s[k] >= 1), k, "a positive int", s.get(k))
    return s


def total_steps(s: dict, world_size: int = 1) -> int:
    if s.get("steps") is not None:
        return int(s["steps"])
    per_step = s["micro_batch"] * s["seq_len"] * s["grad_accum"] * world_size
    return max(1, math.ceil(s["tokens"] / per_step))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def diff_keys(old: dict, new: dict, ignore: tuple[str, ...] = RESUMABLE_CHANGES) -> list[str]:
    """Dotted keys whose values differ (ignoring the top-level keys in ``ignore``)."""
    fo = {k: v for k, v in _flatten(old).items() if k.split(".")[0] not in ignore}
    fn = {k: v for k, v in _flatten(new).items() if k.split(".")[0] not in ignore}
    keys = sorted(set(fo) | set(fn))
    return [k for k in keys if fo.get(k, "<absent>") != fn.get(k, "<absent>")]


def describe_diff(old: dict, new: dict, keys: list[str]) -> str:
    fo, fn = _flatten(old), _flatten(new)
    return "; ".join(f"{k}: checkpoint {fo.get(k, '<absent>')!r} != now {fn.get(k, '<absent>')!r}" for k in keys)
