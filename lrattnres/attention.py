"""Causal token attention with document masking.

Training packs several documents into one row; a token may attend only to earlier tokens of its own
document (``doc_ids`` [B, T] labels them; documents are contiguous runs of equal ids).  Three
backends compute the same function:

* ``sdpa``: scaled_dot_product_attention with an explicit boolean [B, 1, T, T] mask (every score
  computed); ``auto``'s choice on every device.  On CUDA it is the backend whose compiled gradients
  are measured right: on one H200 (torch 2.11) the gpu-small baseline's 150-update run with the gpu
  scale's spec has a largest gradient norm of 2.51 compiled with masked SDPA, as in eager mode,
  where the same run compiled with flex reaches norms of 5e8 to 3e18 (docs/attention.md).  Its cost:
  at accumulation 8 the compiled 1B baseline step runs 54,467 tokens/s with masked SDPA against
  61,302 with flex, 11% fewer (benchmarks/results/train_step_{flex,sdpa}_h200_2026-11-29.json);
* ``flex``: PyTorch's flex_attention with a document block mask, skipping the blocks the mask
  empties; only when asked for by name.  The mask comes from ``create_block_mask``, inside an outer
  ``torch.compile`` (traced into the compiled training step) and outside one (eager models,
  validation: flex then runs compiled on its own on CUDA, since eager flex materialises the scores).
  The tensor-op ``document_block_mask`` (equal block structure, no vmap) is what the compiled step
  used to trace; inside the model's compiled graph it gives gradients about 1,000 times too large
  in the attention's qkv weights (one H200, torch 2.11, compiled against eager against fp64,
  benchmarks/results/compiled_grad_probe_h200_2026-12-05.json), while ``create_block_mask`` traced
  there matches eager.  That check covers a 2-layer model of gpu-small's width; the compiled flex
  step has not yet passed the GPU test file or a 1B run, so a compiled training step with flex on
  CUDA prints :data:`COMPILED_FLEX_WARNING` once per process (:func:`warn_compiled_flex`).
  :data:`FLEX_VARIANT_ENV` selects variants of the flex path (:func:`flex_variant`;
  benchmarks/compiled_grad_probe.py).  flex
  needs a head width of at least 16 on CUDA;
* ``flash``: flash-attn's varlen kernel over the documents cut out of the rows (the author's
  choice); only when asked for by name (``auto`` never picks it), and only with the optional
  ``flash`` extra installed (a config that names it without the package is refused when it is
  checked).  Its bookkeeping (``Segments``: the cumulative document offsets ``cu_seqlens`` over the
  flattened rows and the longest document, ``lrattnres.segments``) is built once per batch on the
  host by the data loader and handed to the forward, so the forward never waits on the GPU.

Without ``doc_ids`` every backend is plain causal SDPA (one document per row).  RoPE positions
count from the start of the row, not of the document: RoPE scores depend only on the distance
between two tokens, and two tokens of one document are the same distance apart either way.

The model prepares the mask once per forward (``make_attention``) and every layer reuses it.
``describe`` names the backend a forward uses and its version, for the provenance of results.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lrattnres.segments import Segments, document_segments  # noqa: F401 (re-exported)

BACKENDS = ("auto", "flash", "flex", "sdpa")
FLASH_PACKAGE = "flash_attn"  # the module the ``flash`` backend imports (distribution flash-attn)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flash_installed() -> bool:
    """Whether flash-attn is installed (found, not imported: importing it loads its CUDA library)."""
    return importlib.util.find_spec(FLASH_PACKAGE) is not None


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The concrete backend ``auto`` stands for: masked ``sdpa`` on every device (on CUDA the backend
    whose compiled gradients are measured right; see the module docstring).  ``auto`` never picks
    ``flex`` or ``flash``; named backends pass through."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "sdpa"


# ---- flex under an outer torch.compile: the warning, and the variants a GPU probe compares -----------

# What a compiled training step with flex on CUDA prints, once per process (warn_compiled_flex).
COMPILED_FLEX_WARNING = (
    "warning: attention 'flex' in a compiled training step on CUDA: its gradients match eager ones on a "
    "2-layer model (one H200, torch 2.11) since its mask comes from create_block_mask, but the compiled flex "
    "step has not passed the GPU test file or a 1B run; for results, set recipe.attention to auto or sdpa "
    "(masked SDPA, checked right; docs/attention.md)")
_warned = False


def warn_compiled_flex(backend: str, device: torch.device | str, compiled: bool,
                       say: Callable[[str], None] | None = None) -> bool:
    """Print :data:`COMPILED_FLEX_WARNING` (through ``say``, else to stderr) the first time in this
    process that a compiled training step runs flex on CUDA; returns whether it printed."""
    global _warned
    if _warned or not compiled or torch.device(device).type != "cuda" or resolve_backend(backend, device) != "flex":
        return False
    _warned = True
    (say or (lambda msg: print(msg, file=sys.stderr, flush=True)))(COMPILED_FLEX_WARNING)
    return True


# Variants of the flex path, for a GPU probe that tells the candidate causes of the compiled flex
# gradients apart (benchmarks/compiled_grad_probe.py).  None is the default path.
FLEX_VARIANT_ENV = "LRATTNRES_FLEX_VARIANT"
FLEX_VARIANT_FLAGS = {
    # q, k, v made contiguous before flex (the model passes views of the fused qkv projection; upstream
    # issue 146377: a compiled flex backward gave wrong K gradients for some input strides)
    "contiguous": "q, k, v copied to contiguous tensors before flex",
    # inside the outer compile, the tensor-op document_block_mask instead of create_block_mask: the path
    # whose gradients were measured wrong, kept to reproduce the fault
    "tensor_mask": "the tensor-op document_block_mask traced inside the compiled graph instead of create_block_mask",
    # flex and its mask out of the model's graph: a graph break around each attention call, which
    # builds its mask with create_block_mask and runs flex compiled on its own (the eager model's path)
    "outside": "flex compiled on its own outside the model's graph (a graph break around each call)",
}


def parse_flex_variant(text: str | None, where: str = FLEX_VARIANT_ENV) -> frozenset[str]:
    """The flags of a comma-separated variant (empty: the default path); an unknown flag is an error
    naming ``where``."""
    flags = frozenset(f.strip() for f in (text or "").split(",") if f.strip())
    unknown = sorted(flags - set(FLEX_VARIANT_FLAGS))
    if unknown:
        raise ValueError(f"{where}={text!r}: unknown flex variant flag(s) {unknown}; expected a comma-separated "
                         f"subset of {sorted(FLEX_VARIANT_FLAGS)}, or nothing for the default path")
    return flags


_FLEX_VARIANT = parse_flex_variant(os.environ.get(FLEX_VARIANT_ENV))


def flex_variant() -> frozenset[str]:
    """The flex variant this process runs (from :data:`FLEX_VARIANT_ENV` at import, or
    :func:`set_flex_variant`)."""
    return _FLEX_VARIANT


def set_flex_variant(flags) -> frozenset[str]:
    """Run the flex variant ``flags`` (a comma-separated string or an iterable of flags) from now on;
    returns the previous one.  A model compiled before keeps what it traced: reset dynamo
    (``torch._dynamo.reset()``) before compiling again."""
    global _FLEX_VARIANT
    previous = _FLEX_VARIANT
    _FLEX_VARIANT = parse_flex_variant(flags if isinstance(flags, str) or flags is None else ",".join(flags),
                                       where="set_flex_variant")
    return previous


def describe(backend: str, device: torch.device | str, *, documents: bool = True) -> dict[str, str]:
    """``{"requested", "backend", "version"}`` of the attention a forward runs on ``device``.

    ``documents``: whether the forward gets ``doc_ids`` (training, validation, diagnostics); without
    them every backend is plain causal SDPA (the downstream evaluation).  The version is torch's for
    flex and SDPA, flash-attn's for flash."""
    used = resolve_backend(backend, torch.device(device)) if documents else "sdpa"
    out = {"requested": backend, "backend": used}
    if used == "flash":
        from importlib import metadata

        try:
            version = f"flash-attn {metadata.version('flash-attn')}"
        except metadata.PackageNotFoundError:
            version = "flash-attn (not installed)"
    else:
        version = f"torch {torch.__version__}"
    out["version"] = version
    if used == "flex" and _FLEX_VARIANT:  # a probe's variant, never the default
        out["flex_variant"] = sorted(_FLEX_VARIANT)
    return out


def make_attention(
    doc_ids: torch.Tensor | None, *, seq_len: int, device: torch.device, dtype: torch.dtype, backend: str = "auto",
    segments: Segments | None = None,
) -> Attend:
    """``attend(q, k, v)`` for q, k, v [B, H, T, hd]: causal, and within documents if ``doc_ids`` is given.

    ``segments`` (the batch's ``Segments``, on ``device``) is what the ``flash`` backend reads; the
    other backends ignore it."""
    backend = resolve_backend(backend, device, dtype)
    if doc_ids is None:
        return functools.partial(F.scaled_dot_product_attention, is_causal=True)
    if doc_ids.dim() != 2 or doc_ids.shape[1] != seq_len:
        raise ValueError(f"doc_ids must be [B, T] with T = {seq_len}, got shape {tuple(doc_ids.shape)}")
    if backend == "flash":
        if segments is None:
            raise ValueError("attention 'flash' needs the batch's Segments (cu_seqlens and max_seqlen, built on "
                             "the host by the data loader: Batch.segments); pass segments= to the model")
        return _flash_attention(doc_ids.shape[0], seq_len, segments)
    doc_ids = doc_ids.to(device)
    if backend == "sdpa":
        return _sdpa_attention(doc_ids)
    return _flex_attention(doc_ids)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None, backend: str = "auto",
    segments: Segments | None = None,
) -> torch.Tensor:
    """One-off causal document-masked attention, [B, H, T, hd] -> [B, H, T, hd]."""
    attend = make_attention(doc_ids, seq_len=q.shape[2], device=q.device, dtype=q.dtype, backend=backend,
                            segments=segments)
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

    Not the default: traced into the model's compiled graph it gives wrong gradients on CUDA
    (the module docstring); ``tensor_mask`` in :data:`FLEX_VARIANT_ENV` selects it.  This builds
    the same block structure from per-block document ranges (as modded-nanogpt does): a kv block
    is needed by a q block when it is not in the future and their document ranges overlap, and is
    *full* (no per-element mask) when both lie wholly inside one document and the
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
    of Inductor: fallback_to_eager): the compiled 1B step that reached NaN used that ordering
    (docs/attention.md; the cause is not isolated).  Each column's slot is a count (needed
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


def _create_document_mask(doc_ids: torch.Tensor):
    """create_block_mask's BlockMask of causal attention within documents."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(document_causal, B, None, T, T, device=doc_ids.device)


@torch.compiler.disable
def _flex_outside(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Variant ``outside``: one attention call out of the model's graph, as an eager model runs it
    (its mask from create_block_mask, flex compiled on its own on a GPU)."""
    return _flex_fn(q.device.type)(q, k, v, block_mask=_create_document_mask(doc_ids))


def _flex_attention(doc_ids: torch.Tensor) -> Attend:
    from torch.nn.attention.flex_attention import flex_attention

    variant = _FLEX_VARIANT
    if "contiguous" in variant:
        def prep(x):
            return x.contiguous()
    else:
        def prep(x):
            return x
    if torch.compiler.is_compiling() and "outside" in variant:
        return lambda q, k, v: _flex_outside(prep(q), prep(k), prep(v), doc_ids)
    if torch.compiler.is_compiling():
        # traced into the model's graph; the tensor-op mask only as a probe's variant (module docstring)
        block_mask = document_block_mask(doc_ids) if "tensor_mask" in variant else _create_document_mask(doc_ids)
        flex = flex_attention
    else:
        # eager: create_block_mask (the path checked on the H200) and flex's own compiled wrapper
        # on a GPU (eager flex materialises the scores)
        block_mask = _create_document_mask(doc_ids)
        flex = _flex_fn(doc_ids.device.type)
    return lambda q, k, v: flex(prep(q), prep(k), prep(v), block_mask=block_mask)


def _flash_varlen():
    """flash-attn's ``flash_attn_varlen_func`` behind a check of device and dtype, or an error saying
    how to get it."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise ImportError(
            f"attention 'flash' needs flash-attn, which does not import here ({e}); install the optional "
            "extra: pip install '.[flash]' (a CUDA build from source), or use attention 'auto' or 'flex'"
        ) from None

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention 'flash' runs on CUDA in fp16/bf16 only, got {q.dtype} on {q.device} "
                             "(use precision bf16 on a GPU, or attention 'auto')")
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)

    return varlen


def _flash_attention(B: int, T: int, segments: Segments) -> Attend:
    """Attention over the flattened rows cut at ``segments``: no read-back of any device value."""
    varlen = _flash_varlen()
    cu, max_len = segments.cu_seqlens, segments.max_seqlen

    def attend(q, k, v):
        H, hd = q.shape[1], q.shape[3]
        flat = [x.transpose(1, 2).reshape(B * T, H, hd) for x in (q, k, v)]
        out = varlen(*flat, cu, cu, max_len, max_len, causal=True)
        return out.reshape(B, T, H, hd).transpose(1, 2)

    return attend
