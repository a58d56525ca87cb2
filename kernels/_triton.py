"""Fused Triton kernels for depth routing (Fast-AttnRes style), forward and backward.

Layout: every source is a [N, d] matrix with unit column stride and its own row stride; the
kernels read the sources through a table of base addresses (int64 ``data_ptr``s) and a table of
row strides, so a list of tensors is never stacked.  One program owns BLOCK_T tokens and the
whole row width (BLOCK_D = next power of two >= d, masked).

Forward (one pass over the sources, online softmax):
    reads S*d + writes d elements per token, plus one fp32 logsumexp per token.
Backward (one pass over the sources):
    reads g and the saved output h (d each), the S sources once, writes the S source gradients;
    the query gradient is reduced per program into an fp32 partial [programs, r] that the host
    sums (deterministic).

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
def _attnres_fwd_kernel(
    src_ptrs,  # int64 [S]: base addresses of the sources
    src_strides,  # int64 [S]: row strides (elements)
    q_ptr,  # [r] (any float dtype)
    out_ptr,  # [N, d] contiguous, output dtype (= source dtype)
    lse_ptr,  # fp32 [N]
    N,
    S,
    d,
    r,
    inv_n,  # 1/r for "slice", 1/d for "full"
    eps,
    SLICE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = offs < d
    tail = (offs >= d - r) & col_ok
    mask = row_ok[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + (offs - (d - r)), mask=tail, other=0.0).to(tl.float32)
    rows64 = rows.to(tl.int64)

    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if PREFETCH:
        base = tl.load(src_ptrs).to(tl.pointer_type(dtype))
        stride = tl.load(src_strides)
        x_next = tl.load(base + rows64[:, None] * stride + offs[None, :], mask=mask, other=0.0)
    for i in range(S):
        if PREFETCH:
            x = x_next.to(tl.float32)
            j = tl.minimum(i + 1, S - 1)
            base = tl.load(src_ptrs + j).to(tl.pointer_type(dtype))
            stride = tl.load(src_strides + j)
            x_next = tl.load(base + rows64[:, None] * stride + offs[None, :], mask=mask & ((rows * 0 + i + 1) < S)[:, None], other=0.0)
        else:
            base = tl.load(src_ptrs + i).to(tl.pointer_type(dtype))
            stride = tl.load(src_strides + i)
            x = tl.load(base + rows64[:, None] * stride + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if SLICE:
            ss = tl.sum(tl.where(tail[None, :], x * x, 0.0), axis=1)
        else:
            ss = tl.sum(x * x, axis=1)
        rinv = tl.rsqrt(ss * inv_n + eps)
        z = tl.sum(x * q[None, :], axis=1) * rinv
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        acc = acc * alpha[:, None] + p[:, None] * x
        l = l * alpha + p
        m = m_new
    h = acc / l[:, None]
    tl.store(out_ptr + rows64[:, None] * d + offs[None, :], h.to(dtype), mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=row_ok)


@triton.jit
def _attnres_bwd_kernel(
    src_ptrs,  # int64 [S]
    src_strides,  # int64 [S]
    grad_ptrs,  # int64 [S]: base addresses of the source gradients (contiguous [N, d])
    q_ptr,  # [r]
    h_ptr,  # [N, d] saved output, row stride d
    g_ptr,  # [N, d] upstream gradient, row stride stride_g
    lse_ptr,  # fp32 [N]
    dq_part_ptr,  # fp32 [programs, r]
    N,
    S,
    d,
    r,
    stride_g,
    inv_n,
    eps,
    SLICE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREFETCH: tl.constexpr,
    DQ2D: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = h_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    col_ok = offs < d
    tail = (offs >= d - r) & col_ok
    q = tl.load(q_ptr + (offs - (d - r)), mask=tail, other=0.0).to(tl.float32)
    if DQ2D:
        dq2 = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    else:
        dq = tl.zeros([BLOCK_D], tl.float32)
    nblk = tl.cdiv(N, BLOCK_T)
    for blk in range(pid, nblk, nprog):
        rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        mask = row_ok[:, None] & col_ok[None, :]
        g = tl.load(g_ptr + rows64[:, None] * stride_g + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        hh = tl.load(h_ptr + rows64[:, None] * d + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        gh = tl.sum(g * hh, axis=1)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        if PREFETCH:
            base = tl.load(src_ptrs).to(tl.pointer_type(dtype))
            stride = tl.load(src_strides)
            x_next = tl.load(base + rows64[:, None] * stride + offs[None, :], mask=mask, other=0.0)
        for i in range(S):
            gbase = tl.load(grad_ptrs + i).to(tl.pointer_type(dtype))
            if PREFETCH:
                x = x_next.to(tl.float32)
                j = tl.minimum(i + 1, S - 1)
                base = tl.load(src_ptrs + j).to(tl.pointer_type(dtype))
                stride = tl.load(src_strides + j)
                x_next = tl.load(base + rows64[:, None] * stride + offs[None, :], mask=mask & ((rows * 0 + i + 1) < S)[:, None], other=0.0)
            else:
                base = tl.load(src_ptrs + i).to(tl.pointer_type(dtype))
                stride = tl.load(src_strides + i)
                x = tl.load(base + rows64[:, None] * stride + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            if SLICE:
                k = tl.where(tail[None, :], x, 0.0)
            else:
                k = x
            ss = tl.sum(k * k, axis=1)
            rinv = tl.rsqrt(ss * inv_n + eps)
            z = tl.sum(x * q[None, :], axis=1) * rinv
            w = tl.exp(z - lse)
            go = tl.sum(g * x, axis=1)
            c = w * (go - gh) * rinv  # dL/dz_i * rinv_i
            coef = z * rinv * inv_n
            grad = w[:, None] * g + c[:, None] * (q[None, :] - coef[:, None] * k)
            tl.store(gbase + rows64[:, None] * d + offs[None, :], grad.to(dtype), mask=mask)
            if DQ2D:
                dq2 += c[:, None] * x
            else:
                dq += tl.sum(c[:, None] * x, axis=0)
    if DQ2D:
        dq = tl.sum(dq2, axis=0)
    tl.store(dq_part_ptr + pid.to(tl.int64) * r + (offs - (d - r)), dq, mask=tail)
