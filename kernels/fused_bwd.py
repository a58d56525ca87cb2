"""The fused backward, from the forward's saved statistics.

With g = dL/dh:
    dz_i  = w_i (g.o_i - g.h)
    do_i  = w_i g + dz_i rinv_i (q - (z_i rinv_i / n) k_i)      (q and k_i over the key columns)
    dq    = sum_tokens sum_i dz_i rinv_i k_i
w_i, z_i and rinv_i come from the statistics, so one row sum per source (g.o_i) remains; g.h comes
from h and its rounding residual or, in the deferred forms (DEFER), from the sources (g.h = sum_i
w_i g.o_i), and then the forward keeps no residual.  The query gradient is accumulated per program
into an fp32 partial row [programs, r], summed after the kernel in a fixed order (sums.py).

Two bodies, one per grid (a launch configuration picks one with BLOCK_T):

- _bwd_tiles (BLOCK_T > 0): BLOCK_T tokens per program in the forward's layout, the sources one or
  two (PAIR) per step of the loop _tile_loop; PERSIST loops a few programs per multiprocessor over
  the token blocks.  DEFER runs the loop twice: the first pass reads every source row, writes the
  key-free chunks' gradients and keeps g.o_i in a scratch [S, N]; the second reads the key's chunks
  again and writes theirs.  DEFER with PAIR (the resident pair, S <= 2) is one step, no loop.
- _bwd_persistent (BLOCK_T = 0): a few programs per multiprocessor loop over the tokens, one token
  at a time, the sources SB per step ([SB, BLOCK_D] tiles whose row sums share one reduction).  The
  backward at r = d runs here where the tuner picks it; its source loop waits on every load.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    _add2, _chunks, _dq_store, _dst, _g_rows, _go_terms, _inv_key_width, _queries, _row_tiles, _rows2d, _src,
    _store_grads, _store_rows, _tiles, _token_rows, _weights, _zeros,
)


@triton.jit
def _step_tiles(src, ALIGN: tl.constexpr, j, S, P: tl.constexpr, rows, rows64, row_ok, offs, ok, EVICT: tl.constexpr,
                FIRST: tl.constexpr):
    """The raw tiles of sources j to j + P - 1 (one chunk tuple each, chunks FIRST to NCH - 1)."""
    out = ()
    for p in tl.static_range(P):
        out = out + (_tiles(src, ALIGN, j + p, S, rows, rows64, row_ok, offs, ok, EVICT, FIRST),)
    return out


@triton.jit
def _tile_step(i, t, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr, inv_n, offs, ok, q, tail, dq, dst,
               GALIGN: tl.constexpr, SLICE: tl.constexpr, KEY0: tl.constexpr, RESIDENT: tl.constexpr):
    """One step of the token tile on the raw tiles ``t`` of sources i to i + P - 1 (P = 1 or 2): the
    row sums g.o (two in one reduction), the gradients stored, the query-gradient accumulators
    returned.  The second of a pair is masked out where i + 1 = S.  RESIDENT: every source is in
    this step, so g.h = sum_i w_i g.o_i comes from it, not from ``gh``."""
    P: tl.constexpr = len(t)
    xs = ()
    gos = ()
    for p in tl.static_range(P):
        x, go = _go_terms(t[p], g)
        xs = xs + (x,)
        gos = gos + (go,)
    if P == 2:
        s = tl.reduce(gos, 1, _add2)
        live = (row_ok, row_ok & ((rows * 0 + i + 1) < S))
    else:
        s = (tl.sum(gos[0], axis=1),)
        live = (row_ok,)
    if RESIDENT:
        za = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=live[0], other=0.0)
        zb = tl.load(st_ptr + tl.cast(2 + i, tl.int64) * N + rows, mask=live[1], other=0.0)
        gh = tl.exp(za - lse) * s[0] + tl.exp(zb - lse) * s[1]
    wts = ()
    gps = ()
    for p in tl.static_range(P):
        wts = wts + (_weights(s[p], gh, lse, i + p, S, N, rows, live[p], st_ptr, inv_n),)
    for p in tl.static_range(P):
        gps = gps + (_dst(dst, i + p, S, GALIGN),)
    for p in tl.static_range(P):
        w, cq, coef = wts[p]
        dq = _store_grads(gps[p], rows64[:, None], d, live[p], offs, ok, xs[p], g, q, tail, w, cq, coef, dq, SLICE,
                          KEY0)
    return dq


@triton.jit
def _tile_loop(src, ALIGN: tl.constexpr, dst, GALIGN: tl.constexpr, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr,
               go_ptr, inv_n, offs, ok, q, tail, dq, SLICE: tl.constexpr, KEY0: tl.constexpr, PREFETCH: tl.constexpr,
               EVICT: tl.constexpr, STAGES: tl.constexpr, P: tl.constexpr, PASS: tl.constexpr):
    """The token tile's source loop, P sources per step, the next step's tiles loaded early with
    PREFETCH.  PASS 0: whole rows (_tile_step).  The deferred form's PASS 1: g.o_i into the scratch,
    g.h summed, the key-free chunks' gradients w_i g; its PASS 2: the key's chunks re-read and their
    gradients.  Returns g.h and the query-gradient accumulators."""
    FIRST: tl.constexpr = KEY0 if PASS == 2 else 0
    if PREFETCH:
        nxt = _step_tiles(src, ALIGN, 0, S, P, rows, rows64, row_ok, offs, ok, EVICT, FIRST)
    for i in tl.range(0, S, P, num_stages=STAGES):
        t = _step_tiles(src, ALIGN, i + P * PREFETCH, S, P, rows, rows64, row_ok, offs, ok, EVICT, FIRST)
        if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next sources') for the next
            t, nxt = nxt, t
        if PASS == 0:
            dq = _tile_step(i, t, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr, inv_n, offs, ok, q, tail, dq, dst,
                            GALIGN, SLICE, KEY0, False)
        elif PASS == 1:
            x, go = _go_terms(t[0], g)
            go = tl.sum(go, axis=1)
            z = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
            w = tl.exp(z - lse)
            gh += w * go
            tl.store(go_ptr + tl.cast(i, tl.int64) * N + rows, go, mask=row_ok)
            gp = _dst(dst, i, S, GALIGN)
            for c in tl.static_range(KEY0):
                _store_rows(gp, rows64[:, None], d, offs[c], row_ok, ok[c], w[:, None] * g[c])
        else:
            go = tl.load(go_ptr + tl.cast(i, tl.int64) * N + rows, mask=row_ok, other=0.0)
            w, cq, coef = _weights(go, gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
            dq = _store_grads(_dst(dst, i, S, GALIGN), rows64[:, None], d, row_ok, offs, ok, t[0], g, q, tail,
                              w, cq, coef, dq, SLICE, KEY0, FIRST)
    return gh, dq


@triton.jit
def _tile_block(
    blk, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n, offs, ok, q, tail, dq, src, ALIGN: tl.constexpr,
    dst, GALIGN: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, KEY0: tl.constexpr,
    BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr,
    DEFER: tl.constexpr,
):
    """Token block ``blk``: its g (and g.h), then the source loop; the accumulators dq returned."""
    rows, row_ok, rows64 = _token_rows(blk, N, BLOCK_T)
    g, gh = _g_rows(g_ptr, h_ptr, res_ptr, row_ok, rows64, offs, ok, stride_g, d, HAS_RES, RES_STEP, not DEFER)
    if not DEFER:
        gh = tl.sum(gh, axis=1)
    lse = tl.load(st_ptr + rows, mask=row_ok, other=0.0)
    if DEFER:  # g.h from the sources (h and the residual not read)
        gh = lse * 0.0
    if DEFER and not PAIR:  # two passes
        gh, dq = _tile_loop(src, ALIGN, dst, GALIGN, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr, go_ptr, inv_n,
                            offs, ok, q, tail, dq, SLICE, KEY0, PREFETCH, EVICT, STAGES, 1, 1)
        tl.debug_barrier()  # this program's g.o stores, visible to all its threads
        gh, dq = _tile_loop(src, ALIGN, dst, GALIGN, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr, go_ptr, inv_n,
                            offs, ok, q, tail, dq, SLICE, KEY0, PREFETCH, EVICT, STAGES, 1, 2)
    elif DEFER:  # the resident pair: one step, no loop (a PERSIST block loop around it is innermost)
        tl.static_assert(not PREFETCH, "the resident pair has no next source to prefetch")
        t = _step_tiles(src, ALIGN, 0, S, 2, rows, rows64, row_ok, offs, ok, EVICT, 0)
        dq = _tile_step(0, t, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr, inv_n, offs, ok, q, tail, dq, dst,
                        GALIGN, SLICE, KEY0, True)
    else:
        gh, dq = _tile_loop(src, ALIGN, dst, GALIGN, rows, row_ok, rows64, N, S, d, g, gh, lse, st_ptr, go_ptr, inv_n,
                            offs, ok, q, tail, dq, SLICE, KEY0, PREFETCH, EVICT, STAGES, PAIR + 1, 0)
    return dq


@triton.jit
def _bwd_tiles(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n, src, ALIGN: tl.constexpr,
    dst, GALIGN: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
    BLOCK_D: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr,
    EVICT: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr, DEFER: tl.constexpr, PERSIST: tl.constexpr,
):
    """The token-tile backward: one block per program, or (PERSIST) the programs loop over the
    blocks, so that the partial rows are per program.  Many resident programs keep more loads in
    flight than the persistent grid, which stalls on them."""
    tl.static_assert(PREFETCH <= 1, "the token-tile backward prefetches at most one step")
    pid = tl.program_id(0)
    offs, ok, tail = _chunks(d, r, BLOCK_D, NCH)
    q = _queries(q_ptr, d, r, offs, tail)
    dq = _zeros([BLOCK_D], NCH)
    if PERSIST:  # the resident pair's block loop is innermost: STAGES lets Triton pipeline its loads
        for blk in tl.range(pid, tl.cdiv(N, BLOCK_T), tl.num_programs(0),
                            num_stages=STAGES if (DEFER and PAIR) else None):
            dq = _tile_block(blk, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n, offs, ok, q, tail,
                             dq, src, ALIGN, dst, GALIGN, SLICE, HAS_RES, RES_STEP, KEY0, BLOCK_T, PREFETCH, EVICT,
                             STAGES, PAIR, DEFER)
            if DEFER and not PAIR:  # keeps a program's threads in step between blocks
                tl.debug_barrier()
    else:
        dq = _tile_block(pid, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n, offs, ok, q, tail, dq,
                         src, ALIGN, dst, GALIGN, SLICE, HAS_RES, RES_STEP, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES,
                         PAIR, DEFER)
    _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail, KEY0)


@triton.jit
def _bwd_persistent(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g, inv_n, src, ALIGN: tl.constexpr, dst,
    GALIGN: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr,
    NCH: tl.constexpr, KEY0: tl.constexpr, SB: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The persistent backward: each program walks tokens pid, pid + programs, ...; per token the
    sources SB at a time, the next SB loaded early with PREFETCH (the loop: ``for b in tl.range(0, S,
    SB)``)."""
    tl.static_assert(PREFETCH <= 1, "the persistent backward prefetches at most one step")
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    sbs = tl.arange(0, SB)
    offs, ok, tail = _chunks(d, r, BLOCK_D, NCH)
    q = _queries(q_ptr, d, r, offs, tail)
    dq = _zeros([BLOCK_D], NCH)
    for row in range(pid, N, nprog):
        row64 = tl.cast(row, tl.int64)
        g, gh = _g_rows(g_ptr, h_ptr, res_ptr, None, row64, offs, ok, stride_g, d, HAS_RES, RES_STEP, True)
        gh = tl.sum(gh, axis=0)
        lse = tl.load(st_ptr + row)
        if PREFETCH:
            p, st = _src(src, sbs, S, ALIGN)
            nxt = _row_tiles(p, st, row64, sbs, S, offs, ok, EVICT)
        for b in tl.range(0, S, SB, num_stages=STAGES):
            js = b + sbs
            jl = js + PREFETCH * SB  # the sources this step loads: the next SB when prefetching
            p, st = _src(src, jl, S, ALIGN)
            t = _row_tiles(p, st, row64, jl, S, offs, ok, EVICT)
            if PREFETCH:
                t, nxt = nxt, t
            g2 = _rows2d(g)  # [1, BLOCK_D] against the [SB, BLOCK_D] tiles (hoisted out of the loop)
            x, go = _go_terms(t, g2)
            w, cq, coef = _weights(tl.sum(go, axis=1), gh, lse, js, S, N, row, js < S, st_ptr, inv_n)
            dq = _store_grads(_dst(dst, js, S, GALIGN)[:, None], row64, d, js < S, offs, ok, x, g2, q, tail, w, cq,
                              coef, dq, SLICE, KEY0)
    _dq_store(dq, dq_part_ptr, pid, r, d, offs, tail, KEY0)


@triton.jit
def _bwd_body(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n, src, ALIGN: tl.constexpr,
    dst, GALIGN: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
    BLOCK_D: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, SB: tl.constexpr, BLOCK_T: tl.constexpr,
    PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr, DEFER: tl.constexpr,
    PERSIST: tl.constexpr,
):
    if BLOCK_T > 0:
        _bwd_tiles(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n, src, ALIGN, dst,
                   GALIGN, SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER,
                   PERSIST)
    else:
        tl.static_assert(not (PAIR or DEFER or PERSIST), "PAIR, DEFER and PERSIST need the token tile: BLOCK_T > 0")
        _bwd_persistent(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g, inv_n, src, ALIGN, dst,
                        GALIGN, SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, SB, PREFETCH, EVICT, STAGES)


@triton.jit
def _attnres_bwd_kernel(
    src0_ptr, src_offs, src_strides,  # the sources: anchor, int64 [S] offsets and row strides
    grad0_ptr, grad_offs,  # their gradients (each contiguous [N, d]): anchor, int64 [S] offsets
    q_ptr,  # [r]
    h_ptr,  # [N, d] the saved output, row stride d
    res_ptr,  # int8 [N, d] its rounding residual (unused unless HAS_RES)
    g_ptr,  # [N, d] the upstream gradient, row stride stride_g
    st_ptr,  # fp32 [1 + 2S, N]: the forward's statistics
    dq_part_ptr,  # fp32 [programs, r]: the query-gradient partial rows
    go_ptr,  # fp32 [S, N]: the two-pass form's g.o scratch (None otherwise)
    N, S, d, r, stride_g, inv_n, eps, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
    ALIGN: tl.constexpr, GALIGN: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr,
    SB: tl.constexpr,  # sources per step (the persistent grid)
    BLOCK_T: tl.constexpr,  # tokens per program (0: the persistent grid)
    PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    PAIR: tl.constexpr,  # the token tile two sources per step
    DEFER: tl.constexpr,  # g.h from the sources (two passes; with PAIR, the resident pair)
    PERSIST: tl.constexpr,  # the token tile's programs loop over the blocks (0: one block each)
):
    _bwd_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n,
              (src0_ptr, src_offs, src_strides), ALIGN, (grad0_ptr, grad_offs), GALIGN, SLICE, HAS_RES, RES_STEP,
              BLOCK_D, NCH, KEY0, SB, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER, PERSIST)


@triton.jit
def _attnres_bwd_args_kernel(
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15,
    dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15,
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g,
    NSLOT: tl.constexpr, EPS: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
    BLOCK_D: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, SB: tl.constexpr, BLOCK_T: tl.constexpr,
    PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr, DEFER: tl.constexpr,
    PERSIST: tl.constexpr,
):
    src = ((x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)[:NSLOT],
           (xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15)[:NSLOT])
    dst = (dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15)[:NSLOT]
    _bwd_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g,
              _inv_key_width(r, d, SLICE), src, 0, dst, 0, SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, SB, BLOCK_T,
              PREFETCH, EVICT, STAGES, PAIR, DEFER, PERSIST)
