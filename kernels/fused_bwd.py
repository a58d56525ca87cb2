"""The fused backward, from the forward's saved statistics.

With g = dL/dh:
    dz_i  = w_i (g.o_i - g.h)
    do_i  = w_i g + dz_i rinv_i (P^T q - (z_i rinv_i / n) k_i)      (k_i zero-padded to d)
    dq    = sum_tokens sum_i dz_i rinv_i o_i[tail]
(kernels/naive.py writes the same out in torch.)  w_i, z_i and rinv_i come from the statistics, so one
row sum per source (g.o_i) remains; g.h comes from h and its rounding residual, or, in the deferred
forms, from the sources (g.h = sum_i w_i g.o_i).  No [S, tokens, d] temporary.  The query gradient
is accumulated per program into an fp32 partial row [programs, r], summed after the kernel in a fixed
order (sums.py or torch, whichever kernels.op timed fastest).

Grids (a launch configuration picks one):
- persistent (BLOCK_T = 0, _bwd_body): a few programs per multiprocessor loop over the tokens, one
  token at a time, walking the sources SB at a time ([SB, BLOCK_D] tiles whose row sums share one
  reduction);
- token tile (BLOCK_T > 0, _bwd_tile_body): BLOCK_T tokens per program in the forward's layout, the
  sources one at a time (or two, PAIR: pair.py); with PERSIST a few programs per multiprocessor loop
  over the token blocks, so the partial rows are per program, not per block;
- deferred (DEFER, token tile, _bwd_tile_deferred): two passes, g.h from the sources; h and the
  residual are not read and the forward keeps no residual.  The first pass writes the key-free
  chunks' gradients (w_i g) and keeps g.o_i in a scratch [S, N]; the second reads the key's chunks
  again and writes theirs.  DEFER with PAIR is the resident pair (pair.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pair import _bwd_tile_pairs
from .tiles import (
    _bwd_chunks, _bwd_row, _bwd_rows, _bwd_weights, _chunk_queries, _dq_stores, _grad_ptrs, _inv_key_width,
    _ring, _rows_grad, _src, _src_rows, _src_tiles, _store_tile, _sum_chunks, _tile, _tile_grad, _tile_grads,
    _tiles_go, _to_f32, _token_rows,
)


@triton.jit
def _bwd_body(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g, inv_n,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, SB: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr,
    x_ptrs, x_strides, dx_ptrs,  # the per-argument sources, row strides and gradients, tuples (None for TABLE)
):
    """The backward's persistent program (the kernels' arguments are described at
    _attnres_bwd_kernel); PREFETCH 0 or 1."""
    tl.static_assert(PREFETCH <= 1, "the persistent backward prefetches at most one step")
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    sbs = tl.arange(0, SB)
    (offs, ok, tail,
     dq0, dq1, dq2, dq3, dq4) = _bwd_chunks(d, r, BLOCK_D, NCH)
    q = _chunk_queries(q_ptr, d, r, offs, tail, NCH)
    for row in range(pid, N, nprog):
        row64 = tl.cast(row, tl.int64)
        g0, gh = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs[0], ok[0], d, stride_g, HAS_RES, RES_STEP)
        gh1, gh2, gh3, gh4 = gh, gh, gh, gh  # past NCH: unused
        if NCH >= 2:
            g1, gh1 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs[1], ok[1], d, stride_g, HAS_RES, RES_STEP)
        if NCH >= 3:
            g2, gh2 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs[2], ok[2], d, stride_g, HAS_RES, RES_STEP)
        if NCH >= 4:
            g3, gh3 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs[3], ok[3], d, stride_g, HAS_RES, RES_STEP)
        if NCH >= 5:
            g4, gh4 = _bwd_row(g_ptr, h_ptr, res_ptr, row64, offs[4], ok[4], d, stride_g, HAS_RES, RES_STEP)
        gh = tl.sum(_sum_chunks(gh, gh1, gh2, gh3, gh4, NCH), axis=0)
        lse = tl.load(st_ptr + row)
        if PREFETCH:
            p, st = _src(sbs, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
            tn0, tn1, tn2, tn3, tn4 = _src_rows(p, st, row64, sbs, S, offs, ok, NCH, EVICT)
        for b in tl.range(0, S, SB, num_stages=STAGES):
            js = b + sbs
            jl = js + PREFETCH * SB  # the sources this step loads: the next SB when prefetching
            p, st = _src(jl, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
            u0, u1, u2, u3, u4 = _src_rows(p, st, row64, jl, S, offs, ok, NCH, EVICT)
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
            gp = _grad_ptrs(js, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs)
            dq0 = _rows_grad(gp, row64, d, offs[0], ok[0], js, S, t0, g0, q[0], tail[0], w, c, coef, dq0, SLICE,
                             KEY0 > 0)
            if NCH >= 2:
                dq1 = _rows_grad(gp, row64, d, offs[1], ok[1], js, S, t1, g1, q[1], tail[1], w, c, coef, dq1, SLICE,
                                 KEY0 > 1)
            if NCH >= 3:
                dq2 = _rows_grad(gp, row64, d, offs[2], ok[2], js, S, t2, g2, q[2], tail[2], w, c, coef, dq2, SLICE,
                                 KEY0 > 2)
            if NCH >= 4:
                dq3 = _rows_grad(gp, row64, d, offs[3], ok[3], js, S, t3, g3, q[3], tail[3], w, c, coef, dq3, SLICE,
                                 KEY0 > 3)
            if NCH >= 5:
                dq4 = _rows_grad(gp, row64, d, offs[4], ok[4], js, S, t4, g4, q[4], tail[4], w, c, coef, dq4, SLICE,
                                 KEY0 > 4)
    _dq_stores(dq0, dq1, dq2, dq3, dq4, dq_part_ptr, pid, r, d, offs,
               tail, NCH, KEY0)


@triton.jit
def _key_tiles(j, S, rows, rows64, row_ok, offs, ok,
               NCH: tl.constexpr, KEY0: tl.constexpr, EVICT: tl.constexpr,
               TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs,
               x_strides):
    """Source j's raw tiles of chunks KEY0 to NCH - 1 (the key's; KEY0 >= 1) as chunks 1 to 4, the last
    chunk's tile standing in for the others: the deferred backward's second pass."""
    p, st = _src(j, S, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
    last = _tile(p, st, j, S, rows, rows64, row_ok, offs[NCH - 1],
                 ok[NCH - 1], EVICT)
    u1, u2, u3, u4 = last, last, last, last
    if NCH >= 3 and KEY0 <= 1:
        u1 = _tile(p, st, j, S, rows, rows64, row_ok, offs[1], ok[1], EVICT)
    if NCH >= 4 and KEY0 <= 2:
        u2 = _tile(p, st, j, S, rows, rows64, row_ok, offs[2], ok[2], EVICT)
    if NCH >= 5 and KEY0 <= 3:
        u3 = _tile(p, st, j, S, rows, rows64, row_ok, offs[3], ok[3], EVICT)
    return u1, u2, u3, u4


@triton.jit
def _bwd_tile_deferred(
    rows, row_ok, rows64, N, S, d, lse, st_ptr, go_ptr, inv_n, offs, ok, g, q, tail, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr, TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr,
    grad_offs, GALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs, x_strides, dx_ptrs,
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
        tn0, tn1, tn2, tn3, tn4 = _src_tiles(0, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE, src0_ptr,
                                             src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
    for i in tl.range(0, S, num_stages=STAGES):  # pass 1: g.o_i, g.h, the key-free chunks' gradients
        t0, t1, t2, t3, t4 = _src_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE, src0_ptr,
                                        src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
        if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's) for the next
            t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4 = _ring(t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4, NCH)
        t0, t1, t2, t3, t4, go = _tiles_go(t0, t1, t2, t3, t4, g, NCH)
        go = tl.sum(go, axis=1)
        z = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
        w = tl.exp(z - lse)
        gh += w * go
        tl.store(go_ptr + tl.cast(i, tl.int64) * N + rows, go, mask=row_ok)
        gp = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs)
        _store_tile(gp, rows64, row_ok, d, offs[0], ok[0], w[:, None] * g[0])
        if KEY0 >= 2:
            _store_tile(gp, rows64, row_ok, d, offs[1], ok[1], w[:, None] * g[1])
        if KEY0 >= 3:
            _store_tile(gp, rows64, row_ok, d, offs[2], ok[2], w[:, None] * g[2])
        if KEY0 >= 4:
            _store_tile(gp, rows64, row_ok, d, offs[3], ok[3], w[:, None] * g[3])
    tl.debug_barrier()  # this program's g.o stores, visible to all its threads
    if PREFETCH:
        kn1, kn2, kn3, kn4 = _key_tiles(0, S, rows, rows64, row_ok, offs, ok, NCH,
                                        KEY0, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs,
                                        x_strides)
    for i in tl.range(0, S, num_stages=STAGES):  # pass 2: the key's chunks
        k1, k2, k3, k4 = _key_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs, ok,
                                    NCH, KEY0, EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs,
                                    x_strides)
        if PREFETCH:  # the key tiles loaded a step ago; keep this step's (the next source's) for the next
            k1, k2, k3, k4, kn1, kn2, kn3, kn4 = kn1, kn2, kn3, kn4, k1, k2, k3, k4
        go = tl.load(go_ptr + tl.cast(i, tl.int64) * N + rows, mask=row_ok, other=0.0)
        w, c, coef = _bwd_weights(go, gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
        gp = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs)
        if KEY0 <= 1:
            dq1 = _tile_grad(gp, rows64, row_ok, d, offs[1], ok[1], k1.to(tl.float32), g[1], q[1], tail[1], w, c,
                             coef, dq1, SLICE, False)
        if NCH >= 3 and KEY0 <= 2:
            dq2 = _tile_grad(gp, rows64, row_ok, d, offs[2], ok[2], k2.to(tl.float32), g[2], q[2], tail[2], w, c,
                             coef, dq2, SLICE, False)
        if NCH >= 4 and KEY0 <= 3:
            dq3 = _tile_grad(gp, rows64, row_ok, d, offs[3], ok[3], k3.to(tl.float32), g[3], q[3], tail[3], w, c,
                             coef, dq3, SLICE, False)
        if NCH >= 5:
            dq4 = _tile_grad(gp, rows64, row_ok, d, offs[4], ok[4], k4.to(tl.float32), g[4], q[4], tail[4], w, c,
                             coef, dq4, SLICE, False)
    return dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_block(
    blk, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n, offs, ok, q, tail, dq0, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    PAIR: tl.constexpr, DEFER: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs, x_strides, dx_ptrs,
):
    """Token block ``blk`` of the token-tile backward (_bwd_tile_body): its g (and g.h), the source
    loop, the query-gradient accumulators dq0..dq4 updated and returned."""
    rows, row_ok, rows64 = _token_rows(blk, N, BLOCK_T)
    g0, gh = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs[0], ok[0], d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    g1, g2, g3, g4 = g0, g0, g0, g0  # unused past NCH
    gh1, gh2, gh3, gh4 = gh, gh, gh, gh
    if NCH >= 2:
        g1, gh1 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs[1], ok[1], d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if NCH >= 3:
        g2, gh2 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs[2], ok[2], d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if NCH >= 4:
        g3, gh3 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs[3], ok[3], d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    if NCH >= 5:
        g4, gh4 = _bwd_rows(g_ptr, h_ptr, res_ptr, rows64, row_ok, offs[4], ok[4], d, stride_g, HAS_RES, RES_STEP,
                          not DEFER)
    g = (g0, g1, g2, g3, g4)
    if not DEFER:
        gh = tl.sum(_sum_chunks(gh, gh1, gh2, gh3, gh4, NCH), axis=1)
    lse = tl.load(st_ptr + rows, mask=row_ok, other=0.0)
    if DEFER:  # g.h from the sources (h and the residual not read; _bwd_rows gave g in their place)
        gh = lse * 0.0
    if DEFER and not PAIR:
        dq1, dq2, dq3, dq4 = _bwd_tile_deferred(
            rows, row_ok, rows64, N, S, d, lse, st_ptr, go_ptr, inv_n, offs, ok, g, q, tail, dq1, dq2, dq3, dq4,
            SLICE, NCH, KEY0, PREFETCH, EVICT, STAGES, TABLE, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr,
            grad_offs, GALIGN, NSLOT, x_ptrs, x_strides, dx_ptrs)
    elif PAIR:
        dq0, dq1, dq2, dq3, dq4 = _bwd_tile_pairs(
            rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n, offs, ok, g, q, tail,
            dq0, dq1, dq2, dq3, dq4, SLICE, NCH, KEY0, PREFETCH, EVICT, STAGES, TABLE, src0_ptr, src_offs, src_strides,
            ALIGN, grad0_ptr, grad_offs, GALIGN, NSLOT, x_ptrs, x_strides, dx_ptrs, DEFER)
    else:
        if PREFETCH:
            tn0, tn1, tn2, tn3, tn4 = _src_tiles(0, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE, src0_ptr,
                                                 src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
        for i in tl.range(0, S, num_stages=STAGES):
            u0, u1, u2, u3, u4 = _src_tiles(i + PREFETCH, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE,
                                            src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
            t0, t1, t2, t3, t4 = u0, u1, u2, u3, u4
            if PREFETCH:  # use the tiles loaded a step ago; keep this step's (the next source's) for the next
                t0, t1, t2, t3, t4, tn0, tn1, tn2, tn3, tn4 = _ring(u0, u1, u2, u3, u4, tn0, tn1, tn2, tn3, tn4, NCH)
            t0, t1, t2, t3, t4, go = _tiles_go(t0, t1, t2, t3, t4, g, NCH)
            w, c, coef = _bwd_weights(tl.sum(go, axis=1), gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
            gp = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs)
            dq0, dq1, dq2, dq3, dq4 = _tile_grads(gp, rows64, row_ok, d, offs, ok, t0, t1, t2, t3, t4, g, q,
                                                  tail, w, c, coef, dq0, dq1, dq2, dq3, dq4, SLICE, KEY0, NCH)
    return dq0, dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_body(
    q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n,
    SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr, BLOCK_D: tl.constexpr, NCH: tl.constexpr,
    KEY0: tl.constexpr, BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
    PAIR: tl.constexpr, DEFER: tl.constexpr, PERSIST: tl.constexpr,
    TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs, x_strides, dx_ptrs,
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
    partials are about a tenth of the backward's bytes."""
    tl.static_assert(PREFETCH <= 1, "the token-tile backward prefetches at most one step")
    pid = tl.program_id(0)
    (offs, ok, tail,
     dq0, dq1, dq2, dq3, dq4) = _bwd_chunks(d, r, BLOCK_D, NCH)
    q = _chunk_queries(q_ptr, d, r, offs, tail, NCH)
    if PERSIST:  # the resident pair's block loop is innermost: STAGES lets Triton pipeline its loads
        for blk in tl.range(pid, tl.cdiv(N, BLOCK_T), tl.num_programs(0),
                            num_stages=STAGES if (DEFER and PAIR) else None):
            dq0, dq1, dq2, dq3, dq4 = _bwd_tile_block(
                blk, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n, offs, ok, q,
                tail, dq0, dq1, dq2, dq3, dq4,
                SLICE, HAS_RES, RES_STEP, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER,
                TABLE, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr, grad_offs, GALIGN, NSLOT, x_ptrs, x_strides,
                dx_ptrs)
            if DEFER and not PAIR:  # (each block has its own scratch columns, so this orders no memory; it keeps a
                tl.debug_barrier()  # program's threads in step between blocks, as measured on the H200)
    else:
        dq0, dq1, dq2, dq3, dq4 = _bwd_tile_block(
            pid, h_ptr, res_ptr, g_ptr, st_ptr, go_ptr, N, S, d, stride_g, inv_n, offs, ok, q,
            tail, dq0, dq1, dq2, dq3, dq4,
            SLICE, HAS_RES, RES_STEP, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER,
            TABLE, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr, grad_offs, GALIGN, NSLOT, x_ptrs, x_strides,
            dx_ptrs)
    _dq_stores(dq0, dq1, dq2, dq3, dq4, dq_part_ptr, pid, r, d, offs,
               tail, NCH, KEY0)


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
    N, S, d, r, stride_g, inv_n, eps, SLICE: tl.constexpr, HAS_RES: tl.constexpr, RES_STEP: tl.constexpr,
    ALIGN: tl.constexpr, GALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    SB: tl.constexpr,  # sources per step (persistent grid)
    BLOCK_T: tl.constexpr,  # tokens per program (0: the persistent grid)
    PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    PAIR: tl.constexpr,  # token-tile grid: two sources per step
    DEFER: tl.constexpr,  # token-tile grid: g.h from the sources, no h (two passes; with PAIR one, S <= 2)
    PERSIST: tl.constexpr,  # token-tile grid: programs loop over the token blocks (0: one block each)
):
    if BLOCK_T > 0:
        _bwd_tile_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g, inv_n, SLICE,
                       HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH, EVICT, STAGES, PAIR, DEFER, PERSIST,
                       True, src0_ptr, src_offs, src_strides, ALIGN, grad0_ptr, grad_offs, GALIGN, 0,
                       None, None, None)  # no per-argument sources
    else:
        tl.static_assert(not PAIR, "PAIR (two sources per step) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not DEFER, "DEFER (two passes) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not PERSIST, "PERSIST (looping token blocks) is of the token-tile grid: BLOCK_T > 0")
        _bwd_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g, inv_n, SLICE, HAS_RES,
                  RES_STEP, BLOCK_D, NCH, KEY0, SB, PREFETCH, EVICT, STAGES, True, src0_ptr, src_offs, src_strides,
                  ALIGN, grad0_ptr, grad_offs, GALIGN, 0,
                  None, None, None)  # no per-argument sources


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
    N, S, d, r, stride_g, NSLOT: tl.constexpr, EPS: tl.constexpr, SLICE: tl.constexpr, HAS_RES: tl.constexpr,
    RES_STEP: tl.constexpr,
    BLOCK_D: tl.constexpr,  # columns per chunk
    NCH: tl.constexpr,  # column chunks per row: 1 to 5
    KEY0: tl.constexpr,  # first column chunk holding key columns (0: compute as if every chunk may)
    SB: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program (0: the persistent grid)
    PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr,  # Triton software-pipeline stages of the source loop (1: none)
    PAIR: tl.constexpr,  # token-tile grid: two sources per step
    DEFER: tl.constexpr,  # token-tile grid: g.h from the sources, no h (two passes; with PAIR one, S <= 2)
    PERSIST: tl.constexpr,  # token-tile grid: programs loop over the token blocks (0: one block each)
):
    if BLOCK_T > 0:
        _bwd_tile_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, go_ptr, N, S, d, r, stride_g,
                       _inv_key_width(r, d, SLICE), SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, BLOCK_T, PREFETCH,
                       EVICT, STAGES, PAIR, DEFER, PERSIST, False, None, None, None, 1, None, None, 1, NSLOT,
                       (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
                       (xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15),
                       (dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15))
    else:
        tl.static_assert(not PAIR, "PAIR (two sources per step) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not DEFER, "DEFER (two passes) needs the token-tile grid: BLOCK_T > 0")
        tl.static_assert(not PERSIST, "PERSIST (looping token blocks) is of the token-tile grid: BLOCK_T > 0")
        _bwd_body(q_ptr, h_ptr, res_ptr, g_ptr, st_ptr, dq_part_ptr, N, S, d, r, stride_g,
                  _inv_key_width(r, d, SLICE), SLICE, HAS_RES, RES_STEP, BLOCK_D, NCH, KEY0, SB, PREFETCH, EVICT,
                  STAGES, False, None, None, None, 1, None, None, 1, NSLOT,
                  (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
                  (xs0, xs1, xs2, xs3, xs4, xs5, xs6, xs7, xs8, xs9, xs10, xs11, xs12, xs13, xs14, xs15),
                  (dx0, dx1, dx2, dx3, dx4, dx5, dx6, dx7, dx8, dx9, dx10, dx11, dx12, dx13, dx14, dx15))
