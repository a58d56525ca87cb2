"""Fused Triton kernels for depth routing (Fast-AttnRes style), forward and backward.

Layout: every source is a [N, d] matrix with unit column stride and its own row stride.  The
kernels read the sources through a table of element offsets relative to an anchor tensor (the
first source) plus a table of row strides, so a list of tensors is never stacked; addressing off a
typed anchor pointer (rather than casting integers to pointers) keeps Triton's alignment analysis,
and the ALIGN hint (host-checked) lets every row load be a 16-byte vector.  One program owns
BLOCK_T tokens and the whole row width (BLOCK_D = next power of two >= d, masked).

Forward (one pass over the sources, online softmax): reads S*d, writes d elements per token, one
fp32 logsumexp per token, and (bf16/fp16) an int8 residual per element: the next 8 mantissa bits of
the fp32 mix that rounding to the output dtype dropped.  The backward needs g.h at fp32 accuracy
(dz_i = w_i (g.o_i - g.h) cancels), and g.h from the rounded h alone fails the paper's bf16
criterion on random upstream gradients; the residual restores h to about 2^-16 relative for one byte.

Backward (one pass over the sources): reads g, h and the residual, the S sources once, writes the S
source gradients; the query gradient is reduced per program into an fp32 partial [programs, r] that
the host sums (deterministic).  Persistent grid: programs loop over token blocks.

Math (fp32).  k_i = o_i restricted to the key coordinates (the last r for "slice", all d for
"full"), n = their count, rinv_i = 1/sqrt(|k_i|^2/n + eps), z_i = rinv_i * (q . o_i[tail]),
w = softmax(z), h = sum_i w_i o_i.  With g = dL/dh:
    dz_i  = w_i (g.o_i - g.h)
    do_i  = w_i g + dz_i rinv_i (P^T q - (z_i rinv_i / n) k_i)      (k_i zero-padded to d)
    dq    = sum_tokens sum_i dz_i rinv_i o_i[tail]
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _res_base(hb32):
    """2^exponent of each (rounded) value, and whether it is a finite normal number."""
    ebits = hb32.to(tl.int32, bitcast=True) & 0x7F800000
    ok = (ebits > 0) & (ebits < 0x7F800000)
    return ebits.to(tl.float32, bitcast=True), ok


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _query_cols(q_ptr, d, r, BLOCK_D: tl.constexpr):
    """Column offsets of a row tile, which are real (< d), which are the key's (the last r), and
    the query laid over those (fp32, zero elsewhere)."""
    offs = tl.arange(0, BLOCK_D)
    col_ok = offs < d
    tail = (offs >= d - r) & col_ok
    q = tl.load(q_ptr + (offs - (d - r)), mask=tail, other=0.0).to(tl.float32)
    return offs, col_ok, tail, q


@triton.jit
def _token_rows(blk, N, col_ok, BLOCK_T: tl.constexpr):
    """Token block ``blk``: its rows, which are real, the rows as int64, and the tile's mask."""
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    return rows, row_ok, rows.to(tl.int64), row_ok[:, None] & col_ok[None, :]


@triton.jit
def _dq_zeros(BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DQ2D: tl.constexpr):
    """The query-gradient accumulator: [BLOCK_T, BLOCK_D] (summed over rows at the end) or [BLOCK_D]."""
    if DQ2D:
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], tl.float32)
    return acc


@triton.jit
def _dq_add(acc, c, x, DQ2D: tl.constexpr):
    if DQ2D:
        acc += c[:, None] * x
    else:
        acc += tl.sum(c[:, None] * x, axis=0)
    return acc


@triton.jit
def _dq_store(acc, dq_part_ptr, pid, r, d, offs, tail, DQ2D: tl.constexpr):
    """This program's query-gradient partial, over the key columns."""
    if DQ2D:
        dq = tl.sum(acc, axis=0)
    else:
        dq = acc
    tl.store(dq_part_ptr + pid.to(tl.int64) * r + (offs - (d - r)), dq, mask=tail)


@triton.jit
def _key_cols(q_ptr, d, r, BLOCK_R: tl.constexpr):
    """The key tile's columns (the last r of the row), which are real, and the query over them."""
    j = tl.arange(0, BLOCK_R)
    key_ok = j < r
    qt = tl.load(q_ptr + j, mask=key_ok, other=0.0).to(tl.float32)
    return (d - r) + j, key_ok, qt


@triton.jit
def _fwd_source(x, xt, q, qt, tail, m, l, acc, inv_n, eps, SLICE: tl.constexpr, TAIL: tl.constexpr,
                FUSED: tl.constexpr):
    """Online-softmax update of (max, sum, fp32 mix) by one fp32 source tile x [BLOCK_T, BLOCK_D];
    with TAIL the key sums come from xt, the same rows' key columns only [BLOCK_T, BLOCK_R].
    Returns the new state and this source's score z and 1/RMS rinv per token."""
    if TAIL:
        kk = xt * xt
        kq = xt * qt[None, :]
    else:
        if SLICE:
            kk = tl.where(tail[None, :], x * x, 0.0)
        else:
            kk = x * x
        kq = x * q[None, :]
    if FUSED:  # one fused reduction (one shared-memory round) for both row sums
        ss, qk = tl.reduce((kk, kq), 1, _add2)
    else:  # separate sums (the interpreter runs tl.reduce with a Python combine: slow)
        ss = tl.sum(kk, axis=1)
        qk = tl.sum(kq, axis=1)
    rinv = tl.rsqrt(ss * inv_n + eps)
    z = qk * rinv
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    p = tl.exp(z - m_new)
    acc = acc * alpha[:, None] + p[:, None] * x
    l = l * alpha + p
    return m_new, l, acc, z, rinv


@triton.jit
def _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok):
    """Row 1 + i of the statistics gets source i's scores, row 1 + S + i their 1/RMS."""
    tl.store(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, z, mask=row_ok)
    tl.store(st_ptr + tl.cast(1 + S + i, tl.int64) * N + rows, rinv, mask=row_ok)


@triton.jit
def _fwd_store(acc, m, l, out_ptr, res_ptr, lse_ptr, rows, rows64, offs, row_ok, mask, d,
               HAS_RES: tl.constexpr, RES_STEP: tl.constexpr):
    """Write the mix in the output dtype, its int8 rounding residual and the logsumexp."""
    h = acc * (1.0 / l)[:, None]
    hb = h.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * d + offs[None, :], hb, mask=mask)
    if HAS_RES:
        hb32 = hb.to(tl.float32)
        base, ok = _res_base(hb32)
        step = tl.where(ok, base * RES_STEP, 1.0)
        code = tl.floor((h - hb32) / step + 0.5)
        code = tl.where(ok, tl.minimum(tl.maximum(code, -127.0), 127.0), 0.0)
        tl.store(res_ptr + rows64[:, None] * d + offs[None, :], code.to(tl.int8), mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _bwd_rows(g_ptr, h_ptr, res_ptr, lse_ptr, rows, rows64, offs, row_ok, mask, d, stride_g,
              HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, FUSED: tl.constexpr, ZR: tl.constexpr):
    """Per token block: the upstream gradient g, g.h at fp32 accuracy, and the logsumexp."""
    g = tl.load(g_ptr + rows64[:, None] * stride_g + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    hh = tl.load(h_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        code = tl.load(res_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0).to(tl.float32)
        base, ok = _res_base(hh)
        hh = tl.where(ok, hh + code * (base * RES_STEP), hh)
    # g.h through the same reduction tree as g.o_i below: with one dominant source they cancel
    if FUSED and not ZR:
        _u0, _u1, gh = tl.reduce((g * hh, g * hh, g * hh), 1, _add3)
    else:
        gh = tl.sum(g * hh, axis=1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    return g, gh, lse


@triton.jit
def _bwd_source(x, g, gh, lse, q, tail, inv_n, eps, SLICE: tl.constexpr, FUSED: tl.constexpr):
    """One source's gradient tile, and c = dL/dz * rinv per token (the query gradient's weight),
    recomputing the score and 1/RMS from the tile (three row sums; ZR=False)."""
    if SLICE:
        k = tl.where(tail[None, :], x, 0.0)
    else:
        k = x
    if FUSED:
        ss, qk, go = tl.reduce((k * k, x * q[None, :], g * x), 1, _add3)
    else:
        ss = tl.sum(k * k, axis=1)
        qk = tl.sum(x * q[None, :], axis=1)
        go = tl.sum(g * x, axis=1)
    rinv = tl.rsqrt(ss * inv_n + eps)
    z = qk * rinv
    w = tl.exp(z - lse)
    c = w * (go - gh) * rinv  # dL/dz_i * rinv_i
    coef = z * rinv * inv_n
    grad = w[:, None] * g + c[:, None] * (q[None, :] - coef[:, None] * k)
    return grad, c


@triton.jit
def _bwd_weights(x, g, gh, lse, st_ptr, i, S, N, rows, row_ok, inv_n):
    """Source i's softmax weight w, c = dL/dz * rinv and z rinv / n per token, from the forward's
    saved score and 1/RMS: one row sum (g . o_i) per source (ZR=True)."""
    z = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
    rinv = tl.load(st_ptr + tl.cast(1 + S + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
    go = tl.sum(g * x, axis=1)
    w = tl.exp(z - lse)
    c = w * (go - gh) * rinv
    return w, c, z * rinv * inv_n


@triton.jit
def _table_src(src0_ptr, src_offs, src_strides, j, S, ALIGN: tl.constexpr):
    """Base pointer and row stride of source j (the last source's when j >= S)."""
    jj = tl.minimum(j, S - 1)
    off = tl.multiple_of(tl.load(src_offs + jj), ALIGN)
    stride = tl.multiple_of(tl.load(src_strides + jj), ALIGN)
    return src0_ptr + off, stride


@triton.jit
def _tile(ptr, stride, j, S, rows, rows64, cols, mask, EVICT: tl.constexpr):
    """Raw tile [BLOCK_T, len(cols)] of the source at ``ptr`` (zeros when j >= S)."""
    live = ((rows * 0 + j) < S)[:, None]
    addr = ptr + rows64[:, None] * stride + cols[None, :]
    if EVICT:  # read once: let the sources leave the L2 first
        x = tl.load(addr, mask=mask & live, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(addr, mask=mask & live, other=0.0)
    return x


@triton.jit
def _tiles(ptr, stride, j, S, rows, rows64, offs, mask, toffs, tmask, TAIL: tl.constexpr, EVICT: tl.constexpr):
    """The rows [BLOCK_T, BLOCK_D] and, with TAIL, their key columns [BLOCK_T, BLOCK_R] (read again:
    the second read hits the cache)."""
    if TAIL:
        xt = _tile(ptr, stride, j, S, rows, rows64, toffs, tmask, False)
    x = _tile(ptr, stride, j, S, rows, rows64, offs, mask, EVICT)
    if not TAIL:
        xt = x
    return x, xt


@triton.jit
def _key_scores(xt, qt, inv_n, eps, FUSED: tl.constexpr):
    """Score z and key 1/RMS per row of a key tile [BLOCK_T, BLOCK_R] (fp32)."""
    if FUSED:
        ss, qk = tl.reduce((xt * xt, xt * qt[None, :]), 1, _add2)
    else:
        ss = tl.sum(xt * xt, axis=1)
        qk = tl.sum(xt * qt[None, :], axis=1)
    rinv = tl.rsqrt(ss * inv_n + eps)
    return qk * rinv, rinv


@triton.jit
def _lse_update(m, l, z):
    """Running (max, sum of exp) of the scores seen so far, after z."""
    m_new = tl.maximum(m, z)
    return m_new, l * tl.exp(m - m_new) + tl.exp(z - m_new)


@triton.jit
def _load_score(st_ptr, i, N, rows, row_ok):
    return tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)


@triton.jit
def _stash(scr_ptr, pid, i, S, w, c, coef, BLOCK_T: tl.constexpr):
    """This program's scratch [3, S, BLOCK_T]: source i's w, c, coef for its current token block."""
    j = tl.arange(0, BLOCK_T)
    base = scr_ptr + (pid * 3 * S + i) * BLOCK_T
    tl.store(base + j, w)
    tl.store(base + S * BLOCK_T + j, c)
    tl.store(base + 2 * S * BLOCK_T + j, coef)


@triton.jit
def _unstash(scr_ptr, pid, i, S, BLOCK_T: tl.constexpr):
    j = tl.arange(0, BLOCK_T)
    base = scr_ptr + (pid * 3 * S + i) * BLOCK_T
    return tl.load(base + j), tl.load(base + S * BLOCK_T + j), tl.load(base + 2 * S * BLOCK_T + j)


@triton.jit
def _store_grad(gp, x, xt, g, gt, q, qt, tail, w, c, coef, rows64, offs, mask, toffs, tmask, d, r,
                SLICE: tl.constexpr, TAIL: tl.constexpr):
    """Write dL/do_i = w g + c (q - coef k) (the key term only on the key columns)."""
    if TAIL:  # the key term on the key tile, w g alone on the columns before it
        tl.store(gp + rows64[:, None] * d + offs[None, :], (w[:, None] * g).to(gp.dtype.element_ty),
                 mask=mask & (offs < d - r)[None, :])
        gk = w[:, None] * gt + c[:, None] * (qt[None, :] - coef[:, None] * xt)
        tl.store(gp + rows64[:, None] * d + toffs[None, :], gk.to(gp.dtype.element_ty), mask=tmask)
    else:
        if SLICE:
            k = tl.where(tail[None, :], x, 0.0)
        else:
            k = x
        grad = w[:, None] * g + c[:, None] * (q[None, :] - coef[:, None] * k)
        tl.store(gp + rows64[:, None] * d + offs[None, :], grad.to(gp.dtype.element_ty), mask=mask)


@triton.jit
def _attnres_fwd_kernel(
    src0_ptr,  # anchor: the first source (typed pointer)
    src_offs,  # int64 [S]: element offset of each source from the anchor
    src_strides,  # int64 [S]: row strides (elements)
    q_ptr,  # [r] (any float dtype)
    out_ptr,  # [N, d] contiguous, source dtype
    res_ptr,  # int8 [N, d] contiguous (unused unless HAS_RES)
    st_ptr,  # fp32 [1 + 2S, N]: logsumexp, the S scores, the S key 1/RMS
    N,
    S,
    d,
    r,
    inv_n,  # 1/r for "slice", 1/d for "full"
    eps,
    SLICE: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,  # 2^-(mantissa bits + 8)
    ALIGN: tl.constexpr,  # offsets and strides are multiples of this many elements
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= r (the key tile, with TAIL)
    PREFETCH: tl.constexpr,  # how many sources ahead to load (0, 1, 2)
    TAIL: tl.constexpr,  # key sums over the key columns' own tile ("slice", BLOCK_R < BLOCK_D)
    SPLIT: tl.constexpr,  # two passes: the scores from the key tiles, then the mix (needs TAIL)
    EVICT: tl.constexpr,  # evict-first hint on the source reads
    FUSED: tl.constexpr,  # multi-operand row reductions (GPU); separate tl.sum (interpreter)
):
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    toffs, key_ok, qt = _key_cols(q_ptr, d, r, BLOCK_R)
    rows, row_ok, rows64, mask = _token_rows(tl.program_id(0), N, col_ok, BLOCK_T)
    tmask = row_ok[:, None] & key_ok[None, :]
    if SPLIT:  # pass 1: scores from the key tiles; pass 2: the mix with the final weights
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_T], tl.float32)
        p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
        xt_n = _tile(p, st, 0, S, rows, rows64, toffs, tmask, False)
        for i in range(S):
            xt = xt_n
            p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
            xt_n = _tile(p, st, i + 1, S, rows, rows64, toffs, tmask, False)
            z, rinv = _key_scores(xt.to(tl.float32), qt, inv_n, eps, FUSED)
            m, l = _lse_update(m, l, z)
            _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok)
        lse = m + tl.log(l)
        tl.debug_barrier()  # the scores just stored are read back by every thread below
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        if PREFETCH >= 1:
            p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
            x_n1 = _tile(p, st, 0, S, rows, rows64, offs, mask, EVICT)
        if PREFETCH >= 2:
            p, st = _table_src(src0_ptr, src_offs, src_strides, 1, S, ALIGN)
            x_n2 = _tile(p, st, 1, S, rows, rows64, offs, mask, EVICT)
        for i in range(S):
            if PREFETCH == 0:
                p, st = _table_src(src0_ptr, src_offs, src_strides, i, S, ALIGN)
                x = _tile(p, st, i, S, rows, rows64, offs, mask, EVICT)
            elif PREFETCH == 1:
                x = x_n1
                p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
                x_n1 = _tile(p, st, i + 1, S, rows, rows64, offs, mask, EVICT)
            else:
                x = x_n1
                x_n1 = x_n2
                p, st = _table_src(src0_ptr, src_offs, src_strides, i + 2, S, ALIGN)
                x_n2 = _tile(p, st, i + 2, S, rows, rows64, offs, mask, EVICT)
            w = tl.exp(_load_score(st_ptr, i, N, rows, row_ok) - lse)
            acc += w[:, None] * x.to(tl.float32)
        _fwd_store(acc, lse, tl.full([BLOCK_T], 1.0, tl.float32), out_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok,
                   mask, d, HAS_RES, RES_STEP)
    else:  # one pass, online softmax
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        if PREFETCH >= 1:
            p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
            x_n1, xt_n1 = _tiles(p, st, 0, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
        if PREFETCH >= 2:
            p, st = _table_src(src0_ptr, src_offs, src_strides, 1, S, ALIGN)
            x_n2, xt_n2 = _tiles(p, st, 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
        for i in range(S):
            if PREFETCH == 0:
                p, st = _table_src(src0_ptr, src_offs, src_strides, i, S, ALIGN)
                x, xt = _tiles(p, st, i, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            elif PREFETCH == 1:
                x, xt = x_n1, xt_n1
                p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
                x_n1, xt_n1 = _tiles(p, st, i + 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            else:
                x, xt = x_n1, xt_n1
                x_n1, xt_n1 = x_n2, xt_n2
                p, st = _table_src(src0_ptr, src_offs, src_strides, i + 2, S, ALIGN)
                x_n2, xt_n2 = _tiles(p, st, i + 2, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            m, l, acc, z, rinv = _fwd_source(x.to(tl.float32), xt.to(tl.float32), q, qt, tail, m, l, acc, inv_n, eps,
                                             SLICE, TAIL, FUSED)
            _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok)
        _fwd_store(acc, m, l, out_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok, mask, d, HAS_RES, RES_STEP)


@triton.jit
def _attnres_bwd_kernel(
    src0_ptr,  # anchor of the sources
    src_offs,  # int64 [S]
    src_strides,  # int64 [S]
    grad0_ptr,  # anchor of the source gradients (each contiguous [N, d])
    grad_offs,  # int64 [S]
    q_ptr,  # [r]
    h_ptr,  # [N, d] saved output, row stride d
    res_ptr,  # int8 [N, d] saved residual (unused unless HAS_RES)
    g_ptr,  # [N, d] upstream gradient, row stride stride_g
    st_ptr,  # fp32 [1 + 2S, N]: the forward's statistics
    dq_part_ptr,  # fp32 [programs, r]
    scr_ptr,  # fp32 [programs, 3, S, BLOCK_T] scratch (SPLIT)
    N,
    S,
    d,
    r,
    stride_g,
    inv_n,
    eps,
    SLICE: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,
    ALIGN: tl.constexpr,
    GALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREFETCH: tl.constexpr,  # how many sources ahead to load (0, 1, 2)
    DQ2D: tl.constexpr,
    ZR: tl.constexpr,  # read the saved scores (one row sum per source) instead of recomputing them
    TAIL: tl.constexpr,  # key terms on the key columns' own tile (needs ZR)
    SPLIT: tl.constexpr,  # two loops over the sources: the rows, then the key columns (needs TAIL)
    EVICT: tl.constexpr,
    FUSED: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    toffs, key_ok, qt = _key_cols(q_ptr, d, r, BLOCK_R)
    if TAIL:
        dq = _dq_zeros(BLOCK_T, BLOCK_R, DQ2D)
    else:
        dq = _dq_zeros(BLOCK_T, BLOCK_D, DQ2D)
    nblk = tl.cdiv(N, BLOCK_T)
    for blk in range(pid, nblk, nprog):
        rows, row_ok, rows64, mask = _token_rows(blk, N, col_ok, BLOCK_T)
        tmask = row_ok[:, None] & key_ok[None, :]
        g, gh, lse = _bwd_rows(g_ptr, h_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok, mask, d, stride_g,
                               HAS_RES, RES_STEP, FUSED, ZR)
        gt = g
        if TAIL:
            gt = tl.load(g_ptr + rows64[:, None] * stride_g + toffs[None, :], mask=tmask, other=0.0).to(tl.float32)
        if SPLIT:  # loop A: g.o_i on the rows, w g before the key columns; loop B: the key columns
            if PREFETCH >= 1:
                p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
                x_n1 = _tile(p, st, 0, S, rows, rows64, offs, mask, EVICT)
            if PREFETCH >= 2:
                p, st = _table_src(src0_ptr, src_offs, src_strides, 1, S, ALIGN)
                x_n2 = _tile(p, st, 1, S, rows, rows64, offs, mask, EVICT)
            for i in range(S):
                if PREFETCH == 0:
                    p, st = _table_src(src0_ptr, src_offs, src_strides, i, S, ALIGN)
                    x = _tile(p, st, i, S, rows, rows64, offs, mask, EVICT)
                elif PREFETCH == 1:
                    x = x_n1
                    p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
                    x_n1 = _tile(p, st, i + 1, S, rows, rows64, offs, mask, EVICT)
                else:
                    x = x_n1
                    x_n1 = x_n2
                    p, st = _table_src(src0_ptr, src_offs, src_strides, i + 2, S, ALIGN)
                    x_n2 = _tile(p, st, i + 2, S, rows, rows64, offs, mask, EVICT)
                gp = grad0_ptr + tl.multiple_of(tl.load(grad_offs + i), GALIGN)
                w, c, coef = _bwd_weights(x.to(tl.float32), g, gh, lse, st_ptr, i, S, N, rows, row_ok, inv_n)
                tl.store(gp + rows64[:, None] * d + offs[None, :], (w[:, None] * g).to(gp.dtype.element_ty),
                         mask=mask & (offs < d - r)[None, :])
                _stash(scr_ptr, pid, i, S, w, c, coef, BLOCK_T)
            tl.debug_barrier()  # the stash, written above, is read by every thread below
            p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
            xt_n = _tile(p, st, 0, S, rows, rows64, toffs, tmask, False)
            for i in range(S):
                xt = xt_n.to(tl.float32)
                p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
                xt_n = _tile(p, st, i + 1, S, rows, rows64, toffs, tmask, False)
                gp = grad0_ptr + tl.multiple_of(tl.load(grad_offs + i), GALIGN)
                w, c, coef = _unstash(scr_ptr, pid, i, S, BLOCK_T)
                gk = w[:, None] * gt + c[:, None] * (qt[None, :] - coef[:, None] * xt)
                tl.store(gp + rows64[:, None] * d + toffs[None, :], gk.to(gp.dtype.element_ty), mask=tmask)
                dq = _dq_add(dq, c, xt, DQ2D)
            tl.debug_barrier()  # the next token block overwrites the stash
        else:
            if PREFETCH >= 1:
                p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
                x_n1, xt_n1 = _tiles(p, st, 0, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            if PREFETCH >= 2:
                p, st = _table_src(src0_ptr, src_offs, src_strides, 1, S, ALIGN)
                x_n2, xt_n2 = _tiles(p, st, 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            for i in range(S):
                goff = tl.multiple_of(tl.load(grad_offs + i), GALIGN)
                if PREFETCH == 0:
                    p, st = _table_src(src0_ptr, src_offs, src_strides, i, S, ALIGN)
                    x, xt = _tiles(p, st, i, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
                elif PREFETCH == 1:
                    x, xt = x_n1, xt_n1
                    p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
                    x_n1, xt_n1 = _tiles(p, st, i + 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
                else:
                    x, xt = x_n1, xt_n1
                    x_n1, xt_n1 = x_n2, xt_n2
                    p, st = _table_src(src0_ptr, src_offs, src_strides, i + 2, S, ALIGN)
                    x_n2, xt_n2 = _tiles(p, st, i + 2, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
                x = x.to(tl.float32)
                xt = xt.to(tl.float32)
                gp = grad0_ptr + goff
                if ZR:
                    w, c, coef = _bwd_weights(x, g, gh, lse, st_ptr, i, S, N, rows, row_ok, inv_n)
                    _store_grad(gp, x, xt, g, gt, q, qt, tail, w, c, coef, rows64, offs, mask, toffs, tmask, d, r,
                                SLICE, TAIL)
                else:
                    grad, c = _bwd_source(x, g, gh, lse, q, tail, inv_n, eps, SLICE, FUSED)
                    tl.store(gp + rows64[:, None] * d + offs[None, :], grad.to(grad0_ptr.dtype.element_ty), mask=mask)
                dq = _dq_add(dq, c, xt, DQ2D)
    if TAIL:
        _dq_store(dq, dq_part_ptr, pid, r, d, toffs, key_ok, DQ2D)
    else:
        _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail, DQ2D)


# ----------------------------------------------------------------------------------------------
# Per-argument kernels: up to 16 sources, each its own pointer argument.
#
# torch.compile launches these from its generated code (kernels.op wraps them in a
# torch.library.triton_op), so there are no host tables: a table needs data pointers, which a
# traced graph does not have.  Triton's argument specialisation sees each pointer's and each row
# stride's 16-byte divisibility, which is what ALIGN tells the table kernels.  The loop over sources
# is a runtime loop, as in the table kernels, and picks source i's pointer with a chain of scalar
# selects over the NSLOT arguments given (unused slots are None).  Unrolling the loop over a
# compile-time S instead ran 27-33% slower on the H200 (2026-11-29, kernel_sweep "args" rows at
# 4096 tokens: registers went up).  No float arguments: Inductor passes Python floats as fp64, which
# would turn the fp32 math into fp64 (EPS is a compile-time constant, 1/n is computed here).

MAX_ARG_SOURCES = tl.constexpr(16)


@triton.jit
def _inv_key_width(r, d, SLICE: tl.constexpr):
    """1/n for the key's RMS: n = r ("slice") or d ("full"); r may arrive as a compile-time 1."""
    if SLICE:
        inv_n = 1.0 / (r * 1.0)
    else:
        inv_n = 1.0 / (d * 1.0)
    return inv_n


@triton.jit
def _select(i, NSLOT: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Argument a_i for a runtime i < NSLOT (scalar selects; a_0 when i is out of range)."""
    v = a0
    if NSLOT > 1:
        v = tl.where(i == 1, a1, v)
    if NSLOT > 2:
        v = tl.where(i == 2, a2, v)
    if NSLOT > 3:
        v = tl.where(i == 3, a3, v)
    if NSLOT > 4:
        v = tl.where(i == 4, a4, v)
    if NSLOT > 5:
        v = tl.where(i == 5, a5, v)
    if NSLOT > 6:
        v = tl.where(i == 6, a6, v)
    if NSLOT > 7:
        v = tl.where(i == 7, a7, v)
    if NSLOT > 8:
        v = tl.where(i == 8, a8, v)
    if NSLOT > 9:
        v = tl.where(i == 9, a9, v)
    if NSLOT > 10:
        v = tl.where(i == 10, a10, v)
    if NSLOT > 11:
        v = tl.where(i == 11, a11, v)
    if NSLOT > 12:
        v = tl.where(i == 12, a12, v)
    if NSLOT > 13:
        v = tl.where(i == 13, a13, v)
    if NSLOT > 14:
        v = tl.where(i == 14, a14, v)
    if NSLOT > 15:
        v = tl.where(i == 15, a15, v)
    return v


@triton.jit
def _arg_src(i, S, NSLOT: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
             xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15):
    """Pointer and row stride of source i (the last source's when i >= S)."""
    jj = tl.minimum(i, S - 1)
    ptr = _select(jj, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    stride = _select(jj, NSLOT, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    return ptr, stride


@triton.jit
def _attnres_fwd_args_kernel(
    # sources (None past NSLOT)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    # their row strides (elements)
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    q_ptr,  # [r]
    out_ptr,  # [N, d] contiguous, source dtype
    res_ptr,  # int8 [N, d] contiguous (None unless HAS_RES)
    st_ptr,  # fp32 [1 + 2S, N]
    N,
    S,
    d,
    r,
    NSLOT: tl.constexpr,  # source arguments given (= S)
    EPS: tl.constexpr,
    SLICE: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREFETCH: tl.constexpr,
    TAIL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVICT: tl.constexpr,
    FUSED: tl.constexpr,
):
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    toffs, key_ok, qt = _key_cols(q_ptr, d, r, BLOCK_R)
    rows, row_ok, rows64, mask = _token_rows(tl.program_id(0), N, col_ok, BLOCK_T)
    tmask = row_ok[:, None] & key_ok[None, :]
    inv_n = _inv_key_width(r, d, SLICE)
    if SPLIT:  # pass 1: scores from the key tiles; pass 2: the mix with the final weights
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_T], tl.float32)
        p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
        xt_n = _tile(p, st, 0, S, rows, rows64, toffs, tmask, False)
        for i in range(S):
            xt = xt_n
            p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            xt_n = _tile(p, st, i + 1, S, rows, rows64, toffs, tmask, False)
            z, rinv = _key_scores(xt.to(tl.float32), qt, inv_n, EPS, FUSED)
            m, l = _lse_update(m, l, z)
            _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok)
        lse = m + tl.log(l)
        tl.debug_barrier()  # the scores just stored are read back by every thread below
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        if PREFETCH >= 1:
            p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x_n1 = _tile(p, st, 0, S, rows, rows64, offs, mask, EVICT)
        if PREFETCH >= 2:
            p, st = _arg_src(1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x_n2 = _tile(p, st, 1, S, rows, rows64, offs, mask, EVICT)
        for i in range(S):
            if PREFETCH == 0:
                p, st = _arg_src(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x = _tile(p, st, i, S, rows, rows64, offs, mask, EVICT)
            elif PREFETCH == 1:
                x = x_n1
                p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n1 = _tile(p, st, i + 1, S, rows, rows64, offs, mask, EVICT)
            else:
                x = x_n1
                x_n1 = x_n2
                p, st = _arg_src(i + 2, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n2 = _tile(p, st, i + 2, S, rows, rows64, offs, mask, EVICT)
            w = tl.exp(_load_score(st_ptr, i, N, rows, row_ok) - lse)
            acc += w[:, None] * x.to(tl.float32)
        _fwd_store(acc, lse, tl.full([BLOCK_T], 1.0, tl.float32), out_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok,
                   mask, d, HAS_RES, RES_STEP)
    else:  # one pass, online softmax
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        if PREFETCH >= 1:
            p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x_n1, xt_n1 = _tiles(p, st, 0, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
        if PREFETCH >= 2:
            p, st = _arg_src(1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x_n2, xt_n2 = _tiles(p, st, 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
        for i in range(S):
            if PREFETCH == 0:
                p, st = _arg_src(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x, xt = _tiles(p, st, i, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            elif PREFETCH == 1:
                x, xt = x_n1, xt_n1
                p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n1, xt_n1 = _tiles(p, st, i + 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            else:
                x, xt = x_n1, xt_n1
                x_n1, xt_n1 = x_n2, xt_n2
                p, st = _arg_src(i + 2, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n2, xt_n2 = _tiles(p, st, i + 2, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            m, l, acc, z, rinv = _fwd_source(x.to(tl.float32), xt.to(tl.float32), q, qt, tail, m, l, acc, inv_n, EPS,
                                             SLICE, TAIL, FUSED)
            _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok)
        _fwd_store(acc, m, l, out_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok, mask, d, HAS_RES, RES_STEP)


@triton.jit
def _attnres_bwd_args_kernel(
    # sources (None past NSLOT)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    # their row strides
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    # source gradients, contiguous [N, d] (None past NSLOT)
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
    q_ptr,  # [r]
    h_ptr,  # [N, d] saved output, row stride d
    res_ptr,  # int8 [N, d] saved residual (None unless HAS_RES)
    g_ptr,  # [N, d] upstream gradient, row stride stride_g
    st_ptr,  # fp32 [1 + 2S, N]
    dq_part_ptr,  # fp32 [programs, r]
    scr_ptr,  # fp32 [programs, 3, S, BLOCK_T] scratch (SPLIT)
    N,
    S,
    d,
    r,
    stride_g,
    NSLOT: tl.constexpr,
    EPS: tl.constexpr,
    SLICE: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREFETCH: tl.constexpr,
    DQ2D: tl.constexpr,
    ZR: tl.constexpr,
    TAIL: tl.constexpr,
    SPLIT: tl.constexpr,
    EVICT: tl.constexpr,
    FUSED: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    toffs, key_ok, qt = _key_cols(q_ptr, d, r, BLOCK_R)
    inv_n = _inv_key_width(r, d, SLICE)
    if TAIL:
        dq = _dq_zeros(BLOCK_T, BLOCK_R, DQ2D)
    else:
        dq = _dq_zeros(BLOCK_T, BLOCK_D, DQ2D)
    nblk = tl.cdiv(N, BLOCK_T)
    for blk in range(pid, nblk, nprog):
        rows, row_ok, rows64, mask = _token_rows(blk, N, col_ok, BLOCK_T)
        tmask = row_ok[:, None] & key_ok[None, :]
        g, gh, lse = _bwd_rows(g_ptr, h_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok, mask, d, stride_g,
                               HAS_RES, RES_STEP, FUSED, ZR)
        gt = g
        if TAIL:
            gt = tl.load(g_ptr + rows64[:, None] * stride_g + toffs[None, :], mask=tmask, other=0.0).to(tl.float32)
        if SPLIT:  # loop A: g.o_i on the rows, w g before the key columns; loop B: the key columns
            if PREFETCH >= 1:
                p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n1 = _tile(p, st, 0, S, rows, rows64, offs, mask, EVICT)
            if PREFETCH >= 2:
                p, st = _arg_src(1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n2 = _tile(p, st, 1, S, rows, rows64, offs, mask, EVICT)
            for i in range(S):
                if PREFETCH == 0:
                    p, st = _arg_src(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                    x = _tile(p, st, i, S, rows, rows64, offs, mask, EVICT)
                elif PREFETCH == 1:
                    x = x_n1
                    p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                    x_n1 = _tile(p, st, i + 1, S, rows, rows64, offs, mask, EVICT)
                else:
                    x = x_n1
                    x_n1 = x_n2
                    p, st = _arg_src(i + 2, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                    x_n2 = _tile(p, st, i + 2, S, rows, rows64, offs, mask, EVICT)
                gp = _select(i, NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
                w, c, coef = _bwd_weights(x.to(tl.float32), g, gh, lse, st_ptr, i, S, N, rows, row_ok, inv_n)
                tl.store(gp + rows64[:, None] * d + offs[None, :], (w[:, None] * g).to(gp.dtype.element_ty),
                         mask=mask & (offs < d - r)[None, :])
                _stash(scr_ptr, pid, i, S, w, c, coef, BLOCK_T)
            tl.debug_barrier()  # the stash, written above, is read by every thread below
            p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            xt_n = _tile(p, st, 0, S, rows, rows64, toffs, tmask, False)
            for i in range(S):
                xt = xt_n.to(tl.float32)
                p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                xt_n = _tile(p, st, i + 1, S, rows, rows64, toffs, tmask, False)
                gp = _select(i, NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
                w, c, coef = _unstash(scr_ptr, pid, i, S, BLOCK_T)
                gk = w[:, None] * gt + c[:, None] * (qt[None, :] - coef[:, None] * xt)
                tl.store(gp + rows64[:, None] * d + toffs[None, :], gk.to(gp.dtype.element_ty), mask=tmask)
                dq = _dq_add(dq, c, xt, DQ2D)
            tl.debug_barrier()  # the next token block overwrites the stash
        else:
            if PREFETCH >= 1:
                p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n1, xt_n1 = _tiles(p, st, 0, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            if PREFETCH >= 2:
                p, st = _arg_src(1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                x_n2, xt_n2 = _tiles(p, st, 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
            for i in range(S):
                if PREFETCH == 0:
                    p, st = _arg_src(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                    x, xt = _tiles(p, st, i, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
                elif PREFETCH == 1:
                    x, xt = x_n1, xt_n1
                    p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                    x_n1, xt_n1 = _tiles(p, st, i + 1, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
                else:
                    x, xt = x_n1, xt_n1
                    x_n1, xt_n1 = x_n2, xt_n2
                    p, st = _arg_src(i + 2, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
                    x_n2, xt_n2 = _tiles(p, st, i + 2, S, rows, rows64, offs, mask, toffs, tmask, TAIL, EVICT)
                x = x.to(tl.float32)
                xt = xt.to(tl.float32)
                gp = _select(i, NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
                if ZR:
                    w, c, coef = _bwd_weights(x, g, gh, lse, st_ptr, i, S, N, rows, row_ok, inv_n)
                    _store_grad(gp, x, xt, g, gt, q, qt, tail, w, c, coef, rows64, offs, mask, toffs, tmask, d, r,
                                SLICE, TAIL)
                else:
                    grad, c = _bwd_source(x, g, gh, lse, q, tail, inv_n, EPS, SLICE, FUSED)
                    tl.store(gp + rows64[:, None] * d + offs[None, :], grad.to(gp.dtype.element_ty), mask=mask)
                dq = _dq_add(dq, c, xt, DQ2D)
    if TAIL:
        _dq_store(dq, dq_part_ptr, pid, r, d, toffs, key_ok, DQ2D)
    else:
        _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail, DQ2D)
