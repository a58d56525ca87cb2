"""The @triton.jit pieces the forward and backward bodies share.

Column chunks.  A source is a [N, d] matrix with unit column stride and its own row stride, read at
the full row width as NCH chunks of BLOCK_D columns (kernels.configs.col_layout).  Every per-chunk
value is a tuple with one entry per chunk, built and walked with ``tl.static_range(NCH)``: column
offsets, masks, the query, g, the source tiles, the accumulators.  All chunks share one register
layout, so their elementwise terms add up before one row sum.  The key (the last r columns) starts
in chunk KEY0 (kernels.configs.key_pos; 0 where the kernel is built without the key-chunk
specialisation): the chunks before it need no key terms, and their source gradient is w g.

Source addressing.  Sources are never stacked.  A kernel reads them through one bundle ``src`` and
its compile-time ALIGN, and writes their gradients through ``dst`` and GALIGN:

- table kernels (eager calls, any S): ``src = (anchor, offsets, row strides)``: a typed pointer to
  the first source and int64 tables of each source's element offset from it and row stride;
  ``dst = (anchor, offsets)``.  ALIGN >= 1 is the alignment the host checked (offsets and strides
  multiples of ALIGN elements), so that every row load is a 16-byte vector where it is 8.
- per-argument kernels (torch.compile, S <= 16): ``src = (pointers, row strides)`` and ``dst =
  pointers``, tuples of one kernel argument per source, picked by a chain of selects; ALIGN = 0.
  Inductor launches these from its own code, which has no data pointers to build a table from.

The rounding residual.  For bf16/fp16 outputs the forward stores, per element, the 8 bits below the
rounded h (_res_code) and the backward rebuilds h to about 2^-16 relative (_res_h): g.h needs fp32
accuracy because dz_i = w_i (g.o_i - g.h) cancels.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_ARG_SOURCES = tl.constexpr(16)


# ---------------------------------------------------------------------------------------------- residual


@triton.jit
def _res_base(hb32):
    """2^exponent of each (rounded) value, and whether it is a finite normal number."""
    ebits = hb32.to(tl.int32, bitcast=True) & 0x7F800000
    ok = (ebits > 0) & (ebits < 0x7F800000)
    return ebits.to(tl.float32, bitcast=True), ok


@triton.jit
def _res_code(h, hb, RES_STEP: tl.constexpr):
    """int8 residual of rounding the fp32 mix h to hb.  RES_STEP 0 (bf16, the top half of an fp32):
    h's bit pattern minus hb's, over 2^8, rounded: exact across binades, zeros and subnormals.
    Otherwise (fp16): round((h - hb) / (2^e(hb) RES_STEP)), 0 where hb is not a finite normal."""
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
    """h (fp32) rebuilt from its rounded value hh (fp32) and its residual code (_res_code)."""
    if RES_STEP == 0:
        return (hh.to(tl.int32, bitcast=True) + (code.to(tl.int32) << 8)).to(tl.float32, bitcast=True)
    base, ok = _res_base(hh)
    return tl.where(ok, hh + code.to(tl.float32) * (base * RES_STEP), hh)


# ---------------------------------------------------------------------------------------------- chunks


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _cols(d, r, base, BLOCK_D: tl.constexpr):
    """Column offsets of the chunk starting at ``base``, which are in the row (< d), which are the
    key's (the last r).  No pointer goes in: Inductor takes what a helper returns as derived from
    every pointer it was given, and these offsets address the stores."""
    offs = base + tl.arange(0, BLOCK_D)
    col_ok = offs < d
    return offs, col_ok, (offs >= d - r) & col_ok


@triton.jit
def _query(q_ptr, offs, d, r, tail):
    """The query laid over a chunk's key columns (fp32, zero elsewhere).  Kept apart from _cols: an
    offset returned by a call that also read the query would mark the query as written."""
    return tl.load(q_ptr + (offs - (d - r)), mask=tail, other=0.0).to(tl.float32)


@triton.jit
def _chunks(d, r, BLOCK_D: tl.constexpr, NCH: tl.constexpr):
    """Per chunk (tuples): column offsets, in-row masks, key masks."""
    offs = ()
    ok = ()
    tail = ()
    for c in tl.static_range(NCH):
        o, k, t = _cols(d, r, c * BLOCK_D, BLOCK_D)
        offs = offs + (o,)
        ok = ok + (k,)
        tail = tail + (t,)
    return offs, ok, tail


@triton.jit
def _queries(q_ptr, d, r, offs, tail):
    """The query's columns of each chunk (a separate call from _chunks: see _query)."""
    q = ()
    for c in tl.static_range(len(offs)):
        q = q + (_query(q_ptr, offs[c], d, r, tail[c]),)
    return q


@triton.jit
def _zeros(shape, NCH: tl.constexpr):
    out = ()
    for c in tl.static_range(NCH):
        out = out + (tl.zeros(shape, tl.float32),)
    return out


@triton.jit
def _token_rows(blk, N, BLOCK_T: tl.constexpr):
    """Token block ``blk``: its rows, which are real, and the rows as int64."""
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    return rows, row_ok, rows.to(tl.int64)


@triton.jit
def _inv_key_width(r, d, SLICE: tl.constexpr):
    """1/n for the key's RMS: n = r ("slice") or d ("full")."""
    if SLICE:
        inv_n = 1.0 / (r * 1.0)
    else:
        inv_n = 1.0 / (d * 1.0)
    return inv_n


# ---------------------------------------------------------------------------------------------- addressing


@triton.jit
def _select(i, args):
    """args[i] by a chain of selects (args[0] where i is out of range); i an index or a tensor."""
    v = args[0]
    for k in tl.static_range(1, len(args)):
        v = tl.where(i == k, args[k], v)
    return v


@triton.jit
def _src(src, js, S, ALIGN: tl.constexpr):
    """Pointers and row strides of sources js (an index or [SB]; the last source's where js >= S)."""
    jj = tl.minimum(js, S - 1)
    if ALIGN == 0:
        p = _select(jj, src[0]) + jj * 0  # [SB] even with one slot
        st = _select(jj, src[1]) + jj * 0
    else:
        off = tl.multiple_of(tl.load(src[1] + jj), ALIGN)
        st = tl.multiple_of(tl.load(src[2] + jj), ALIGN)
        p = src[0] + off
    return p, st


@triton.jit
def _dst(dst, js, S, GALIGN: tl.constexpr):
    """Pointers of the gradients of sources js (the last source's where js >= S)."""
    jj = tl.minimum(js, S - 1)
    if GALIGN == 0:
        gp = _select(jj, dst) + js * 0
    else:
        gp = dst[0] + tl.multiple_of(tl.load(dst[1] + jj), GALIGN)
    return gp


@triton.jit
def _load(addr, mask, EVICT: tl.constexpr):
    if EVICT:  # each source row is read once: let it leave the L2 first
        x = tl.load(addr, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(addr, mask=mask, other=0.0)
    return x


@triton.jit
def _tiles(src, ALIGN: tl.constexpr, j, S, rows, rows64, row_ok, offs, ok, EVICT: tl.constexpr, FIRST: tl.constexpr = 0):
    """Source j's raw tiles [BLOCK_T, BLOCK_D] of tokens ``rows``, chunks FIRST to NCH - 1 (zeros
    where j >= S): one step of the token-tile loops.  From FIRST > 0 (the two-pass form's second
    pass) the last chunk is loaded first, the order its kernels were measured in."""
    p, st = _src(src, j, S, ALIGN)
    live = row_ok & ((rows * 0 + j) < S)
    NCH: tl.constexpr = len(offs)
    if FIRST > 0:
        last = _load(p + rows64[:, None] * st + offs[NCH - 1][None, :], live[:, None] & ok[NCH - 1][None, :], EVICT)
    out = ()
    for c in tl.static_range(FIRST, NCH - (FIRST > 0)):
        out = out + (_load(p + rows64[:, None] * st + offs[c][None, :], live[:, None] & ok[c][None, :], EVICT),)
    if FIRST > 0:
        out = out + (last,)
    return out


@triton.jit
def _row_tiles(p, st, row64, js, S, offs, ok, EVICT: tl.constexpr):
    """Row ``row64`` of sources js [SB] (pointers p, row strides st), one [SB, BLOCK_D] tile per
    chunk: one step of the persistent backward's loop."""
    out = ()
    for c in tl.static_range(len(offs)):
        addr = p[:, None] + (row64 * st)[:, None] + offs[c][None, :]
        out = out + (_load(addr, (js < S)[:, None] & ok[c][None, :], EVICT),)
    return out


@triton.jit
def _rows2d(v):
    """Each [BLOCK_D] vector of a chunk tuple as a [1, BLOCK_D] row."""
    out = ()
    for c in tl.static_range(len(v)):
        out = out + (v[c][None, :],)
    return out


# ---------------------------------------------------------------------------------------------- key terms


@triton.jit
def _key_terms(x, q, tail, SLICE: tl.constexpr):
    """Elementwise terms of |k|^2 and q.k of one fp32 chunk (added up over chunks before the row sum)."""
    if SLICE:
        kk = tl.where(tail[None, :], x * x, 0.0)
    else:
        kk = x * x
    return kk, x * q[None, :]


@triton.jit
def _key_sums(t, q, tail, KEY0: tl.constexpr, SLICE: tl.constexpr):
    """A source's raw tiles in fp32 and their key terms (kk, kq) added over the chunks: in chunk
    order where every chunk may hold key columns (KEY0 = 0); else from the last chunk down to KEY0,
    then, under "full", the squares of the key-free chunks (they hold no q.k terms)."""
    NCH: tl.constexpr = len(t)
    x = (t[0].to(tl.float32),)
    if KEY0 == 0:
        kk, kq = _key_terms(x[0], q[0], tail[0], SLICE)
    for c in tl.static_range(1, NCH):
        x = x + (t[c].to(tl.float32),)
    if KEY0 == 0:
        terms = ()
        for c in tl.static_range(1, NCH):
            terms = terms + (_key_terms(x[c], q[c], tail[c], SLICE),)
        for c in tl.static_range(1, NCH):  # every |k|^2 term, then every q.k term
            kk = kk + terms[c - 1][0]
        for c in tl.static_range(1, NCH):
            kq = kq + terms[c - 1][1]
    else:
        kk, kq = _key_terms(x[NCH - 1], q[NCH - 1], tail[NCH - 1], SLICE)
        for c in tl.static_range(NCH - 2, KEY0 - 1, -1):
            kk1, kq1 = _key_terms(x[c], q[c], tail[c], SLICE)
            kk = kk + kk1
            kq = kq + kq1
        if not SLICE:
            for c in tl.static_range(KEY0):
                kk = kk + x[c] * x[c]
    return x, kk, kq


@triton.jit
def _score(ss, qk, inv_n, eps):
    """A source's score z and key 1/RMS per token from its row sums |k|^2 and q.k."""
    rinv = tl.rsqrt(ss * inv_n + eps)
    return qk * rinv, rinv


@triton.jit
def _scores(kk, kq, inv_n, eps, FUSED: tl.constexpr):
    """Row sums of the key terms (one fused reduction where FUSED; the interpreter runs tl.reduce's
    Python combine slowly), then the score and key 1/RMS."""
    if FUSED:
        ss, qk = tl.reduce((kk, kq), 1, _add2)
    else:
        ss = tl.sum(kk, axis=1)
        qk = tl.sum(kq, axis=1)
    return _score(ss, qk, inv_n, eps)


# ---------------------------------------------------------------------------------------------- backward pieces


@triton.jit
def _g_rows(g_ptr, h_ptr, res_ptr, live, rows64, offs, ok, stride_g, d, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
            WITH_H: tl.constexpr):
    """g (fp32) per chunk, of one token (``live`` None, ``rows64`` its index) or of a token block
    (rows where ``live``), and the terms of g.h at fp32 accuracy (h rebuilt from its residual)
    added over the chunks after all are read; without WITH_H (the deferred forms) h is not read and
    g stands in for the terms."""
    g = ()
    ghs = ()
    for c in tl.static_range(len(offs)):
        if live is None:
            mask = ok[c]
            row = rows64
        else:
            mask = live[:, None] & ok[c][None, :]
            row = rows64[:, None]
        gc = tl.load(g_ptr + row * stride_g + offs[c], mask=mask, other=0.0).to(tl.float32)
        ghc = gc
        if WITH_H:
            hh = tl.load(h_ptr + row * d + offs[c], mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                hh = _res_h(hh, tl.load(res_ptr + row * d + offs[c], mask=mask, other=0), RES_STEP)
            ghc = gc * hh
        g = g + (gc,)
        ghs = ghs + (ghc,)
    gh = ghs[0]
    for c in tl.static_range(1, len(offs)):
        gh = gh + ghs[c]
    return g, gh


@triton.jit
def _go_terms(t, g):
    """A source's tiles in fp32 and the terms of g.o over its chunks (added up for one row sum)."""
    x = (t[0].to(tl.float32),)
    go = g[0] * x[0]
    for c in tl.static_range(1, len(t)):
        x = x + (t[c].to(tl.float32),)
    for c in tl.static_range(1, len(t)):
        go = go + g[c] * x[c]
    return x, go


@triton.jit
def _weights(go, gh, lse, js, S, N, rows, live, st_ptr, inv_n):
    """From g.o (sources js of one token, or one source of tokens ``rows``) and the forward's
    statistics: the weights w, cq = dL/dz rinv (the query gradient's weight; 0 where not ``live``)
    and the key term's coefficient z rinv / n."""
    z = tl.load(st_ptr + tl.cast(1 + js, tl.int64) * N + rows, mask=live, other=0.0)
    rinv = tl.load(st_ptr + tl.cast(1 + S + js, tl.int64) * N + rows, mask=live, other=0.0)
    w = tl.exp(z - lse)
    return w, w * (go - gh) * rinv, z * rinv * inv_n


@triton.jit
def _grad(x, g, q, tail, w, cq, coef, SLICE: tl.constexpr, KEYLESS: tl.constexpr):
    """One chunk of gradient rows from the fp32 source rows x (g broadcast against them).  KEYLESS:
    the chunk lies before the key, so under "slice" its gradient is w g alone."""
    if KEYLESS and SLICE:
        return w[:, None] * g
    if SLICE:
        k = tl.where(tail[None, :], x, 0.0)
    else:
        k = x
    return w[:, None] * g + cq[:, None] * (q[None, :] - coef[:, None] * k)


@triton.jit
def _store_rows(gp, row, d, off, live, ok, x):
    """x stored in the gradient rows at ``gp + row * d`` (gp: one pointer with a token block's rows
    [BLOCK_T, 1], or the sources' pointers [SB, 1] with one token's row), columns ``off``; rows where
    ``live``.  The value comes before its address: the order the kernels were measured in."""
    tl.store(gp + row * d + off[None, :], x.to(gp.dtype.element_ty), mask=live[:, None] & ok[None, :])


@triton.jit
def _store_grads(gp, row, d, live, offs, ok, t, g, q, tail, w, cq, coef, dq, SLICE: tl.constexpr,
                 KEY0: tl.constexpr, FIRST: tl.constexpr = 0):
    """One step's gradient rows (_store_rows) for chunks FIRST to NCH - 1 (``t`` holds those chunks'
    tiles, each taken to fp32 where it is used), and each key chunk's share added to the
    query-gradient accumulators dq (returned)."""
    out = ()
    for ch in tl.static_range(len(offs)):
        if ch < FIRST:
            out = out + (dq[ch],)
        else:
            x = t[ch - FIRST].to(tl.float32)
            _store_rows(gp, row, d, offs[ch], live, ok[ch], _grad(x, g[ch], q[ch], tail[ch], w, cq, coef, SLICE,
                                                                  KEY0 > ch))
            if KEY0 > ch:
                out = out + (dq[ch],)
            else:
                out = out + (dq[ch] + tl.sum(cq[:, None] * x, axis=0),)
    return out


@triton.jit
def _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail, KEY0: tl.constexpr):
    """This program's query-gradient partial row: the key columns of chunks KEY0 to NCH - 1."""
    for c in tl.static_range(KEY0, len(dq)):
        tl.store(dq_part_ptr + pid.to(tl.int64) * r + (offs[c] - (d - r)), dq[c], mask=tail[c])
