"""The throughput spec: the timed methods, the gains between them, every key and its default, and
the check of a spec (an unknown or bad key is named)."""

from __future__ import annotations

import copy
from typing import Any

from lrattnres.checks import is_int, is_number
from lrattnres.errors import SpecError
from lrattnres.presets import PRESETS


METHOD_TABLE: dict[str, dict[str, Any]] = {
    "baseline": {"method": "baseline", "impl": "torch", "router": "reference", "rank": None},
    "fused-rd": {"method": "attnres", "impl": "fused", "router": "fused", "rank": "d"},
    "fused-rd4": {"method": "lr", "impl": "fused", "router": "fused", "rank": "d/4"},
    "reference-rd4": {"method": "lr", "impl": "reference", "router": "reference", "rank": "d/4"},
    "fla-rd": {"method": "attnres", "impl": "fla", "router": "fla", "rank": "d"},
}

# (name, numerator, denominator): g = 100 (v_num / v_den - 1)
GAINS: tuple[tuple[str, str, str], ...] = (
    ("rank", "fused-rd4", "fused-rd"),
    ("kernel", "fused-rd4", "reference-rd4"),
    ("combined_vs_fla", "fused-rd4", "fla-rd"),
    ("kernel_vs_fla", "fused-rd", "fla-rd"),
    ("routing_rd4", "fused-rd4", "baseline"),
    ("routing_rd", "fused-rd", "baseline"),
)

DEFAULTS: dict[str, Any] = {
    "presets": ["tiny"],
    "methods": ["fla-rd", "fused-rd", "fused-rd4"],  # Table 3's three; "baseline", "reference-rd4" are extra rows
    "micro_batch": 4,
    "seq_len": 128,
    "grad_accum": 1,
    "grad_accum_by_preset": {},  # e.g. {"4B": 2}: per-preset override of grad_accum
    "repeats": 5,
    "repeats_by_preset": {},  # e.g. {"4B": 3}
    "methods_by_preset": {},  # e.g. {"4B": ["fla-rd", "fused-rd", "fused-rd4"]}
    "warmup": 3,  # updates before the measured ones in every timed run (compilation happens in the first)
    "min_updates": 8,
    "max_updates": 30,
    "window": 6,
    "stride": 2,
    "cv": 0.01,
    "drift": 0.005,
    "blocks": 8,
    "device": "auto",
    "precision": "auto",  # auto: bf16 on CUDA, fp32 on the CPU
    "compile": False,
    "attention": "auto",
    "seed": 0,
    "tokens": "data",  # data: the data stage's first training batches (given --data); synthetic: log-normal documents
    "vocab_size": None,  # synthetic tokens: None = the preset's vocabulary (512 for the small presets)
    "doc_len_median": 512,  # synthetic tokens: median document length (log-normal, sigma 1)
    "deadline_s": None,  # start no new repeat after this many seconds from the start (number, or {preset: s})
    "threads": "auto",  # torch.set_num_threads; auto: 1 on the CPU (steadier timing on a shared machine), untouched on CUDA
    "published": None,  # path of published.yaml (claim ids); default: reports/published.yaml of the repo
    "claims": True,  # false: produce no claims (a second recorded result of the same sizes)
    # Resolution: after the `repeats`, more repeats of the resolved gain's two methods until its 95% interval's
    # half-width (percentage points) is at most target_half_width, max_repeats are done, or budget_s is spent.
    "target_half_width": None,  # null: the `repeats` only
    "resolve_gain": "rank",  # a name of GAINS
    "max_repeats": 30,  # repeats in all, the `repeats` included
    "budget_s": None,  # seconds one size may take over all its commands (number or {preset: s}); null: no bound
}

SMALL_VOCAB = 512
PAPER_SIZES = {"1B": "1b", "4B": "4b"}
PAPER_GPUS = ("H100", "B200")


def _check(cond: bool, key: str, expected: str, got: Any) -> None:
    if not cond:
        raise SpecError(f"throughput spec key {key!r}: expected {expected}, got {got!r}")


def resolve_spec(spec: dict | None) -> dict:
    """Defaults merged in, every key validated; unknown keys are named."""
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise SpecError(f"throughput spec: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise SpecError(f"throughput spec key {unknown[0]!r} is not known; expected one of {sorted(DEFAULTS)}")
    s = copy.deepcopy(DEFAULTS)
    s.update(copy.deepcopy(spec))

    _check(isinstance(s["presets"], list) and s["presets"] and all(p in PRESETS for p in s["presets"]),
           "presets", f"a non-empty list of preset names from {sorted(PRESETS)}", s["presets"])
    _check(isinstance(s["methods"], list) and s["methods"] and all(m in METHOD_TABLE for m in s["methods"])
           and len(set(s["methods"])) == len(s["methods"]),
           "methods", f"a non-empty list of distinct names from {list(METHOD_TABLE)}", s["methods"])
    for k in ("micro_batch", "seq_len", "grad_accum", "repeats", "warmup", "min_updates", "max_updates", "window",
              "stride", "blocks", "doc_len_median"):
        lo = 0 if k == "warmup" else 1
        _check(is_int(s[k]) and s[k] >= lo, k, f"an int >= {lo}", s[k])
    _check(s["max_updates"] >= s["min_updates"], "max_updates", f"an int >= min_updates={s['min_updates']}",
           s["max_updates"])
    _check(s["window"] >= 2, "window", "an int >= 2", s["window"])
    for k in ("cv", "drift"):
        _check(is_number(s[k]) and s[k] >= 0, k, "a number >= 0 (a fraction: 0.01 = 1%)", s[k])
    for k, check, what in (("grad_accum_by_preset", lambda v: is_int(v) and v >= 1, "positive ints"),
                           ("repeats_by_preset", lambda v: is_int(v) and v >= 1, "positive ints"),
                           ("methods_by_preset", lambda v: isinstance(v, list) and v and all(m in METHOD_TABLE for m in v),
                            f"non-empty lists of names from {list(METHOD_TABLE)}")):
        d = s[k]
        _check(isinstance(d, dict) and all(p in s["presets"] for p in d), k,
               f"an object keyed by presets of {s['presets']}", d)
        for p, v in d.items():
            _check(check(v), f"{k}.{p}", what, v)
    _check(s["device"] in ("auto", "cpu", "cuda"), "device", "'auto', 'cpu' or 'cuda'", s["device"])
    _check(s["precision"] in ("auto", "fp32", "bf16"), "precision", "'auto', 'fp32' or 'bf16'", s["precision"])
    _check(isinstance(s["compile"], bool), "compile", "a bool", s["compile"])
    from lrattnres.attention import BACKENDS

    _check(s["attention"] in BACKENDS, "attention", f"one of {BACKENDS}", s["attention"])
    _check(is_int(s["seed"]) and s["seed"] >= 0, "seed", "a non-negative int", s["seed"])
    _check(s["tokens"] in ("data", "synthetic"), "tokens", "'data' or 'synthetic'", s["tokens"])
    _check(s["vocab_size"] is None or (is_int(s["vocab_size"]) and s["vocab_size"] >= 2), "vocab_size",
           "null or an int >= 2", s["vocab_size"])
    dl = s["deadline_s"]
    _check(dl is None or (is_number(dl) and dl > 0) or (isinstance(dl, dict) and all(p in s["presets"] and is_number(v)
                                                                                   and v > 0 for p, v in dl.items())),
           "deadline_s", "null, a positive number of seconds, or {preset: seconds} (counted from the start)", dl)
    _check(s["threads"] in (None, "auto") or (is_int(s["threads"]) and s["threads"] >= 1), "threads",
           "'auto', null or an int >= 1", s["threads"])
    _check(s["published"] is None or isinstance(s["published"], str), "published", "null or a path", s["published"])
    _check(isinstance(s["claims"], bool), "claims", "a bool", s["claims"])
    thw = s["target_half_width"]
    _check(thw is None or (is_number(thw) and thw > 0), "target_half_width",
           "null or a positive number of percentage points", thw)
    _check(s["resolve_gain"] in [g[0] for g in GAINS], "resolve_gain", f"one of {[g[0] for g in GAINS]}",
           s["resolve_gain"])
    _check(is_int(s["max_repeats"]) and s["max_repeats"] >= 1, "max_repeats", "an int >= 1", s["max_repeats"])
    bud = s["budget_s"]
    _check(bud is None or (is_number(bud) and bud > 0) or (isinstance(bud, dict) and all(
        p in s["presets"] and is_number(v) and v > 0 for p, v in bud.items())),
           "budget_s", "null, a positive number of seconds, or {preset: seconds} (over all of a size's commands)", bud)
    _check(not s["compile"] or s["warmup"] >= 1, "warmup",
           "an int >= 1 with compile true (compilation happens in the first warm-up update, outside the timed "
           "region)", s["warmup"])
    for p in s["presets"]:
        ml = PRESETS[p]["max_seq_len"]
        _check(s["seq_len"] <= ml, "seq_len", f"at most preset {p!r}'s max_seq_len={ml}", s["seq_len"])
    return s


def for_preset(s: dict, key: str, preset: str):
    """A key that is one value for every size or ``{preset: value}`` (``deadline_s``, ``budget_s``)."""
    v = s[key]
    return v.get(preset) if isinstance(v, dict) else v
