"""The sum of the query-gradient partial rows [programs, r] fp32 over its rows, in a fixed order.

The backward writes one partial row per program; kernels.launch sums them with _sum_rows_kernel in
two launches (slabs of rows, then the slabs), with _sum_rows_once_kernel in one (the last program
to finish a column block sums the slabs), or with torch, whichever timed fastest at that size.  Both
Triton sums take the same slabs in the same order, so they give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    partial rows go through it twice (kernels.launch.sum_rows): slabs into an fp32 [splits, r], then
    the splits into the query's dtype.  torch's sum over the rows of a [1056, 384] matrix runs on 51
    blocks (10.8 us under ncu), a tenth of the backward at S = 2."""
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
    decides only who adds, not the order).  It saves the second launch's boundary (about 1-2 us at
    S = 2, where the whole backward is 40-60 us); the count must be 0 on entry (kernels.launch.sum_counts
    keeps a zeroed ring of them)."""
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
