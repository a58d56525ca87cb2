"""Shared @triton.jit pieces of the fused kernels (fused_fwd.py, fused_bwd.py, pair.py).

Column layout: every source is a [N, d] matrix with unit column stride and its own row stride, read
at the full row width as NCH column chunks of BLOCK_D columns (a power of two, masked past d), NCH
from 1 to 5, whichever pads least (d = 1536 as 3 x 512, 2560 as 5 x 512: no masked columns; see
kernels.configs.col_layout).  All chunks share one register layout, so their elementwise terms add
up before a single row sum.  Triton has no arrays of tiles: a row's five chunks are five values, the
constant ones (column offsets, masks, the query's columns, g) passed between helpers as tuples (offs,
ok, tail, q, g), the ones a loop carries (tiles t0..t4, accumulators acc0..acc4, dq0..dq4) as separate
names.  Values past NCH are chunk 0's and never used; the compile-time guards (NCH >= c + 1) leave
no code for them.  Chunk c is "keyless" when KEY0 > c: the key (the last r
columns) starts in chunk KEY0, so the chunks before it need no key terms (kernels.configs.key_pos).

Source addressing: sources are never stacked.  Two kernel families share one body per pass and
differ only in how the sources are addressed, a compile-time choice (TABLE):

- table kernels (eager calls, any S): a table of element offsets relative to an anchor tensor (the
  first source) plus a table of row strides; addressing off a typed anchor pointer (rather than
  casting integers to pointers) keeps Triton's alignment analysis, and the ALIGN hint (host-checked)
  lets every row load be a 16-byte vector;
- per-argument kernels (torch.compile, S <= 16): one pointer argument per source (x_i, row strides
  xs_i, gradients dx_i; None past NSLOT), picked by a chain of selects, so that Inductor can launch
  them from its own generated code (no data pointers, no tables; kernels.op wraps them in a
  torch.library.triton_op).

Rounding residual: for bf16/fp16 outputs the forward stores, per element, the next 8 mantissa bits
that rounding the fp32 mix dropped (_res_code), and the backward rebuilds h to about 2^-16 relative
(_res_h): g.h needs fp32 accuracy because dz_i = w_i (g.o_i - g.h) cancels.
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
# The two kernel families share their bodies (fused_fwd._fwd_body, fused_bwd._bwd_body and
# _bwd_tile_body) and differ only in how the sources are addressed: the table kernels pass an anchor
# pointer, an offset table and a stride table (TABLE); the per-argument kernels pass one pointer and
# one row stride per source (x_i, xs_i, None past NSLOT) and the gradients' pointers (dx_i).  Which
# one is a compile-time choice, so each kernel compiles to the code of a body written for its family
# alone (benchmarks/offline_sass.py --against compares the machine code of two revisions).


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
def _select(i, NSLOT: tl.constexpr, args):
    """args[i] for i < NSLOT (a chain of selects; args[0] where i is out of range); i may be a tensor,
    ``args`` a tuple of MAX_ARG_SOURCES kernel arguments."""
    v = args[0]
    for k in tl.static_range(1, MAX_ARG_SOURCES):
        if NSLOT > k:
            v = tl.where(i == k, args[k], v)
    return v


@triton.jit
def _arg_src(js, S, NSLOT: tl.constexpr, x_ptrs, x_strides):
    """Pointers and row strides of sources js, one index or [SB] (the last source's where js >= S)."""
    jj = tl.minimum(js, S - 1)
    ptr = _select(jj, NSLOT, x_ptrs)
    stride = _select(jj, NSLOT, x_strides)
    return ptr + jj * 0, stride + jj * 0  # [SB] even when one slot leaves the selects scalar


@triton.jit
def _src(js, S, TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr,
         x_ptrs, x_strides):
    """Pointers and row strides of sources js, one index or [SB] (the last source's where js >= S):
    from the offset table (TABLE) or from the per-source arguments."""
    if TABLE:
        p, st = _table_src(src0_ptr, src_offs, src_strides, js, S, ALIGN)
    else:
        p, st = _arg_src(js, S, NSLOT, x_ptrs, x_strides)
    return p, st


@triton.jit
def _grad_ptrs(js, S, TABLE: tl.constexpr, grad0_ptr, grad_offs, GALIGN: tl.constexpr, NSLOT: tl.constexpr, dx_ptrs):
    """Pointers [SB] of the gradients of sources js (the last source's where js >= S)."""
    jj = tl.minimum(js, S - 1)
    if TABLE:
        gp = grad0_ptr + tl.multiple_of(tl.load(grad_offs + jj), GALIGN)
    else:
        gp = _select(jj, NSLOT, dx_ptrs)
        gp = gp + js * 0  # [SB] even with one slot
    return gp


@triton.jit
def _src_tiles(j, S, rows, rows64, row_ok, offs, ok,
               NCH: tl.constexpr, EVICT: tl.constexpr,
               TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs,
               x_strides):
    """Source j's raw tiles [BLOCK_T, BLOCK_D] of tokens ``rows``, one per column chunk (chunk 0's
    repeated past NCH; zeros when j >= S): the token-block bodies' one load per loop step."""
    p, st = _src(j, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
    u0 = _tile(p, st, j, S, rows, rows64, row_ok, offs[0], ok[0], EVICT)
    u1, u2, u3, u4 = u0, u0, u0, u0
    if NCH >= 2:
        u1 = _tile(p, st, j, S, rows, rows64, row_ok, offs[1], ok[1], EVICT)
    if NCH >= 3:
        u2 = _tile(p, st, j, S, rows, rows64, row_ok, offs[2], ok[2], EVICT)
    if NCH >= 4:
        u3 = _tile(p, st, j, S, rows, rows64, row_ok, offs[3], ok[3], EVICT)
    if NCH >= 5:
        u4 = _tile(p, st, j, S, rows, rows64, row_ok, offs[4], ok[4], EVICT)
    return u0, u1, u2, u3, u4


@triton.jit
def _ring(u0, u1, u2, u3, u4, tn0, tn1, tn2, tn3, tn4, NCH: tl.constexpr):
    """PREFETCH's one-step ring: a step uses the tiles loaded a step ago (tn) and keeps those it just
    loaded (u, the next source's) for the next step.  Returns this step's tiles and the kept ones
    (three are swapped even for fewer chunks: the measured code)."""
    t0, t1, t2, tn0, tn1, tn2 = tn0, tn1, tn2, u0, u1, u2
    t3, t4 = u3, u4
    if NCH >= 4:
        t3, tn3 = tn3, u3
    if NCH >= 5:
        t4, tn4 = tn4, u4
    return t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4


@triton.jit
def _src_rows(p, st, row64, js, S, offs, ok,
              NCH: tl.constexpr, EVICT: tl.constexpr):
    """Row ``row64`` of sources js [SB] (pointers p, row strides st), one [SB, BLOCK_D] tile per column
    chunk (chunk 0's repeated past NCH): the persistent backward's one load per loop step."""
    u0 = _rows_tile(p, st, row64, js, S, offs[0], ok[0], EVICT)
    u1, u2, u3, u4 = u0, u0, u0, u0
    if NCH >= 2:
        u1 = _rows_tile(p, st, row64, js, S, offs[1], ok[1], EVICT)
    if NCH >= 3:
        u2 = _rows_tile(p, st, row64, js, S, offs[2], ok[2], EVICT)
    if NCH >= 4:
        u3 = _rows_tile(p, st, row64, js, S, offs[3], ok[3], EVICT)
    if NCH >= 5:
        u4 = _rows_tile(p, st, row64, js, S, offs[4], ok[4], EVICT)
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
def _key_sum(kk, kq, t1, t2, t3, t4, q, tail, NCH: tl.constexpr,
             SLICE: tl.constexpr):
    """Chunk 0's key terms (kk, kq) plus those of chunks 1 to NCH - 1 (every chunk may hold key
    columns: KEY0 = 0), all chunks' terms first, then the sums (the measured kernels' order, which sets
    the rounding)."""
    kk1, kq1 = _key_terms(t1, q[1], tail[1], SLICE)
    kk2, kq2, kk3, kq3, kk4, kq4 = kk1, kq1, kk1, kq1, kk1, kq1  # past NCH: unused
    if NCH >= 3:
        kk2, kq2 = _key_terms(t2, q[2], tail[2], SLICE)
    if NCH >= 4:
        kk3, kq3 = _key_terms(t3, q[3], tail[3], SLICE)
    if NCH >= 5:
        kk4, kq4 = _key_terms(t4, q[4], tail[4], SLICE)
    return _sum_chunks(kk, kk1, kk2, kk3, kk4, NCH), _sum_chunks(kq, kq1, kq2, kq3, kq4, NCH)


@triton.jit
def _key_skip(t0, t1, t2, t3, t4, q, tail, NCH: tl.constexpr,
              KEY0: tl.constexpr, SLICE: tl.constexpr):
    """The key terms of a row whose key starts in chunk KEY0 > 0: the chunks before it hold no key
    column, so no q.k terms, and |k|^2 terms only under "full".  The key chunks are added from the
    last one down (the measured kernels' order, which sets the rounding).  NCH >= 2 here."""
    kk, kq = _key_terms(_pick(NCH - 1, t0, t1, t2, t3, t4), q[NCH - 1], tail[NCH - 1], SLICE)
    if NCH >= 5 and KEY0 <= 3:
        kk, kq = _key_add(kk, kq, t3, q[3], tail[3], SLICE)
    if NCH >= 4 and KEY0 <= 2:
        kk, kq = _key_add(kk, kq, t2, q[2], tail[2], SLICE)
    if NCH >= 3 and KEY0 <= 1:
        kk, kq = _key_add(kk, kq, t1, q[1], tail[1], SLICE)
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
def _tiles_go(t0, t1, t2, t3, t4, g, NCH: tl.constexpr):
    """One source's raw tiles of a token block in fp32, and the terms of g.o over the row's chunks
    (added up for one row sum)."""
    t0 = t0.to(tl.float32)
    go = g[0] * t0
    t1, t2, t3, t4 = _to_f32(t1, t2, t3, t4, NCH)
    if NCH >= 2:
        go = go + g[1] * t1
    if NCH >= 3:
        go = go + g[2] * t2
    if NCH >= 4:
        go = go + g[3] * t3
    if NCH >= 5:
        go = go + g[4] * t4
    return t0, t1, t2, t3, t4, go


@triton.jit
def _tile_grads(gp, rows64, live, d, offs, ok,
                t0, t1, t2, t3, t4, g, q, tail,
                w, c, coef, dq0, dq1, dq2, dq3, dq4, SLICE: tl.constexpr, KEY0: tl.constexpr, NCH: tl.constexpr):
    """_tile_grad over a row's NCH chunks (tokens where ``live``): one source's gradient stored, the
    query-gradient accumulators dq0..dq4 returned."""
    dq0 = _tile_grad(gp, rows64, live, d, offs[0], ok[0], t0, g[0], q[0], tail[0], w, c, coef, dq0, SLICE, KEY0 > 0)
    if NCH >= 2:
        dq1 = _tile_grad(gp, rows64, live, d, offs[1], ok[1], t1, g[1], q[1], tail[1], w, c, coef, dq1, SLICE, KEY0 > 1)
    if NCH >= 3:
        dq2 = _tile_grad(gp, rows64, live, d, offs[2], ok[2], t2, g[2], q[2], tail[2], w, c, coef, dq2, SLICE, KEY0 > 2)
    if NCH >= 4:
        dq3 = _tile_grad(gp, rows64, live, d, offs[3], ok[3], t3, g[3], q[3], tail[3], w, c, coef, dq3, SLICE, KEY0 > 3)
    if NCH >= 5:
        dq4 = _tile_grad(gp, rows64, live, d, offs[4], ok[4], t4, g[4], q[4], tail[4], w, c, coef, dq4, SLICE, KEY0 > 4)
    return dq0, dq1, dq2, dq3, dq4


# ---------------------------------------------------------------------------------------------- per-chunk constants
#
# A row's NCH column chunks (1 to 5): constants as tuples, loop-carried values as separate names (see
# the module docstring).  Chunk c is "keyless" when KEY0 > c (see kernels.configs.key_pos).


@triton.jit
def _bwd_chunks(d, r, BLOCK_D: tl.constexpr, NCH: tl.constexpr):
    """The backward's per-chunk constants: the tuples (offs, ok, tail) of column offsets, in-row masks
    and key masks of chunks 0..4, and zeroed query-gradient accumulators dq0..dq4 (chunk 0's past NCH,
    unused).  No pointer goes in: Inductor's analysis of which arguments a kernel writes takes what a
    helper returns as derived from every pointer it was given, and these offsets address the stores."""
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
    offs = (offs0, offs1, offs2, offs3, offs4)
    ok = (ok0, ok1, ok2, ok3, ok4)
    tail = (tail0, tail1, tail2, tail3, tail4)
    return offs, ok, tail, dq0, dq1, dq2, dq3, dq4


@triton.jit
def _chunk_queries(q_ptr, d, r, offs, tail, NCH: tl.constexpr):
    """The query's columns of chunks 0..4 as a tuple (chunk 0's past NCH)."""
    q0 = _query(q_ptr, offs[0], d, r, tail[0])
    q1, q2, q3, q4 = q0, q0, q0, q0
    if NCH >= 2:
        q1 = _query(q_ptr, offs[1], d, r, tail[1])
    if NCH >= 3:
        q2 = _query(q_ptr, offs[2], d, r, tail[2])
    if NCH >= 4:
        q3 = _query(q_ptr, offs[3], d, r, tail[3])
    if NCH >= 5:
        q4 = _query(q_ptr, offs[4], d, r, tail[4])
    return (q0, q1, q2, q3, q4)


@triton.jit
def _dq_stores(dq0, dq1, dq2, dq3, dq4, dq_part_ptr, pid, r, d, offs,
               tail, NCH: tl.constexpr, KEY0: tl.constexpr):
    """This program's query-gradient partial row: the key columns of chunks KEY0.. (the chunks before
    KEY0 hold none)."""
    if KEY0 == 0:
        _dq_store(dq0, dq_part_ptr, pid, r, d, offs[0], tail[0])
    if NCH >= 2 and KEY0 <= 1:
        _dq_store(dq1, dq_part_ptr, pid, r, d, offs[1], tail[1])
    if NCH >= 3 and KEY0 <= 2:
        _dq_store(dq2, dq_part_ptr, pid, r, d, offs[2], tail[2])
    if NCH >= 4 and KEY0 <= 3:
        _dq_store(dq3, dq_part_ptr, pid, r, d, offs[3], tail[3])
    if NCH >= 5:
        _dq_store(dq4, dq_part_ptr, pid, r, d, offs[4], tail[4])


@triton.jit
def _fwd_key(t0, t1, t2, t3, t4, q, tail, NCH: tl.constexpr,
             KEY0: tl.constexpr, SLICE: tl.constexpr):
    """One source's raw tiles in fp32 and its key terms (kk, kq) over the row's chunks: the forward's
    step for one source, before the row sums."""
    t0 = t0.to(tl.float32)
    if KEY0 == 0:
        kk, kq = _key_terms(t0, q[0], tail[0], SLICE)
    t1, t2, t3, t4 = _to_f32(t1, t2, t3, t4, NCH)
    if NCH >= 2:
        if KEY0 == 0:
            kk, kq = _key_sum(kk, kq, t1, t2, t3, t4, q, tail, NCH, SLICE)
        else:
            kk, kq = _key_skip(t0, t1, t2, t3, t4, q, tail, NCH, KEY0, SLICE)
    return t0, t1, t2, t3, t4, kk, kq
