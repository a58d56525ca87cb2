"""The fused forward: one pass over the sources with an online softmax.

Each program takes BLOCK_T tokens and walks the sources one at a time (the next source's tiles
loaded before this one's arithmetic with PREFETCH; Triton's software pipeliner with STAGES > 1), or
at exactly two sources loads both at once (PAIR, pair.py).  Per source: the key terms over the row's
chunks, one fused reduction for |k|^2 and q.k, the score z_i and key 1/RMS rinv_i, and the running
mix.  One-token programs rescale the online softmax lazily (_lazy_rescale: only when a score passes
the reference maximum by more than LAZY_TAU).

Writes h in the sources' dtype, the per-token statistics [1 + 2S, N] fp32 (the logsumexp, each
source's score and key 1/RMS: the backward then needs one row sum per source) and, for bf16/fp16
where the backward is not deferred, the int8 rounding residual (tiles._res_code).  DRAM bytes: S
sources read, h written, plus half a unit for the residual (units of N d 2 bytes).

Math (fp32): k_i = o_i restricted to the key coordinates (the last r for "slice", all d for "full"),
n = their count, rinv_i = 1/sqrt(|k_i|^2/n + eps), z_i = rinv_i (q . o_i[tail]), w = softmax(z),
h = sum_i w_i o_i.  kernels/naive.py writes the same out in torch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pair import _mix2, _scores_pair, _src_pair
from .tiles import _cols, _fwd_key, _inv_key_width, _query, _res_code, _ring, _scores, _src_tiles, _token_rows


@triton.jit
def _softmax_step(kk, kq, m, l, inv_n, eps, FUSED: tl.constexpr):
    """Row sums of the key terms, this source's score z and key 1/RMS per token, and the online
    softmax's new (max, sum) with the old mix's rescale alpha and this source's weight p."""
    z, rinv = _scores(kk, kq, inv_n, eps, FUSED)
    m_new = tl.maximum(m, z)
    alpha = tl.exp(m - m_new)
    p = tl.exp(z - m_new)
    return m_new, l * alpha + p, alpha, p, z, rinv


@triton.jit
def _mix(acc, alpha, p, x, RESCALE: tl.constexpr = True):
    """The running mix after one more source (x, weight p), rescaled by alpha unless the lazy softmax
    rescaled it already (RESCALE False)."""
    if RESCALE:
        return acc * alpha[:, None] + p[:, None] * x
    return acc + p[:, None] * x


# The lazy online softmax's threshold: the reference m moves (and the mix is rescaled) only when a score
# passes it by more than this, so weights exp(z - m) stay below e^8 (about 3e3): no fp32 overflow for
# any S, and the mix's relative rounding unchanged.
LAZY_TAU = tl.constexpr(8.0)


@triton.jit
def _lazy_rescale(z, m, l, NCH: tl.constexpr, a0, a1, a2, a3, a4):
    """The lazy online softmax's step before adding a source: where some token's score z passes the
    reference m by more than LAZY_TAU (always at the first source, m = -inf), move every token's m to
    max(m, z) and rescale its running sum l and mix chunks a0..a4 (a branch taken by the whole
    program).  Otherwise nothing: the per-element multiply of the online softmax's rescale, a third
    of a key-free chunk's arithmetic, runs only where the maximum grew a lot, mostly at the first
    source."""
    if tl.max(z - m, axis=0) > LAZY_TAU:
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        m = m_new
        l = l * alpha
        a0 = a0 * alpha[:, None]
        if NCH >= 2:
            a1 = a1 * alpha[:, None]
        if NCH >= 3:
            a2 = a2 * alpha[:, None]
        if NCH >= 4:
            a3 = a3 * alpha[:, None]
        if NCH >= 5:
            a4 = a4 * alpha[:, None]
    return m, l, a0, a1, a2, a3, a4


@triton.jit
def _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok):
    """Row 1 + i of the statistics gets source i's scores, row 1 + S + i their key 1/RMS."""
    tl.store(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, z, mask=row_ok)
    tl.store(st_ptr + tl.cast(1 + S + i, tl.int64) * N + rows, rinv, mask=row_ok)


@triton.jit
def _store_mix(acc, inv_l, out_ptr, res_ptr, rows64, row_ok, offs, col_ok, d,
               HAS_RES: tl.constexpr, RES_STEP: tl.constexpr):
    """Write one column chunk of the mix in the output dtype and its int8 rounding residual."""
    h = acc * inv_l[:, None]
    hb = h.to(out_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows64[:, None] * d + offs[None, :], hb, mask=mask)
    if HAS_RES:
        tl.store(res_ptr + rows64[:, None] * d + offs[None, :], _res_code(h, hb, RES_STEP), mask=mask)


@triton.jit
def _fwd_body(
    q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, inv_n, eps,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    FUSED: tl.constexpr, LAZY: tl.constexpr, PAIR: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x_ptrs, x_strides,  # the per-argument sources and their row strides, tuples (None for TABLE)
):
    """The forward of BLOCK_T tokens (the kernels' arguments are described at _attnres_fwd_kernel)."""
    tl.static_assert(PREFETCH <= 1, "the forward prefetches at most one step")
    lazy: tl.constexpr = (LAZY == 2) | ((LAZY == 1) & (BLOCK_T == 1))  # the lazy online softmax (_lazy_rescale)
    rows, row_ok, rows64 = _token_rows(tl.program_id(0), N, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    offs0, ok0, tail0 = _cols(d, r, 0, BLOCK_D)
    q0 = _query(q_ptr, offs0, d, r, tail0)
    acc0 = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    offs1, ok1, tail1, q1 = offs0, ok0, tail0, q0  # chunk 0's past NCH (unused)
    acc1, acc2, acc3, acc4 = acc0, acc0, acc0, acc0
    offs2, ok2, tail2, q2 = offs0, ok0, tail0, q0
    offs3, ok3, tail3, q3 = offs0, ok0, tail0, q0
    offs4, ok4, tail4, q4 = offs0, ok0, tail0, q0
    if NCH >= 2:
        offs1, ok1, tail1 = _cols(d, r, BLOCK_D, BLOCK_D)
        q1 = _query(q_ptr, offs1, d, r, tail1)
        acc1 = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if NCH >= 3:
        offs2, ok2, tail2 = _cols(d, r, 2 * BLOCK_D, BLOCK_D)
        q2 = _query(q_ptr, offs2, d, r, tail2)
        acc2 = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if NCH >= 4:
        offs3, ok3, tail3 = _cols(d, r, 3 * BLOCK_D, BLOCK_D)
        q3 = _query(q_ptr, offs3, d, r, tail3)
        acc3 = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if NCH >= 5:
        offs4, ok4, tail4 = _cols(d, r, 4 * BLOCK_D, BLOCK_D)
        q4 = _query(q_ptr, offs4, d, r, tail4)
        acc4 = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    offs = (offs0, offs1, offs2, offs3, offs4)  # the chunks' constants as tuples, for the helpers
    ok = (ok0, ok1, ok2, ok3, ok4)
    tail = (tail0, tail1, tail2, tail3, tail4)
    q = (q0, q1, q2, q3, q4)
    if PAIR:  # two sources (the host checks S = 2): both loaded at once, the exact two-way softmax
        a0, a1, a2, a3, a4, b0, b1, b2, b3, b4 = _src_pair(
            0, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE,
            src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
        a0, a1, a2, a3, a4, kka, kqa = _fwd_key(a0, a1, a2, a3, a4, q, tail, NCH, KEY0, SLICE)
        b0, b1, b2, b3, b4, kkb, kqb = _fwd_key(b0, b1, b2, b3, b4, q, tail, NCH, KEY0, SLICE)
        za, ra, zb, rb = _scores_pair(kka, kqa, kkb, kqb, inv_n, eps, FUSED)
        m = tl.maximum(za, zb)
        pa = tl.exp(za - m)
        pb = tl.exp(zb - m)
        l = pa + pb
        acc0 = _mix2(pa, a0, pb, b0)
        if NCH >= 2:
            acc1 = _mix2(pa, a1, pb, b1)
        if NCH >= 3:
            acc2 = _mix2(pa, a2, pb, b2)
        if NCH >= 4:
            acc3 = _mix2(pa, a3, pb, b3)
        if NCH >= 5:
            acc4 = _mix2(pa, a4, pb, b4)
        _store_scores(st_ptr, 0, S, N, za, ra, rows, row_ok)
        _store_scores(st_ptr, 1, S, N, zb, rb, rows, row_ok)
    else:  # the sources one at a time, online softmax
        if PREFETCH:
            tn0, tn1, tn2, tn3, tn4 = _src_tiles(0, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE, src0_ptr,
                                                 src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
        for i in tl.range(0, S, num_stages=STAGES):
            u0, u1, u2, u3, u4 = _src_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE,
                                            src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
            t0, t1, t2, t3, t4 = u0, u1, u2, u3, u4
            if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's) for the next
                t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4 = _ring(u0, u1, u2, u3, u4, tn0, tn1, tn2, tn3, tn4, NCH)
            t0, t1, t2, t3, t4, kk, kq = _fwd_key(t0, t1, t2, t3, t4, q, tail, NCH, KEY0, SLICE)
            if lazy:  # rescale only where the maximum grew past LAZY_TAU
                z, rinv = _scores(kk, kq, inv_n, eps, FUSED)
                m, l, acc0, acc1, acc2, acc3, acc4 = _lazy_rescale(z, m, l, NCH, acc0, acc1, acc2, acc3, acc4)
                pw = tl.exp(z - m)
                l = l + pw
                alpha = pw  # unused: the mix below adds without rescaling
            else:
                m, l, alpha, pw, z, rinv = _softmax_step(kk, kq, m, l, inv_n, eps, FUSED)
            acc0 = _mix(acc0, alpha, pw, t0, not lazy)
            if NCH >= 2:
                acc1 = _mix(acc1, alpha, pw, t1, not lazy)
            if NCH >= 3:
                acc2 = _mix(acc2, alpha, pw, t2, not lazy)
            if NCH >= 4:
                acc3 = _mix(acc3, alpha, pw, t3, not lazy)
            if NCH >= 5:
                acc4 = _mix(acc4, alpha, pw, t4, not lazy)
            _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok)
    inv_l = 1.0 / l
    _store_mix(acc0, inv_l, out_ptr, res_ptr, rows64, row_ok, offs0, ok0, d, HAS_RES, RES_STEP)
    if NCH >= 2:
        _store_mix(acc1, inv_l, out_ptr, res_ptr, rows64, row_ok, offs1, ok1, d, HAS_RES, RES_STEP)
    if NCH >= 3:
        _store_mix(acc2, inv_l, out_ptr, res_ptr, rows64, row_ok, offs2, ok2, d, HAS_RES, RES_STEP)
    if NCH >= 4:
        _store_mix(acc3, inv_l, out_ptr, res_ptr, rows64, row_ok, offs3, ok3, d, HAS_RES, RES_STEP)
    if NCH >= 5:
        _store_mix(acc4, inv_l, out_ptr, res_ptr, rows64, row_ok, offs4, ok4, d, HAS_RES, RES_STEP)
    tl.store(st_ptr + rows, m + tl.log(l), mask=row_ok)


# ---------------------------------------------------------------------------------------------- table kernels


@triton.jit
def _attnres_fwd_kernel(
    src0_ptr,  # anchor: the first source (typed pointer)
    src_offs,  # int64 [S]: element offset of each source from the anchor
    src_strides,  # int64 [S]: row strides (elements)
    q_ptr,  # [r] (any float dtype)
    out_ptr,  # [N, d] contiguous, source dtype
    res_ptr,  # int8 [N, d] contiguous (unused unless HAS_RES)
    st_ptr,  # fp32 [1 + 2S, N]: logsumexp, the S scores, the S key 1/RMS
    N, S, d, r,
    inv_n,  # 1/r for "slice", 1/d for "full"
    eps, SLICE: tl.constexpr, HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,  # residual code (_res_code): 0 for bf16's bit code, 2^-18 for fp16
    ALIGN: tl.constexpr,  # offsets and strides are multiples of this many elements
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    BLOCK_T: tl.constexpr,  # tokens per program
    PREFETCH: tl.constexpr,  # load the next source's tiles one step ahead (0 or 1)
    EVICT: tl.constexpr,  # evict-first hint on the source reads
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    FUSED: tl.constexpr,  # multi-operand row reductions (GPU); separate tl.sum (interpreter)
    LAZY: tl.constexpr,  # lazy online softmax (_lazy_rescale): 0 off, 1 for one-token programs, 2 always
    PAIR: tl.constexpr,  # S = 2 only: both sources loaded at once, no source loop (PREFETCH, STAGES, LAZY unused)
):
    _fwd_body(q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, inv_n, eps, SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH,
              KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, FUSED, LAZY, PAIR, True, src0_ptr, src_offs, src_strides, ALIGN,
              0,
              None, None)  # no per-argument sources


# ----------------------------------------------------------------------------------------------
# Per-argument kernels: up to 16 sources, each its own pointer argument.
#
# torch.compile launches these from its generated code (kernels.op wraps them in a
# torch.library.triton_op), so there are no host tables: a table needs data pointers, which a
# traced graph does not have.  Triton's argument specialisation sees each pointer's and each row
# stride's 16-byte divisibility, which is what ALIGN tells the table kernels.  The loop over sources
# is a runtime loop, as in the table kernels, and picks the step's pointers with a chain of selects
# over the NSLOT arguments given (unused slots are None).  Unrolling the loop over a compile-time S
# instead runs 27-33% slower on the H200 (kernel_sweep_h200_2026-11-29_args_unrolled, 4096 tokens:
# more registers).  No float arguments: Inductor passes Python floats as fp64, which would turn
# the fp32 math into fp64 (EPS is a compile-time constant, 1/n is computed here).


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
    N, S, d, r,
    NSLOT: tl.constexpr,  # source arguments given (= S)
    EPS: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    FUSED: tl.constexpr, LAZY: tl.constexpr,
    PAIR: tl.constexpr,  # S = 2 only (see _attnres_fwd_kernel)
):
    _fwd_body(q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, _inv_key_width(r, d, SLICE), EPS, SLICE, HAS_RES,
              RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, FUSED, LAZY, PAIR, False, None, None,
              None, 1, NSLOT, (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
              (xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15))
