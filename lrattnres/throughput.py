"""Training-step throughput with the protocol of Section 4.9 and Appendix I (Table 3).

``python -m lrattnres throughput --spec '<json>' --out RESULT.json [--data MANIFEST]``

Protocol (Appendix I, "Matched model comparison", "Measurement protocol", "Paired uncertainty"):

* Matched weights: per repeat one shared initialisation of the backbone (seeded), copied into every
  method's model; the routing queries (the only extra parameters of the timed methods) are zeros,
  the production initialisation.  Same seed, same cached tokens for every method.
* Cached tokens: one fixed host buffer of ``grad_accum`` micro-batches with production document
  boundaries (the first training batches of ``--data``'s train split, or synthetic tokens with
  log-normal document lengths ended by the end-of-text id), read once, transferred to the device in
  every update exactly as the trainer does.
* One timed update is the production step of ``lrattnres.train``: ``LossModule`` (bf16 autocast,
  cross-entropy + z-loss), ``accumulate_gradients`` (host-to-device transfer, forward, backward over
  ``grad_accum`` micro-batches, clipping) and ``apply_update`` (Muon + AdamW from
  ``optim.build_optimizers``, zero_grad); the device is synchronised before and after.  Compilation,
  storage reads, evaluation and logging are outside the timed region (compilation happens in the
  warm-up updates).
* ``warmup`` (3) updates, then ``min_updates``..``max_updates`` (8..30) measured updates, stopping
  by :func:`should_stop`; every measured update counts: v = tokens x n / sum(times).
* ``repeats`` (5) fresh repeats per configuration, the method order rotated by one each repeat.
* Paired gains ``g_j = 100 (v_j^A / v_j^B - 1)`` over repeats j, reported as mean and a 95%
  interval ``mean +- t_{0.975, n-1} s_g / sqrt(n)`` (:func:`paired_gain`).  The paper prints the
  half-width as ``t_{0.975,4} s_g / 5``; the standard error of a mean of n = 5 is s / sqrt(5), and
  dividing by 5 would shrink the interval by sqrt(5) -- we take that as a typo and use s / sqrt(n).

Methods (``methods`` spec key, any subset, in this rotation order):

=================  =========  =======================================================  ======
name               method     router                                                   r
=================  =========  =======================================================  ======
``baseline``       baseline   none: the plain PreNorm backbone (beyond the paper)      --
``fused-rd``       attnres    this project's kernel (``kernels.attnres``)              d
``fused-rd4``      lr         this project's kernel                                    d/4
``reference-rd4``  lr         the PyTorch reference (``routing.route``)                d/4
``fla-rd``         attnres    FLA's ``fused_attnres`` (fla-core), CUDA only            d
=================  =========  =======================================================  ======

The default ``methods`` are Table 3's three (``fla-rd``, ``fused-rd``, ``fused-rd4``); ``baseline`` and
``reference-rd4`` are extra rows a scale may add. All routed methods use N = ``blocks`` (8), clipped
to 2L for presets with fewer writes.  FLA is
wired as an alternative router through :func:`fla_router`, an adapter with weightless key RMS
(``rms_weight = ones``); it is skipped with a note where ``fla`` does not import or the device is
not CUDA.

Gains: ``rank`` (fused-rd4 / fused-rd: Table 3's rank gain), ``kernel`` (fused-rd4 / reference-rd4),
``combined_vs_fla`` (fused-rd4 / fla-rd: Section 4.9's combined gain), ``kernel_vs_fla``
(fused-rd / fla-rd), ``routing_rd4`` and ``routing_rd`` (routed / baseline: the cost of routing).

Claims: only for the paper's shapes (presets 1B and 4B) measured on a GPU: the direction claims of
Section 4.9 per GPU, ``sec4.9.{rank_gain_positive,fast_beats_fla,combined_gain_positive}.<gpu>.<size>``
with the per-repeat paired gains as evidence (a GPU of the same architecture stands in for the
paper's: :data:`GPU_STAND_INS`), Appendix I's stopping rule (``appI.repeats_met_stopping_rule.<size>``:
the timed runs that did not converge); the value claims of Table 3 only when the GPU is one of the
paper's (H100, B200), under those ids.  Smaller scales produce no claims (the numbers are shown in
the report beside the paper's, marked as a different scale and hardware).

Resuming and deadlines: the workflow times one size per job (``{results}/throughput/<preset>.json``,
merged by ``--aggregate``). After every timed run the stage rewrites a partial state beside its
output (``<preset>.partial.json``: the finished runs, with the spec, device, data and code they were
made with); a rerun of the same spec on the same device continues from it, and a complete run
removes it. Under ``LRATTNRES_DEADLINE`` (lrattnres/deadline.py) no run starts that would not end
before the deadline (the longest finished run of the size is the estimate) and a run under way
stops between updates; the stage then exits 75 with its partial state kept, so that a retry, or a
later GPU command of lrattnres/pieces.py, continues it.

The stopping rule, the interval and the gains are pure functions, tested in tests/test_throughput.py.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from lrattnres.checks import is_int, is_number
from lrattnres.devices import resolve_device
from lrattnres.errors import SpecError

# --------------------------------------------------------------------------------------- spec

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
    "warmup": 3,
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
    from lrattnres.presets import PRESETS

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
    for p in s["presets"]:
        ml = PRESETS[p]["max_seq_len"]
        _check(s["seq_len"] <= ml, "seq_len", f"at most preset {p!r}'s max_seq_len={ml}", s["seq_len"])
    return s


# ------------------------------------------------------------------------------ stopping rule


def window_stats(times: list[float]) -> tuple[float, float]:
    """(coefficient of variation, drift) of one window of update times, as fractions.

    CV = sample SD / mean; drift = |mean(second half) - mean(first half)| / mean (for an odd window
    the middle update belongs to neither half)."""
    n = len(times)
    if n < 2:
        raise ValueError("a window needs at least 2 updates")
    mean = sum(times) / n
    cv = statistics.stdev(times) / mean
    h = n // 2
    first, second = times[:h], times[n - h:]
    drift = abs(sum(second) / h - sum(first) / h) / mean
    return cv, drift


def window_ok(times: list[float], cv: float, drift: float) -> bool:
    c, d = window_stats(times)
    return c <= cv and d <= drift


def should_stop(times: list[float], *, min_updates: int = 8, max_updates: int = 30, window: int = 6,
                stride: int = 2, cv: float = 0.01, drift: float = 0.005) -> tuple[bool, str]:
    """Whether to stop after the measured update times ``times`` (seconds), and why.

    Appendix I: 8 to 30 measured updates; stop when two consecutive six-update windows each have a
    coefficient of variation of at most 1% and a drift between their halves of at most 0.5%.  The
    two windows are the last ``window`` updates and the ``window`` updates ending ``stride`` updates
    earlier.  With the paper's numbers (window 6, stride 2) they span the last 8 updates, so the
    rule can first fire at the paper's minimum of eight; ``stride = window`` gives disjoint windows.
    Returns ``(True, "converged")``, ``(True, "max_updates")`` or ``(False, "")``.
    """
    n = len(times)
    if n >= max_updates:
        return True, "max_updates"
    if n < max(min_updates, window + stride):
        return False, ""
    late = times[n - window:]
    early = times[n - window - stride:n - stride]
    if window_ok(early, cv, drift) and window_ok(late, cv, drift):
        return True, "converged"
    return False, ""


# ------------------------------------------------------------------------------ uncertainty

# two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30 (scipy.stats.t.ppf(0.975, df), 3 decimals)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}


def t975(df: int, use_scipy: bool = True) -> float:
    """t_{0.975, df}: from scipy where installed, else the table (df <= 30) or a Cornish-Fisher expansion."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if use_scipy:
        try:
            from scipy.stats import t as student_t

            return float(student_t.ppf(0.975, df))
        except ImportError:
            pass
    if df in T975:
        return T975[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(values: list[float], use_scipy: bool = True) -> dict[str, Any]:
    """Mean, sample SD and the 95% interval mean +- t_{0.975, n-1} s / sqrt(n).

    (The paper's formula prints s_g / 5 for n = 5; the standard error of a mean is s / sqrt(n).)"""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "t": None, "half_width": None, "ci95": [None, None]}
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "t": None, "half_width": None, "ci95": [None, None]}
    sd = statistics.stdev(values)
    t = t975(n - 1, use_scipy)
    hw = t * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "t": t, "half_width": hw, "ci95": [mean - hw, mean + hw]}


def paired_gains(numerator: list[float], denominator: list[float]) -> list[float]:
    """g_j = 100 (v_j^num / v_j^den - 1) for paired repeats j."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired gains need equal repeat counts, got {len(numerator)} and {len(denominator)}")
    return [100.0 * (a / b - 1.0) for a, b in zip(numerator, denominator)]


def paired_gain(numerator: list[float], denominator: list[float], use_scipy: bool = True) -> dict[str, Any]:
    g = paired_gains(numerator, denominator)
    out = mean_ci95(g, use_scipy)
    out["per_repeat"] = g
    return out


# ------------------------------------------------------------------------------ tokens


def synthetic_buffer(n_batches: int, micro_batch: int, seq_len: int, vocab_size: int, eot_id: int,
                     doc_len_median: int, seed: int) -> list:
    """``n_batches`` Batches of random tokens with log-normal document lengths (sigma 1) ended by
    ``eot_id``; doc_ids and shifted targets exactly as ``lrattnres.data.loader`` builds them."""
    import numpy as np

    from lrattnres.data.loader import batch_from_rows

    rng = np.random.default_rng([seed, 4242])
    n = n_batches * micro_batch * (seq_len + 1)
    tokens = rng.integers(0, vocab_size, size=n, dtype=np.int64)
    tokens[tokens == eot_id] = (eot_id + 1) % vocab_size
    pos = 0
    while True:
        pos += max(1, int(rng.lognormal(math.log(doc_len_median), 1.0)))
        if pos > n:
            break
        tokens[pos - 1] = eot_id
    rows = tokens.reshape(n_batches, micro_batch, seq_len + 1)
    return [batch_from_rows(r, eot_id) for r in rows]


def data_buffer(manifest: dict, n_batches: int, micro_batch: int, seq_len: int, seed: int) -> list:
    """The first ``n_batches`` training batches of the data stage's loader (real tokens, real boundaries)."""
    from lrattnres.data import TokenLoader

    loader = TokenLoader(manifest, "train", micro_batch, seq_len, seed)
    return [next(loader) for _ in range(n_batches)]


# ------------------------------------------------------------------------------ FLA adapter


def fla_available(device_type: str) -> tuple[bool, str]:
    """(True, version) where FLA's fused_attnres imports and the device is CUDA; else (False, why)."""
    if device_type != "cuda":
        return False, "FLA's fused_attnres runs on CUDA only"
    try:
        from fla.ops.attnres import fused_attnres  # noqa: F401
    except Exception as e:  # ImportError, or a Triton/driver error at import
        return False, f"fla does not import ({type(e).__name__}: {e})"
    try:
        from importlib.metadata import version

        return True, version("fla-core")
    except Exception:
        return True, "unknown version"


def fla_router(compile_safe: bool = False) -> Callable:
    """A router with the signature of ``kernels.attnres`` over FLA's ``fused_attnres``.

    Standard AttnRes only (FLA normalises the key over the full width): r must equal d and norm
    "slice" (with r = d the same as "full").  Weightless RMS: ``rms_weight = ones(d)``.  Under
    torch.compile the call is left out of the graph (``compile_safe``).
    """
    import torch
    from fla.ops.attnres import fused_attnres

    ones: dict = {}

    def route(sources, query, *, norm: str = "slice", eps: float = 1e-6):
        d = sources[0].shape[-1]
        if query.shape[-1] != d:
            raise ValueError(f"FLA's fused_attnres routes with r = d only; got r = {query.shape[-1]}, d = {d}")
        key = (query.device, query.dtype, d)
        if key not in ones:
            ones[key] = torch.ones(d, device=query.device, dtype=query.dtype)
        dt = sources[0].dtype  # FLA wants same-dtype sources (the model writes them in the embedding's dtype)
        srcs = [x if x.dtype == dt else x.to(dt) for x in sources]
        return fused_attnres(query, srcs, ones[key], rms_eps=eps)

    return torch.compiler.disable(route) if compile_safe else route


# ------------------------------------------------------------------------------ models


def method_config(preset: str, name: str, s: dict, vocab_size: int) -> dict:
    """Model-config dict of one method at one preset."""
    from lrattnres.presets import get_preset

    p = get_preset(preset)
    m = METHOD_TABLE[name]
    d = p["d_model"]
    cfg = {"preset": preset, "vocab_size": vocab_size, "method": m["method"], "attention": s["attention"],
           "max_seq_len": max(p["max_seq_len"], s["seq_len"])}
    if m["method"] != "baseline":
        cfg["blocks"] = min(s["blocks"], 2 * p["n_layers"])
        cfg["rank"] = d if m["rank"] == "d" else max(1, d // 4)
        cfg["router"] = "reference" if m["router"] == "reference" else "fused" if m["router"] == "fused" else "reference"
    else:
        cfg["router"] = "reference"
    return cfg


def shared_backbone(preset: str, s: dict, vocab_size: int, repeat: int, device) -> dict:
    """One shared initialisation of the backbone for a repeat: the baseline model's weights, seeded."""
    import torch

    from lrattnres.model import build_model

    torch.manual_seed(s["seed"] * 1_000_003 + repeat)
    with torch.device(device):
        model = build_model(method_config(preset, "baseline", s, vocab_size))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    return state


def matched_model(preset: str, name: str, s: dict, vocab_size: int, shared: dict, device):
    """The method's model with the shared backbone copied in and the queries zero (deterministic)."""
    import torch

    from lrattnres.model import build_model

    with torch.device(device):
        model = build_model(method_config(preset, name, s, vocab_size))
    missing, unexpected = model.load_state_dict(shared, strict=False)
    extra_ok = {"queries"}
    if unexpected or set(missing) - extra_ok:
        raise RuntimeError(f"shared backbone does not fit method {name!r}: missing {missing}, unexpected {unexpected}")
    if hasattr(model, "queries"):
        with torch.no_grad():
            model.queries.zero_()
    if METHOD_TABLE[name]["router"] == "fla":
        route = fla_router(compile_safe=s["compile"])
        model._fused_router = lambda dev: route  # the model's forward asks this for its router
    return model


# ------------------------------------------------------------------------------ timing


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_spec() -> dict:
    from lrattnres.train import spec as train_spec

    return copy.deepcopy(train_spec.DEFAULTS)


def time_method(model, batches: list, s: dict, device, precision: str, log=None,
                guard: Callable[[float], None] | None = None) -> dict:
    """Warm-up updates, then measured updates until :func:`should_stop`; returns the times.

    Each update is the trainer's: ``accumulate_gradients`` (transfer, forward, backward over the
    micro-batches, clipping) then ``apply_update`` (Muon + AdamW, zero_grad), with the device
    synchronised before and after; nothing else is inside the timed region. ``guard(seconds)`` is
    called before every update after the first with the last update's duration (it raises to stop:
    the deadline, lrattnres/deadline.py).
    """
    import torch

    from lrattnres.train.loop import LossModule, accumulate_gradients, apply_update
    from lrattnres.train.optim import build_optimizers

    ts = _train_spec()
    lm = LossModule(model, precision)
    fwd = torch.compile(lm, dynamic=False) if s["compile"] else lm
    optimizers = build_optimizers(model, ts["optim"], device.type)
    params = [p for p in model.parameters() if p.requires_grad]
    z, clip = float(ts["z_loss"]), ts["grad_clip"]

    from lrattnres.attention import resolve_backend

    segments = resolve_backend(model.cfg.attention, device) == "flash"

    def update():
        ce, zl, gn = accumulate_gradients(fwd, lm, batches, params, device, z, clip, segments=segments)
        if not all(math.isfinite(v) for v in (ce, zl, gn)):
            raise RuntimeError(f"non-finite loss or gradient norm during timing (ce {ce}, z {zl}, norm {gn})")
        apply_update(optimizers, device)
        return ce

    gc.collect()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    last = None
    for _ in range(s["warmup"]):
        if guard is not None and last is not None:
            guard(last)
        t = time.perf_counter()
        update()
        _sync(device)
        last = time.perf_counter() - t
    _sync(device)
    warm_s = time.perf_counter() - t0
    times: list[float] = []
    while True:
        if guard is not None and (times or last is not None):
            guard(times[-1] if times else last)
        _sync(device)
        t = time.perf_counter()
        ce = update()
        _sync(device)
        times.append(time.perf_counter() - t)
        stop, why = should_stop(times, min_updates=s["min_updates"], max_updates=s["max_updates"],
                                window=s["window"], stride=s["stride"], cv=s["cv"], drift=s["drift"])
        if stop:
            break
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    wdtype = str(next(model.parameters()).dtype).replace("torch.", "")
    del optimizers, fwd, lm
    return {"times_s": times, "warmup_s": warm_s, "stopped": why, "final_ce": ce, "peak_mem_gib": peak,
            "weights_dtype": wdtype}


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gpu_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}"


def rotation(methods: list[str], repeat: int) -> list[str]:
    """Method order of repeat ``repeat``: rotated left by ``repeat``."""
    k = repeat % len(methods)
    return methods[k:] + methods[:k]


def run(spec: dict, data: str | None = None, log=None, on_repeat: Callable[[dict], None] | None = None,
        partial: dict | None = None, on_run: Callable[[dict], None] | None = None) -> dict:
    """Run the protocol; returns the result dict (``on_repeat`` gets the partial result after every repeat).

    ``partial``: the state of an earlier, unfinished run of the same spec (:func:`partial_state`):
    its timed runs are taken as they are and only the missing ones are timed (the matched weights of
    a repeat are a function of the seed and the repeat, so a repeat may be finished by another
    process). ``on_run`` gets the partial state after every timed run. With ``LRATTNRES_DEADLINE``
    set, no run starts that would not end before it, and a run under way stops between updates:
    :class:`lrattnres.deadline.DeadlineReached` (the finished runs are in the last partial state)."""
    import torch

    from lrattnres import deadline
    from lrattnres.presets import PAPER_VOCAB, get_preset
    from lrattnres.provenance import now, provenance

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = now()
    t_start = time.perf_counter()
    s = resolve_spec(spec)
    deadline.deadline()  # a malformed LRATTNRES_DEADLINE stops here, before any work
    device = resolve_device(s["device"], where="throughput spec key 'device'")
    threads = 1 if (s["threads"] == "auto" and device.type == "cpu") else s["threads"]
    if is_int(threads):
        torch.set_num_threads(threads)
    precision = s["precision"] if s["precision"] != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    fla_ok, fla_note = fla_available(device.type)
    manifest = None
    if data and s["tokens"] == "data":
        from lrattnres.data import load_manifest

        manifest = load_manifest(data, verify="size")
    done = {(r["preset"], r["repeat"], r["name"]): r for r in (partial or {}).get("runs", [])}
    dropped = {p: list(v) for p, v in (partial or {}).get("dropped", {}).items()}

    result: dict[str, Any] = {
        "stage": "throughput", "device": gpu_name(device), "device_type": device.type, "spec": s,
        "precision": precision, "compile": s["compile"], "threads": torch.get_num_threads(),
        "tokens": ("data: " + str(data)) if manifest is not None else
        f"synthetic (log-normal documents, median {s['doc_len_median']})",
        "fla": {"available": fla_ok, "note": fla_note},
        "rows": [], "gains": {}, "runs": [], "skipped": list((partial or {}).get("skipped", [])), "complete": False,
        "notes": [
            "95% intervals use t_{0.975,n-1} s/sqrt(n); the paper's Appendix I prints s_g/5 (a typo: the "
            "standard error of a mean of five is s/sqrt(5)).",
        ],
    }
    if done:
        result["notes"].append(f"{len(done)} timed runs of an earlier, unfinished process taken as they were "
                               f"(resumed {started})")
    if s["compile"]:
        result["notes"].append("torch.compile(dynamic=False) of the loss module; compilation happens in the warm-up updates.")
    else:
        result["notes"].append("eager mode (compile false): the paper times compiled models (fullgraph=True).")

    def state() -> dict:
        return {"runs": list(result["runs"]), "skipped": list(result["skipped"]), "dropped": dict(dropped)}

    for preset in s["presets"]:
        methods = list(s["methods_by_preset"].get(preset, s["methods"]))
        if "fla-rd" in methods and not fla_ok:
            methods.remove("fla-rd")
            if not any(x["preset"] == preset and x["method"] == "fla-rd" for x in result["skipped"]):
                result["skipped"].append({"preset": preset, "method": "fla-rd", "why": fla_note})
            say(f"[throughput] {preset}: fla-rd skipped: {fla_note}")
        methods = [m for m in methods if m not in dropped.get(preset, [])]
        if not methods:
            continue
        p = get_preset(preset)
        if manifest is not None:
            vocab, eot = int(manifest["vocab_size"]), int(manifest["eot_id"])
        else:
            vocab = s["vocab_size"] or p["vocab_size"] or SMALL_VOCAB
            eot = 100257 if vocab == PAPER_VOCAB else vocab - 1
        accum = s["grad_accum_by_preset"].get(preset, s["grad_accum"])
        repeats = s["repeats_by_preset"].get(preset, s["repeats"])
        batches = None

        def cached_tokens():
            if manifest is not None:
                return data_buffer(manifest, accum, s["micro_batch"], s["seq_len"], s["seed"])
            return synthetic_buffer(accum, s["micro_batch"], s["seq_len"], vocab, eot, s["doc_len_median"], s["seed"])

        tokens_per_update = accum * s["micro_batch"] * s["seq_len"]
        d = p["d_model"]
        say(f"[throughput] {preset}: methods {methods}, {repeats} repeats, {tokens_per_update} tokens per update "
            f"({s['micro_batch']} x {s['seq_len']} x {accum}), device {result['device']}, {precision}, "
            f"compile {s['compile']}")
        per_method: dict[str, list[float]] = {m: [] for m in methods}
        rows_meta = {}
        for name in methods:
            cfg = method_config(preset, name, s, vocab)
            rows_meta[name] = {"preset": preset, "size": PAPER_SIZES.get(preset, preset), "name": name,
                               "method": METHOD_TABLE[name]["method"], "impl": METHOD_TABLE[name]["impl"],
                               "r": cfg.get("rank"), "d": d, "N": cfg.get("blocks"),
                               "tokens_per_update": tokens_per_update, "grad_accum": accum,
                               "micro_batch": s["micro_batch"], "seq_len": s["seq_len"]}
        dl = s["deadline_s"].get(preset) if isinstance(s["deadline_s"], dict) else s["deadline_s"]
        failed: set[str] = set()
        for j in range(repeats):
            if dl and time.perf_counter() - t_start > dl:
                result["notes"].append(f"deadline {dl:g} s reached: {preset} stopped after {j} of {repeats} repeats")
                say(f"[throughput] deadline {dl:g} s reached before {preset} repeat {j}")
                result["cut"] = True
                break
            t_rep = time.perf_counter()
            shared = None
            got: dict[str, float] = {}
            for pos, name in enumerate(rotation(methods, j)):
                earlier = done.get((preset, j, name))
                if earlier is not None:  # timed by an earlier process
                    got[name] = earlier["tokens_per_s"]
                    result["runs"].append(earlier)
                    continue
                # a run that would not end before LRATTNRES_DEADLINE does not start (the longest one so far)
                took = [r["warmup_s"] + sum(r["times_s"]) for r in result["runs"] if r["preset"] == preset]
                if took:
                    deadline.check(max(took), f"{preset} repeat {j} {name}")
                model = None
                try:
                    if batches is None:
                        batches = cached_tokens()
                    if shared is None:
                        shared = shared_backbone(preset, s, vocab, j, device)
                    model = matched_model(preset, name, s, vocab, shared, device)
                    model.train()
                    rec = time_method(model, batches, s, device, precision, log=say,
                                      guard=lambda sec, n=name: deadline.check(1.05 * sec, f"{preset} repeat {j} {n}: the next update"))
                except deadline.DeadlineReached:
                    raise
                except Exception as e:  # one failing method (an unsupported shape, OOM) must not end the run
                    why = f"{type(e).__name__}: {str(e)[:500]}"
                    say(f"[throughput] {preset} repeat {j} {name} FAILED, dropped from the comparison: {why}")
                    result["skipped"].append({"preset": preset, "method": name, "why": f"failed in repeat {j}: {why}"})
                    failed.add(name)
                    dropped.setdefault(preset, []).append(name)
                    if on_run is not None:
                        on_run(state())
                    continue
                finally:
                    del model
                    _free(device)
                n = len(rec["times_s"])
                v = tokens_per_update * n / sum(rec["times_s"])
                got[name] = v
                result["runs"].append({"preset": preset, "repeat": j, "position": pos, "name": name,
                                       "tokens_per_s": v, "updates": n, **rec})
                say(f"[throughput] {preset} repeat {j} #{pos} {name}: {v:,.0f} tokens/s over {n} updates "
                    f"({rec['stopped']}; warm-up {rec['warmup_s']:.1f} s)")
                if on_run is not None:
                    on_run(state())
            del shared
            _free(device)
            for name in failed:
                if name in methods:
                    methods.remove(name)
                per_method.pop(name, None)
            failed.clear()
            if not methods:
                break
            for name, v in got.items():
                if name in per_method:
                    per_method[name].append(v)
            result["rows"] = [r for r in result["rows"] if r["preset"] != preset] + [
                _row(rows_meta[m], per_method[m]) for m in methods]
            result["gains"][preset] = _gains(per_method)
            result["claims"] = claims_for(result, s)
            result["elapsed_s"] = time.perf_counter() - t_start
            say(f"[throughput] {preset} repeat {j} done in {time.perf_counter() - t_rep:.1f} s"
                + "".join(f"; {g} {v['per_repeat'][-1]:+.2f}%" for g, v in result["gains"][preset].items()))
            if on_repeat is not None:
                on_repeat(result)
        del batches
    result["complete"] = not result.get("cut", False)
    result["claims"] = claims_for(result, s)
    result["elapsed_s"] = time.perf_counter() - t_start
    from lrattnres.attention import describe as describe_attention

    result["provenance"] = provenance(s, started=started, attention=describe_attention(s["attention"], device))
    return result


def _row(meta: dict, values: list[float]) -> dict:
    st = mean_ci95(values)
    return {**meta, "repeats": list(values), "mean": st["mean"], "sd": st["sd"]}


def _gains(per_method: dict[str, list[float]]) -> dict[str, dict]:
    out = {}
    for gname, num, den in GAINS:
        if num in per_method and den in per_method and per_method[num] and len(per_method[num]) == len(per_method[den]):
            out[gname] = {"numerator": num, "denominator": den, **paired_gain(per_method[num], per_method[den])}
    return out


# ------------------------------------------------------------------------------ claims


def published_ids(path: str | None = None) -> set[str]:
    """Claim ids of the published-numbers file ({} if it is absent)."""
    p = Path(path) if path else Path(__file__).resolve().parent.parent / "reports" / "published.yaml"
    if not p.exists():
        return set()
    return set(_ids_of(str(p.resolve()), p.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _ids_of(path: str, mtime_ns: int) -> frozenset:
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or []
    return frozenset(r["id"] for r in data if isinstance(r, dict) and "id" in r)


def paper_gpu(device_name: str) -> str | None:
    """'h100' / 'b200' when the device is one of the paper's GPUs, else None."""
    for g in PAPER_GPUS:
        if g in device_name.upper():
            return g.lower()
    return None


# GPUs of the same architecture as one of the paper's: they stand in for it in the direction claims
# of Section 4.9 (never in Table 3's values, which are the paper's hardware's numbers).
GPU_STAND_INS = {"H200": "h100", "GH200": "h100"}


def direction_gpu(device_name: str) -> tuple[str | None, str]:
    """(the paper's GPU whose direction claims a measurement on ``device_name`` stands for, a note)."""
    gpu = paper_gpu(device_name)
    if gpu:
        return gpu, ""
    name = device_name.upper()
    for other, stands in sorted(GPU_STAND_INS.items(), key=lambda kv: -len(kv[0])):
        if other in name:
            return stands, f"measured on {device_name}, the same architecture as the {stands.upper()}"
    return None, ""


def claims_for(result: dict, s: dict, ids: set[str] | None = None) -> dict[str, dict]:
    """Claims of a (partial) result: only for the paper's shapes on a GPU (see the module docstring).

    Direction claims (Section 4.9's gains) carry the per-repeat paired gains as ``samples``: the claims
    engine judges them by the interval over repeats."""
    if result.get("device_type") != "cuda" or not s.get("claims", True):
        return {}
    ids = published_ids(s.get("published")) if ids is None else ids
    gpu = paper_gpu(result.get("device", ""))
    dgpu, stand_in = direction_gpu(result.get("device", ""))
    out: dict[str, dict] = {}
    setting = (f"{result.get('device')}, microbatch {s['micro_batch']} x {s['seq_len']}, "
               f"{'compiled' if s['compile'] else 'eager'}, {result.get('precision')}")

    def put(cid: str, value: Any, note: str, **evidence) -> None:
        if cid in ids and value is not None:
            out[cid] = {"reproduced": value, "note": note, **evidence}

    for preset, size in PAPER_SIZES.items():
        gains = result.get("gains", {}).get(preset, {})
        rows = {r["name"]: r for r in result.get("rows", []) if r["preset"] == preset}
        if not rows:
            continue
        accum = next(iter(rows.values()))["grad_accum"]
        where = f"{setting}, accumulation {accum} (paper: 64)"
        rank = gains.get("rank")
        if dgpu is not None:
            for cid, g, what in ((f"sec4.9.rank_gain_positive.{dgpu}.{size}", rank, "rank gain r = d/4 vs r = d"),
                                 (f"sec4.9.fast_beats_fla.{dgpu}.{size}", gains.get("kernel_vs_fla"),
                                  "kernel gain over FLA at r = d"),
                                 (f"sec4.9.combined_gain_positive.{dgpu}.{size}", gains.get("combined_vs_fla"),
                                  "combined gain over FLA")):
                if g and g.get("per_repeat"):
                    put(cid, g["mean"], "; ".join(x for x in (f"paired {what}, this project's kernel in place of "
                                                              f"Fast-AttnRes", stand_in, where) if x),
                        samples=list(g["per_repeat"]), unit="repeats")
        runs = [r for r in result.get("runs", []) if r.get("preset") == preset]
        if runs:
            missed = [f"repeat {r['repeat']} {r['name']} ({r.get('stopped')}, {r.get('updates')} updates)"
                      for r in runs if r.get("stopped") != "converged"]
            put(f"appI.repeats_met_stopping_rule.{size}", len(missed),
                f"{len(runs) - len(missed)} of {len(runs)} timed runs met the CV and drift limits"
                + (f"; not: {', '.join(missed)}" if missed else "") + f"; {where}")
        if gpu is None:
            continue
        for name, impl, rk in (("fla-rd", "fla", "rd"), ("fused-rd", "fast", "rd"), ("fused-rd4", "fast", "rd4")):
            r = rows.get(name)
            if r and r["repeats"]:
                note = f"{len(r['repeats'])} repeats; {where}" + ("; this project's kernel" if impl == "fast" else "")
                put(f"table3.tokens_per_s.{gpu}.{size}.{impl}.{rk}", r["mean"], note)
                put(f"table3.tokens_per_s_sd.{gpu}.{size}.{impl}.{rk}", r["sd"], note)
        if rank and rank["n"] >= 2:
            put(f"table3.rank_gain_pct.{gpu}.{size}", rank["mean"], where)
            put(f"table3.rank_gain_ci_low.{gpu}.{size}", rank["ci95"][0], where + "; t s/sqrt(n)")
            put(f"table3.rank_gain_ci_high.{gpu}.{size}", rank["ci95"][1], where + "; t s/sqrt(n)")
        comb = gains.get("combined_vs_fla")
        if comb:
            put(f"sec4.9.combined_gain_pct.{gpu}.{size}", comb["mean"], where)
    return out


# ------------------------------------------------------------------------------ partial state

PARTIAL_FORMAT = "lrattnres.throughput.partial/1"


def partial_path(out: str | Path) -> Path:
    """The partial-state file beside a result: ``1B.json`` -> ``1B.partial.json``."""
    out = Path(out)
    return out.with_name(out.stem + ".partial.json")


def partial_key(s: dict, device_name: str, data_sha256: str | None) -> dict:
    """What a partial state must share with the run that continues it: the resolved spec, the device,
    the data and the code that is timed (the training stack and this module)."""
    import hashlib

    from lrattnres.train.loop import code_fingerprint

    code = hashlib.sha256((code_fingerprint() + Path(__file__).read_text(encoding="utf-8")).encode()).hexdigest()
    return {"spec": {k: v for k, v in s.items() if k not in ("deadline_s", "published")}, "device": device_name,
            "data_sha256": data_sha256, "code_sha256": code}


def load_partial(path: Path, key: dict, log=None) -> dict | None:
    """The partial state at ``path`` when it continues a run of ``key``, else None (a state of another
    spec, device, data or code is left to be overwritten)."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not path.is_file():
        return None
    try:
        import json

        st = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        say(f"[throughput] {path}: not readable ({e}); starting afresh")
        return None
    if not isinstance(st, dict) or st.get("format") != PARTIAL_FORMAT or not isinstance(st.get("runs"), list):
        say(f"[throughput] {path}: not a partial state of format {PARTIAL_FORMAT}; starting afresh")
        return None
    if st.get("key") != key:
        differs = sorted(k for k in key if (st.get("key") or {}).get(k) != key[k])
        say(f"[throughput] {path}: made with another {', '.join(differs)}; starting afresh")
        return None
    say(f"[throughput] {path}: continuing after {len(st['runs'])} timed runs")
    return st


def aggregate(parts: list[dict], paths: list[str]) -> dict:
    """One throughput result from the results of single sizes (one job per size)."""
    if not parts:
        raise SpecError("throughput --aggregate: no results given")
    spec = dict(parts[0]["spec"], presets=[p for part in parts for p in part["spec"]["presets"]])
    out = {k: parts[0][k] for k in ("stage", "device", "device_type", "precision", "compile", "threads", "tokens", "fla")
           if k in parts[0]}
    out.update(spec=spec, rows=[r for p in parts for r in p["rows"]], runs=[r for p in parts for r in p["runs"]],
               skipped=[r for p in parts for r in p["skipped"]], gains={k: v for p in parts for k, v in p["gains"].items()},
               complete=all(p.get("complete") for p in parts), parts=list(paths),
               notes=list(dict.fromkeys(n for p in parts for n in p.get("notes", []))),
               elapsed_s=sum(p.get("elapsed_s") or 0 for p in parts))
    devices = sorted({p.get("device") for p in parts})
    if len(devices) > 1:
        out["notes"].append(f"the sizes were timed on different devices: {', '.join(map(str, devices))}")
    out["claims"] = claims_for(out, spec)
    return out


# ------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres throughput",
                                description="training-step throughput with the protocol of Section 4.9 / Appendix I")
    p.add_argument("--spec", default="{}", help="JSON object of settings (see lrattnres.throughput.DEFAULTS)")
    p.add_argument("--data", default=None, help="data manifest: time on its first training batches (else synthetic tokens)")
    p.add_argument("--out", required=True, help="result JSON (written once, complete)")
    p.add_argument("--partial", default=None, help="partial-state file, rewritten after every timed run and continued "
                   "by the next run of the same spec (default: <out stem>.partial.json beside --out)")
    p.add_argument("--aggregate", nargs="+", default=None, metavar="RESULT",
                   help="merge these results (one per size) into --out; times nothing")
    args = p.parse_args(argv)
    from lrattnres import deadline
    from lrattnres.io import atomic_write_json, read_json, read_spec_arg
    from lrattnres.provenance import now, provenance

    if args.aggregate:
        started = now()
        result = aggregate([read_json(x) for x in args.aggregate], args.aggregate)
        result["provenance"] = provenance(result["spec"], started=started)
        atomic_write_json(args.out, result)
        return 0
    try:
        spec = read_spec_arg(args.spec)
    except ValueError as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 2
    try:
        s = resolve_spec(spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return 2
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    ppath = Path(args.partial) if args.partial else partial_path(args.out)
    data_sha = None
    if args.data and s["tokens"] == "data":
        from lrattnres.data import load_manifest

        data_sha = load_manifest(args.data, verify="size")["_sha256"]
    key = partial_key(s, gpu_name(resolve_device(s["device"], where="throughput spec key 'device'")), data_sha)
    if (left := deadline.left()) is not None and left <= 0:
        print(f"throughput: the deadline ({deadline.ENV}) has passed; nothing started, rerun to continue", file=sys.stderr)
        return deadline.EXIT_DEADLINE
    earlier = load_partial(ppath, key, say)

    def keep(state: dict) -> None:
        atomic_write_json(ppath, {"format": PARTIAL_FORMAT, "key": key, "updated": now(), **state})

    try:
        result = run(spec, data=args.data, log=say, partial=earlier, on_run=keep)
    except deadline.DeadlineReached as e:
        print(f"throughput: {e} ({ppath})", file=sys.stderr)
        return deadline.EXIT_DEADLINE
    atomic_write_json(args.out, result)
    ppath.unlink(missing_ok=True)
    print(f"[throughput] wrote {args.out} ({'complete' if result['complete'] else 'partial'}, "
          f"{result['elapsed_s']:.0f} s)", file=sys.stderr)
    return 0
