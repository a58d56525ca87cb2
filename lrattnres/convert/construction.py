"""Proposition 1's construction: the joint span of the active queries, the orthogonal change of
residual coordinates that puts it in the last r coordinates, and the rotated weights (see
:mod:`lrattnres.convert` for the rule of each parameter)."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

from lrattnres.errors import SpecError, UserError
from lrattnres.ranks import resolve_rank


class RankError(UserError, ValueError):
    """The requested rank is below the joint query rank: the conversion would not be exact."""


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
    """Convert an AttnRes ``model`` to full-width-RMS LR-AttnRes of rank ``rank`` (lrattnres/ranks.py; "k" is the queries' joint rank).

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
    r = resolve_rank(rank, cfg.d_model, where="spec.rank", joint_rank=span.joint_rank, error=SpecError)
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
