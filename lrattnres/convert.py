"""Checkpoint conversion (Section 4.8, Appendix B.1-B.2, Table 2): AttnRes -> LR-AttnRes, no retraining.

A standard AttnRes checkpoint (method ``attnres``, r = d, full or N-block routing) becomes a
full-width-RMS LR-AttnRes checkpoint (method ``lr-fullrms``, same blocks, rank r) with the same
routing distributions and logits in exact arithmetic, whenever r >= k = rank(Q).

The construction (Proposition 1)
--------------------------------
* Active queries.  The model has one static query per read after a write: ``queries[t-1]`` serves the
  read after write t, t = 1..2L (the last feeds the head).  The embedding-only first read is the
  identity and needs none.  So the active queries are all 2L rows of ``queries``, stacked into
  Q = [q_1 .. q_2L] in R^{d x 2L}.  (Every read mixes at least two sources, the embedding and the
  latest write or block, so no query is inert.)
* Folding.  A routing RMSNorm with an affine weight gamma_t scores ``q_t . (gamma_t * o / rho_d(o))``
  = ``(gamma_t * q_t) . o / rho_d(o)``, so the effective query is ``gamma_t * q_t``
  (:func:`effective_queries`).  This model's routing norms are weightless (gamma = 1), so the fold
  is the identity here; pass ``routing_norm_weight`` to convert a checkpoint that has them.  (Affine
  weights of the sub-layer input norms would likewise be folded into the columns of the input
  projections before rotating, as in SliceGPT; this backbone has none, and the rotation refuses any
  parameter it does not know.)
* Span and rank.  Q is cast to float64 and decomposed, Q = U S V^T (full U, d x d).  The joint rank
  k is the numerical rank: the number of singular values above ``rtol * s_max`` with
  ``rtol = max(d, 2L) * eps_float64`` by default (NumPy's ``matrix_rank`` rule; ``spec.rtol``
  overrides it).  The float64 tolerance is deliberately tight: stored fp32 queries cast exactly to
  float64, so k is the rank of the stored numbers, and a conversion at r >= k is exact to float64
  rounding.  U[:, :k] is an orthonormal basis of the span; U[:, k:] completes it.
* Change of coordinates.  For r >= k the new basis is B = [U[:, r:], U[:, :r]] (the top r left
  singular vectors, which contain the span, last) and R = B^T (d x d, orthogonal).  R maps the span
  onto e_{d-r+1..d}: R q has zeros in its first d - r coordinates, so keeping its last r is exact.
* Weights (column-vector activations h' = R h; nn.Linear stores [out, in]):
  residual-facing input projections W' = W R^T (``attn.qkv``, ``mlp.gate_up``, ``head``), output
  projections W' = R W (``attn.out``, ``mlp.down``), embedding rows e' = R e (table E' = E R^T),
  residual-output biases b' = R b (none in this model), queries q' = (R q)[d-r:].  Weightless RMSNorm
  commutes with R (rho_d(R o) = rho_d(o)), QK-norm and RoPE act inside the heads after the QKV
  projection, so they are untouched; so do block sums (linear).  All of it is absorbed into existing
  parameters: the converted model has no extra rotation.

Checks (Table 2, Appendix B.2)
------------------------------
* ``fp64_max_logit_err``: both models cast to float64 (reference router, SDPA attention), logits on
  one full-length sequence (``max_seq_len`` tokens: the first window of the validation split, with
  its document mask), max |difference|; ``logit_scale`` = max |logit| for relative statements.  The
  converted float64 model is the one compared (the paper verifies FP64 logits, then exports).  The
  claim ``table2.fp64_max_err.<row>`` carries this absolute difference (Table 2's quantity, bound
  1e-9); the note gives it relative to the logit scale.  ``fp64_noise_floor`` is how far the
  original's float64 logits move when every weight gets one float64 rounding of noise: a model with
  large, sharp routing scores amplifies rounding (random models with queries of norm ~16 at d = 1024
  reach 1e-6), so the error is read against that floor.  ``exported_max_logit_err`` is the same
  difference for the converted weights as exported (BF16 by default), ``exported_original_max_logit_err``
  the original's after the same export: what the export's rounding alone moves.
* Export and reload (Appendix B.2: "export and strictly reload the BF16 checkpoints"): the original
  and the converted weights are written as checked safetensors in ``spec.export_dtype`` (``bf16``,
  the default; ``storage``: the checkpoint's own dtype), read back through ``load_model`` (sha256,
  every parameter of the recorded architecture) and compared with what was written. On a GPU the
  reloaded models' fused routing is compared with the reference on the FP64 check's sequence
  (``native_vs_reference_max_logit_err``, bf16).
* Paired validation cross-entropy of the *reloaded* original and converted models (Table 2: "BF16
  model computation, FP32 per-token cross-entropy, and FP64 summation"): the same windows of the
  validation split, bf16 autocast on a GPU and fp32 on the CPU (``spec.precision``), fp32 per-token
  CE, fp64 sums; ``delta_ce`` = converted minus original.
* ``joint_rank`` and ``active_queries`` (= 2L).
* Slice drift: the converted weights run with slice normalisation (method ``lr``: RMS over the last r
  coordinates only).  The theorem does not cover it; the drift is reported, not claimed.

CLI::

    python -m lrattnres convert --checkpoint results/<scale>/runs/<run>/model.safetensors --data <manifest.json>
        --spec '{"rank": "d/8", "val_tokens": null, "batch_size": 8, "claim_row": "0.5b.nfull"}'
        --out convert.json [--save converted/model.safetensors]
    python -m lrattnres convert --aggregate a.json b.json ... --out convert_all.json

Spec keys: ``rank`` (int, "d", "d/<n>" or "k" = the joint rank), ``val_tokens`` (int target tokens or
null = the whole split), ``batch_size``, ``claim_row`` ("<size>.n<N>", e.g. "0.5b.nfull", "1b.n8", or
null), optional ``precision`` ("auto" | "bf16" | "fp32"), ``device`` ("auto" | "cpu" | "cuda[:i]"),
``rtol`` (float or null), ``seq_len`` (CE window length; default: the training spec's, else
max_seq_len), ``export_dtype`` ("bf16" | "storage"; default "bf16").
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lrattnres.checks import is_int
from lrattnres.devices import resolve_device
from lrattnres.errors import SpecError, UserError

log = logging.getLogger("lrattnres.convert")

DEFAULT_PUBLISHED = Path(__file__).resolve().parent.parent / "reports" / "published.yaml"
SPEC_KEYS = {"rank", "val_tokens", "batch_size", "claim_row", "precision", "device", "rtol", "seq_len", "export_dtype"}
SPEC_REQUIRED = ("rank", "batch_size")
SIZES = ("0.5b", "1b", "4b")


class RankError(UserError, ValueError):
    """The requested rank is below the joint query rank: the conversion would not be exact."""


# ------------------------------------------------------------------------------------------ math


def effective_queries(queries, routing_norm_weight=None):
    """The effective queries [T, d] in float64: ``queries`` with any routing-RMSNorm affine weight
    folded in (``gamma_t * q_t``).  ``routing_norm_weight`` is None (weightless norms: the identity,
    this model's case), a [d] weight shared by every read, or a [T, d] weight per read."""
    import torch

    q = queries.detach().to(torch.float64)
    if routing_norm_weight is not None:
        g = routing_norm_weight.detach().to(device=q.device, dtype=torch.float64)
        if g.shape not in ((q.shape[-1],), tuple(q.shape)):
            raise ValueError(f"routing_norm_weight must be [d] or [T, d] = {tuple(q.shape)}, got {tuple(g.shape)}")
        q = q * g
    return q


@dataclasses.dataclass
class QuerySpan:
    """The joint span of the active queries: Q = U S V^T with Q = queries^T [d, T]."""

    joint_rank: int  # k: singular values above rtol * s_max
    active_queries: int  # T = 2L
    singular_values: list[float]  # all min(d, T) of them, descending
    rtol: float
    basis: Any  # U [d, d] float64: U[:, :k] spans the queries, U[:, k:] completes it

    @property
    def span_basis(self):
        return self.basis[:, : self.joint_rank]


def default_rtol(d: int, n_queries: int) -> float:
    return max(d, n_queries) * 2.220446049250313e-16  # max(M, N) * eps(float64), as numpy.linalg.matrix_rank


def query_span(queries, rtol: float | None = None) -> QuerySpan:
    """Joint rank and an orthonormal basis of the span of ``queries`` ([T, d], effective queries)."""
    import torch

    q = queries.detach().to(torch.float64)
    T, d = q.shape
    rtol = default_rtol(d, T) if rtol is None else float(rtol)
    U, S, _ = torch.linalg.svd(q.T, full_matrices=True)  # q.T: [d, T]
    smax = float(S[0]) if S.numel() else 0.0
    k = int((S > rtol * smax).sum()) if smax > 0 else 0
    return QuerySpan(joint_rank=k, active_queries=T, singular_values=[float(s) for s in S], rtol=rtol, basis=U)


def rotation(span: QuerySpan, rank: int):
    """The orthogonal change of residual coordinates R [d, d] (float64) putting the query span in the
    last ``rank`` coordinates; RankError if rank < k."""
    import torch

    U = span.basis
    d = U.shape[0]
    if not 1 <= rank <= d:
        raise ValueError(f"rank r={rank} must satisfy 1 <= r <= d={d}")
    if rank < span.joint_rank:
        raise RankError(
            f"rank r={rank} is below the joint query rank k={span.joint_rank} (of {span.active_queries} active "
            f"queries, rtol {span.rtol:.3g}): an exact conversion needs r >= k = {span.joint_rank}"
        )
    B = torch.cat([U[:, rank:], U[:, :rank]], dim=1)  # new basis vectors as columns; the span last
    return B.T.contiguous()


# name -> role; {i} is a layer index
_ROLES = [
    (re.compile(r"embed\.weight"), "embed"),
    (re.compile(r"head\.weight"), "in"),
    (re.compile(r"layers\.\d+\.attn\.qkv\.weight"), "in"),
    (re.compile(r"layers\.\d+\.mlp\.gate_up\.weight"), "in"),
    (re.compile(r"layers\.\d+\.attn\.out\.weight"), "out"),
    (re.compile(r"layers\.\d+\.mlp\.down\.weight"), "out"),
    (re.compile(r"layers\.\d+\.attn\.out\.bias"), "out_bias"),
    (re.compile(r"layers\.\d+\.mlp\.down\.bias"), "out_bias"),
    (re.compile(r"layers\.\d+\.attn\.qkv\.bias"), "keep"),
    (re.compile(r"layers\.\d+\.mlp\.gate_up\.bias"), "keep"),
    (re.compile(r"head\.bias"), "keep"),
    (re.compile(r"queries"), "queries"),
]


def _role(name: str) -> str:
    for pat, role in _ROLES:
        if pat.fullmatch(name):
            return role
    raise ValueError(
        f"parameter {name!r}: the conversion does not know how it meets the residual stream "
        "(expected embed, head, layers.i.attn.qkv/out, layers.i.mlp.gate_up/down and queries: "
        "a standard AttnRes checkpoint of this backbone)"
    )


def rotate_state_dict(state: dict, R, rank: int, queries=None) -> dict:
    """The rotated parameters in float64 (see the module doc for the rule of each role).  ``queries``
    ([T, d], the effective queries) replaces ``state['queries']`` when given (folded weights)."""
    import torch

    R = R.to(torch.float64)
    d = R.shape[0]
    out = {}
    for name, w in state.items():
        role = _role(name)
        w = w.detach().to(device=R.device, dtype=torch.float64)
        if role == "embed" or role == "in":  # rows e -> R e; W -> W R^T
            if w.shape[-1] != d:
                raise ValueError(f"parameter {name!r}: expected last dimension d={d}, got {tuple(w.shape)}")
            out[name] = w @ R.T
        elif role == "out":  # W -> R W
            if w.shape[0] != d:
                raise ValueError(f"parameter {name!r}: expected first dimension d={d}, got {tuple(w.shape)}")
            out[name] = R @ w
        elif role == "out_bias":
            out[name] = R @ w
        elif role == "keep":
            out[name] = w
        else:  # queries: q' = R q, keep the last r coordinates
            q = w if queries is None else queries.to(device=R.device, dtype=torch.float64)
            if q.shape[-1] != d:
                raise ValueError(f"parameter {name!r}: expected [2L, d={d}] (standard AttnRes), got {tuple(q.shape)}")
            out[name] = (q @ R.T)[:, d - rank :].contiguous()
    if "queries" not in out:
        raise ValueError("state dict has no 'queries': not a routed (AttnRes) checkpoint")
    return out


def parse_rank(rank: Any, d: int, k: int | None = None) -> int:
    """An int, "d", "d/<n>" (d // n, exact division required) or "k" (the joint rank)."""
    if is_int(rank):
        return rank
    if isinstance(rank, str):
        s = rank.strip()
        if s == "d":
            return d
        if s == "k":
            if k is None:
                raise SpecError("spec.rank 'k' needs the joint rank")
            return max(k, 1)
        m = re.fullmatch(r"d\s*/\s*(\d+)", s)
        if m:
            n = int(m.group(1))
            if n < 1 or d % n:
                raise SpecError(f"spec.rank {rank!r}: d={d} is not divisible by {n}")
            return d // n
        if s.isdigit():
            return int(s)
    raise SpecError(f"spec.rank: expected an int, 'd', 'd/<n>' or 'k', got {rank!r}")


@dataclasses.dataclass
class Conversion:
    """A converted model and what it took: ``model`` (float64 unless asked otherwise), the span, R."""

    model: Any
    config: Any  # the converted ModelConfig (method lr-fullrms, rank r)
    span: QuerySpan
    R: Any
    rank: int
    query_residual: float  # max ||(R q)[:d-r]|| / max ||q||: what keeping the last r coordinates drops


def _check_source(cfg) -> None:
    if cfg.method != "attnres":
        raise ValueError(
            f"checkpoint has method {cfg.method!r}: the conversion takes a standard AttnRes checkpoint "
            "(method 'attnres', r = d)"
        )
    if cfg.rank != cfg.d_model:
        raise ValueError(f"checkpoint has rank {cfg.rank} != d_model {cfg.d_model}: not standard AttnRes")


def convert_model(model, rank: Any, *, rtol: float | None = None, routing_norm_weight=None,
                  dtype=None, device=None) -> Conversion:
    """Convert an AttnRes ``model`` to full-width-RMS LR-AttnRes of rank ``rank`` (see ``parse_rank``).

    The rotation is computed and applied in float64; the returned model is in ``dtype`` (default
    float64) on ``device`` (default: the model's)."""
    import torch

    from lrattnres.model import build_model

    cfg = model.cfg
    _check_source(cfg)
    dtype = torch.float64 if dtype is None else dtype
    device = next(model.parameters()).device if device is None else torch.device(device)
    state = {k: v for k, v in model.state_dict().items()}
    q_eff = effective_queries(state["queries"].to(device), routing_norm_weight)
    span = query_span(q_eff, rtol)
    r = parse_rank(rank, cfg.d_model, span.joint_rank)
    R = rotation(span, r)
    new_state = rotate_state_dict(state, R, r, queries=q_eff)
    d = cfg.d_model
    rq = q_eff @ R.T
    qmax = float(q_eff.norm(dim=-1).max()) if q_eff.numel() else 0.0
    resid = float(rq[:, : d - r].norm(dim=-1).max()) if d > r else 0.0
    new_cfg = dataclasses.replace(cfg, method="lr-fullrms", rank=r)
    with torch.device(device):
        new = build_model(new_cfg)
    new.to(dtype)
    new.load_state_dict({k: v.to(dtype) for k, v in new_state.items()}, strict=True)
    new.eval()
    return Conversion(model=new, config=new_cfg, span=span, R=R, rank=r,
                      query_residual=resid / qmax if qmax > 0 else 0.0)


def with_config(model, **changes):
    """A view of ``model`` sharing its weights, with config fields replaced (e.g. method 'lr' to run
    the converted weights with slice normalisation, or attention 'sdpa' for float64).  Only the
    forward's configuration changes; do not change dtypes or devices through the view."""
    view = copy.copy(model)
    view.cfg = dataclasses.replace(model.cfg, **changes)
    return view


# --------------------------------------------------------------------------------------- checks


def _fp64_view(model, device=None):
    """A float64 copy of ``model`` (on ``device``, default the model's) with the reference router and
    SDPA attention, for the FP64 check."""
    import torch

    device = next(model.parameters()).device if device is None else device
    m = copy.deepcopy(model).to(device=device, dtype=torch.float64)
    return with_config(m, router="reference", attention="sdpa")


def max_logit_diff(a, b, inputs, doc_ids=None) -> tuple[float, float]:
    """(max |logits_a - logits_b|, max |logits_a|) in the models' dtype (float64 for the check)."""
    import torch

    with torch.no_grad():
        la = a(inputs, doc_ids)
        lb = b(inputs, doc_ids)
    return float((la - lb).abs().max()), float(la.abs().max())


def max_logit_diff_to(ref, model, inputs, doc_ids=None) -> float:
    """max |logits - ref| of ``model`` on ``inputs``."""
    import torch

    with torch.no_grad():
        return float((model(inputs, doc_ids) - ref).abs().max())


def fp64_noise_floor(model64, ref, inputs, doc_ids=None, seed: int = 0) -> float:
    """How far the float64 logits move when every weight of ``model64`` is perturbed by one float64
    rounding (relative 2^-53 noise): the floor under which an FP64 logit difference is rounding
    amplified by the model's own sensitivity.  Perturbs ``model64`` in place."""
    import torch

    g = torch.Generator(device=ref.device).manual_seed(seed)
    eps = torch.finfo(torch.float64).eps / 2
    with torch.no_grad():
        for p in model64.parameters():
            p.mul_(1 + eps * torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype))
    return max_logit_diff_to(ref, model64, inputs, doc_ids)


def _autocast(device, precision: str):
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def paired_ce(models: dict, batches, device, precision: str, max_windows: int | None = None,
              progress: bool = True) -> dict:
    """Token-averaged CE of every model in ``models`` over the same windows: fp32 per-token CE, fp64
    sums.  Returns {"ce": {name: ce}, "tokens": n, "windows": w, "window_ce": {name: [per-window]}}."""
    import torch
    import torch.nn.functional as F

    sums = {n: torch.zeros((), dtype=torch.float64, device=device) for n in models}
    per_window: dict[str, list] = {n: [] for n in models}
    tokens = windows = 0
    from lrattnres.progress import bar as progress_bar

    it = progress_bar(batches, desc="[convert] paired CE", unit="batch", live=progress, leave=False)
    with torch.no_grad():
        for b in it:
            if max_windows is not None:
                take = min(b.inputs.shape[0], max_windows - windows)
                if take <= 0:
                    break
                if take < b.inputs.shape[0]:
                    b = b.head(take)
            b = b.to(device, non_blocking=True)
            inputs, targets, doc_ids = b.inputs, b.targets, b.doc_ids
            for name, m in models.items():
                with _autocast(device, precision):
                    logits = m(inputs, doc_ids, segments=b.segments)
                ce = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none")
                ce = ce.view(targets.shape).double()
                sums[name] += ce.sum()
                per_window[name].append(ce.sum(-1).cpu())
            tokens += targets.numel()
            windows += targets.shape[0]
    out = {"ce": {n: float(s / tokens) if tokens else float("nan") for n, s in sums.items()},
           "tokens": tokens, "windows": windows,
           "window_ce": {n: (torch.cat(v) if v else torch.zeros(0, dtype=torch.float64)) for n, v in per_window.items()}}
    return out


def _paired_se(a, b, seq_len: int) -> float | None:
    """Standard error of the token-averaged difference from per-window sums (windows of equal length)."""
    n = a.numel()
    if n < 2:
        return None
    diff = (b - a) / seq_len
    return float(diff.std(unbiased=True) / math.sqrt(n))


# --------------------------------------------------------------------------------------- claims


def parse_claim_row(row: str | None) -> tuple[str, str] | None:
    """"0.5b.nfull" -> ("0.5b", "nfull"); None -> None."""
    if row is None:
        return None
    m = re.fullmatch(r"(0\.5b|1b|4b)\.(nfull|n\d+)", str(row).strip().lower())
    if not m:
        raise SpecError(f"spec.claim_row: expected '<size>.n<N>' with size in {SIZES} and N 'full' or an int "
                         f"(e.g. '0.5b.nfull', '1b.n8'), or null; got {row!r}")
    return m.group(1), m.group(2)


def published_records(path: str | Path | None = None) -> dict[str, dict] | None:
    """The published records by id, or None (with a warning) when the file does not exist."""
    from lrattnres.claims import load_published

    path = Path(path) if path is not None else DEFAULT_PUBLISHED
    if not path.exists():
        log.warning("published claims file not found (%s); no claims emitted", path)
        return None
    return load_published(path)


def result_claims(result: dict, published: dict[str, dict] | None) -> dict[str, dict]:
    """The claims of one conversion result under its ``claim_row`` (only ids of the published file).

    ``table2.fp64_max_err.<row>``: the absolute FP64 max logit difference (Table 2's quantity; the
    note gives it relative to the logit scale); ``table2.delta_ce.<row>``: converted minus original;
    ``table2.orig_ce/conv_ce.<row>``: the CEs; ``appB.2.joint_rank.<size>``: the joint rank (a value
    claim: compared with the paper's at the paper scale; the note gives the model's active queries)."""
    parsed = parse_claim_row(result.get("claim_row"))
    if parsed is None or not published:
        return {}
    size, n = parsed
    row = f"{size}.{n}"
    blocks = result.get("blocks")
    who = (f"{result.get('run_id')} (L={result.get('n_layers')}, N={blocks}, d={result.get('d')} -> "
           f"r={result.get('rank')}) standing in for the paper's {size.upper()} N={n[1:]} row")
    ce_how = (f"{result.get('val_tokens_evaluated'):,} validation tokens, {result.get('precision')} on "
              f"{result.get('device')}")
    scale = result.get("logit_scale") or 0.0
    err = result.get("fp64_max_logit_err")
    out: dict[str, dict] = {}

    def put(cid, value, note):
        if cid in published and value is not None:
            out[cid] = {"reproduced": value, "note": note}

    rel = f"{err / scale:.3g}" if err is not None and scale > 0 else "n/a"
    put(f"table2.fp64_max_err.{row}", err,
        f"{who}; absolute max |logit difference| on one {result.get('fp64_seq_len')}-token sequence in FP64; "
        f"relative to the logit scale {scale:.4g}: {rel}"
        + (f"; float64 noise floor (one rounding of every weight) {result['fp64_noise_floor']:.3g}"
           if result.get("fp64_noise_floor") is not None else ""))
    put(f"table2.delta_ce.{row}", result.get("delta_ce"), f"{who}; converted minus original over {ce_how}")
    put(f"table2.orig_ce.{row}", result.get("original_ce"), f"{who}; {ce_how}")
    put(f"table2.conv_ce.{row}", result.get("converted_ce"), f"{who}; {ce_how}")
    rid = f"appB.2.joint_rank.{size}"
    if rid in published and result.get("joint_rank") is not None:
        k, t = result["joint_rank"], result["active_queries"]
        paper_t = published[rid].get("row", {}).get("active_queries")
        out[rid] = {"reproduced": k, "note": f"{who}; joint rank {k} of {t} active queries"
                    + ("" if paper_t == t else f" (the paper's model has {paper_t})")}
    return out


def _worst(cid: str, entries: list[tuple[Any, str, str]]) -> tuple[Any, str]:
    """Combine the values of one claim id over several checkpoints: the worst case for invariants,
    the mean for values.  ``entries``: (value, note, run_id)."""
    vals = [v for v, _, _ in entries]
    runs = [r for _, _, r in entries]
    if len(entries) == 1:
        return vals[0], entries[0][1]
    if all(isinstance(v, bool) for v in vals):
        bad = [r for v, _, r in entries if not v]
        note = f"holds for all {len(vals)} checkpoints ({', '.join(runs)})" if not bad else f"fails for {', '.join(bad)}"
        return all(vals), note
    nums = [float(v) for v in vals]
    if ".fp64_max_err." in cid or ".joint_rank." in cid:
        i = max(range(len(nums)), key=lambda j: nums[j])
        return vals[i], f"worst (largest) of {len(vals)} checkpoints, from {runs[i]}: {entries[i][1]}"
    if ".delta_ce." in cid:
        i = max(range(len(nums)), key=lambda j: abs(nums[j]))
        return vals[i], f"worst (largest |ΔCE|) of {len(vals)} checkpoints, from {runs[i]}: {entries[i][1]}"
    mean = sum(nums) / len(nums)
    return mean, f"mean of {len(vals)} checkpoints ({', '.join(f'{r}: {v:.6g}' for r, v in zip(runs, nums))})"


def aggregate(results: list[dict]) -> dict[str, dict]:
    """Claims of several conversion results combined: every id produced by one checkpoint as it is
    (the Table 2 rows), ids produced by several (the per-size joint rank, or a row two checkpoints
    stand for) as the worst case over them for invariants (largest FP64 error, largest |ΔCE|, largest
    rank, all bools) and the mean for values."""
    grouped: dict[str, list] = {}
    for res in results:
        for cid, c in (res.get("claims") or {}).items():
            grouped.setdefault(cid, []).append((c.get("reproduced"), c.get("note", ""), str(res.get("run_id"))))
    out = {}
    for cid, entries in grouped.items():
        v, note = _worst(cid, entries)
        out[cid] = {"reproduced": v, "note": note}
    return out


def invariant_summary(results: list[dict]) -> dict:
    """Worst case over every conversion (mapped to a paper row or not)."""
    def mx(key, f=lambda x: x):
        vals = [f(r[key]) for r in results if r.get(key) is not None]
        return max(vals) if vals else None

    rel = [r["fp64_max_logit_err"] / r["logit_scale"] for r in results
           if r.get("fp64_max_logit_err") is not None and r.get("logit_scale")]
    return {
        "checkpoints": len(results),
        "fp64_max_logit_err": mx("fp64_max_logit_err"),
        "fp64_rel_logit_err": max(rel) if rel else None,
        "fp64_rel_below_1e-9": all(x <= 1e-9 for x in rel) if rel else None,
        "max_abs_delta_ce": mx("delta_ce", abs),
        "abs_delta_ce_below_1e-3": (mx("delta_ce", abs) <= 1e-3) if mx("delta_ce", abs) is not None else None,
        "joint_rank_within_active_queries": all(r["joint_rank"] <= r["active_queries"] for r in results) if results else None,
        "max_slice_drift_logit_err": max((r.get("slice_drift", {}).get("max_logit_err") or 0.0) for r in results) if results else None,
    }


def aggregate_results(results: list[dict], provenance_block: dict | None = None) -> dict:
    """The ``convert_all`` result: every conversion, the union of their claims (aggregated)."""
    from lrattnres.provenance import provenance

    conversions = [{k: v for k, v in r.items() if k != "_path"} for r in results]
    return {
        "stage": "convert",
        "conversions": conversions,
        "invariants": invariant_summary(conversions),
        "claims": aggregate(conversions),
        "provenance": provenance_block or provenance({"aggregate": [r.get("run_id") for r in conversions]}),
    }


# ------------------------------------------------------------------------------------------ run


def validate_spec(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise SpecError(f"--spec: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise SpecError(f"spec.{unknown[0]}: unknown key (expected {sorted(SPEC_KEYS)})")
    for k in SPEC_REQUIRED:
        if k not in spec:
            raise SpecError(f"spec.{k}: missing (required)")
    out = {"val_tokens": None, "claim_row": None, "precision": "auto", "device": "auto", "rtol": None,
           "seq_len": None, "export_dtype": "bf16", **spec}
    if out["export_dtype"] not in ("bf16", "storage"):
        raise SpecError(f"spec.export_dtype: expected 'bf16' or 'storage', got {out['export_dtype']!r}")
    if not (is_int(out["rank"]) or isinstance(out["rank"], str)):
        raise SpecError(f"spec.rank: expected an int or 'd/<n>', got {out['rank']!r}")
    for k, lo in (("batch_size", 1), ("val_tokens", 1), ("seq_len", 1)):
        v = out[k]
        if v is None and k != "batch_size":
            continue
        if not is_int(v) or v < lo:
            raise SpecError(f"spec.{k}: expected an int >= {lo}{'' if k == 'batch_size' else ' or null'}, got {v!r}")
    if out["precision"] not in ("auto", "bf16", "fp32"):
        raise SpecError(f"spec.precision: expected 'auto', 'bf16' or 'fp32', got {out['precision']!r}")
    if out["rtol"] is not None and not (isinstance(out["rtol"], (int, float)) and out["rtol"] >= 0):
        raise SpecError(f"spec.rtol: expected a number >= 0 or null, got {out['rtol']!r}")
    parse_claim_row(out["claim_row"])
    return out


def _export(conv_model, dtype, device):
    """The converted model with weights rounded to the export dtype (what ``--save`` writes)."""
    import torch

    from lrattnres.model import build_model

    with torch.device(device):
        m = build_model(conv_model.cfg)
    m.to(dtype)
    m.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in conv_model.state_dict().items()}, strict=True)
    return m.eval()


def run(checkpoint: str | Path, data: str | Path, spec: dict, save: str | Path | None = None,
        published: str | Path | None = None, progress: bool = True) -> dict:
    """Convert one checkpoint and check it; returns the result JSON (see the module doc)."""
    import torch

    from lrattnres.data import iter_eval_batches, load_manifest, manifest_sha256
    from lrattnres.provenance import now, provenance
    from lrattnres.train import checkpoint as ckpt

    started = now()
    t0 = time.perf_counter()
    spec = validate_spec(spec)
    device = resolve_device(spec["device"], where="spec.device")
    precision = spec["precision"]
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"

    model, info = ckpt.load_model(checkpoint, "cpu")
    cfg = model.cfg
    _check_source(cfg)
    storage = next(model.parameters()).dtype
    run_id = (info.get("spec") or {}).get("run_id") or Path(checkpoint).resolve().parent.name
    manifest = load_manifest(data)
    msha = manifest_sha256(manifest)
    if info.get("manifest_sha256") and info["manifest_sha256"] != msha:
        log.warning("%s was trained on data manifest %s, evaluating on %s", checkpoint,
                    info["manifest_sha256"][:12], msha[:12])
    if manifest.get("vocab_size") is not None and manifest["vocab_size"] > cfg.vocab_size:
        raise ValueError(f"{data}: vocab_size {manifest['vocab_size']} exceeds the checkpoint's {cfg.vocab_size}")
    claim_row = spec["claim_row"]
    parsed = parse_claim_row(claim_row)
    if parsed is not None and parsed[1] != f"n{cfg.blocks}":
        log.warning("claim_row %s names N=%s but the checkpoint routes with blocks=%s", claim_row, parsed[1][1:], cfg.blocks)

    # ---- conversion and the FP64 check --------------------------------------------------------
    log.info("%s: %s N=%s d=%d, %d active queries", run_id, cfg.method, cfg.blocks, cfg.d_model, 2 * cfg.n_layers)
    orig64 = _fp64_view(model, device)  # the original stays on the CPU in its dtype until the CE pass
    conv = convert_model(orig64, spec["rank"], rtol=spec["rtol"], dtype=torch.float64, device=device)
    conv64 = with_config(conv.model, router="reference", attention="sdpa")
    log.info("joint rank k=%d of %d; converting d=%d -> r=%d (query residual %.3g)", conv.span.joint_rank,
             conv.span.active_queries, cfg.d_model, conv.rank, conv.query_residual)
    L = cfg.max_seq_len
    first = iter_eval_batches(manifest, "val", 1, L)
    fp64_len = L
    if len(first) == 0:  # a validation split shorter than one full-length window
        fp64_len = max(1, first.tokens_total - 1)
        log.warning("validation split holds %d tokens: the FP64 check uses %d, not max_seq_len=%d",
                    first.tokens_total, fp64_len, L)
        first = iter_eval_batches(manifest, "val", 1, fp64_len)
    seq = next(iter(first))
    inputs, doc_ids = seq.inputs.to(device), seq.doc_ids.to(device)
    with torch.no_grad():
        ref, w_orig = orig64(inputs, doc_ids, return_routing=True)
        err, scale = max_logit_diff_to(ref, conv64, inputs, doc_ids), float(ref.abs().max())
        slice_err = max_logit_diff_to(ref, with_config(conv64, method="lr"), inputs, doc_ids)
        _, w_conv = conv64(inputs, doc_ids, return_routing=True)
    routing_err = max(float((a - b).abs().max()) for a, b in zip(w_orig, w_conv))
    del w_orig, w_conv
    spectrum, qres = conv.span, conv.query_residual
    edtype = torch.bfloat16 if spec["export_dtype"] == "bf16" else storage
    conv_export = _export(conv.model, edtype, device)
    orig_export = _export(model, edtype, device)
    del conv64, conv  # free the float64 converted model before the exported copy's check
    exported_err = max_logit_diff_to(ref, _fp64_view(conv_export), inputs, doc_ids)
    exported_orig_err = max_logit_diff_to(ref, _fp64_view(orig_export), inputs, doc_ids)
    noise_floor = fp64_noise_floor(orig64, ref, inputs, doc_ids)  # perturbs orig64: last use
    log.info("FP64 max logit error %.3e (logit scale %.3g; float64 noise floor %.3e), routing weights %.3e; "
             "exported (%s) %.3e, the original exported %.3e; slice drift %.3e", err, scale, noise_floor, routing_err,
             str(edtype).replace("torch.", ""), exported_err, exported_orig_err, slice_err)
    del orig64, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # ---- export and strict reload (Appendix B.2) ----------------------------------------------
    meta = {"model_config": dataclasses.asdict(conv_export.cfg), "spec": info.get("spec"),
            "manifest_sha256": info.get("manifest_sha256"), "step": info.get("step"), "tokens": info.get("tokens"),
            "converted_from": {"checkpoint": str(checkpoint), "run_id": run_id, "joint_rank": spectrum.joint_rank,
                               "rank": int(conv_export.cfg.rank), "method": "lr-fullrms", "rtol": spectrum.rtol},
            "export_dtype": str(edtype).replace("torch.", "")}
    with tempfile.TemporaryDirectory(prefix="lrattnres-convert-") as tmp:
        paths = {"original": Path(tmp) / "original.safetensors",
                 "converted": Path(save) if save is not None else Path(tmp) / "converted.safetensors"}
        reloaded = {}
        for name, m, info_ in (("original", orig_export, {**info, "export_dtype": meta["export_dtype"]}),
                               ("converted", conv_export, meta)):
            weights = {k: v.detach().cpu() for k, v in m.state_dict().items()}
            ckpt.save_model(weights, {k: v for k, v in info_.items() if k != "path"}, paths[name])
            back, _ = ckpt.load_model(paths[name], "cpu")  # strict reload: sha256, every parameter
            for k, v in back.state_dict().items():
                if not torch.equal(v.to(weights[k].dtype), weights[k]):
                    raise RuntimeError(f"{paths[name]}: parameter {k} changed in the export and reload")
            reloaded[name] = back.to(device).eval()
        del orig_export, conv_export
    saved = str(save) if save is not None else None
    if saved:
        log.info("saved the converted checkpoint to %s", save)
    native_err = None
    if device.type == "cuda":  # the reloaded models' native routing against the reference on the check's sequence
        with torch.no_grad(), _autocast(device, "bf16"):
            native_err = max(float((with_config(m, router="fused")(inputs, doc_ids).float()
                                    - with_config(m, router="reference")(inputs, doc_ids).float()).abs().max())
                             for m in reloaded.values())

    # ---- paired validation CE -----------------------------------------------------------------
    seq_len = spec["seq_len"] or (info.get("spec") or {}).get("seq_len") or L
    seq_len = min(int(seq_len), L)
    batches = iter_eval_batches(manifest, "val", spec["batch_size"], seq_len)
    max_windows = None if spec["val_tokens"] is None else max(1, spec["val_tokens"] // seq_len)
    models = {"original": reloaded["original"], "converted": reloaded["converted"],
              "slice": with_config(reloaded["converted"], method="lr")}
    ce = paired_ce(models, batches, device, precision, max_windows, progress=progress)
    orig_ce, conv_ce, slice_ce = ce["ce"]["original"], ce["ce"]["converted"], ce["ce"]["slice"]
    wce = ce["window_ce"]
    log.info("paired CE over %d tokens (%s): original %.6f converted %.6f delta %+.3e; slice %.6f",
             ce["tokens"], precision, orig_ce, conv_ce, conv_ce - orig_ce, slice_ce)

    result = {
        "stage": "convert",
        "run_id": run_id,
        "source_checkpoint": str(checkpoint),
        "method": cfg.method,
        "converted_method": "lr-fullrms",
        "blocks": cfg.blocks,
        "n_layers": cfg.n_layers,
        "d": cfg.d_model,
        "rank": int(reloaded["converted"].cfg.rank),
        "joint_rank": spectrum.joint_rank,
        "active_queries": spectrum.active_queries,
        "rtol": spectrum.rtol,
        "singular_values": spectrum.singular_values,
        "query_residual": qres,
        "fp64_seq_len": int(inputs.shape[1]),
        "fp64_max_logit_err": err,
        "logit_scale": scale,
        "fp64_noise_floor": noise_floor,
        "fp64_rel_logit_err": err / scale if scale > 0 else None,
        "routing_max_err": routing_err,
        "exported_dtype": str(edtype).replace("torch.", ""),
        "exported_max_logit_err": exported_err,
        "exported_original_max_logit_err": exported_orig_err,
        "native_vs_reference_max_logit_err": native_err,
        "original_ce": orig_ce,
        "converted_ce": conv_ce,
        "delta_ce": conv_ce - orig_ce,
        "delta_ce_se": _paired_se(wce["original"], wce["converted"], seq_len),
        "val_tokens_evaluated": ce["tokens"],
        "val_windows": ce["windows"],
        "seq_len": seq_len,
        "precision": precision,
        "device": str(device),
        "slice_drift": {
            "method": "lr",
            "max_logit_err": slice_err,
            "rel_logit_err": slice_err / scale if scale > 0 else None,
            "ce": slice_ce,
            "delta_ce": slice_ce - orig_ce,
            "note": "converted weights run with slice normalisation (RMS over the last r coordinates); "
                    "Proposition 1 does not cover this",
        },
        "claim_row": claim_row,
        "manifest_sha256": msha,
        "saved": saved,
        "spec": spec,
        "wall_s": time.perf_counter() - t0,
        "peak_gpu_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
    }
    result["claims"] = result_claims(result, published_records(published))
    from lrattnres.attention import describe as describe_attention

    # the attention each forward ran: the FP64 check in SDPA, the paired CE in each model's own
    attention = {"fp64_check": describe_attention("sdpa", device),
                 **{name: describe_attention(m.cfg.attention, device) for name, m in models.items()}}
    result["provenance"] = provenance({"checkpoint": str(checkpoint), "spec": spec}, started=started,
                                      attention=attention)
    return result


def main(argv: list[str] | None = None) -> int:

    from lrattnres.io import atomic_write_json, read_json, read_spec_arg

    p = argparse.ArgumentParser(prog="python -m lrattnres convert",
                                description="convert a standard AttnRes checkpoint to full-width-RMS LR-AttnRes "
                                            "(Section 4.8), or aggregate conversion results")
    p.add_argument("--checkpoint", help="model.safetensors of a standard AttnRes run")
    p.add_argument("--data", help="data manifest (manifest.json or its folder)")
    p.add_argument("--spec", help="JSON: rank, val_tokens, batch_size, claim_row [, precision, device, rtol, seq_len]")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--save", default=None,
                   help="write the converted weights here (a .safetensors file, with its .sha256 beside it)")
    p.add_argument("--published", default=None, help="published claims file (default: reports/published.yaml)")
    p.add_argument("--aggregate", nargs="+", default=None, metavar="RESULT",
                   help="combine per-checkpoint convert results into one (convert_all)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress bar (plain progress lines instead, as whenever stderr is not a terminal)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    if args.aggregate is not None:
        if args.checkpoint or args.data or args.spec or args.save:
            p.error("--aggregate takes result files only (no --checkpoint/--data/--spec/--save)")
        results = []
        for path in args.aggregate:
            r = read_json(path)
            if not isinstance(r, dict) or r.get("stage") != "convert" or "fp64_max_logit_err" not in r:
                raise ValueError(f"{path}: not a per-checkpoint convert result (stage 'convert' with fp64_max_logit_err)")
            results.append(r)
        out = aggregate_results(results)
        atomic_write_json(args.out, out)
        log.info("aggregated %d conversions into %s: %d claims", len(results), args.out, len(out["claims"]))
        return 0

    for name in ("checkpoint", "data", "spec"):
        if getattr(args, name) is None:
            p.error(f"--{name} is required (or use --aggregate)")
    spec = read_spec_arg(args.spec)
    try:
        result = run(args.checkpoint, args.data, spec, save=args.save, published=args.published,
                     progress=not args.no_progress)
    except RankError as e:  # a clear refusal, not a traceback
        print(f"convert: {args.checkpoint}: {e}", file=sys.stderr)
        return 2
    atomic_write_json(args.out, result)
    log.info("wrote %s", args.out)
    return 0
