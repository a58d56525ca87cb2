"""Fused Triton kernels for depth routing (Fast-AttnRes style), forward and backward.

Layout: every source is a [N, d] matrix with unit column stride and its own row stride, read at
the full row width as NCH column chunks of BLOCK_D columns (a power of two, masked past d), NCH from
1 to 5, whichever pads least (d = 1536 as 3 x 512 and 2560 as 5 x 512: no masked lanes;
kernels.op._col_layout).  All chunks share one register layout, so their elementwise
terms add up before a single row sum.  The forward gives each program BLOCK_T tokens and walks the
sources one at a time (the next source's tiles loaded before this one's arithmetic, PREFETCH), or at
S = 2 loads both at once and takes the exact two-way softmax (PAIR: no loop, no online rescale).  The
backward's persistent programs take one token at a time and walk the sources SB at a time: a step
loads [SB, BLOCK_D] tiles of SB sources' rows, whose row sums share one reduction.  (On the H200 at
d = 1536 the three-chunk kernels ran fastest with one token and one source per step: benchmarks/
results/kernel_sweep_h200_2026-11-29_split.md.)  STAGES > 1 hands the source loop to Triton's
software pipeliner (tl.range num_stages: an offline sm_90 build turns the source loads into cp.async
copies through shared memory, issued stages - 1 iterations early); 1 is a plain loop (the same
machine code as range()), 3 is in some autotuned candidates (docs/kernel_notes.md, eighth session).

Sources are never stacked; two kernel families address them, around one shared body per pass
(_fwd_body, _bwd_body):

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
the output dtype dropped (for bf16 taken from the fp32 bit pattern with integer operations:
_res_code).  The backward needs g.h at fp32 accuracy (dz_i = w_i (g.o_i - g.h) cancels), and g.h from
the rounded h alone fails the paper's bf16 criterion on random upstream gradients; the residual
restores h to about 2^-16 relative for one byte.  One-token programs rescale the online softmax
lazily (_lazy_rescale: only when a score passes the reference maximum by more than e^8).

Backward (one pass over the sources): reads g, h and the residual, the statistics and the S sources
once, writes the S source gradients; with the saved scores one row sum per source (g.o_i) remains.
The query gradient is accumulated per program into an fp32 partial [programs, r], summed after the
kernel in a fixed order (_sum_rows_kernel's two launches, _sum_rows_once_kernel's one, or torch,
whichever kernels.op timed fastest).  Persistent
grid: programs loop over tokens.  A second grid, the token-tile backward
(_bwd_tile_body, chosen by BLOCK_T > 0), gives each program BLOCK_T tokens in the forward's layout
and no token loop, and writes one partial row per BLOCK_T tokens (PERSIST: a few programs per
multiprocessor loop over the blocks, one partial row each).  On the H200 its kernel stalled
less on loads than the persistent one (ncu); with the key-chunk specialisation (KEY0) it is the
fastest backward at most three-chunk shapes timed, and an autotuned candidate beside the persistent
grid (docs/kernel_notes.md, seventh and eighth sessions).  The deferred backward (DEFER, token-tile
grid; _bwd_tile_deferred) takes g.h from the sources in a first pass instead of from h and the
residual, writes the key's chunks in a second, and lets the forward skip the residual (kernels.op
chooses it up to a few sources).

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
def _res_code(h, hb, RES_STEP: tl.constexpr):
    """int8 residual of rounding the fp32 mix h to hb (bf16/fp16): the next 8 bits below hb's.
    RES_STEP 0 (bf16): bf16 is the top half of an fp32, so h's fp32 bit pattern minus hb's is the
    dropped part counted in fp32 units in the last place (|.| <= 2^15, h and hb of one sign), and the
    code is that over 2^8, rounded: three integer operations, exact across binades, zeros and
    subnormals.  Otherwise (fp16): round((h - hb) / (2^e(hb) RES_STEP)), 0 where hb is not a finite
    normal number."""
    hb32 = hb.to(tl.float32)
    if RES_STEP == 0:
        code = (h.to(tl.int32, bitcast=True) - hb32.to(tl.int32, bitcast=True) + 128) >> 8
        return tl.minimum(tl.maximum(code, -127), 127).to(tl.int8)
    base, ok = _res_base(hb32)
    step = tl.where(ok, base * RES_STEP, 1.0)
    code = tl.floor((h - hb32) / step + 0.5)
    return tl.where(ok, tl.minimum(tl.maximum(code, -127.0), 127.0), 0.0).to(tl.int8)


@triton.jit
def _res_h(hh, code, RES_STEP: tl.constexpr):
    """h (fp32) rebuilt from its rounded value hh (fp32) and int8 residual code (_res_code)."""
    if RES_STEP == 0:
        return (hh.to(tl.int32, bitcast=True) + (code.to(tl.int32) << 8)).to(tl.float32, bitcast=True)
    base, ok = _res_base(hh)
    return tl.where(ok, hh + code.to(tl.float32) * (base * RES_STEP), hh)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _cols(d, r, base, BLOCK_D: tl.constexpr):
    """Column offsets of the chunk starting at column ``base``, which are real (< d) and which are
    the key's (the last r)."""
    offs = base + tl.arange(0, BLOCK_D)
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
def _token_rows(blk, N, BLOCK_T: tl.constexpr):
    """Token block ``blk``: its rows, which are real, and the rows as int64."""
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    return rows, row_ok, rows.to(tl.int64)


@triton.jit
def _rows_tile(ptrs, strides, row64, js, S, offs, col_ok, EVICT: tl.constexpr):
    """Row ``row64`` of sources js [SB] (pointers and row strides given), one column chunk:
    [SB, BLOCK_D], zeros where js >= S."""
    addr = ptrs[:, None] + (row64 * strides)[:, None] + offs[None, :]
    mask = (js < S)[:, None] & col_ok[None, :]
    if EVICT:  # each source row is read once: let it leave the L2 first
        x = tl.load(addr, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(addr, mask=mask, other=0.0)
    return x


@triton.jit
def _tile(ptr, stride, j, S, rows, rows64, row_ok, offs, col_ok, EVICT: tl.constexpr):
    """Raw tile [BLOCK_T, BLOCK_D] (one column chunk) of the source at ``ptr`` (zeros when j >= S)."""
    live = row_ok & ((rows * 0 + j) < S)
    addr = ptr + rows64[:, None] * stride + offs[None, :]
    mask = live[:, None] & col_ok[None, :]
    if EVICT:  # read once: let the sources leave the L2 first
        x = tl.load(addr, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(addr, mask=mask, other=0.0)
    return x


@triton.jit
def _key_terms(x, q, tail, SLICE: tl.constexpr):
    """Elementwise terms of |k|^2 and q.k for one fp32 chunk (chunks of one layout add up before the
    row sum, so a row split into chunks still takes one reduction)."""
    if SLICE:
        kk = tl.where(tail[None, :], x * x, 0.0)
    else:
        kk = x * x
    return kk, x * q[None, :]


@triton.jit
def _scores(kk, kq, inv_n, eps, FUSED: tl.constexpr):
    """Row sums of the key terms: this source's score z and key 1/RMS per token."""
    if FUSED:  # one fused reduction (one shared-memory round) for both row sums
        ss, qk = tl.reduce((kk, kq), 1, _add2)
    else:  # separate sums (the interpreter runs tl.reduce with a Python combine: slow)
        ss = tl.sum(kk, axis=1)
        qk = tl.sum(kq, axis=1)
    return _score(ss, qk, inv_n, eps)


@triton.jit
def _score(ss, qk, inv_n, eps):
    """A source's score z and key 1/RMS per token from its row sums |k|^2 and q.k."""
    rinv = tl.rsqrt(ss * inv_n + eps)
    return qk * rinv, rinv


@triton.jit
def _add4(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _scores_pair(kka, kqa, kkb, kqb, inv_n, eps, FUSED: tl.constexpr):
    """_scores for two sources at once (the pair forward): one fused reduction for the four row sums."""
    if FUSED:
        ssa, qka, ssb, qkb = tl.reduce((kka, kqa, kkb, kqb), 1, _add4)
    else:
        ssa, qka = tl.sum(kka, axis=1), tl.sum(kqa, axis=1)
        ssb, qkb = tl.sum(kkb, axis=1), tl.sum(kqb, axis=1)
    za, ra = _score(ssa, qka, inv_n, eps)
    zb, rb = _score(ssb, qkb, inv_n, eps)
    return za, ra, zb, rb


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


@triton.jit
def _mix2(pa, a, pb, b):
    """The unnormalised mix of two sources' fp32 tiles with weights pa, pb (the pair forward)."""
    return pa[:, None] * a + pb[:, None] * b


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
def _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs, col_ok, d, stride_g, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr):
    """One token, one column chunk: the upstream gradient g [BLOCK_D] (fp32) and the terms of g.h
    at fp32 accuracy (h rebuilt from its residual)."""
    g = tl.load(g_ptr + row64 * stride_g + offs, mask=col_ok, other=0.0).to(tl.float32)
    hh = tl.load(h_ptr + row64 * d + offs, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        hh = _res_h(hh, tl.load(res_ptr + row64 * d + offs, mask=col_ok, other=0), RES_STEP)
    return g, g * hh


@triton.jit
def _bwd_weights(go, gh, lse, js, S, N, rows, live, st_ptr, inv_n):
    """From g.o (sources js of one token, or one source of tokens ``rows``) and the forward's
    scores: the weights w, c = dL/dz * rinv (the query gradient's weight; 0 where not ``live``) and
    the key term's coefficient z rinv / n."""
    # tl.cast, not .to: js is a loop index, which the interpreter passes as a Python int
    z = tl.load(st_ptr + tl.cast(1 + js, tl.int64) * N + rows, mask=live, other=0.0)
    rinv = tl.load(st_ptr + tl.cast(1 + S + js, tl.int64) * N + rows, mask=live, other=0.0)
    w = tl.exp(z - lse)
    return w, w * (go - gh) * rinv, z * rinv * inv_n


@triton.jit
def _bwd_grad(x, g, q, tail, w, c, coef, SLICE: tl.constexpr, KEYLESS: tl.constexpr = False):
    """Gradient rows [SB or BLOCK_T, BLOCK_D] of one column chunk of the fp32 source rows x (g
    broadcast against them: one token's [1, BLOCK_D], or a token block's).  KEYLESS: the chunk lies
    before the key (KEY0), so under "slice" its gradient is w g alone."""
    if KEYLESS and SLICE:
        return w[:, None] * g
    if SLICE:
        k = tl.where(tail[None, :], x, 0.0)
    else:
        k = x
    return w[:, None] * g + c[:, None] * (q[None, :] - coef[:, None] * k)


@triton.jit
def _store_grad(gp, row64, d, offs, col_ok, js, S, grad):
    """One column chunk of the gradient rows of sources js (pointers gp [SB])."""
    tl.store(gp[:, None] + row64 * d + offs[None, :], grad.to(gp.dtype.element_ty),
             mask=(js < S)[:, None] & col_ok[None, :])


@triton.jit
def _dq_store(acc, dq_part_ptr, pid, r, d, offs, tail):
    """This program's query-gradient partial over the key columns of one chunk."""
    tl.store(dq_part_ptr + pid.to(tl.int64) * r + (offs - (d - r)), acc, mask=tail)


@triton.jit
def _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs, col_ok, d, stride_g,
              HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, WITH_H: tl.constexpr = True):
    """_bwd_row for a block of tokens: g [BLOCK_T, BLOCK_D] (fp32) and the terms of g.h (not read
    without WITH_H: g stands in for them, unused)."""
    mask = row_ok[:, None] & col_ok[None, :]
    g = tl.load(g_ptr + rows64[:, None] * stride_g + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if not WITH_H:
        return g, g
    hh = tl.load(h_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        hh = _res_h(hh, tl.load(res_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0), RES_STEP)
    return g, g * hh


@triton.jit
def _store_tile(ptr, rows64, row_ok, d, offs, col_ok, x):
    tl.store(ptr + rows64[:, None] * d + offs[None, :], x.to(ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------- source addressing
#
# The two kernel families share their bodies (_fwd_body, _bwd_body) and differ only in how the
# sources are addressed: the table kernels pass an anchor pointer, an offset table and a stride
# table (TABLE); the per-argument kernels pass one pointer and one row stride per source (x_i, xs_i,
# None past NSLOT) and the gradients' pointers (dx_i).  Which one is a compile-time choice, so each
# kernel compiles to the code it had when each family had its own copy of the body (checked with
# benchmarks/offline_sass.py --against).


@triton.jit
def _table_src(src0_ptr, src_offs, src_strides, js, S, ALIGN: tl.constexpr):
    """Base pointers and row strides of sources js, one index or [SB] (the last source's where
    js >= S)."""
    jj = tl.minimum(js, S - 1)
    off = tl.multiple_of(tl.load(src_offs + jj), ALIGN)
    stride = tl.multiple_of(tl.load(src_strides + jj), ALIGN)
    return src0_ptr + off, stride


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
def _src(js, S, TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
         x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
         xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15):
    """Pointers and row strides of sources js, one index or [SB] (the last source's where js >= S):
    from the offset table (TABLE) or from the per-source arguments."""
    if TABLE:
        p, st = _table_src(src0_ptr, src_offs, src_strides, js, S, ALIGN)
    else:
        p, st = _arg_src(js, S, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                         xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    return p, st


@triton.jit
def _grad_ptrs(js, S, TABLE: tl.constexpr, grad0_ptr, grad_offs, GALIGN: tl.constexpr, NSLOT: tl.constexpr,
               dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15):
    """Pointers [SB] of the gradients of sources js (the last source's where js >= S)."""
    jj = tl.minimum(js, S - 1)
    if TABLE:
        gp = grad0_ptr + tl.multiple_of(tl.load(grad_offs + jj), GALIGN)
    else:
        gp = _select(jj, NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14,
                     dx15)
        gp = gp + js * 0  # [SB] even with one slot
    return gp


@triton.jit
def _src_tiles(j, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
               NCH: tl.constexpr, EVICT: tl.constexpr,
               TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
               x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15):
    """Source j's raw tiles [BLOCK_T, BLOCK_D] of tokens ``rows``, one per column chunk (chunk 0's
    repeated past NCH; zeros when j >= S): the token-block bodies' one load per loop step."""
    p, st = _src(j, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                 x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                 xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    u0 = _tile(p, st, j, S, rows, rows64, row_ok, offs0, ok0, EVICT)
    u1, u2, u3, u4 = u0, u0, u0, u0
    if NCH >= 2:
        u1 = _tile(p, st, j, S, rows, rows64, row_ok, offs1, ok1, EVICT)
    if NCH >= 3:
        u2 = _tile(p, st, j, S, rows, rows64, row_ok, offs2, ok2, EVICT)
    if NCH >= 4:
        u3 = _tile(p, st, j, S, rows, rows64, row_ok, offs3, ok3, EVICT)
    if NCH >= 5:
        u4 = _tile(p, st, j, S, rows, rows64, row_ok, offs4, ok4, EVICT)
    return u0, u1, u2, u3, u4


@triton.jit
def _ring(u0, u1, u2, u3, u4, tn0, tn1, tn2, tn3, tn4, NCH: tl.constexpr):
    """PREFETCH's one-step ring: a step uses the tiles loaded a step ago (tn) and keeps those it just
    loaded (u, the next source's) for the next step.  Returns this step's tiles and the kept ones
    (three swapped even for fewer chunks: the code as timed)."""
    t0, t1, t2, tn0, tn1, tn2 = tn0, tn1, tn2, u0, u1, u2
    t3, t4 = u3, u4
    if NCH >= 4:
        t3, tn3 = tn3, u3
    if NCH >= 5:
        t4, tn4 = tn4, u4
    return t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4


@triton.jit
def _src_pair(j, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
              NCH: tl.constexpr, EVICT: tl.constexpr,
              TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
              x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
              xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15):
    """Sources j and j + 1's raw tiles (_src_tiles; source j's loads first): a step that holds two
    sources."""
    a0, a1, a2, a3, a4 = _src_tiles(j, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                    offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                                    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14,
                                    xs15)
    b0, b1, b2, b3, b4 = _src_tiles(j + 1, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                    offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                                    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14,
                                    xs15)
    return a0, a1, a2, a3, a4, b0, b1, b2, b3, b4


@triton.jit
def _key_tiles(j, S, rows, rows64, row_ok, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
               NCH: tl.constexpr, KEY0: tl.constexpr, EVICT: tl.constexpr,
               TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
               x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
               xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15):
    """Source j's raw tiles of chunks KEY0 to NCH - 1 (the key's; KEY0 >= 1) as chunks 1 to 4, the last
    chunk's tile standing in for the others: the deferred backward's second pass."""
    p, st = _src(j, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                 x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                 xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    last = _tile(p, st, j, S, rows, rows64, row_ok, _pick(NCH - 1, offs1, offs1, offs2, offs3, offs4),
                 _pick(NCH - 1, ok1, ok1, ok2, ok3, ok4), EVICT)
    u1, u2, u3, u4 = last, last, last, last
    if NCH >= 3 and KEY0 <= 1:
        u1 = _tile(p, st, j, S, rows, rows64, row_ok, offs1, ok1, EVICT)
    if NCH >= 4 and KEY0 <= 2:
        u2 = _tile(p, st, j, S, rows, rows64, row_ok, offs2, ok2, EVICT)
    if NCH >= 5 and KEY0 <= 3:
        u3 = _tile(p, st, j, S, rows, rows64, row_ok, offs3, ok3, EVICT)
    return u1, u2, u3, u4


@triton.jit
def _src_rows(p, st, row64, js, S, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
              NCH: tl.constexpr, EVICT: tl.constexpr):
    """Row ``row64`` of sources js [SB] (pointers p, row strides st), one [SB, BLOCK_D] tile per column
    chunk (chunk 0's repeated past NCH): the persistent backward's one load per loop step."""
    u0 = _rows_tile(p, st, row64, js, S, offs0, ok0, EVICT)
    u1, u2, u3, u4 = u0, u0, u0, u0
    if NCH >= 2:
        u1 = _rows_tile(p, st, row64, js, S, offs1, ok1, EVICT)
    if NCH >= 3:
        u2 = _rows_tile(p, st, row64, js, S, offs2, ok2, EVICT)
    if NCH >= 4:
        u3 = _rows_tile(p, st, row64, js, S, offs3, ok3, EVICT)
    if NCH >= 5:
        u4 = _rows_tile(p, st, row64, js, S, offs4, ok4, EVICT)
    return u0, u1, u2, u3, u4


@triton.jit
def _to_f32(t1, t2, t3, t4, NCH: tl.constexpr):
    """Chunks 1 to NCH - 1 of a step's raw tiles in fp32 (the rest passed through unused)."""
    if NCH >= 2:
        t1 = t1.to(tl.float32)
    if NCH >= 3:
        t2 = t2.to(tl.float32)
    if NCH >= 4:
        t3 = t3.to(tl.float32)
    if NCH >= 5:
        t4 = t4.to(tl.float32)
    return t1, t2, t3, t4


@triton.jit
def _pick(c: tl.constexpr, a0, a1, a2, a3, a4):
    """a_c for a compile-time chunk index c (the chunks' values are separate names)."""
    v = a0
    if c == 1:
        v = a1
    if c == 2:
        v = a2
    if c == 3:
        v = a3
    if c == 4:
        v = a4
    return v


@triton.jit
def _key_add(kk, kq, x, q, tail, SLICE: tl.constexpr):
    kk1, kq1 = _key_terms(x, q, tail, SLICE)
    return kk + kk1, kq + kq1


@triton.jit
def _sum_chunks(a0, a1, a2, a3, a4, NCH: tl.constexpr):
    """a0 + a1 + ... over a row's NCH chunks, in chunk order (the terms past NCH are unused stand-ins)."""
    if NCH >= 2:
        a0 = a0 + a1
    if NCH >= 3:
        a0 = a0 + a2
    if NCH >= 4:
        a0 = a0 + a3
    if NCH >= 5:
        a0 = a0 + a4
    return a0


@triton.jit
def _key_sum(kk, kq, t1, t2, t3, t4, q1, q2, q3, q4, tail1, tail2, tail3, tail4, NCH: tl.constexpr,
             SLICE: tl.constexpr):
    """Chunk 0's key terms (kk, kq) plus those of chunks 1 to NCH - 1 (every chunk may hold key
    columns: KEY0 = 0), all chunks' terms first, then the sums (the order the kernels were timed in)."""
    kk1, kq1 = _key_terms(t1, q1, tail1, SLICE)
    kk2, kq2, kk3, kq3, kk4, kq4 = kk1, kq1, kk1, kq1, kk1, kq1  # past NCH: unused
    if NCH >= 3:
        kk2, kq2 = _key_terms(t2, q2, tail2, SLICE)
    if NCH >= 4:
        kk3, kq3 = _key_terms(t3, q3, tail3, SLICE)
    if NCH >= 5:
        kk4, kq4 = _key_terms(t4, q4, tail4, SLICE)
    return _sum_chunks(kk, kk1, kk2, kk3, kk4, NCH), _sum_chunks(kq, kq1, kq2, kq3, kq4, NCH)


@triton.jit
def _key_skip(t0, t1, t2, t3, t4, q1, q2, q3, q4, tail1, tail2, tail3, tail4, NCH: tl.constexpr,
              KEY0: tl.constexpr, SLICE: tl.constexpr):
    """The key terms of a row whose key starts in chunk KEY0 > 0: the chunks before it hold no key
    column, so no q.k terms, and |k|^2 terms only under "full".  The key chunks are added from the
    last one down (the order the three-chunk kernels were timed in).  NCH >= 2 here, so chunk 0's query
    and tail are never picked (q1 and tail1 stand in for them)."""
    kk, kq = _key_terms(_pick(NCH - 1, t0, t1, t2, t3, t4), _pick(NCH - 1, q1, q1, q2, q3, q4),
                        _pick(NCH - 1, tail1, tail1, tail2, tail3, tail4), SLICE)
    if NCH >= 5 and KEY0 <= 3:
        kk, kq = _key_add(kk, kq, t3, q3, tail3, SLICE)
    if NCH >= 4 and KEY0 <= 2:
        kk, kq = _key_add(kk, kq, t2, q2, tail2, SLICE)
    if NCH >= 3 and KEY0 <= 1:
        kk, kq = _key_add(kk, kq, t1, q1, tail1, SLICE)
    if not SLICE:
        kk = kk + t0 * t0
        if KEY0 >= 2:
            kk = kk + t1 * t1
        if KEY0 >= 3:
            kk = kk + t2 * t2
        if KEY0 >= 4:
            kk = kk + t3 * t3
    return kk, kq


@triton.jit
def _tile_grad(gp, rows64, row_ok, d, offs, col_ok, x, g, q, tail, w, c, coef, dq, SLICE: tl.constexpr,
               KEYLESS: tl.constexpr):
    """One column chunk of a token block's step: store the source's gradient [BLOCK_T, BLOCK_D], and
    add the chunk's share of the query gradient (none before the key)."""
    _store_tile(gp, rows64, row_ok, d, offs, col_ok, _bwd_grad(x, g, q, tail, w, c, coef, SLICE, KEYLESS))
    if not KEYLESS:
        dq += tl.sum(c[:, None] * x, axis=0)
    return dq


@triton.jit
def _rows_grad(gp, row64, d, offs, col_ok, js, S, x, g, q, tail, w, c, coef, dq, SLICE: tl.constexpr,
               KEYLESS: tl.constexpr):
    """_tile_grad for one token's rows of sources js [SB, BLOCK_D] (g one token's [BLOCK_D])."""
    _store_grad(gp, row64, d, offs, col_ok, js, S, _bwd_grad(x, g[None, :], q, tail, w, c, coef, SLICE, KEYLESS))
    if not KEYLESS:
        dq += tl.sum(c[:, None] * x, axis=0)
    return dq


@triton.jit
def _tiles_go(t0, t1, t2, t3, t4, g0, g1, g2, g3, g4, NCH: tl.constexpr):
    """One source's raw tiles of a token block in fp32, and the terms of g.o over the row's chunks
    (added up for one row sum)."""
    t0 = t0.to(tl.float32)
    go = g0 * t0
    t1, t2, t3, t4 = _to_f32(t1, t2, t3, t4, NCH)
    if NCH >= 2:
        go = go + g1 * t1
    if NCH >= 3:
        go = go + g2 * t2
    if NCH >= 4:
        go = go + g3 * t3
    if NCH >= 5:
        go = go + g4 * t4
    return t0, t1, t2, t3, t4, go


@triton.jit
def _tile_grads(gp, rows64, live, d, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
                t0, t1, t2, t3, t4, g0, g1, g2, g3, g4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4,
                w, c, coef, dq0, dq1, dq2, dq3, dq4, SLICE: tl.constexpr, KEY0: tl.constexpr, NCH: tl.constexpr):
    """_tile_grad over a row's NCH chunks (tokens where ``live``): one source's gradient stored, the
    query-gradient accumulators dq0..dq4 returned."""
    dq0 = _tile_grad(gp, rows64, live, d, offs0, ok0, t0, g0, q0, tail0, w, c, coef, dq0, SLICE, KEY0 > 0)
    if NCH >= 2:
        dq1 = _tile_grad(gp, rows64, live, d, offs1, ok1, t1, g1, q1, tail1, w, c, coef, dq1, SLICE, KEY0 > 1)
    if NCH >= 3:
        dq2 = _tile_grad(gp, rows64, live, d, offs2, ok2, t2, g2, q2, tail2, w, c, coef, dq2, SLICE, KEY0 > 2)
    if NCH >= 4:
        dq3 = _tile_grad(gp, rows64, live, d, offs3, ok3, t3, g3, q3, tail3, w, c, coef, dq3, SLICE, KEY0 > 3)
    if NCH >= 5:
        dq4 = _tile_grad(gp, rows64, live, d, offs4, ok4, t4, g4, q4, tail4, w, c, coef, dq4, SLICE, KEY0 > 4)
    return dq0, dq1, dq2, dq3, dq4


# ---------------------------------------------------------------------------------------------- kernel bodies
#
# A row's NCH column chunks (1 to 5) are separate names (offs0..offs4, t0..t4, acc0..acc4, ...): Triton
# has no arrays of tiles.  Names past NCH are chunk 0's and never used; the compile-time guards
# (NCH >= c + 1) leave no code for them.  Chunk c is "keyless" when KEY0 > c (see kernels.op._key_pos).


@triton.jit
def _bwd_chunks(d, r, BLOCK_D: tl.constexpr, NCH: tl.constexpr):
    """The backward's per-chunk constants: column offsets, in-row masks, key masks and zeroed
    query-gradient accumulators of chunks 0..4 (chunk 0's past NCH, unused).  No pointer goes in:
    Inductor's analysis of which arguments a kernel writes takes what a helper returns as derived from
    every pointer it was given, and these offsets address the stores."""
    offs0, ok0, tail0 = _cols(d, r, 0, BLOCK_D)
    dq0 = tl.zeros([BLOCK_D], tl.float32)
    offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4 = offs0, ok0, offs0, ok0, offs0, ok0, offs0, ok0
    tail1, tail2, tail3, tail4 = tail0, tail0, tail0, tail0
    dq1, dq2, dq3, dq4 = dq0, dq0, dq0, dq0
    if NCH >= 2:
        offs1, ok1, tail1 = _cols(d, r, BLOCK_D, BLOCK_D)
        dq1 = tl.zeros([BLOCK_D], tl.float32)
    if NCH >= 3:
        offs2, ok2, tail2 = _cols(d, r, 2 * BLOCK_D, BLOCK_D)
        dq2 = tl.zeros([BLOCK_D], tl.float32)
    if NCH >= 4:
        offs3, ok3, tail3 = _cols(d, r, 3 * BLOCK_D, BLOCK_D)
        dq3 = tl.zeros([BLOCK_D], tl.float32)
    if NCH >= 5:
        offs4, ok4, tail4 = _cols(d, r, 4 * BLOCK_D, BLOCK_D)
        dq4 = tl.zeros([BLOCK_D], tl.float32)
    return (offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, tail0, tail1, tail2, tail3, tail4,
            dq0, dq1, dq2, dq3, dq4)


@triton.jit
def _chunk_queries(q_ptr, d, r, offs0, offs1, offs2, offs3, offs4, tail0, tail1, tail2, tail3, tail4,
                   NCH: tl.constexpr):
    """The query's columns of chunks 0..4 (chunk 0's past NCH)."""
    q0 = _query(q_ptr, offs0, d, r, tail0)
    q1, q2, q3, q4 = q0, q0, q0, q0
    if NCH >= 2:
        q1 = _query(q_ptr, offs1, d, r, tail1)
    if NCH >= 3:
        q2 = _query(q_ptr, offs2, d, r, tail2)
    if NCH >= 4:
        q3 = _query(q_ptr, offs3, d, r, tail3)
    if NCH >= 5:
        q4 = _query(q_ptr, offs4, d, r, tail4)
    return q0, q1, q2, q3, q4


@triton.jit
def _dq_stores(dq0, dq1, dq2, dq3, dq4, dq_part_ptr, pid, r, d, offs0, offs1, offs2, offs3, offs4,
               tail0, tail1, tail2, tail3, tail4, NCH: tl.constexpr, KEY0: tl.constexpr):
    """This program's query-gradient partial row: the key columns of chunks KEY0.. (the chunks before
    KEY0 hold none)."""
    if KEY0 == 0:
        _dq_store(dq0, dq_part_ptr, pid, r, d, offs0, tail0)
    if NCH >= 2 and KEY0 <= 1:
        _dq_store(dq1, dq_part_ptr, pid, r, d, offs1, tail1)
    if NCH >= 3 and KEY0 <= 2:
        _dq_store(dq2, dq_part_ptr, pid, r, d, offs2, tail2)
    if NCH >= 4 and KEY0 <= 3:
        _dq_store(dq3, dq_part_ptr, pid, r, d, offs3, tail3)
    if NCH >= 5:
        _dq_store(dq4, dq_part_ptr, pid, r, d, offs4, tail4)


@triton.jit
def _fwd_key(t0, t1, t2, t3, t4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4, NCH: tl.constexpr,
             KEY0: tl.constexpr, SLICE: tl.constexpr):
    """One source's raw tiles in fp32 and its key terms (kk, kq) over the row's chunks: the forward's
    step for one source, before the row sums."""
    t0 = t0.to(tl.float32)
    if KEY0 == 0:
        kk, kq = _key_terms(t0, q0, tail0, SLICE)
    t1, t2, t3, t4 = _to_f32(t1, t2, t3, t4, NCH)
    if NCH >= 2:
        if KEY0 == 0:
            kk, kq = _key_sum(kk, kq, t1, t2, t3, t4, q1, q2, q3, q4, tail1, tail2, tail3, tail4, NCH, SLICE)
        else:
            kk, kq = _key_skip(t0, t1, t2, t3, t4, q1, q2, q3, q4, tail1, tail2, tail3, tail4, NCH, KEY0, SLICE)
    return t0, t1, t2, t3, t4, kk, kq


@triton.jit
def _fwd_body(
    q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, inv_n, eps,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    FUSED: tl.constexpr, LAZY: tl.constexpr, PAIR: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,  # sources (None for TABLE)
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,  # their row strides
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
    if PAIR:  # two sources (the host checks S = 2): both loaded at once, the exact two-way softmax
        a0, a1, a2, a3, a4, b0, b1, b2, b3, b4 = _src_pair(
            0, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, NCH, EVICT, TABLE,
            src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
            x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
        a0, a1, a2, a3, a4, kka, kqa = _fwd_key(a0, a1, a2, a3, a4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3,
                                                tail4, NCH, KEY0, SLICE)
        b0, b1, b2, b3, b4, kkb, kqb = _fwd_key(b0, b1, b2, b3, b4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3,
                                                tail4, NCH, KEY0, SLICE)
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
            tn0, tn1, tn2, tn3, tn4 = _src_tiles(0, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3,
                                                 ok3, offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides,
                                                 ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
                                                 x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10,
                                                 xs11, xs12, xs13, xs14, xs15)
        for i in tl.range(0, S, num_stages=STAGES):
            u0, u1, u2, u3, u4 = _src_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2,
                                            offs3, ok3, offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides,
                                            ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13,
                                            x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11,
                                            xs12, xs13, xs14, xs15)
            t0, t1, t2, t3, t4 = u0, u1, u2, u3, u4
            if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's) for the next
                t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4 = _ring(u0, u1, u2, u3, u4, tn0, tn1, tn2, tn3, tn4, NCH)
            t0, t1, t2, t3, t4, kk, kq = _fwd_key(t0, t1, t2, t3, t4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3,
                                                  tail4, NCH, KEY0, SLICE)
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


@triton.jit
def _bwd_body(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g, inv_n,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, SB: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,  # sources (None for TABLE)
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,  # their row strides
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,  # gradients
):
    """The backward's persistent program (the kernels' arguments are described at
    _attnres_bwd_kernel); PREFETCH 0 or 1."""
    tl.static_assert(PREFETCH <= 1, "the persistent backward prefetches at most one step")
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    sbs = tl.arange(0, SB)
    (offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, tail0, tail1, tail2, tail3, tail4,
     dq0, dq1, dq2, dq3, dq4) = _bwd_chunks(d, r, BLOCK_D, NCH)
    q0, q1, q2, q3, q4 = _chunk_queries(q_ptr, d, r, offs0, offs1, offs2, offs3, offs4, tail0, tail1, tail2, tail3,
                                        tail4, NCH)
    for row in range(pid, N, nprog):
        row64 = tl.cast(row, tl.int64)
        g0, gh = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs0, ok0, d, stride_g, HAS_RES, RES_STEP)
        gh1, gh2, gh3, gh4 = gh, gh, gh, gh  # past NCH: unused
        if NCH >= 2:
            g1, gh1 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs1, ok1, d, stride_g, HAS_RES, RES_STEP)
        if NCH >= 3:
            g2, gh2 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs2, ok2, d, stride_g, HAS_RES, RES_STEP)
        if NCH >= 4:
            g3, gh3 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs3, ok3, d, stride_g, HAS_RES, RES_STEP)
        if NCH >= 5:
            g4, gh4 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs4, ok4, d, stride_g, HAS_RES, RES_STEP)
        gh = tl.sum(_sum_chunks(gh, gh1, gh2, gh3, gh4, NCH), axis=0)
        lse = tl.load(st_ptr + row)
        if PREFETCH:
            p, st = _src(sbs, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                         x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                         xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            tn0, tn1, tn2, tn3, tn4 = _src_rows(p, st, row64, sbs, S, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                                offs4, ok4, NCH, EVICT)
        for b in tl.range(0, S, SB, num_stages=STAGES):
            js = b + sbs
            jl = js + PREFETCH * SB  # the sources this step loads: the next SB when prefetching
            p, st = _src(jl, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                         x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                         xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
            u0, u1, u2, u3, u4 = _src_rows(p, st, row64, jl, S, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                           offs4, ok4, NCH, EVICT)
            t0, t1, t2, t3, t4 = u0, u1, u2, u3, u4
            if PREFETCH:  # rotate only the chunks there are (the code timed for one chunk carried one tile)
                t0, tn0 = tn0, u0
                if NCH >= 2:
                    t1, tn1 = tn1, u1
                if NCH >= 3:
                    t2, tn2 = tn2, u2
                if NCH >= 4:
                    t3, tn3 = tn3, u3
                if NCH >= 5:
                    t4, tn4 = tn4, u4
            t0 = t0.to(tl.float32)
            go = g0[None, :] * t0
            t1, t2, t3, t4 = _to_f32(t1, t2, t3, t4, NCH)
            if NCH >= 2:
                go = go + g1[None, :] * t1
            if NCH >= 3:
                go = go + g2[None, :] * t2
            if NCH >= 4:
                go = go + g3[None, :] * t3
            if NCH >= 5:
                go = go + g4[None, :] * t4
            w, c, coef = _bwd_weights(tl.sum(go, axis=1), gh, lse, js, S, N, row, js < S, st_ptr, inv_n)
            gp = _grad_ptrs(js, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                            dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
            dq0 = _rows_grad(gp, row64, d, offs0, ok0, js, S, t0, g0, q0, tail0, w, c, coef, dq0, SLICE, KEY0 > 0)
            if NCH >= 2:
                dq1 = _rows_grad(gp, row64, d, offs1, ok1, js, S, t1, g1, q1, tail1, w, c, coef, dq1, SLICE, KEY0 > 1)
            if NCH >= 3:
                dq2 = _rows_grad(gp, row64, d, offs2, ok2, js, S, t2, g2, q2, tail2, w, c, coef, dq2, SLICE, KEY0 > 2)
            if NCH >= 4:
                dq3 = _rows_grad(gp, row64, d, offs3, ok3, js, S, t3, g3, q3, tail3, w, c, coef, dq3, SLICE, KEY0 > 3)
            if NCH >= 5:
                dq4 = _rows_grad(gp, row64, d, offs4, ok4, js, S, t4, g4, q4, tail4, w, c, coef, dq4, SLICE, KEY0 > 4)
    _dq_stores(dq0, dq1, dq2, dq3, dq4, dq_part_ptr, pid, r, d, offs0, offs1, offs2, offs3, offs4,
               tail0, tail1, tail2, tail3, tail4, NCH, KEY0)


@triton.jit
def _pair_step(
    i, a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n,
    offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
    g0, g1, g2, g3, g4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4, dq0, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, TABLE: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
    GH_PAIR: tl.constexpr,
):
    """One step of _bwd_tile_pairs on the raw tiles of sources i (a0..a4) and i + 1 (b0..b4): both row
    sums g.o in one two-operand reduction, both sources' gradients stored, the query-gradient
    accumulators returned.  GH_PAIR: g.h from this pair instead of ``gh``."""
    a0, a1, a2, a3, a4, goa = _tiles_go(a0, a1, a2, a3, a4, g0, g1, g2, g3, g4, NCH)
    b0, b1, b2, b3, b4, gob = _tiles_go(b0, b1, b2, b3, b4, g0, g1, g2, g3, g4, NCH)
    sa, sb = tl.reduce((goa, gob), 1, _add2)
    live_b = row_ok & ((rows * 0 + i + 1) < S)  # the pair's second source exists
    if GH_PAIR:  # every source is in this pair: g.h = sum_i w_i g.o_i (sb = 0 for a masked-out source)
        za = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
        zb = tl.load(st_ptr + tl.cast(2 + i, tl.int64) * N + rows, mask=live_b, other=0.0)
        gh = tl.exp(za - lse) * sa + tl.exp(zb - lse) * sb
    wa, ca, ka = _bwd_weights(sa, gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
    wb, cb, kb = _bwd_weights(sb, gh, lse, i + 1, S, N, rows, live_b, st_ptr, inv_n)
    gpa = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                     dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
    gpb = _grad_ptrs(i + 1, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                     dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
    dq0, dq1, dq2, dq3, dq4 = _tile_grads(gpa, rows64, row_ok, d, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                          offs4, ok4, a0, a1, a2, a3, a4, g0, g1, g2, g3, g4, q0, q1, q2, q3, q4,
                                          tail0, tail1, tail2, tail3, tail4, wa, ca, ka, dq0, dq1, dq2, dq3, dq4,
                                          SLICE, KEY0, NCH)
    dq0, dq1, dq2, dq3, dq4 = _tile_grads(gpb, rows64, live_b, d, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                          offs4, ok4, b0, b1, b2, b3, b4, g0, g1, g2, g3, g4, q0, q1, q2, q3, q4,
                                          tail0, tail1, tail2, tail3, tail4, wb, cb, kb, dq0, dq1, dq2, dq3, dq4,
                                          SLICE, KEY0, NCH)
    return dq0, dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_pairs(
    rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
    g0, g1, g2, g3, g4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4, dq0, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr, TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr,
    grad_offs, GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
    GH_PAIR: tl.constexpr = False,
):
    """The token-tile backward's source loop two sources at a time (PAIR): sources i and i + 1 loaded
    together (the next pair early with PREFETCH), their row sums g.o in one two-operand reduction;
    where S is odd the last pair's second source is masked out (zero tiles, no stores, no query
    gradient).  GH_PAIR (the resident pair: S <= 2, the host's guarantee): one step and no loop, g.h =
    w_a g.o_a + w_b g.o_b from the pair in hand, not ``gh`` (h and its residual were not read, and no
    source is read twice); without a loop here, a persistent loop over token blocks around it is
    innermost, which Triton's pipeliner needs.  Returns the query-gradient accumulators."""
    tl.static_assert(not (GH_PAIR and PREFETCH), "the resident pair has no next source to prefetch")
    if PREFETCH or GH_PAIR:  # sources 0 and 1: the first pair ahead of the loop, or the resident pair
        na0, na1, na2, na3, na4, nb0, nb1, nb2, nb3, nb4 = _src_pair(
            0, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, NCH, EVICT, TABLE,
            src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
            x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
    if GH_PAIR:
        return _pair_step(0, na0, na1, na2, na3, na4, nb0, nb1, nb2, nb3, nb4, rows, row_ok, rows64, N, S, d, gh, lse,
                          st_ptr, inv_n, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, g0, g1, g2, g3, g4,
                          q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4, dq0, dq1, dq2, dq3, dq4,
                          SLICE, NCH, KEY0, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                          dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15, True)
    for i in tl.range(0, S, 2, num_stages=STAGES):
        a0, a1, a2, a3, a4, b0, b1, b2, b3, b4 = _src_pair(
            i + 2 * PREFETCH, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, NCH,
            EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10,
            x11, x12, x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14,
            xs15)
        if PREFETCH:  # use the pair loaded a step ago; keep this step's for the next
            a0, a1, a2, a3, a4, na0, na1, na2, na3, na4 = na0, na1, na2, na3, na4, a0, a1, a2, a3, a4
            b0, b1, b2, b3, b4, nb0, nb1, nb2, nb3, nb4 = nb0, nb1, nb2, nb3, nb4, b0, b1, b2, b3, b4
        dq0, dq1, dq2, dq3, dq4 = _pair_step(
            i, a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n,
            offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, g0, g1, g2, g3, g4, q0, q1, q2, q3, q4,
            tail0, tail1, tail2, tail3, tail4, dq0, dq1, dq2, dq3, dq4, SLICE, NCH, KEY0, TABLE, grad0_ptr, grad_offs,
            GALIGN, NSLOT, dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15, False)
    return dq0, dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_deferred(
    rows, row_ok, rows64, N, S, d, lse, st_ptr, go_ptr, inv_n, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
    offs4, ok4, g0, g1, g2, g3, g4, q1, q2, q3, q4, tail1, tail2, tail3, tail4, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr, TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr,
    grad_offs, GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
):
    """The token-tile backward in two passes over the sources, with g.h from the sources instead of
    from h and its rounding residual ("slice" with the key past the first chunk, KEY0 >= 1).  The
    chunks before KEY0 need only w_i g, and w_i comes from the saved scores, so the first pass reads
    every source's whole row once: it writes those chunks' gradients, keeps g.o_i (scratch go_ptr
    [S, N] fp32) and adds up g.h = sum_i w_i g.o_i (fp32, as exact as the residual made it).  The
    second pass reads the key's chunks again (just read by this program, so from the L2 while few
    sources' key chunks per resident program fit; on the H200 they outgrew it by S = 25) and writes
    their gradients.  DRAM traffic: g, the sources and their gradients (2S + 1 units of N d 2 bytes,
    the formula's), against 2S + 2.5 with h and the residual; the forward writes no residual (S + 1
    against S + 1.5).  Returns the query-gradient accumulators of chunks 1 to 4."""
    tl.static_assert(KEY0 >= 1 and KEY0 < NCH, "the deferred backward needs key-free leading chunks")
    tl.static_assert(SLICE, "the deferred backward needs 'slice' (under 'full' every chunk is in the key)")
    gh = lse * 0.0
    if PREFETCH:
        tn0, tn1, tn2, tn3, tn4 = _src_tiles(0, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                             offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                                             x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                             xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13,
                                             xs14, xs15)
    for i in tl.range(0, S, num_stages=STAGES):  # pass 1: g.o_i, g.h, the key-free chunks' gradients
        t0, t1, t2, t3, t4 = _src_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2,
                                        offs3, ok3, offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides,
                                        ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13,
                                        x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11,
                                        xs12, xs13, xs14, xs15)
        if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's) for the next
            t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4 = _ring(t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4, NCH)
        t0, t1, t2, t3, t4, go = _tiles_go(t0, t1, t2, t3, t4, g0, g1, g2, g3, g4, NCH)
        go = tl.sum(go, axis=1)
        z = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
        w = tl.exp(z - lse)
        gh += w * go
        tl.store(go_ptr + tl.cast(i, tl.int64) * N + rows, go, mask=row_ok)
        gp = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                        dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
        _store_tile(gp, rows64, row_ok, d, offs0, ok0, w[:, None] * g0)
        if KEY0 >= 2:
            _store_tile(gp, rows64, row_ok, d, offs1, ok1, w[:, None] * g1)
        if KEY0 >= 3:
            _store_tile(gp, rows64, row_ok, d, offs2, ok2, w[:, None] * g2)
        if KEY0 >= 4:
            _store_tile(gp, rows64, row_ok, d, offs3, ok3, w[:, None] * g3)
    tl.debug_barrier()  # this program's g.o stores, visible to all its threads
    if PREFETCH:
        kn1, kn2, kn3, kn4 = _key_tiles(0, S, rows, rows64, row_ok, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, NCH,
                                        KEY0, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                                        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                        xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14,
                                        xs15)
    for i in tl.range(0, S, num_stages=STAGES):  # pass 2: the key's chunks
        k1, k2, k3, k4 = _key_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4,
                                    NCH, KEY0, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT,
                                    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)
        if PREFETCH:  # the key tiles loaded a step ago; keep this step's (the next source's) for the next
            k1, k2, k3, k4, kn1, kn2, kn3, kn4 = kn1, kn2, kn3, kn4, k1, k2, k3, k4
        go = tl.load(go_ptr + tl.cast(i, tl.int64) * N + rows, mask=row_ok, other=0.0)
        w, c, coef = _bwd_weights(go, gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
        gp = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                        dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
        if KEY0 <= 1:
            dq1 = _tile_grad(gp, rows64, row_ok, d, offs1, ok1, k1.to(tl.float32), g1, q1, tail1, w, c, coef, dq1,
                             SLICE, False)
        if NCH >= 3 and KEY0 <= 2:
            dq2 = _tile_grad(gp, rows64, row_ok, d, offs2, ok2, k2.to(tl.float32), g2, q2, tail2, w, c, coef, dq2,
                             SLICE, False)
        if NCH >= 4 and KEY0 <= 3:
            dq3 = _tile_grad(gp, rows64, row_ok, d, offs3, ok3, k3.to(tl.float32), g3, q3, tail3, w, c, coef, dq3,
                             SLICE, False)
        if NCH >= 5:
            dq4 = _tile_grad(gp, rows64, row_ok, d, offs4, ok4, k4.to(tl.float32), g4, q4, tail4, w, c, coef, dq4,
                             SLICE, False)
    return dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_block(
    blk, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n,
    offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4,
    dq0, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    PAIR: tl.constexpr, DEFER: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
):
    """Token block ``blk`` of the token-tile backward (_bwd_tile_body): its g (and g.h), the source
    loop, the query-gradient accumulators dq0..dq4 updated and returned."""
    rows, row_ok, rows64 = _token_rows(blk, N, BLOCK_T)
    g0, gh = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs0, ok0, d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    g1, g2, g3, g4 = g0, g0, g0, g0  # unused past NCH
    gh1, gh2, gh3, gh4 = gh, gh, gh, gh
    if NCH >= 2:
        g1, gh1 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs1, ok1, d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if NCH >= 3:
        g2, gh2 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs2, ok2, d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if NCH >= 4:
        g3, gh3 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs3, ok3, d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if NCH >= 5:
        g4, gh4 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs4, ok4, d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if not DEFER:
        gh = tl.sum(_sum_chunks(gh, gh1, gh2, gh3, gh4, NCH), axis=1)
    lse = tl.load(st_ptr + rows, mask=row_ok, other=0.0)
    if DEFER:  # g.h from the sources (h and the residual not read; _bwd_rows gave g in their place)
        gh = lse * 0.0
    if DEFER and not PAIR:
        dq1, dq2, dq3, dq4 = _bwd_tile_deferred(
            rows, row_ok, rows64, N, S, d, lse, st_ptr, go_ptr, inv_n, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
            offs4, ok4, g0, g1, g2, g3, g4, q1, q2, q3, q4, tail1, tail2, tail3, tail4, dq1, dq2, dq3, dq4,
            SLICE, NCH, KEY0, PREFETCH, EVICT, STAGES, TABLE, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr,
            grad_offs, GALIGN, NSLOT,
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
            dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
    elif PAIR:
        dq0, dq1, dq2, dq3, dq4 = _bwd_tile_pairs(
            rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
            offs4, ok4, g0, g1, g2, g3, g4, q0, q1, q2, q3, q4, tail0, tail1, tail2, tail3, tail4,
            dq0, dq1, dq2, dq3, dq4, SLICE, NCH, KEY0, PREFETCH, EVICT, STAGES, TABLE, src0_ptr, src_offs, src_strides,
            ALIGN, grad0_ptr, grad_offs, GALIGN, NSLOT,
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
            dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15, DEFER)
    else:
        if PREFETCH:
            tn0, tn1, tn2, tn3, tn4 = _src_tiles(0, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2, offs3,
                                                 ok3, offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides,
                                                 ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
                                                 x13, x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10,
                                                 xs11, xs12, xs13, xs14, xs15)
        for i in tl.range(0, S, num_stages=STAGES):
            u0, u1, u2, u3, u4 = _src_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs0, ok0, offs1, ok1, offs2, ok2,
                                            offs3, ok3, offs4, ok4, NCH, EVICT, TABLE, src0_ptr, src_offs, src_strides,
                                            ALIGN, NSLOT, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13,
                                            x14, x15, xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11,
                                            xs12, xs13, xs14, xs15)
            t0, t1, t2, t3, t4 = u0, u1, u2, u3, u4
            if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's) for the next
                t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4 = _ring(u0, u1, u2, u3, u4, tn0, tn1, tn2, tn3, tn4, NCH)
            t0, t1, t2, t3, t4, go = _tiles_go(t0, t1, t2, t3, t4, g0, g1, g2, g3, g4, NCH)
            w, c, coef = _bwd_weights(tl.sum(go, axis=1), gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
            gp = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT,
                            dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
            dq0, dq1, dq2, dq3, dq4 = _tile_grads(gp, rows64, row_ok, d, offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3,
                                                  offs4, ok4, t0, t1, t2, t3, t4, g0, g1, g2, g3, g4, q0, q1, q2, q3, q4,
                                                  tail0, tail1, tail2, tail3, tail4, w, c, coef, dq0, dq1, dq2, dq3, dq4,
                                                  SLICE, KEY0, NCH)
    return dq0, dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_body(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    PAIR: tl.constexpr, DEFER: tl.constexpr, PERSIST: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
):
    """The backward of BLOCK_T tokens, one program per block (no persistent loop): the forward's
    layout, walking the sources one at a time with the next one's tiles loaded early (PREFETCH) or
    Triton's pipeliner (STAGES).  Each program writes its own query-gradient partial row.  Why: the
    persistent backward waits on every source load (ncu on the H200, 8192 tokens, d = 1536, S = 9:
    12 of its 18 cycles per issued instruction stalled on global loads), while many resident
    programs of one token block each keep more loads in flight.  PAIR walks the sources two at a
    time: both sources' loads in flight together and both row sums in one reduction (fast-attnres's
    backward takes two sources per step: about 1% faster at d = 1536, S = 9 on the H200).  DEFER:
    two passes, g.h from the sources, h and the residual not read (_bwd_tile_deferred); DEFER with PAIR
    is the resident pair (S <= 2): one step holds every source, g.h from the pair, each source read
    once (g, the sources and their gradients: 2S + 1 units of N d 2 bytes).  PERSIST: the
    programs loop over the token blocks (the host launches a few per multiprocessor), so the partial
    rows are per program, not per block: at S = 2 with one token per block those [tokens, r] fp32
    partials were about a tenth of the backward's bytes."""
    tl.static_assert(PREFETCH <= 1, "the token-tile backward prefetches at most one step")
    pid = tl.program_id(0)
    (offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, tail0, tail1, tail2, tail3, tail4,
     dq0, dq1, dq2, dq3, dq4) = _bwd_chunks(d, r, BLOCK_D, NCH)
    q0, q1, q2, q3, q4 = _chunk_queries(q_ptr, d, r, offs0, offs1, offs2, offs3, offs4, tail0, tail1, tail2, tail3,
                                        tail4, NCH)
    if PERSIST:  # the resident pair's block loop is innermost: STAGES lets Triton pipeline its loads
        for blk in tl.range(pid, tl.cdiv(N, BLOCK_T), tl.num_programs(0),
                            num_stages=STAGES if (DEFER and PAIR) else None):
            dq0, dq1, dq2, dq3, dq4 = _bwd_tile_block(
                blk, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n,
                offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, q0, q1, q2, q3, q4,
                tail0, tail1, tail2, tail3, tail4, dq0, dq1, dq2, dq3, dq4,
                SLICE, HAS_RES, RES_STEP, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER,
                TABLE, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr, grad_offs, GALIGN, NSLOT,
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
                dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
            if DEFER and not PAIR:  # (each block has its own scratch columns, so this orders no memory; it keeps a
                tl.debug_barrier()  # program's threads in step between blocks, as timed on the H200)
    else:
        dq0, dq1, dq2, dq3, dq4 = _bwd_tile_block(
            pid, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n,
            offs0, ok0, offs1, ok1, offs2, ok2, offs3, ok3, offs4, ok4, q0, q1, q2, q3, q4,
            tail0, tail1, tail2, tail3, tail4, dq0, dq1, dq2, dq3, dq4,
            SLICE, HAS_RES, RES_STEP, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER,
            TABLE, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr, grad_offs, GALIGN, NSLOT,
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
            dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
    _dq_stores(dq0, dq1, dq2, dq3, dq4, dq_part_ptr, pid, r, d, offs0, offs1, offs2, offs3, offs4,
               tail0, tail1, tail2, tail3, tail4, NCH, KEY0)


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
    N,
    S,
    d,
    r,
    inv_n,  # 1/r for "slice", 1/d for "full"
    eps,
    SLICE: tl.constexpr,
    HAS_RES: tl.constexpr,
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
              KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, FUSED, LAZY, PAIR, True, src0_ptr, src_offs, src_strides, ALIGN, 0,
              None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None,  # no x_i
              None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None)  # no xs_i


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
    go_ptr,  # fp32 [S, N] scratch of the deferred backward (None unless DEFER)
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
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    SB: tl.constexpr,  # sources per step (persistent grid)
    BLOCK_T: tl.constexpr,  # tokens per program (0: the persistent grid)
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    PAIR: tl.constexpr,  # token-tile grid: two sources per step
    DEFER: tl.constexpr,  # token-tile grid: g.h from the sources, no h (two passes; with PAIR one, S <= 2)
    PERSIST: tl.constexpr,  # token-tile grid: programs loop over the token blocks (0: one block each)
):
    if BLOCK_T > 0:
        _bwd_tile_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n, SLICE,
                       HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER, PERSIST, True,
                       src0_ptr,
                       src_offs,
                       src_strides, ALIGN, grad0_ptr, grad_offs, GALIGN, 0,
                       None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None,
                       None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None,
                       None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None)
    else:
        tl.static_assert(not PAIR, "PAIR (two sources per step) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not DEFER, "DEFER (two passes) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not PERSIST, "PERSIST (looping token blocks) is of the token-tile grid: BLOCK_T > 0")
        _bwd_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g, inv_n, SLICE, HAS_RES,
                  RES_STEP, BLOCK_D, NCH, KEY0, SB, PREFETCH, EVICT, STAGES, True, src0_ptr, src_offs, src_strides, ALIGN,
                  grad0_ptr, grad_offs, GALIGN, 0,
                  None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None,  # x_i
                  None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None,  # xs_i
                  None, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None)  # dx_i


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
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    BLOCK_T: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    FUSED: tl.constexpr,
    LAZY: tl.constexpr,
    PAIR: tl.constexpr,  # S = 2 only (see _attnres_fwd_kernel)
):
    _fwd_body(q_ptr, out_ptr, res_ptr, st_ptr, N, S, d, r, _inv_key_width(r, d, SLICE), EPS, SLICE, HAS_RES,
              RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, FUSED, LAZY, PAIR, False, None, None, None, 1, NSLOT,
              x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
              xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)


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
    go_ptr,  # fp32 [S, N] scratch of the deferred backward (None unless DEFER)
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
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    SB: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program (0: the persistent grid)
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    PAIR: tl.constexpr,  # token-tile grid: two sources per step
    DEFER: tl.constexpr,  # token-tile grid: g.h from the sources, no h (two passes; with PAIR one, S <= 2)
    PERSIST: tl.constexpr,  # token-tile grid: programs loop over the token blocks (0: one block each)
):
    if BLOCK_T > 0:
        _bwd_tile_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g,
                       _inv_key_width(r, d, SLICE), SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT,
                       STAGES, PAIR, DEFER, PERSIST, False, None, None, None, 1, None, None, 1, NSLOT,
                       x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                       xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
                       dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)
    else:
        tl.static_assert(not PAIR, "PAIR (two sources per step) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not DEFER, "DEFER (two passes) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not PERSIST, "PERSIST (looping token blocks) is of the token-tile grid: BLOCK_T > 0")
        _bwd_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g,
                  _inv_key_width(r, d, SLICE), SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, SB, PREFETCH, EVICT, STAGES,
                  False, None, None, None, 1, None, None, 1, NSLOT,
                  x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                  xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
                  dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)


# ---------------------------------------------------------------------------------------------- partial sums


@triton.jit
def _slab_sum(x_ptr, s, P, r, rows_per, cols, col_ok, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
              CG: tl.constexpr = False):
    """The sum of rows [s * rows_per, (s + 1) * rows_per) of x [P, r] fp32 (rows past P left out) at
    columns ``cols``, in BLOCK_P-row steps then one reduction: the fixed order both partial sums share.
    CG: load past the L1 (rows other programs of the same launch wrote)."""
    start = s * rows_per
    end = tl.minimum(start + rows_per, P)
    acc = tl.zeros([BLOCK_P, BLOCK_R], tl.float32)
    for p0 in range(start, end, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        ok = (rows < end)[:, None] & col_ok[None, :]
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * r + cols[None, :]
        if CG:
            acc += tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(ptrs, mask=ok, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _sum_rows_kernel(x_ptr, y_ptr, P, r, rows_per, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[s, c] = sum of x[s * rows_per : (s + 1) * rows_per, c] (rows past P left out): program (s, b)
    sums one slab of rows for BLOCK_R columns, in a fixed order, and stores in y's element type.  The
    query gradient's partial rows [programs, r] fp32 go through it twice (kernels.op._sum_partials):
    slabs into an fp32 [splits, r], then the splits into the query dtype.  Why: torch's sum over the
    rows of a [1056, 384] matrix ran on 51 blocks (10.8 us under ncu, seventh session), a tenth of the
    backward at S = 2; two launches over a few hundred programs keep the sum deterministic."""
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < r
    tl.store(y_ptr + s.to(tl.int64) * r + cols, _slab_sum(x_ptr, s, P, r, rows_per, cols, col_ok, BLOCK_P, BLOCK_R),
             mask=col_ok)


@triton.jit
def _sum_rows_once_kernel(x_ptr, slab_ptr, y_ptr, count_ptr, P, r, rows_per, splits,
                          BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """The same sum as _sum_rows_kernel's two launches, in one: program (s, b) sums its slab of rows
    for BLOCK_R columns into slab[s] (fp32), then counts itself in at count[b]; the program that
    arrives last for column block b sums the ``splits`` slabs in a fixed order into y (y's element
    type) and sets count[b] back to 0 for the next sum.  Deterministic (fixed orders; the atomic
    decides only who adds, not the order).  Why: the second launch costs a kernel boundary (about
    1-2 us at S = 2, where the whole backward is 40-60 us); the count must be 0 on entry
    (kernels.op._sum_counts keeps a zeroed ring of them)."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    cols = b * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < r
    slab = _slab_sum(x_ptr, s, P, r, rows_per, cols, col_ok, BLOCK_P, BLOCK_R)
    tl.store(slab_ptr + s.to(tl.int64) * r + cols, slab, mask=col_ok)
    tl.debug_barrier()  # every thread's slab store before the count (the release below is one thread's)
    arrived = tl.atomic_add(count_ptr + b, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        total = _slab_sum(slab_ptr, 0, splits, r, splits, cols, col_ok, BLOCK_S, BLOCK_R, True)
        tl.store(y_ptr + cols, total.to(y_ptr.dtype.element_ty), mask=col_ok)
        tl.atomic_xchg(count_ptr + b, 0, sem="relaxed", scope="gpu")
