"""Fused Triton kernels for depth routing (Fast-AttnRes style), forward and backward.

Layout: every source is a [N, d] matrix with unit column stride and its own row stride, read at
the full row width (BLOCK_D = next power of two >= d, masked).  The forward gives each program
BLOCK_T tokens and walks the sources one at a time (the next source's tile loaded before this one's
arithmetic, PREFETCH).  The backward's persistent programs take one token at a time and walk the
sources SB at a time: a step loads an [SB, BLOCK_D] tile of SB sources' rows, whose row sums share
one reduction.  (On the H200 the forward ran fastest with two tokens per program, one source per
step, and the backward with one token and one or two sources per step: benchmarks/results/
kernel_sweep_h200_2026-11-29_sb.md and _variants.md.)  Sources are never stacked; two kernel families
address them:

- table kernels (eager calls, any S): a table of element offsets relative to an anchor tensor (the
  first source) plus a table of row strides; addressing off a typed anchor pointer (rather than
  casting integers to pointers) keeps Triton's alignment analysis, and the ALIGN hint (host-checked)
  lets every row load be a 16-byte vector;
- per-argument kernels (torch.compile, S <= 16): one pointer argument per source, picked by a chain
  of selects, so that Inductor can launch them from its own generated code (no data pointers, no
  tables; kernels.op wraps them in a torch.library.triton_op).

Forward (one pass over the sources, online softmax): reads S*d, writes d elements per token, the
per-token statistics [1 + 2S, N] fp32 (the logsumexp, each source's score z_i and key 1/RMS) and
(bf16/fp16) an int8 residual per element: the next 8 mantissa bits of the fp32 mix that rounding to
the output dtype dropped.  The backward needs g.h at fp32 accuracy (dz_i = w_i (g.o_i - g.h)
cancels), and g.h from the rounded h alone fails the paper's bf16 criterion on random upstream
gradients; the residual restores h to about 2^-16 relative for one byte.

Backward (one pass over the sources): reads g, h and the residual, the statistics and the S sources
once, writes the S source gradients; with the saved scores one row sum per source (g.o_i) remains.
The query gradient is accumulated per program into an fp32 partial [programs, r] that the host sums
(deterministic).  Persistent grid: programs loop over tokens.

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
def _cols(d, r, BLOCK_D: tl.constexpr):
    """Column offsets of a row, which are real (< d) and which are the key's (the last r)."""
    offs = tl.arange(0, BLOCK_D)
    col_ok = offs < d
    return offs, col_ok, (offs >= d - r) & col_ok


@triton.jit
def _query(q_ptr, offs, d, r, tail):
    """The query laid over the key columns (fp32, zero elsewhere).  Kept apart from _cols: Inductor
    finds which arguments a kernel writes by following every value a store's address comes from
    through the calls that made it, so column offsets returned by a call that also read the query
    would mark the query as written (and functionalization would copy it back into its parameter)."""
    return tl.load(q_ptr + (offs - (d - r)), mask=tail, other=0.0).to(tl.float32)


@triton.jit
def _token_rows(blk, N, col_ok, BLOCK_T: tl.constexpr):
    """Token block ``blk``: its rows, which are real, the rows as int64, and the tile's mask."""
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    return rows, row_ok, rows.to(tl.int64), row_ok[:, None] & col_ok[None, :]


@triton.jit
def _rows_tile(ptrs, strides, row64, js, S, offs, col_ok, EVICT: tl.constexpr):
    """Row ``row64`` of sources js [SB] (pointers and row strides given): [SB, BLOCK_D], zeros where
    js >= S."""
    addr = ptrs[:, None] + (row64 * strides)[:, None] + offs[None, :]
    mask = (js < S)[:, None] & col_ok[None, :]
    if EVICT:  # each source row is read once: let it leave the L2 first
        x = tl.load(addr, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(addr, mask=mask, other=0.0)
    return x


@triton.jit
def _tile(ptr, stride, j, S, rows, rows64, offs, mask, EVICT: tl.constexpr):
    """Raw tile [BLOCK_T, BLOCK_D] of the source at ``ptr`` (zeros when j >= S)."""
    live = ((rows * 0 + j) < S)[:, None]
    addr = ptr + rows64[:, None] * stride + offs[None, :]
    if EVICT:  # read once: let the sources leave the L2 first
        x = tl.load(addr, mask=mask & live, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(addr, mask=mask & live, other=0.0)
    return x


@triton.jit
def _fwd_source(x, q, tail, m, l, acc, inv_n, eps, SLICE: tl.constexpr, FUSED: tl.constexpr):
    """Online-softmax update of (max, sum, fp32 mix) by one fp32 source tile x [BLOCK_T, BLOCK_D].
    Returns the new state and this source's score and key 1/RMS per token."""
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
    """Row 1 + i of the statistics gets source i's scores, row 1 + S + i their key 1/RMS."""
    tl.store(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, z, mask=row_ok)
    tl.store(st_ptr + tl.cast(1 + S + i, tl.int64) * N + rows, rinv, mask=row_ok)


@triton.jit
def _fwd_store(acc, m, l, out_ptr, res_ptr, st_ptr, rows, rows64, offs, row_ok, mask, d,
               HAS_RES: tl.constexpr, RES_STEP: tl.constexpr):
    """Write the mix in the output dtype, its int8 rounding residual and the logsumexp (row 0 of the
    statistics)."""
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
    tl.store(st_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _bwd_row(g_ptr, h_ptr, res_ptr, st_ptr, row, row64, offs, col_ok, d, stride_g,
             HAS_RES: tl.constexpr, RES_STEP: tl.constexpr):
    """One token: the upstream gradient g [BLOCK_D] (fp32), g.h at fp32 accuracy, the logsumexp."""
    g = tl.load(g_ptr + row64 * stride_g + offs, mask=col_ok, other=0.0).to(tl.float32)
    hh = tl.load(h_ptr + row64 * d + offs, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        code = tl.load(res_ptr + row64 * d + offs, mask=col_ok, other=0).to(tl.float32)
        base, ok = _res_base(hh)
        hh = tl.where(ok, hh + code * (base * RES_STEP), hh)
    gh = tl.sum(g * hh, axis=0)
    return g, gh, tl.load(st_ptr + row)


@triton.jit
def _bwd_block(x, g, gh, lse, js, S, N, row, st_ptr, q, tail, inv_n, SLICE: tl.constexpr):
    """Gradient rows [SB, BLOCK_D] of the fp32 source rows x, and c = dL/dz * rinv [SB] (the query
    gradient's weight; 0 where js >= S), from the forward's scores: one row sum (g.o_i)."""
    live = js < S
    z = tl.load(st_ptr + (1 + js).to(tl.int64) * N + row, mask=live, other=0.0)
    rinv = tl.load(st_ptr + (1 + S + js).to(tl.int64) * N + row, mask=live, other=0.0)
    go = tl.sum(g[None, :] * x, axis=1)
    w = tl.exp(z - lse)
    c = w * (go - gh) * rinv
    coef = z * rinv * inv_n
    if SLICE:
        k = tl.where(tail[None, :], x, 0.0)
    else:
        k = x
    grad = w[:, None] * g[None, :] + c[:, None] * (q[None, :] - coef[:, None] * k)
    return grad, c


@triton.jit
def _dq_store(acc, dq_part_ptr, pid, r, d, offs, tail):
    """This program's query-gradient partial, over the key columns."""
    tl.store(dq_part_ptr + pid.to(tl.int64) * r + (offs - (d - r)), acc, mask=tail)


# ---------------------------------------------------------------------------------------------- table kernels


@triton.jit
def _table_src(src0_ptr, src_offs, src_strides, js, S, ALIGN: tl.constexpr):
    """Base pointers and row strides of sources js, one index or [SB] (the last source's where
    js >= S)."""
    jj = tl.minimum(js, S - 1)
    off = tl.multiple_of(tl.load(src_offs + jj), ALIGN)
    stride = tl.multiple_of(tl.load(src_strides + jj), ALIGN)
    return src0_ptr + off, stride


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
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    PREFETCH: tl.constexpr,  # load the next source's tile before this one's arithmetic (0, 1)
    EVICT: tl.constexpr,  # evict-first hint on the source reads
    FUSED: tl.constexpr,  # multi-operand row reductions (GPU); separate tl.sum (interpreter)
):
    offs, col_ok, tail = _cols(d, r, BLOCK_D)
    q = _query(q_ptr, offs, d, r, tail)
    rows, row_ok, rows64, mask = _token_rows(tl.program_id(0), N, col_ok, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if PREFETCH:
        p, st = _table_src(src0_ptr, src_offs, src_strides, 0, S, ALIGN)
        x_n = _tile(p, st, 0, S, rows, rows64, offs, mask, EVICT)
    for i in range(S):
        if PREFETCH:
            x = x_n
            p, st = _table_src(src0_ptr, src_offs, src_strides, i + 1, S, ALIGN)
            x_n = _tile(p, st, i + 1, S, rows, rows64, offs, mask, EVICT)
        else:
            p, st = _table_src(src0_ptr, src_offs, src_strides, i, S, ALIGN)
            x = _tile(p, st, i, S, rows, rows64, offs, mask, EVICT)
        m, l, acc, z, rinv = _fwd_source(x.to(tl.float32), q, tail, m, l, acc, inv_n, eps, SLICE, FUSED)
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
    BLOCK_D: tl.constexpr,
    SB: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs, col_ok, tail = _cols(d, r, BLOCK_D)
    q = _query(q_ptr, offs, d, r, tail)
    sbs = tl.arange(0, SB)
    dq = tl.zeros([BLOCK_D], tl.float32)
    for row in range(pid, N, nprog):
        row64 = tl.cast(row, tl.int64)
        g, gh, lse = _bwd_row(g_ptr, h_ptr, res_ptr, st_ptr, row, row64, offs, col_ok, d, stride_g, HAS_RES, RES_STEP)
        if PREFETCH:
            p, st = _table_src(src0_ptr, src_offs, src_strides, sbs, S, ALIGN)
            x_n = _rows_tile(p, st, row64, sbs, S, offs, col_ok, EVICT)
        for b in range(0, S, SB):
            js = b + sbs
            if PREFETCH:
                x = x_n
                p, st = _table_src(src0_ptr, src_offs, src_strides, js + SB, S, ALIGN)
                x_n = _rows_tile(p, st, row64, js + SB, S, offs, col_ok, EVICT)
            else:
                p, st = _table_src(src0_ptr, src_offs, src_strides, js, S, ALIGN)
                x = _rows_tile(p, st, row64, js, S, offs, col_ok, EVICT)
            x = x.to(tl.float32)
            grad, c = _bwd_block(x, g, gh, lse, js, S, N, row, st_ptr, q, tail, inv_n, SLICE)
            gp = grad0_ptr + tl.multiple_of(tl.load(grad_offs + tl.minimum(js, S - 1)), GALIGN)
            tl.store(gp[:, None] + row64 * d + offs[None, :], grad.to(grad0_ptr.dtype.element_ty),
                     mask=(js < S)[:, None] & col_ok[None, :])
            dq += tl.sum(c[:, None] * x, axis=0)
    _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail)


# ----------------------------------------------------------------------------------------------
# Per-argument kernels: up to 16 sources, each its own pointer argument.
#
# torch.compile launches these from its generated code (kernels.op wraps them in a
# torch.library.triton_op), so there are no host tables: a table needs data pointers, which a
# traced graph does not have.  Triton's argument specialisation sees each pointer's and each row
# stride's 16-byte divisibility, which is what ALIGN tells the table kernels.  The loop over sources
# is a runtime loop, as in the table kernels, and picks the step's pointers with a chain of selects
# over the NSLOT arguments given (unused slots are None).  Unrolling the loop over a compile-time S
# instead ran 27-33% slower on the H200 (2026-11-29, kernel_sweep "args" rows at 4096 tokens:
# registers went up).  No float arguments: Inductor passes Python floats as fp64, which would turn
# the fp32 math into fp64 (EPS is a compile-time constant, 1/n is computed here).

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
    """Argument a_i for i < NSLOT (selects; a_0 where i is out of range); i may be a tensor."""
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
def _arg_src(js, S, NSLOT: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15):
    """Pointers and row strides of sources js, one index or [SB] (the last source's where js >= S)."""
    jj = tl.minimum(js, S - 1)
    ptr = _select(jj, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    stride = _select(jj, NSLOT, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    return ptr + jj * 0, stride + jj * 0  # [SB] even when one slot leaves the selects scalar


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
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
    FUSED: tl.constexpr,
):
    offs, col_ok, tail = _cols(d, r, BLOCK_D)
    q = _query(q_ptr, offs, d, r, tail)
    inv_n = _inv_key_width(r, d, SLICE)
    rows, row_ok, rows64, mask = _token_rows(tl.program_id(0), N, col_ok, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if PREFETCH:
        p, st = _arg_src(0, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
        x_n = _tile(p, st, 0, S, rows, rows64, offs, mask, EVICT)
    for i in range(S):
        if PREFETCH:
            x = x_n
            p, st = _arg_src(i + 1, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x_n = _tile(p, st, i + 1, S, rows, rows64, offs, mask, EVICT)
        else:
            p, st = _arg_src(i, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x = _tile(p, st, i, S, rows, rows64, offs, mask, EVICT)
        m, l, acc, z, rinv = _fwd_source(x.to(tl.float32), q, tail, m, l, acc, inv_n, EPS, SLICE, FUSED)
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
    BLOCK_D: tl.constexpr,
    SB: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs, col_ok, tail = _cols(d, r, BLOCK_D)
    q = _query(q_ptr, offs, d, r, tail)
    inv_n = _inv_key_width(r, d, SLICE)
    sbs = tl.arange(0, SB)
    dq = tl.zeros([BLOCK_D], tl.float32)
    for row in range(pid, N, nprog):
        row64 = tl.cast(row, tl.int64)
        g, gh, lse = _bwd_row(g_ptr, h_ptr, res_ptr, st_ptr, row, row64, offs, col_ok, d, stride_g, HAS_RES, RES_STEP)
        if PREFETCH:
            p, st = _arg_src(sbs, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            x_n = _rows_tile(p, st, row64, sbs, S, offs, col_ok, EVICT)
        for b in range(0, S, SB):
            js = b + sbs
            if PREFETCH:
                x = x_n
                p, st = _arg_src(js + SB, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13,
                                   x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13,
                                   xs14, xs15)
                x_n = _rows_tile(p, st, row64, js + SB, S, offs, col_ok, EVICT)
            else:
                p, st = _arg_src(js, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14,
                                   x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13,
                                   xs14, xs15)
                x = _rows_tile(p, st, row64, js, S, offs, col_ok, EVICT)
            x = x.to(tl.float32)
            grad, c = _bwd_block(x, g, gh, lse, js, S, N, row, st_ptr, q, tail, inv_n, SLICE)
            gp = _select(tl.minimum(js, S - 1), NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11,
                         dx12, dx13, dx14, dx15) + js * 0  # [SB] even with one slot
            tl.store(gp[:, None] + row64 * d + offs[None, :], grad.to(dx0.dtype.element_ty),
                     mask=(js < S)[:, None] & col_ok[None, :])
            dq += tl.sum(c[:, None] * x, axis=0)
    _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail)
