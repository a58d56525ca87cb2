"""The fused kernels' math in plain torch: a readable reference of the forward and the backward.

``naive_attnres(sources, query, norm=..., eps=...)`` is the operator, with the same semantics as
``kernels.attnres`` and ``lrattnres.routing.route`` (the model's reference); ``naive_attnres_fwd``
also returns the per-token statistics that the fused forward saves, in the same layout, and
``naive_attnres_bwd`` is the backward that the fused kernels compute from those statistics.  Every
step is written out over the S sources as a loop, in the compute dtype (fp32, or fp64 for fp64
inputs), so that each line can be read against the kernels in ``fused_fwd.py`` and ``fused_bwd.py``.
The tests hold the fused kernels to these functions (tests/test_kernels_naive.py).

Notation, per token (the leading dimensions of the sources are the tokens):

    o_i     the S sources, [d] each
    k_i     o_i's key: its last r coordinates
    n       the key's RMS width: r for norm "slice", d for "full" (RMS over the whole row, then the
            last r coordinates are taken)
    rinv_i  = 1 / sqrt(|k_i|^2 / n + eps)       ("slice"; "full" sums over all d coordinates)
    z_i     = rinv_i (q . k_i)                  the score
    lse     = logsumexp_i z_i
    w_i     = exp(z_i - lse)                    the routing weights (softmax over the sources)
    h       = sum_i w_i o_i                     the output

Backward, with g = dL/dh:

    dz_i    = w_i (g . o_i - g . h)
    c_i     = dz_i rinv_i
    dL/do_i = w_i g + c_i (q - (z_i rinv_i / n) k_i)   on the key columns (the query is laid over
              the last r columns); under "full" the k_i term covers every column
    dL/dq   = sum_tokens sum_i c_i k_i

Statistics (fp32, [1 + 2S, tokens...]): row 0 the logsumexp, rows 1..S the scores z_i, rows
S+1..2S the key 1/RMS rinv_i.  With them the backward needs one row sum per source (g . o_i) and
g . h; it never forms an [S, tokens, d] tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NORMS = ("slice", "full")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _key_width(norm: str, d: int, r: int) -> int:
    """n: how many coordinates the key's RMS is taken over."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    return r if norm == "slice" else d


def naive_attnres_fwd(sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice",
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(h in the sources' dtype, statistics [1 + 2S, ...] in the compute dtype): the forward."""
    d, r, S = sources[0].shape[-1], query.shape[-1], len(sources)
    n = _key_width(norm, d, r)
    wide = _compute_dtype(sources[0])
    q = query.to(wide)
    z, rinv = [], []
    for o in sources:
        x = o.to(wide)
        k = x[..., d - r:]  # the key: the last r coordinates
        sq = (k if norm == "slice" else x).pow(2).sum(-1)  # |k|^2 over the RMS width
        rinv_i = torch.rsqrt(sq / n + eps)
        z.append((k @ q) * rinv_i)
        rinv.append(rinv_i)
    z = torch.stack(z)  # [S, ...]
    lse = torch.logsumexp(z, dim=0)
    h = torch.zeros_like(sources[0], dtype=wide)
    for i, o in enumerate(sources):
        h = h + torch.exp(z[i] - lse).unsqueeze(-1) * o.to(wide)
    stats = torch.cat([lse.unsqueeze(0), z, torch.stack(rinv)])
    assert stats.shape[0] == 1 + 2 * S
    return h.to(sources[0].dtype), stats


def naive_attnres_bwd(sources: Sequence[torch.Tensor], query: torch.Tensor, h: torch.Tensor, stats: torch.Tensor,
                      g: torch.Tensor, *, norm: str = "slice") -> tuple[list[torch.Tensor], torch.Tensor]:
    """(source gradients in the sources' dtype, query gradient in the query's dtype): the backward
    from the forward's output h and statistics, as the fused kernels compute it.  g . h uses h as
    given: pass the output at full precision (the fused kernels rebuild it from the rounded output
    and its residual, or take g . h = sum_i w_i g . o_i)."""
    d, r, S = sources[0].shape[-1], query.shape[-1], len(sources)
    n = _key_width(norm, d, r)
    wide = stats.dtype
    q = query.to(wide)
    g = g.to(wide)
    lse, z, rinv = stats[0], stats[1:1 + S], stats[1 + S:]
    gh = (g * h.to(wide)).sum(-1)
    grads, dq = [], torch.zeros(r, dtype=wide, device=query.device)
    for i, o in enumerate(sources):
        x = o.to(wide)
        w = torch.exp(z[i] - lse)
        dz = w * ((g * x).sum(-1) - gh)
        c = dz * rinv[i]
        coef = (c * z[i] * rinv[i] / n).unsqueeze(-1)
        grad = w.unsqueeze(-1) * g
        grad[..., d - r:] += c.unsqueeze(-1) * q
        if norm == "slice":
            grad[..., d - r:] -= coef * x[..., d - r:]
        else:
            grad -= coef * x
        grads.append(grad.to(o.dtype))
        dq += (c.unsqueeze(-1) * x[..., d - r:]).reshape(-1, r).sum(0)
    return grads, dq.to(query.dtype)


class _NaiveAttnRes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, norm, eps, *sources):
        h, stats = naive_attnres_fwd(sources, query, norm=norm, eps=eps)
        # the backward's g . h at the compute precision: keep the unrounded mix
        wide = stats.dtype
        w = torch.exp(stats[1:1 + len(sources)] - stats[0])
        h_wide = sum(w[i].unsqueeze(-1) * o.to(wide) for i, o in enumerate(sources))
        ctx.save_for_backward(query, h_wide, stats, *sources)
        ctx.norm = norm
        return h

    @staticmethod
    def backward(ctx, grad_h):
        query, h_wide, stats, *sources = ctx.saved_tensors
        grads, dq = naive_attnres_bwd(sources, query, h_wide, stats, grad_h, norm=ctx.norm)
        return (dq, None, None, *grads)


def naive_attnres(sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice",
                  eps: float = 1e-6) -> torch.Tensor:
    """The operator with autograd through ``naive_attnres_bwd`` (not through torch's own graph)."""
    _key_width(norm, sources[0].shape[-1], query.shape[-1])
    return _NaiveAttnRes.apply(query, norm, float(eps), *sources)
