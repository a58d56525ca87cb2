"""The fused forward: one pass over the sources with an online softmax.

Each program takes BLOCK_T tokens and walks the sources one at a time: the next source's tiles
loaded before this one's arithmetic with PREFETCH, Triton's software pipeliner with STAGES > 1.  Per
source: the key terms over the row's chunks, one reduction for |k|^2 and q.k, the score z_i and key
1/RMS rinv_i, and the running mix.  One-token programs rescale the online softmax lazily (LAZY).  At
exactly two sources PAIR loads both at once and mixes them with the exact two-way softmax.

Writes h in the sources' dtype, the statistics [1 + 2S, N] fp32 (the logsumexp, each source's score
and key 1/RMS) and, where HAS_RES, the int8 rounding residual (tiles._res_code).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    _cols, _inv_key_width, _query, _key_sums, _res_code, _score, _scores, _tiles, _token_rows, _zeros,
)

# The lazy online softmax's threshold: the reference maximum m moves (and the mix is rescaled) only
# when a score passes it by more than this, so weights exp(z - m) stay below e^8: no fp32 overflow.
LAZY_TAU = tl.constexpr(8.0)


@triton.jit
def _add4(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _scale(acc, s):
    out = ()
    for c in tl.static_range(len(acc)):
        out = out + (acc[c] * s[:, None],)
    return out


@triton.jit
def _lazy_rescale(z, m, l, acc):
    """Before adding a source: where some token's score passes m by more than LAZY_TAU (always at the
    first source, m = -inf), move m to max(m, z) and rescale the sum l and the mix (a branch the
    whole program takes).  Otherwise nothing: the per-element rescale runs only where the maximum
    grew a lot, mostly at the first source."""
    if tl.max(z - m, axis=0) > LAZY_TAU:
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        m = m_new
        l = l * alpha
        acc = _scale(acc, alpha)
    return m, l, acc


@triton.jit
def _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok):
    """Row 1 + i of the statistics gets source i's scores, row 1 + S + i their key 1/RMS."""
    tl.store(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, z, mask=row_ok)
    tl.store(st_ptr + tl.cast(1 + S + i, tl.int64) * N + rows, rinv, mask=row_ok)


@triton.jit
def _fwd_body(
    q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, inv_n, eps, src, ALIGN: tl.constexpr,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    FUSED: tl.constexpr, LAZY: tl.constexpr, PAIR: tl.constexpr,
):
    """The forward of BLOCK_T tokens (the arguments are described at _attnres_fwd_kernel)."""
    tl.static_assert(PREFETCH <= 1, "the forward prefetches at most one step")
    lazy: tl.constexpr = (LAZY == 2) | ((LAZY == 1) & (BLOCK_T == 1))
    rows, row_ok, rows64 = _token_rows(tl.program_id(0), N, BLOCK_T)
    offs = ()
    ok = ()
    tail = ()
    q = ()
    for c in tl.static_range(NCH):  # each chunk's columns, then its query (the order the forward was measured in)
        c_offs, c_ok, c_tail = _cols(d, r, c * BLOCK_D, BLOCK_D)
        offs, ok, tail = offs + (c_offs,), ok + (c_ok,), tail + (c_tail,)
        q = q + (_query(q_ptr, c_offs, d, r, c_tail),)
    if PAIR:  # two sources (the host checks S = 2): both loaded at once, the exact two-way softmax
        a = _tiles(src, ALIGN, 0, S, rows, rows64, row_ok, offs, ok, EVICT)
        b = _tiles(src, ALIGN, 1, S, rows, rows64, row_ok, offs, ok, EVICT)
        a, kka, kqa = _key_sums(a, q, tail, KEY0, SLICE)
        b, kkb, kqb = _key_sums(b, q, tail, KEY0, SLICE)
        if FUSED:  # the four row sums in one reduction
            ssa, qka, ssb, qkb = tl.reduce((kka, kqa, kkb, kqb), 1, _add4)
            za, ra = _score(ssa, qka, inv_n, eps)
            zb, rb = _score(ssb, qkb, inv_n, eps)
        else:
            za, ra = _scores(kka, kqa, inv_n, eps, False)
            zb, rb = _scores(kkb, kqb, inv_n, eps, False)
        m = tl.maximum(za, zb)
        pa = tl.exp(za - m)
        pb = tl.exp(zb - m)
        l = pa + pb
        acc = ()
        for c in tl.static_range(NCH):
            acc = acc + (pa[:, None] * a[c] + pb[:, None] * b[c],)
        _store_scores(st_ptr, 0, S, N, za, ra, rows, row_ok)
        _store_scores(st_ptr, 1, S, N, zb, rb, rows, row_ok)
    else:  # the sources one at a time, online softmax
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_T], tl.float32)
        acc = _zeros([BLOCK_T, BLOCK_D], NCH)
        if PREFETCH:
            nxt = _tiles(src, ALIGN, 0, S, rows, rows64, row_ok, offs, ok, EVICT)
        for i in tl.range(0, S, num_stages=STAGES):
            t = _tiles(src, ALIGN, i + PREFETCH, S, rows, rows64, row_ok, offs, ok, EVICT)
            if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's)
                t, nxt = nxt, t
            t, kk, kq = _key_sums(t, q, tail, KEY0, SLICE)
            z, rinv = _scores(kk, kq, inv_n, eps, FUSED)
            if lazy:  # rescale only where the maximum grew past LAZY_TAU
                m, l, acc = _lazy_rescale(z, m, l, acc)
                p = tl.exp(z - m)
                l = l + p
                new = ()
                for c in tl.static_range(NCH):
                    new = new + (acc[c] + p[:, None] * t[c],)
            else:
                m_new = tl.maximum(m, z)
                alpha = tl.exp(m - m_new)
                p = tl.exp(z - m_new)
                l = l * alpha + p
                m = m_new
                new = ()
                for c in tl.static_range(NCH):
                    new = new + (acc[c] * alpha[:, None] + p[:, None] * t[c],)
            acc = new
            _store_scores(st_ptr, i, S, N, z, rinv, rows, row_ok)
    inv_l = 1.0 / l
    for c in tl.static_range(NCH):
        h = acc[c] * inv_l[:, None]
        hb = h.to(out_ptr.dtype.element_ty)
        mask = row_ok[:, None] & ok[c][None, :]
        tl.store(out_ptr + rows64[:, None] * d + offs[c][None, :], hb, mask=mask)
        if HAS_RES:
            tl.store(res_ptr + rows64[:, None] * d + offs[c][None, :], _res_code(h, hb, RES_STEP), mask=mask)
    tl.store(st_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _attnres_fwd_kernel(
    src0_ptr,  # the first source (typed pointer): the anchor of the offsets
    src_offs,  # int64 [S]: element offset of each source from the anchor
    src_strides,  # int64 [S]: row strides (elements)
    q_ptr,  # [r]
    out_ptr,  # [N, d] contiguous, the sources' dtype
    res_ptr,  # int8 [N, d] contiguous (unused unless HAS_RES)
    st_ptr,  # fp32 [1 + 2S, N]: logsumexp, the S scores, the S key 1/RMS
    N, S, d, r,
    inv_n,  # 1/r for "slice", 1/d for "full"
    eps, SLICE: tl.constexpr, HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,  # the residual's code (tiles._res_code): 0 for bf16's bits, 2^-18 for fp16
    ALIGN: tl.constexpr,  # offsets and strides are multiples of this many elements
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # chunks per row
    KEY0: tl.constexpr,  # the first chunk holding key columns (0: computed as if every chunk may)
    BLOCK_T: tl.constexpr,  # tokens per program
    PREFETCH: tl.constexpr,  # load the next source's tiles one step ahead (0 or 1)
    EVICT: tl.constexpr,  # evict-first hint on the source reads
    STAGES: tl.constexpr,  # software-pipeline stages of the source loop (1: none)
    FUSED: tl.constexpr,  # multi-operand row reductions (GPU); separate sums (interpreter)
    LAZY: tl.constexpr,  # lazy online softmax: 0 off, 1 for one-token programs, 2 always
    PAIR: tl.constexpr,  # S = 2 only: both sources at once, no source loop
):
    _fwd_body(q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, inv_n, eps, (src0_ptr, src_offs, src_strides), ALIGN, SLICE,
              HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, FUSED, LAZY, PAIR)


# The per-argument forward: up to 16 sources, each its own pointer argument (None past NSLOT), which
# Inductor can launch from its generated code.  Triton's argument specialisation sees each pointer's
# and row stride's 16-byte divisibility (what ALIGN tells the table kernel).  No float arguments:
# Inductor passes Python floats as fp64 (EPS is a compile-time constant, 1/n computed here).
@triton.jit
def _attnres_fwd_args_kernel(
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r,
    NSLOT: tl.constexpr,  # source arguments given (= S)
    EPS: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr,
    NCH: tl.constexpr, KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr, FUSED: tl.constexpr, LAZY: tl.constexpr, PAIR: tl.constexpr,
):
    src = ((x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)[:NSLOT],
           (xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)[:NSLOT])
    _fwd_body(q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, _inv_key_width(r, d, SLICE), EPS, src, 0, SLICE, HAS_RES,
              RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, FUSED, LAZY, PAIR)
