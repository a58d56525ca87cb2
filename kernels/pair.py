"""The pair paths: two sources in one step, loaded together.

- The pair forward (fused_fwd._fwd_body with PAIR, exactly two sources): both sources' tiles loaded
  at once, the four row sums in one reduction (_scores_pair) and the exact two-way softmax (_mix2):
  no source loop and no online rescale.
- The token-tile backward two sources per step (_bwd_tile_pairs, PAIR): both sources' loads in
  flight together and both row sums g.o in one reduction (_pair_step); an odd S masks out the last
  pair's second source.
- The resident pair (_bwd_tile_pairs with GH_PAIR: DEFER with PAIR, at most two sources): one step
  holds every source, so g.h = w_0 g.o_0 + w_1 g.o_1 comes from the tiles in hand; h and the rounding
  residual are not read, and the forward keeps no residual.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import _add2, _bwd_weights, _grad_ptrs, _score, _src_tiles, _tile_grads, _tiles_go


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
def _mix2(pa, a, pb, b):
    """The unnormalised mix of two sources' fp32 tiles with weights pa, pb (the pair forward)."""
    return pa[:, None] * a + pb[:, None] * b


@triton.jit
def _src_pair(j, S, rows, rows64, row_ok, offs, ok,
              NCH: tl.constexpr, EVICT: tl.constexpr,
              TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs,
              x_strides):
    """Sources j and j + 1's raw tiles (_src_tiles; source j's loads first): a step that holds two
    sources."""
    a0, a1, a2, a3, a4 = _src_tiles(j, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE, src0_ptr, src_offs,
                                    src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
    b0, b1, b2, b3, b4 = _src_tiles(j + 1, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE, src0_ptr, src_offs,
                                    src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
    return a0, a1, a2, a3, a4, b0, b1, b2, b3, b4


@triton.jit
def _pair_step(
    i, a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n, offs, ok,
    g, q, tail, dq0, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, TABLE: tl.constexpr, grad0_ptr, grad_offs,
    GALIGN: tl.constexpr, NSLOT: tl.constexpr, dx_ptrs, GH_PAIR: tl.constexpr,
):
    """One step of _bwd_tile_pairs on the raw tiles of sources i (a0..a4) and i + 1 (b0..b4): both row
    sums g.o in one two-operand reduction, both sources' gradients stored, the query-gradient
    accumulators returned.  GH_PAIR: g.h from this pair instead of ``gh``."""
    a0, a1, a2, a3, a4, goa = _tiles_go(a0, a1, a2, a3, a4, g, NCH)
    b0, b1, b2, b3, b4, gob = _tiles_go(b0, b1, b2, b3, b4, g, NCH)
    sa, sb = tl.reduce((goa, gob), 1, _add2)
    live_b = row_ok & ((rows * 0 + i + 1) < S)  # the pair's second source exists
    if GH_PAIR:  # every source is in this pair: g.h = sum_i w_i g.o_i (sb = 0 for a masked-out source)
        za = tl.load(st_ptr + tl.cast(1 + i, tl.int64) * N + rows, mask=row_ok, other=0.0)
        zb = tl.load(st_ptr + tl.cast(2 + i, tl.int64) * N + rows, mask=live_b, other=0.0)
        gh = tl.exp(za - lse) * sa + tl.exp(zb - lse) * sb
    wa, ca, ka = _bwd_weights(sa, gh, lse, i, S, N, rows, row_ok, st_ptr, inv_n)
    wb, cb, kb = _bwd_weights(sb, gh, lse, i + 1, S, N, rows, live_b, st_ptr, inv_n)
    gpa = _grad_ptrs(i, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs)
    gpb = _grad_ptrs(i + 1, S, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs)
    dq0, dq1, dq2, dq3, dq4 = _tile_grads(gpa, rows64, row_ok, d, offs, ok, a0, a1, a2, a3, a4, g, q,
                                          tail, wa, ca, ka, dq0, dq1, dq2, dq3, dq4, SLICE, KEY0, NCH)
    dq0, dq1, dq2, dq3, dq4 = _tile_grads(gpb, rows64, live_b, d, offs, ok, b0, b1, b2, b3, b4, g, q,
                                          tail, wb, cb, kb, dq0, dq1, dq2, dq3, dq4, SLICE, KEY0, NCH)
    return dq0, dq1, dq2, dq3, dq4


@triton.jit
def _bwd_tile_pairs(
    rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n, offs, ok, g, q, tail, dq0, dq1, dq2, dq3, dq4,
    SLICE: tl.constexpr, NCH: tl.constexpr, KEY0: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr,
    STAGES: tl.constexpr, TABLE: tl.constexpr, src0_ptr, src_offs, src_strides, ALIGN: tl.constexpr, grad0_ptr,
    grad_offs, GALIGN: tl.constexpr, NSLOT: tl.constexpr, x_ptrs, x_strides, dx_ptrs, GH_PAIR: tl.constexpr = False,
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
            0, S, rows, rows64, row_ok, offs, ok, NCH, EVICT, TABLE,
            src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
    if GH_PAIR:
        return _pair_step(0, na0, na1, na2, na3, na4, nb0, nb1, nb2, nb3, nb4, rows, row_ok, rows64, N, S, d, gh, lse,
                          st_ptr, inv_n, offs, ok, g, q, tail, dq0, dq1, dq2, dq3, dq4,
                          SLICE, NCH, KEY0, TABLE, grad0_ptr, grad_offs, GALIGN, NSLOT, dx_ptrs, True)
    for i in tl.range(0, S, 2, num_stages=STAGES):
        a0, a1, a2, a3, a4, b0, b1, b2, b3, b4 = _src_pair(
            i + 2 * PREFETCH, S, rows, rows64, row_ok, offs, ok, NCH,
            EVICT, TABLE, src0_ptr, src_offs, src_strides, ALIGN, NSLOT, x_ptrs, x_strides)
        if PREFETCH:  # use the pair loaded a step ago; keep this step's for the next
            a0, a1, a2, a3, a4, na0, na1, na2, na3, na4 = na0, na1, na2, na3, na4, a0, a1, a2, a3, a4
            b0, b1, b2, b3, b4, nb0, nb1, nb2, nb3, nb4 = nb0, nb1, nb2, nb3, nb4, b0, b1, b2, b3, b4
        dq0, dq1, dq2, dq3, dq4 = _pair_step(
            i, a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, rows, row_ok, rows64, N, S, d, gh, lse, st_ptr, inv_n,
            offs, ok, g, q, tail, dq0, dq1, dq2, dq3, dq4, SLICE, NCH, KEY0, TABLE, grad0_ptr, grad_offs,
            GALIGN, NSLOT, dx_ptrs, False)
    return dq0, dq1, dq2, dq3, dq4
