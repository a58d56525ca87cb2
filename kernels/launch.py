"""The launchers: tensors in, the fused kernels launched, tensors out (CPU tensors through Triton's
interpreter too).

They run twice per routing read (768 times per update of the 1B step), and a compiled step whose GPU
work is short waits for them: sources are read in place where they can be, outputs allocated in
their final shape, a tuned choice looked up by one dictionary key.  ``fwd``/``bwd`` launch the table
kernels (eager calls), ``fwd_args``/``bwd_args`` the per-argument kernels (traceable by Inductor).
Triton is optional (the CPU fallback needs none): the kernel modules are imported at the first launch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from . import configs, dispatch
from .settings import Settings

NORMS = ("slice", "full")
# Launches per (kind, S, tokens, d, r[, vector width the tables allowed]): which shapes a model sends
# (under torch.compile the per-argument launches are counted when traced).  Benchmarks read and clear it.
CALLS: Counter = Counter()


def check(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str) -> tuple[int, int]:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if len(sources) == 0:
        raise ValueError("attnres needs at least one source")
    if query.dim() != 1:
        raise ValueError(f"query must be 1-D [r], got shape {tuple(query.shape)}")
    shape = sources[0].shape
    if len(shape) == 0:
        raise ValueError("sources must have a last (feature) dimension")
    for o in sources:
        if o.shape != shape:
            raise ValueError(f"all sources must share one shape; got {tuple(o.shape)} and {tuple(shape)}")
        if o.device != sources[0].device:
            raise ValueError("all sources must be on one device")
    d, r = shape[-1], query.shape[0]
    if not 1 <= r <= d:
        raise ValueError(f"query width r={r} must satisfy 1 <= r <= d={d}")
    return d, r


def _empty(shape, dtype, device, s: Settings) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if s.poison:  # an element the kernels never write shows up
        out.fill_(float("nan") if dtype.is_floating_point else -128)
    return out


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# ---------------------------------------------------------------------------------------------- rows and tables


def _rows(t: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """A [N, d] view with unit column stride (copies only when no such view exists)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.stride(-1) != 1:
        t = t.contiguous()
    t2 = t.reshape(-1, d)
    if t2.shape[0] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def row_stride(t: torch.Tensor, d: int) -> int | None:
    """Row stride of ``t`` read in place as [tokens, d], or None when that needs a copy (a feature
    stride other than 1, or leading dimensions that do not flatten into one)."""
    if t.is_contiguous():
        return d
    st = t.stride()
    if t.dim() == 0 or st[-1] != 1:
        return None
    rs, span = None, 0
    for size, stride in zip(reversed(t.shape[:-1]), reversed(st[:-1])):
        if size == 1:
            continue
        if rs is None:
            rs = stride
        elif stride != span:
            return None
        span = stride * size
    return d if rs is None else rs


def as_rows(ts: Sequence[torch.Tensor], d: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors to address as [tokens, d] rows of ``dtype``, and their row strides (a copy only
    for a tensor that cannot be read in place)."""
    out, strides = [], []
    for t in ts:
        rs = row_stride(t, d) if t.dtype == dtype else None
        if rs is None:
            t = _rows(t, d, dtype)
            rs = t.stride(0) if t.shape[0] > 1 else d
        out.append(t)
        strides.append(rs)
    return out, strides


_TABLES: OrderedDict = OrderedDict()
_TABLES_SIZE = 256
_CAPTURED: list = []  # tables (and their pinned host copies) that captured CUDA graphs read


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows), S] on ``device``, cached by content: a table holds offsets relative to the
    anchor and strides, right for any tensors at the same relative addresses (the caching allocator
    hands them out step after step).  A miss costs one pinned host-to-device copy."""
    key = (device, tuple(tuple(r) for r in rows))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    t = _TABLES.get(key)
    if t is not None:
        _TABLES.move_to_end(key)
        if capturing:  # a captured graph reads it on every replay: never free it
            _CAPTURED.append(t)
        return t
    cpu = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        t = cpu
    else:
        pinned = cpu.pin_memory()
        t = pinned.to(device, non_blocking=True)
        if capturing:  # the graph copies from this host buffer on every replay
            _CAPTURED.append((pinned, t))
    _TABLES[key] = t
    if len(_TABLES) > _TABLES_SIZE:
        _TABLES.popitem(last=False)
    return t


def _anchor_table(tensors: list[torch.Tensor], strides: list[int] | None):
    """Element offsets of ``tensors`` from the first one, and the ALIGN hint (elements)."""
    esz = tensors[0].element_size()
    p0 = tensors[0].data_ptr()
    offs = [(t.data_ptr() - p0) // esz for t in tensors]
    vec = max(1, 16 // esz)
    ok = p0 % 16 == 0 and all(o % vec == 0 for o in offs) and all(x % vec == 0 for x in (strides or []))
    return offs, (vec if ok else 1)


def _fused(dev: torch.device, s: Settings) -> bool:
    return dev.type == "cuda" if s.fused_reductions is None else bool(s.fused_reductions)


def _run(kernel, grid, warm: bool, *args, **kwargs):
    """Launch, or with ``warm`` only compile for these arguments (the launch's cache entry)."""
    if warm:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


# ---------------------------------------------------------------------------------------------- forward


def fwd_outputs(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str, s: Settings):
    """Checks, then (d, r, tokens, whether a rounding residual is kept, h, statistics, residual)."""
    d, r = check(sources, query, norm)
    s0 = sources[0]
    dtype, dev, lead = s0.dtype, s0.device, tuple(s0.shape[:-1])
    has_res = dispatch.res_kept(dtype, d, r, norm, len(sources), s)
    out = _empty(lead + (d,), dtype, dev, s)
    stats = _empty((1 + 2 * len(sources),) + lead, torch.float32, dev, s)
    res = _empty(lead + (d,) if has_res else (0,), torch.int8, dev, s)
    return d, r, s0.numel() // d, has_res, out, stats, res


def fwd(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str, eps: float, s: Settings):
    """The table forward: (h, statistics, residual)."""
    from . import fused_fwd as K

    d, r, n_tok, has_res, out, stats, res = fwd_outputs(sources, query, norm, s)
    if n_tok == 0:
        return out, stats, res
    dtype, dev = out.dtype, out.device
    rows, strides = as_rows(sources, d, dtype)
    offs, align = _anchor_table(rows, strides)
    table = _table([offs, strides], dev)
    block_d, nch = dispatch.layout("fwd", d, r, s)
    CALLS[("fwd", len(rows), n_tok, d, r, align)] += 1
    key = (d, norm == "slice", has_res, dtype, query.dtype, dispatch.res_step(dtype, s), s.lazy_rescale) + \
        dispatch.tune_class(len(rows), n_tok)
    key_pos = configs.key_pos(d, r, block_d, nch)
    args = (rows[0], table[0], table[1], query.contiguous(), out, res if has_res else out, stats,
            n_tok, len(rows), d, r, 1.0 / (r if norm == "slice" else d), float(eps))
    consts = dict(SLICE=dispatch.key_masked(norm, d, r), HAS_RES=has_res, RES_STEP=dispatch.res_step(dtype, s),
                  ALIGN=align, BLOCK_D=block_d, NCH=nch, FUSED=_fused(dev, s), LAZY=s.lazy_rescale)

    def launch(cfg, warm=False):  # with ``warm``: compile only, and return the compiled kernel
        return _run(K._attnres_fwd_kernel, (_cdiv(n_tok, cfg["BLOCK_T"]),), warm, *args, **consts, **cfg)

    cfg = dispatch.choose("fwd", block_d, nch, key_pos, dev, key, launch, dispatch.fwd_forms(len(rows), s), s)
    dispatch.check_fwd_pair(cfg, len(rows))
    launch(cfg)
    return out, stats, res


# ---------------------------------------------------------------------------------------------- backward


def bwd_inputs(sources, query, h, res, g, norm: str, s: Settings):
    """Checks and the backward's operands: (d, r, tokens, residual kept, the deferred forms that
    serve (empty where the forward kept the residual), source gradients, h and g as rows, g's row
    stride), or (None, gradients, query gradient) where no kernel needs to run."""
    d, r = check(sources, query, norm)
    s0 = sources[0]
    dtype, dev = s0.dtype, s0.device
    n_tok = s0.numel() // d
    if len(sources) == 1:
        # w = 1, h = o, dz = 0 exactly; a copy, never g itself (a custom op's output may not alias an input)
        grad = g.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        return None, [grad.view(s0.shape)], torch.zeros_like(query)
    grads = [_empty(o.shape, dtype, dev, s) for o in sources]
    if n_tok == 0:
        return None, grads, torch.zeros_like(query)
    h2 = h if (h.dtype == dtype and h.is_contiguous()) else _rows(h, d, dtype).contiguous()
    (g,), (gs,) = as_rows([g], d, g.dtype)
    has_res = dispatch.keeps_residual_code(dtype) and res.numel() > 0
    deferred = ()
    if dispatch.keeps_residual_code(dtype) and res.numel() == 0:  # the forward kept no residual
        deferred = dispatch.defer_kinds(dtype, d, r, norm, len(sources), s)
        if not deferred:
            raise ValueError(f"attnres backward: the forward kept no rounding residual, but no deferred backward "
                             f"serves this shape with these settings (S = {len(sources)}, d = {d}, r = {r}, norm "
                             f"{norm!r}): pass the forward's settings to the backward")
    return (d, r, n_tok, has_res, deferred, grads, h2, g, gs), None, None


def _bwd_scratch(cfg: dict, n_tok: int, n_sources: int, r: int, dev: torch.device, s: Settings):
    """The query-gradient partials (one row per program: a token block, or with PERSIST and on the
    persistent grid a few programs per multiprocessor) and the two-pass form's g.o scratch."""
    bt = cfg.get("BLOCK_T", 0)
    if bt and cfg.get("PERSIST"):
        programs = max(1, min(_cdiv(n_tok, bt), cfg["PERSIST"] * _num_sms(dev)))
    elif bt:
        programs = _cdiv(n_tok, bt)
    else:
        programs = max(1, min(n_tok, s.bwd_programs_per_sm * _num_sms(dev)))
    part = _empty((programs, r), torch.float32, dev, s)
    go = _empty((n_sources, n_tok), torch.float32, dev, s) if (cfg["DEFER"] and not cfg["PAIR"]) else None
    return part, go


def bwd(sources, query, h, stats, res, g, norm: str, eps: float, s: Settings):
    """The table backward: (source gradients, query gradient)."""
    from . import fused_bwd as K

    ops, grads, dq = bwd_inputs(sources, query, h, res, g, norm, s)
    if ops is None:
        return grads, dq
    d, r, n_tok, has_res, deferred, grads, h2, g, gs = ops
    dtype, dev = h2.dtype, h2.device
    block_d, nch = dispatch.layout("bwd", d, r, s)
    rows, strides = as_rows(sources, d, dtype)
    offs, align = _anchor_table(rows, strides)
    goffs, galign = _anchor_table(grads, [d])
    table = _table([offs, strides, goffs], dev)
    CALLS[("bwd", len(rows), n_tok, d, r, min(align, galign))] += 1
    rstep = dispatch.res_step(dtype, s)
    key = (d, norm == "slice", has_res, dtype, query.dtype, g.dtype, rstep) + dispatch.tune_class(len(rows), n_tok)
    key_pos = configs.key_pos(d, r, block_d, nch)
    args = (rows[0], table[0], table[1], grads[0], table[2], query.contiguous(), h2,
            res.contiguous() if has_res else h2, g, stats.contiguous())
    more = (n_tok, len(rows), d, r, gs, 1.0 / (r if norm == "slice" else d), float(eps))
    consts = dict(SLICE=dispatch.key_masked(norm, d, r), HAS_RES=has_res, RES_STEP=rstep, ALIGN=align, GALIGN=galign,
                  BLOCK_D=block_d, NCH=nch)

    def launch(cfg, warm=False):  # the kernel and the sum of its query-gradient partials
        part, go = _bwd_scratch(cfg, n_tok, len(rows), r, dev, s)
        kernel = _run(K._attnres_bwd_kernel, (part.shape[0],), warm, *args, part, go, *more, **consts, **cfg)
        return kernel if warm else sum_partials(part, query.dtype, s)

    cfg = dispatch.choose("bwd", block_d, nch, key_pos, dev, key, launch, deferred, s)
    dispatch.check_deferred(cfg, deferred, key_pos, len(rows))
    return grads, launch(cfg)


# ---------------------------------------------------------------------------------------------- per-argument kernels


def _slots(ts: Sequence, fill=None) -> list:
    return list(ts) + [fill] * (dispatch.MAX_ARG_SOURCES - len(ts))


def _launch_traced(kernel, grid, *args, **kwargs) -> None:
    """Launch through torch.library.wrap_triton, so that a trace records the kernel."""
    torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


def fwd_args(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str, eps: float, s: Settings):
    """The per-argument forward (at most 16 sources): (h, statistics, residual)."""
    from . import fused_fwd as K

    d, r, n_tok, has_res, out, stats, res = fwd_outputs(sources, query, norm, s)
    if n_tok == 0:
        return out, stats, res
    dtype = out.dtype
    rows, strides = as_rows(sources, d, dtype)
    block_d, nch = dispatch.layout("fwd", d, r, s)
    cfg = dispatch.args_config("fwd", block_d, nch, dispatch.fwd_forms(len(rows), s), s)
    dispatch.check_fwd_pair(cfg, len(rows))
    CALLS[("fwd-args", len(rows), n_tok, d, r)] += 1
    _launch_traced(
        K._attnres_fwd_args_kernel, (_cdiv(n_tok, cfg["BLOCK_T"]),),
        *_slots(rows), *_slots(strides), query.contiguous(), out, res if has_res else None, stats, n_tok, len(rows), d, r,
        NSLOT=len(rows), EPS=float(eps), SLICE=dispatch.key_masked(norm, d, r), HAS_RES=has_res,
        RES_STEP=dispatch.res_step(dtype, s), BLOCK_D=block_d, NCH=nch, FUSED=_fused(out.device, s),
        LAZY=s.lazy_rescale, **dispatch.launch_kwargs(cfg, "fwd", configs.key_pos(d, r, block_d, nch)),
    )
    return out, stats, res


def bwd_args(sources, query, h, stats, res, g, norm: str, eps: float, s: Settings):
    """The per-argument backward: (source gradients, query gradient summed by torch, which Inductor
    compiles)."""
    from . import fused_bwd as K

    ops, grads, dq = bwd_inputs(sources, query, h, res, g, norm, s)
    if ops is None:
        return grads, dq
    d, r, n_tok, has_res, deferred, grads, h2, g, gs = ops
    dtype = h2.dtype
    block_d, nch = dispatch.layout("bwd", d, r, s)
    rows, strides = as_rows(sources, d, dtype)
    key_pos = configs.key_pos(d, r, block_d, nch)
    kw = dispatch.launch_kwargs(dispatch.args_config("bwd", block_d, nch, deferred, s), "bwd", key_pos)
    dispatch.check_deferred(kw, deferred, key_pos, len(rows))
    part, go = _bwd_scratch(kw, n_tok, len(rows), r, h2.device, s)
    CALLS[("bwd-args", len(rows), n_tok, d, r)] += 1
    _launch_traced(
        K._attnres_bwd_args_kernel, (part.shape[0],),
        *_slots(rows), *_slots(strides), *_slots(grads), query.contiguous(), h2, res.contiguous() if has_res else None,
        g, stats.contiguous(), part, go, n_tok, len(rows), d, r, gs,
        NSLOT=len(rows), EPS=float(eps), SLICE=dispatch.key_masked(norm, d, r), HAS_RES=has_res,
        RES_STEP=dispatch.res_step(dtype, s), BLOCK_D=block_d, NCH=nch, **kw,
    )
    return grads, part.sum(0).to(query.dtype)


# ---------------------------------------------------------------------------------------------- partial sums

SUM_BLOCK_P, SUM_BLOCK_R, SUM_WARPS = 64, 64, 4  # a slab step [rows, columns] and its warps
_SUM_COUNTS: dict = {}  # (device, column blocks) -> [int32 counters [ring, blocks], next row]


def sum_splits(n_rows: int, r: int, device: torch.device, s: Settings) -> int:
    """Slabs the partial rows are cut into: about sum_programs_per_sm programs per multiprocessor
    over the column blocks, at least SUM_BLOCK_P rows each."""
    programs = s.sum_programs_per_sm * _num_sms(device)
    return max(1, min(_cdiv(programs, _cdiv(r, SUM_BLOCK_R)), _cdiv(n_rows, SUM_BLOCK_P)))


def sum_rows(part: torch.Tensor, dtype: torch.dtype, s: Settings) -> torch.Tensor:
    """part [P, r] fp32 summed over its rows by sums._sum_rows_kernel: slabs, then the slabs into
    ``dtype`` (one launch where one slab does).  Two launches over a few hundred programs beat
    torch's reduction at these sizes and fix the order (deterministic)."""
    from . import sums as K

    n_rows, r = part.shape
    ncb = _cdiv(r, SUM_BLOCK_R)
    out = _empty((r,), dtype, part.device, s)
    splits = sum_splits(n_rows, r, part.device, s)
    src = part
    if splits > 1:
        src = _empty((splits, r), torch.float32, part.device, s)
        K._sum_rows_kernel[(splits, ncb)](part, src, n_rows, r, _cdiv(n_rows, splits), BLOCK_P=SUM_BLOCK_P,
                                          BLOCK_R=SUM_BLOCK_R, num_warps=SUM_WARPS)
    K._sum_rows_kernel[(1, ncb)](src, out, src.shape[0], r, src.shape[0], BLOCK_P=SUM_BLOCK_P, BLOCK_R=SUM_BLOCK_R,
                                 num_warps=SUM_WARPS)
    return out


def sum_counts(device: torch.device, ncb: int, s: Settings):
    """The next row of zeroed counters for a one-launch sum, or None during graph capture before this
    device and width have a ring (one made then would live in the graph's memory).  Rings are never
    freed (a captured graph keeps their address); sums on different streams or graphs share a row
    only when the ring's length of calls apart."""
    key = (device, ncb)
    ring = _SUM_COUNTS.get(key)
    if ring is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ring = _SUM_COUNTS[key] = [torch.zeros((s.sum_count_ring, ncb), dtype=torch.int32, device=device), 0]
    row = ring[0][ring[1]]
    ring[1] = (ring[1] + 1) % ring[0].shape[0]
    return row


def sum_rows_once(part: torch.Tensor, dtype: torch.dtype, s: Settings) -> torch.Tensor:
    """The same sum in one launch (sums._sum_rows_once_kernel: the same slabs and order, the same
    bits); the two-launch sum where one slab does or no counters can be had."""
    from . import sums as K

    n_rows, r = part.shape
    ncb = _cdiv(r, SUM_BLOCK_R)
    splits = sum_splits(n_rows, r, part.device, s)
    counts = sum_counts(part.device, ncb, s) if splits > 1 else None
    if counts is None:
        return sum_rows(part, dtype, s)
    out = _empty((r,), dtype, part.device, s)
    slabs = _empty((splits, r), torch.float32, part.device, s)
    K._sum_rows_once_kernel[(splits, ncb)](part, slabs, out, counts, n_rows, r, _cdiv(n_rows, splits), splits,
                                           BLOCK_P=SUM_BLOCK_P, BLOCK_R=SUM_BLOCK_R, BLOCK_S=SUM_BLOCK_P,
                                           num_warps=SUM_WARPS)
    return out


SUMS = {"triton": sum_rows, "once": sum_rows_once, "torch": lambda part, dtype, s: part.sum(0).to(dtype)}


def sum_partials(part: torch.Tensor, dtype: torch.dtype, s: Settings) -> torch.Tensor:
    """The query gradient from its partial rows, by the method dispatch.sum_method picks."""
    method = dispatch.sum_method(part, dtype, lambda m: SUMS[m](part, dtype, s), s)
    return SUMS[method](part, dtype, s)
