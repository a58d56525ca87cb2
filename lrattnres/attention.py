"""Causal token attention with document masking.

Training packs several documents into one row; a token may attend only to earlier tokens of its own
document (``doc_ids`` [B, T] labels them; documents are contiguous runs of equal ids).  Three
backends compute the same function:

* ``flash``: flash-attn's varlen kernel over the documents cut out of the rows (the author's
  choice); used by ``auto`` when flash-attn imports and the inputs are CUDA fp16/bf16;
* ``flex``: PyTorch's flex_attention with a document block mask, skipping the blocks the mask
  empties (compiled on CUDA); ``auto``'s choice on CUDA without flash-attn.  Inside an outer
  ``torch.compile`` the block mask is built from tensor ops (``document_block_mask``, equal to
  ``create_block_mask``'s), so it traces with no graph break.  An earlier build of that mask (index
  lists ordered by ``BlockMask.from_kv_blocks``' argsort), with an fp32 residual stream, gave the
  compiled 1B step a first loss 1.3e-3 off masked SDPA's and NaN within 8 updates on an H200
  (torch 2.11); with this build and the bf16 stream it matches SDPA's first loss to 1e-5 and stayed
  finite in every run since (benchmarks/results/train_step_bench_paper_*.md: 8 updates of 64
  micro-batches per configuration).  Which of the two changes cured it is not isolated: in
  isolation both mask builds match SDPA (benchmarks/results/flex_mask_check_h200_2026-11-29.json).
  At accumulation 8 the 1B baseline step ran 61,302-61,890 tokens/s with it against 54,206-55,218
  with masked SDPA (separate runs).  flex needs a head width of at least 16 on CUDA;
* ``sdpa``: scaled_dot_product_attention with an explicit boolean [B, 1, T, T] mask (every score
  computed); ``auto``'s choice on the CPU.

Without ``doc_ids`` every backend is plain causal SDPA (one document per row).  RoPE positions
count from the start of the row, not of the document: RoPE scores depend only on the distance
between two tokens, and two tokens of one document are the same distance apart either way.

The model prepares the mask once per forward (``make_attention``) and every layer reuses it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "flash", "flex", "sdpa")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend ``auto`` stands for on this device and dtype (others pass through)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "sdpa"
    if dtype in (torch.float16, torch.bfloat16) and _has_flash_attn():
        return "flash"
    return "flex"


def make_attention(
    doc_ids: torch.Tensor | None, *, seq_len: int, device: torch.device, dtype: torch.dtype, backend: str = "auto"
) -> Attend:
    """``attend(q, k, v)`` for q, k, v [B, H, T, hd]: causal, and within documents if ``doc_ids`` is given."""
    backend = resolve_backend(backend, device, dtype)
    if doc_ids is None:
        return functools.partial(F.scaled_dot_product_attention, is_causal=True)
    if doc_ids.dim() != 2 or doc_ids.shape[1] != seq_len:
        raise ValueError(f"doc_ids must be [B, T] with T = {seq_len}, got shape {tuple(doc_ids.shape)}")
    doc_ids = doc_ids.to(device)
    if backend == "sdpa":
        return _sdpa_attention(doc_ids)
    if backend == "flex":
        return _flex_attention(doc_ids)
    return _flash_attention(doc_ids)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """One-off causal document-masked attention, [B, H, T, hd] -> [B, H, T, hd]."""
    attend = make_attention(doc_ids, seq_len=q.shape[2], device=q.device, dtype=q.dtype, backend=backend)
    return attend(q, k, v)


def _sdpa_attention(doc_ids: torch.Tensor) -> Attend:
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    mask = (causal & (doc_ids[:, :, None] == doc_ids[:, None, :])).unsqueeze(1)  # [B, 1, T, T]
    return functools.partial(F.scaled_dot_product_attention, attn_mask=mask)


@functools.cache
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # Eager flex_attention materialises the scores: fine on the CPU (tests), too slow on a GPU.
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


FLEX_BLOCK = 128  # flex_attention's default tile; the block mask below is built at this granularity


def document_block_mask(doc_ids: torch.Tensor, block: int = FLEX_BLOCK):
    """flex_attention's BlockMask for causal attention within documents, from tensor ops alone.

    ``create_block_mask`` evaluates the mask function over every (q, kv) pair through vmap; traced
    inside an outer ``torch.compile`` on torch 2.11 that path ended in an illegal memory access.
    This builds the same block structure from per-block document ranges (as modded-nanogpt does):
    a kv block is needed by a q block when it is not in the future and their document ranges
    overlap, and is *full* (no per-element mask) when both lie wholly inside one document and the
    kv block is strictly earlier.  Documents are renumbered as runs, so any labelling works.  The
    block index lists are built without a sort (``_ordered_blocks``), in both directions.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, T = doc_ids.shape
    change = torch.zeros_like(doc_ids, dtype=torch.int32)  # 1 where a new document starts
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    runs = change.cumsum(1, dtype=torch.int32)  # [B, T], non-decreasing along the row
    nb = -(-T // block)
    pad = nb * block - T
    if pad:  # the last block's range: its real tokens only (repeat the last id)
        runs_p = torch.cat([runs, runs[:, -1:].expand(B, pad)], dim=1)
    else:
        runs_p = runs
    per_block = runs_p.view(B, nb, block)
    lo, hi = per_block[:, :, 0], per_block[:, :, -1]  # [B, nb] (runs are sorted within a row)
    idx = torch.arange(nb, device=doc_ids.device)
    causal = idx[:, None] >= idx[None, :]  # q block i, kv block j <= i
    overlap = (lo[:, None, :] <= hi[:, :, None]) & (hi[:, None, :] >= lo[:, :, None])  # [B, i, j]
    any_ = causal[None] & overlap
    one_doc = lo == hi
    if pad:  # a block holding padding positions is partial, as create_block_mask makes it
        one_doc[:, -1] = False
    full = (idx[:, None] > idx[None, :])[None] & one_doc[:, :, None] & one_doc[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    partial = any_ & ~full

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (runs[b, q_idx] == runs[b, kv_idx])

    kv_num, kv_idx = _ordered_blocks(partial)
    full_num, full_idx = _ordered_blocks(full)
    q_num, q_idx = _ordered_blocks(partial.transpose(1, 2))  # the kv-major view flex's backward reads
    full_q_num, full_q_idx = _ordered_blocks(full.transpose(1, 2))
    return BlockMask(
        (T, T), kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx,
        BLOCK_SIZE=(block, block), mask_mod=document_causal,
    )


def _ordered_blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, rows, cols] bool -> counts [B, 1, rows] and column indices [B, 1, rows, cols], each row's
    needed columns first, in order.

    Without a sort (BlockMask.from_kv_blocks orders with torch.argsort, which torch 2.13 keeps out
    of Inductor: fallback_to_eager): the compiled 1B step that reached NaN used that ordering (see
    the module docstring; the cause is not isolated).  Each column's slot is a count (needed
    columns before it, or the row's count plus the unneeded ones before it) and the indices are a
    one-hot sum over slots: elementwise ops and sums only, [B, R, C, C] int32 (16^3 per batch row
    at T = 2048).
    """
    B, R, C = m.shape
    mi = m.to(torch.int32)
    counts = mi.sum(-1, dtype=torch.int32)  # [B, R]
    col = torch.arange(C, device=m.device, dtype=torch.int32)
    before = mi.cumsum(-1, dtype=torch.int32) - mi  # needed columns left of each column
    slot = torch.where(m, before, counts[..., None] + (col - before))  # a permutation of 0..C-1 per row
    onehot = slot[:, :, None, :] == col[None, None, :, None]  # [B, R, slot, column]
    order = (onehot.to(torch.int32) * col).sum(-1, dtype=torch.int32)
    return counts[:, None].contiguous(), order[:, None].contiguous()


def _flex_attention(doc_ids: torch.Tensor) -> Attend:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if torch.compiler.is_compiling():
        # traced into the model's graph, with the tensor-op block mask (see the module docstring)
        block_mask, flex = document_block_mask(doc_ids), flex_attention
    else:
        # eager: create_block_mask (the path checked on the H200) and flex's own compiled wrapper
        # on a GPU (eager flex materialises the scores)
        B, T = doc_ids.shape

        def document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        block_mask = create_block_mask(document_causal, B, None, T, T, device=doc_ids.device)
        flex = _flex_fn(doc_ids.device.type)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def _flash_attention(doc_ids: torch.Tensor) -> Attend:
    from flash_attn import flash_attn_varlen_func

    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]  # a row start always opens a document
    cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([B * T], device=doc_ids.device)])
    cu = cu.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())

    def attend(q, k, v):
        H, hd = q.shape[1], q.shape[3]
        flat = [x.transpose(1, 2).reshape(B * T, H, hd) for x in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu, cu, max_len, max_len, causal=True)
        return out.reshape(B, T, H, hd).transpose(1, 2)

    return attend
