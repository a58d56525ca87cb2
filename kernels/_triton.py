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
def _fwd_source(x, q, tail, m, l, acc, inv_n, eps, SLICE: tl.constexpr, FUSED: tl.constexpr):
    """Online-softmax update of (max, sum, fp32 mix) by one fp32 source tile x [BLOCK_T, BLOCK_D]."""
    if SLICE:
        sq = tl.where(tail[None, :], x * x, 0.0)
    else:
        sq = x * x
    if FUSED:  # one fused reduction (one shared-memory round) for both row sums
        ss, qk = tl.reduce((sq, x * q[None, :]), 1, _add2)
    else:  # separate sums (the interpreter runs tl.reduce with a Python combine: slow)
        ss = tl.sum(sq, axis=1)
        qk = tl.sum(x * q[None, :], axis=1)
    rinv = tl.rsqrt(ss * inv_n + eps)
    z = qk * rinv
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    p = tl.exp(z - m_new)
    acc = acc * alpha[:, None] + p[:, None] * x
    l = l * alpha + p
    return m_new, l, acc


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
              HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, FUSED: tl.constexpr):
    """Per token block: the upstream gradient g, g.h at fp32 accuracy, and the logsumexp."""
    g = tl.load(g_ptr + rows64[:, None] * stride_g + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    hh = tl.load(h_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        code = tl.load(res_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0).to(tl.float32)
        base, ok = _res_base(hh)
        hh = tl.where(ok, hh + code * (base * RES_STEP), hh)
    # g.h through the same reduction tree as g.o_i below: with one dominant source they cancel
    if FUSED:
        _u0, _u1, gh = tl.reduce((g * hh, g * hh, g * hh), 1, _add3)
    else:
        gh = tl.sum(g * hh, axis=1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    return g, gh, lse


@triton.jit
def _bwd_source(x, g, gh, lse, q, tail, inv_n, eps, SLICE: tl.constexpr, FUSED: tl.constexpr):
    """One source's gradient tile, and c = dL/dz * rinv per token (the query gradient's weight)."""
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
def _load_src(src0_ptr, src_offs, src_strides, j, S, rows, rows64, offs, mask, ALIGN: tl.constexpr):
    """Raw [BLOCK_T, BLOCK_D] tile of source j (zeros when j >= S)."""
    jj = tl.minimum(j, S - 1)
    off = tl.multiple_of(tl.load(src_offs + jj), ALIGN)
    stride = tl.multiple_of(tl.load(src_strides + jj), ALIGN)
    ok = mask & ((rows * 0 + j) < S)[:, None]
    return tl.load(src0_ptr + off + rows64[:, None] * stride + offs[None, :], mask=ok, other=0.0)


@triton.jit
def _attnres_fwd_kernel(
    src0_ptr,  # anchor: the first source (typed pointer)
    src_offs,  # int64 [S]: element offset of each source from the anchor
    src_strides,  # int64 [S]: row strides (elements)
    q_ptr,  # [r] (any float dtype)
    out_ptr,  # [N, d] contiguous, source dtype
    res_ptr,  # int8 [N, d] contiguous (unused unless HAS_RES)
    lse_ptr,  # fp32 [N]
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
    PREFETCH: tl.constexpr,  # how many sources ahead to load (0, 1, 2)
    FUSED: tl.constexpr,  # multi-operand row reductions (GPU); separate tl.sum (interpreter)
):
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    rows, row_ok, rows64, mask = _token_rows(tl.program_id(0), N, col_ok, BLOCK_T)

    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if PREFETCH >= 1:
        x_n1 = _load_src(src0_ptr, src_offs, src_strides, 0, S, rows, rows64, offs, mask, ALIGN)
    if PREFETCH >= 2:
        x_n2 = _load_src(src0_ptr, src_offs, src_strides, 1, S, rows, rows64, offs, mask, ALIGN)
    for i in range(S):
        if PREFETCH == 0:
            x = _load_src(src0_ptr, src_offs, src_strides, i, S, rows, rows64, offs, mask, ALIGN).to(tl.float32)
        elif PREFETCH == 1:
            x = x_n1.to(tl.float32)
            x_n1 = _load_src(src0_ptr, src_offs, src_strides, i + 1, S, rows, rows64, offs, mask, ALIGN)
        else:
            x = x_n1.to(tl.float32)
            x_n1 = x_n2
            x_n2 = _load_src(src0_ptr, src_offs, src_strides, i + 2, S, rows, rows64, offs, mask, ALIGN)
        m, l, acc = _fwd_source(x, q, tail, m, l, acc, inv_n, eps, SLICE, FUSED)
    _fwd_store(acc, m, l, out_ptr, res_ptr, lse_ptr, rows, rows64, offs, row_ok, mask, d, HAS_RES, RES_STEP)


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
    lse_ptr,  # fp32 [N]
    dq_part_ptr,  # fp32 [programs, r]
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
    PREFETCH: tl.constexpr,  # how many sources ahead to load (0, 1, 2)
    DQ2D: tl.constexpr,
    FUSED: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    dq = _dq_zeros(BLOCK_T, BLOCK_D, DQ2D)
    nblk = tl.cdiv(N, BLOCK_T)
    for blk in range(pid, nblk, nprog):
        rows, row_ok, rows64, mask = _token_rows(blk, N, col_ok, BLOCK_T)
        g, gh, lse = _bwd_rows(g_ptr, h_ptr, res_ptr, lse_ptr, rows, rows64, offs, row_ok, mask, d, stride_g,
                               HAS_RES, RES_STEP, FUSED)
        if PREFETCH >= 1:
            x_n1 = _load_src(src0_ptr, src_offs, src_strides, 0, S, rows, rows64, offs, mask, ALIGN)
        if PREFETCH >= 2:
            x_n2 = _load_src(src0_ptr, src_offs, src_strides, 1, S, rows, rows64, offs, mask, ALIGN)
        for i in range(S):
            goff = tl.multiple_of(tl.load(grad_offs + i), GALIGN)
            if PREFETCH == 0:
                x = _load_src(src0_ptr, src_offs, src_strides, i, S, rows, rows64, offs, mask, ALIGN).to(tl.float32)
            elif PREFETCH == 1:
                x = x_n1.to(tl.float32)
                x_n1 = _load_src(src0_ptr, src_offs, src_strides, i + 1, S, rows, rows64, offs, mask, ALIGN)
            else:
                x = x_n1.to(tl.float32)
                x_n1 = x_n2
                x_n2 = _load_src(src0_ptr, src_offs, src_strides, i + 2, S, rows, rows64, offs, mask, ALIGN)
            grad, c = _bwd_source(x, g, gh, lse, q, tail, inv_n, eps, SLICE, FUSED)
            gp = grad0_ptr + goff
            tl.store(gp + rows64[:, None] * d + offs[None, :], grad.to(grad0_ptr.dtype.element_ty), mask=mask)
            dq = _dq_add(dq, c, x, DQ2D)
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
def _load_arg(i, S, NSLOT: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
              xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
              rows, rows64, offs, mask):
    """Raw [BLOCK_T, BLOCK_D] tile of source i (zeros when i >= S)."""
    jj = tl.minimum(i, S - 1)
    ptr = _select(jj, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    stride = _select(jj, NSLOT, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    ok = mask & ((rows * 0 + i) < S)[:, None]
    return tl.load(ptr + rows64[:, None] * stride + offs[None, :], mask=ok, other=0.0)


@triton.jit
def _attnres_fwd_args_kernel(
    # sources (None past NSLOT)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    # their row strides (elements)
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    q_ptr,  # [r]
    out_ptr,  # [N, d] contiguous, source dtype
    res_ptr,  # int8 [N, d] contiguous (None unless HAS_RES)
    lse_ptr,  # fp32 [N]
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
    PREFETCH: tl.constexpr,
    FUSED: tl.constexpr,
):
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    rows, row_ok, rows64, mask = _token_rows(tl.program_id(0), N, col_ok, BLOCK_T)
    inv_n = _inv_key_width(r, d, SLICE)

    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if PREFETCH >= 1:
        x_n1 = _load_arg(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                         xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13,
                         xs14, xs15,
                         rows, rows64, offs, mask)
    if PREFETCH >= 2:
        x_n2 = _load_arg(1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                         xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13,
                         xs14, xs15,
                         rows, rows64, offs, mask)
    for i in range(S):
        if PREFETCH == 0:
            x = _load_arg(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                          xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13,
                          xs14, xs15,
                          rows, rows64, offs, mask).to(tl.float32)
        elif PREFETCH == 1:
            x = x_n1.to(tl.float32)
            x_n1 = _load_arg(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                             xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12,
                             xs13, xs14, xs15,
                             rows, rows64, offs, mask)
        else:
            x = x_n1.to(tl.float32)
            x_n1 = x_n2
            x_n2 = _load_arg(i + 2, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                             xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12,
                             xs13, xs14, xs15,
                             rows, rows64, offs, mask)
        m, l, acc = _fwd_source(x, q, tail, m, l, acc, inv_n, EPS, SLICE, FUSED)
    _fwd_store(acc, m, l, out_ptr, res_ptr, lse_ptr, rows, rows64, offs, row_ok, mask, d, HAS_RES, RES_STEP)


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
    lse_ptr,  # fp32 [N]
    dq_part_ptr,  # fp32 [programs, r]
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
    PREFETCH: tl.constexpr,
    DQ2D: tl.constexpr,
    FUSED: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs, col_ok, tail, q = _query_cols(q_ptr, d, r, BLOCK_D)
    inv_n = _inv_key_width(r, d, SLICE)
    dq = _dq_zeros(BLOCK_T, BLOCK_D, DQ2D)
    nblk = tl.cdiv(N, BLOCK_T)
    for blk in range(pid, nblk, nprog):
        rows, row_ok, rows64, mask = _token_rows(blk, N, col_ok, BLOCK_T)
        g, gh, lse = _bwd_rows(g_ptr, h_ptr, res_ptr, lse_ptr, rows, rows64, offs, row_ok, mask, d, stride_g,
                               HAS_RES, RES_STEP, FUSED)
        if PREFETCH >= 1:
            x_n1 = _load_arg(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                             xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12,
                             xs13, xs14, xs15,
                             rows, rows64, offs, mask)
        if PREFETCH >= 2:
            x_n2 = _load_arg(1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                             xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12,
                             xs13, xs14, xs15,
                             rows, rows64, offs, mask)
        for i in range(S):
            if PREFETCH == 0:
                x = _load_arg(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                              xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12,
                              xs13, xs14, xs15,
                              rows, rows64, offs, mask).to(tl.float32)
            elif PREFETCH == 1:
                x = x_n1.to(tl.float32)
                x_n1 = _load_arg(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                 xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11,
                                 xs12, xs13, xs14, xs15,
                                 rows, rows64, offs, mask)
            else:
                x = x_n1.to(tl.float32)
                x_n1 = x_n2
                x_n2 = _load_arg(i + 2, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                 xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11,
                                 xs12, xs13, xs14, xs15,
                                 rows, rows64, offs, mask)
            grad, c = _bwd_source(x, g, gh, lse, q, tail, inv_n, EPS, SLICE, FUSED)
            gp = _select(i, NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
            tl.store(gp + rows64[:, None] * d + offs[None, :], grad.to(gp.dtype.element_ty), mask=mask)
            dq = _dq_add(dq, c, x, DQ2D)
    _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail, DQ2D)
