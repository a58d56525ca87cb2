"""``attnres``: the fused kernels with autograd, on every path a call can take.

- eager, CUDA (or CPU with settings.cpu_triton, through the interpreter): a plain autograd.Function
  over the table kernels (the custom op's eager dispatch costs more host time than the launchers);
- torch.compile, CUDA, S <= 16: the ``torch.library.triton_op`` pair ``attnres_fwd_args`` /
  ``attnres_bwd_args`` over the per-argument kernels, which Inductor traces into its own code (a
  custom op would go back to Python for every read: 768 per update of the 1B step);
- torch.compile otherwise: the custom op ``attnres_fwd`` / ``attnres_bwd`` over the table kernels;
- CPU: the custom op's torch fallback, the reference forward and the backward written out from the
  same statistics.

Saved for the backward: the sources and h (kept by a model anyway), the query, the statistics and,
where kept, the rounding residual.  The ops take the settings as their ``key`` string ("" for
kernels.DEFAULT).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import dispatch, launch
from .settings import DEFAULT, Settings

# ---------------------------------------------------------------------------------------------- torch fallback


def _res_encode(h32: torch.Tensor, hb: torch.Tensor, s: Settings) -> torch.Tensor:
    """int8 residual of rounding ``h32`` to ``hb`` (the kernels' code)."""
    if not dispatch.keeps_residual_code(hb.dtype):
        return torch.empty(0, dtype=torch.int8, device=hb.device)
    hb32 = hb.float()
    step = dispatch.res_step(hb.dtype, s)
    if step == 0:
        code = (h32.float().view(torch.int32) - hb32.view(torch.int32) + 128) >> 8
        return code.clamp(-127, 127).to(torch.int8)
    ebits = hb32.view(torch.int32) & 0x7F800000
    ok = (ebits > 0) & (ebits < 0x7F800000)
    code = torch.floor((h32 - hb32) / torch.where(ok, ebits.view(torch.float32) * step, 1.0) + 0.5).clamp(-127, 127)
    return torch.where(ok, code, 0.0).to(torch.int8)


def _res_decode(hb: torch.Tensor, res: torch.Tensor, s: Settings) -> torch.Tensor:
    """h to about 2^-16 relative from its rounded value and residual (h itself without one)."""
    if not dispatch.keeps_residual_code(hb.dtype) or res.numel() == 0:
        return hb
    hb32 = hb.float()
    step = dispatch.res_step(hb.dtype, s)
    if step == 0:
        return (hb32.view(torch.int32) + res.to(torch.int32) * 256).view(torch.float32)
    ebits = hb32.view(torch.int32) & 0x7F800000
    ok = (ebits > 0) & (ebits < 0x7F800000)
    return torch.where(ok, hb32 + res.float() * (ebits.view(torch.float32) * step), hb32)


def scores_torch(sources, query, norm: str, eps: float):
    """Each source's score z_i and key 1/RMS rinv_i, [S, ...] in fp32 (fp64 for fp64 sources)."""
    d, r = launch.check(sources, query, norm)
    wide = torch.promote_types(sources[0].dtype, torch.float32)
    q = query.to(wide)
    zs, rinvs = [], []
    for o in sources:
        x = o.to(wide)
        k = x[..., d - r:] if norm == "slice" else x
        rinv = torch.rsqrt(k.pow(2).mean(-1) + eps)
        zs.append((x[..., d - r:] @ q) * rinv)
        rinvs.append(rinv)
    return torch.stack(zs), torch.stack(rinvs)


def fwd_torch(sources, query, norm: str, eps: float, s: Settings):
    z, rinv = scores_torch(sources, query, norm, eps)
    lse = torch.logsumexp(z, dim=0)
    w = torch.exp(z - lse)
    h = w[0].unsqueeze(-1) * sources[0].to(w.dtype)
    for wi, o in zip(w[1:], sources[1:]):
        h = h + wi.unsqueeze(-1) * o.to(w.dtype)
    hb = h.to(sources[0].dtype)
    kept = dispatch.res_kept(hb.dtype, sources[0].shape[-1], query.shape[-1], norm, len(sources), s)
    res = _res_encode(h, hb, s) if kept else torch.empty(0, dtype=torch.int8, device=hb.device)
    return hb, torch.cat([lse.unsqueeze(0), z, rinv]), res


def bwd_torch(sources, query, h, stats, res, g, norm: str, eps: float, s: Settings):
    """The backward in torch from the forward's statistics (the kernels' math, any device)."""
    d, r = launch.check(sources, query, norm)
    S = len(sources)
    wide = stats.dtype
    q = query.to(wide)
    g = g.to(wide)
    gos = None  # g.o_i, where g.h needs them first
    if dispatch.keeps_residual_code(h.dtype) and res.numel() == 0:  # no residual: g.h = sum_i w_i g.o_i
        gos = [(g * o.to(wide)).sum(-1) for o in sources]
        gh = sum(torch.exp(stats[1 + i] - stats[0]) * go for i, go in enumerate(gos))
    else:
        gh = (g * _res_decode(h, res, s).to(wide)).sum(-1)
    n = r if norm == "slice" else d
    dq = torch.zeros(r, dtype=wide, device=query.device)
    grads = []
    for i, o in enumerate(sources):
        x = o.to(wide)
        z, rinv = stats[1 + i], stats[1 + S + i]
        w = torch.exp(z - stats[0])
        go = gos[i] if gos is not None else (g * x).sum(-1)
        c = w * (go - gh) * rinv  # dL/dz_i * rinv_i
        coef = (c * z * rinv / n).unsqueeze(-1)
        grad = w.unsqueeze(-1) * g
        grad[..., d - r:] += c.unsqueeze(-1) * q
        if norm == "slice":
            grad[..., d - r:] -= coef * x[..., d - r:]
        else:
            grad -= coef * x
        grads.append(grad.to(o.dtype))
        dq += (c.unsqueeze(-1) * x[..., d - r:]).reshape(-1, r).sum(0)
    return grads, dq.to(query.dtype)


# ---------------------------------------------------------------------------------------------- ops


def _triton_ok(t: torch.Tensor, s: Settings) -> bool:
    return (t.is_cuda or (s.cpu_triton and t.device.type == "cpu")) and t.dtype in dispatch.TRITON_DTYPES


@torch.library.custom_op("lrattnres_kernels::attnres_fwd", mutates_args=())
def attnres_fwd(sources: list[torch.Tensor], query: torch.Tensor, norm: str, eps: float,
                settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [..., d] in the sources' dtype, statistics [1 + 2S, ...] fp32: the logsumexp, the S scores,
    the S key 1/RMS; the int8 rounding residual [..., d], empty where none is kept)."""
    s = Settings.parse(settings)
    if _triton_ok(sources[0], s):
        return launch.fwd(sources, query, norm, eps, s)
    return fwd_torch(sources, query, norm, eps, s)


@attnres_fwd.register_fake
def _(sources, query, norm, eps, settings):
    launch.check(sources, query, norm)
    s0 = sources[0]
    kept = dispatch.res_kept(s0.dtype, s0.shape[-1], query.shape[-1], norm, len(sources), Settings.parse(settings))
    stats = s0.new_empty((1 + 2 * len(sources),) + tuple(s0.shape[:-1]),
                         dtype=torch.promote_types(s0.dtype, torch.float32))
    return s0.new_empty(s0.shape), stats, s0.new_empty(s0.shape if kept else (0,), dtype=torch.int8)


@torch.library.custom_op("lrattnres_kernels::attnres_bwd", mutates_args=())
def attnres_bwd(sources: list[torch.Tensor], query: torch.Tensor, h: torch.Tensor, stats: torch.Tensor,
                res: torch.Tensor, g: torch.Tensor, norm: str, eps: float, settings: str) -> list[torch.Tensor]:
    """The S source gradients, then the query gradient."""
    s = Settings.parse(settings)
    run = launch.bwd if _triton_ok(sources[0], s) else bwd_torch
    grads, dq = run(sources, query, h, stats, res, g, norm, eps, s)
    return list(grads) + [dq]


@attnres_bwd.register_fake
def _(sources, query, h, stats, res, g, norm, eps, settings):
    return [x.new_empty(x.shape) for x in sources] + [query.new_empty(query.shape)]


def _setup_context(ctx, inputs, output):
    sources, query, norm, eps, settings = inputs
    h, stats, res = output
    ctx.save_for_backward(query, h, stats, res, *sources)
    ctx.norm, ctx.eps, ctx.settings = norm, eps, settings


def _backward_through(bwd_op):
    """The registered backward of a forward op: calls ``bwd_op`` with the saved tensors."""

    def backward(ctx, grad_h, grad_stats, grad_res):
        query, h, stats, res, *sources = ctx.saved_tensors
        if grad_h is None:
            grad_h = torch.zeros_like(h)
        out = bwd_op(list(sources), query, h, stats, res, grad_h, ctx.norm, ctx.eps, ctx.settings)
        return list(out[:-1]), out[-1], None, None, None

    return backward


attnres_fwd.register_autograd(_backward_through(attnres_bwd), setup_context=_setup_context)


def _args_ok(sources, s: Settings) -> bool:
    return _triton_ok(sources[0], s) and len(sources) <= dispatch.MAX_ARG_SOURCES


@torch.library.triton_op("lrattnres_kernels::attnres_fwd_args", mutates_args=())
def attnres_fwd_args(sources: list[torch.Tensor], query: torch.Tensor, norm: str, eps: float,
                     settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attnres_fwd for at most 16 sources, traceable into a compiled graph."""
    s = Settings.parse(settings)
    run = launch.fwd_args if _args_ok(sources, s) else fwd_torch
    return run(sources, query, norm, eps, s)


@torch.library.triton_op("lrattnres_kernels::attnres_bwd_args", mutates_args=())
def attnres_bwd_args(sources: list[torch.Tensor], query: torch.Tensor, h: torch.Tensor, stats: torch.Tensor,
                     res: torch.Tensor, g: torch.Tensor, norm: str, eps: float, settings: str) -> list[torch.Tensor]:
    """attnres_bwd for at most 16 sources, traceable into a compiled graph."""
    s = Settings.parse(settings)
    run = launch.bwd_args if _args_ok(sources, s) else bwd_torch
    grads, dq = run(sources, query, h, stats, res, g, norm, eps, s)
    return list(grads) + [dq]


attnres_fwd_args.register_autograd(_backward_through(attnres_bwd_args), setup_context=_setup_context)


def compiled_args_path(sources: Sequence[torch.Tensor], s: Settings) -> bool:
    """Whether a compiled call takes the triton_op (CUDA, at most 16 sources, compiled_path)."""
    return (s.compiled_path == "triton_op" and 0 < len(sources) <= dispatch.MAX_ARG_SOURCES
            and sources[0].is_cuda and sources[0].dtype in dispatch.TRITON_DTYPES)


class _AttnResTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, norm, eps, s, *sources):
        h, stats, res = launch.fwd(sources, query, norm, eps, s)
        ctx.save_for_backward(query, h, stats, res, *sources)
        ctx.norm, ctx.eps, ctx.s = norm, eps, s
        return h

    @staticmethod
    def backward(ctx, grad_h):
        query, h, stats, res, *sources = ctx.saved_tensors
        grads, dq = launch.bwd(sources, query, h, stats, res, grad_h, ctx.norm, ctx.eps, ctx.s)
        return (dq, None, None, None, *grads)


def attnres(sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice", eps: float = 1e-6,
            settings: Settings = DEFAULT) -> torch.Tensor:
    """Fused depth routing: ``sum_i softmax_i(q . RMSNorm(key_i)) o_i``, the semantics of
    ``lrattnres.routing.route``; differentiable in the sources and the query."""
    compiling = torch.compiler.is_compiling()
    if settings.eager_function and not compiling and len(sources) > 0 and _triton_ok(sources[0], settings):
        return _AttnResTriton.apply(query, norm, float(eps), settings, *sources)
    op = attnres_fwd_args if compiling and compiled_args_path(sources, settings) else attnres_fwd
    return op(list(sources), query, norm, float(eps), "" if settings is DEFAULT else settings.key)[0]


def attnres_triton(sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice", eps: float = 1e-6,
                   settings: Settings = DEFAULT) -> torch.Tensor:
    """The table kernels with autograd on any device Triton runs on (CPU: through the interpreter)."""
    return _AttnResTriton.apply(query, norm, float(eps), settings, *sources)
