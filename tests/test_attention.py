"""Document-masked causal attention: every backend this machine has computes the same function."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from lrattnres.attention import causal_attention, describe, resolve_backend
from lrattnres.segments import Segments, document_segments

# eager flex_attention on the CPU is the unfused reference implementation: fine for tests
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

HAS_CUDA = torch.cuda.is_available()


def _local_backends():
    """(backend, device) pairs that run here: sdpa and eager flex on the CPU; flex/flash on CUDA."""
    pairs = [("sdpa", "cpu"), ("flex", "cpu")]
    if HAS_CUDA:
        pairs += [pytest.param("sdpa", "cuda", marks=pytest.mark.gpu), pytest.param("flex", "cuda", marks=pytest.mark.gpu)]
        if importlib.util.find_spec("flash_attn") is not None:
            pairs += [pytest.param("flash", "cuda", marks=pytest.mark.gpu)]
    return pairs


BACKENDS = pytest.mark.parametrize("backend,device", _local_backends())

DOC_IDS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16, [4] * 1 + [5] * 14 + [6] * 1])


def _explicit_reference(q, k, v, doc_ids):
    """softmax(q k^T / sqrt(hd) + mask) v, written out, in fp64."""
    q, k, v = (x.double() for x in (q, k, v))
    T = q.shape[2]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        allowed = allowed[:, None]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def _qkv(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 2, 16, 16, generator=g).to(device=device, dtype=dtype) for _ in range(3)]  # flex on CUDA: hd >= 16


def _tol(device):
    return dict(atol=1e-5, rtol=1e-5) if device == "cpu" else dict(atol=2e-3, rtol=2e-3)


@BACKENDS
def test_backend_matches_explicit_softmax(backend, device):
    dtype = torch.bfloat16 if backend == "flash" else torch.float32
    q, k, v = _qkv(dtype, device)
    out = causal_attention(q, k, v, DOC_IDS.to(device), backend=backend, segments=document_segments(DOC_IDS).to(device))
    ref = _explicit_reference(q.cpu(), k.cpu(), v.cpu(), DOC_IDS)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else _tol(device)
    torch.testing.assert_close(out.cpu().double(), ref, **tol)


@BACKENDS
def test_changing_one_document_leaves_the_others(backend, device):
    dtype = torch.bfloat16 if backend == "flash" else torch.float32
    q, k, v = _qkv(dtype, device)
    doc = DOC_IDS.to(device)
    segs = document_segments(DOC_IDS).to(device)
    out = causal_attention(q, k, v, doc, backend=backend, segments=segs)
    in_doc1 = (doc == 1)[:, None, :, None]
    q2, k2, v2 = (torch.where(in_doc1, torch.randn_like(x), x) for x in (q, k, v))
    out2 = causal_attention(q2, k2, v2, doc, backend=backend, segments=segs)
    outside = ~in_doc1.expand_as(out)
    assert torch.equal(out[outside], out2[outside])
    assert not torch.allclose(out[~outside], out2[~outside])


def test_no_doc_ids_is_plain_causal():
    q, k, v = _qkv()
    torch.testing.assert_close(causal_attention(q, k, v).double(), _explicit_reference(q, k, v, None), atol=1e-5, rtol=1e-5)


def test_sdpa_backward_matches_reference():
    q, k, v = (x.double().requires_grad_(True) for x in _qkv())
    causal_attention(q, k, v, DOC_IDS, backend="sdpa").square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    _explicit_reference(q, k, v, DOC_IDS).square().sum().backward()
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, x.grad)


def test_auto_backend_choice(monkeypatch):
    """auto is masked SDPA on every device (on CUDA the backend whose compiled gradients are measured
    right), installed flash-attn or not, inside torch.compile or not; named backends pass through."""
    import lrattnres.attention as attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for installed in (True, False):
        monkeypatch.setattr(attention, "flash_installed", lambda: installed)
        assert resolve_backend("auto", cpu, torch.float32) == "sdpa"
        assert resolve_backend("auto", cuda, torch.bfloat16) == "sdpa"
        assert resolve_backend("auto", cuda, torch.float32) == "sdpa"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_backend("auto", cuda, torch.bfloat16) == "sdpa"
    assert resolve_backend("flex", cuda, torch.bfloat16) == "flex"
    assert resolve_backend("sdpa", cuda, torch.bfloat16) == "sdpa"
    assert resolve_backend("flash", cpu) == "flash"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        resolve_backend("xformers", cpu, torch.float32)


def test_describe_names_the_backend_that_runs_and_its_version(monkeypatch):
    import lrattnres.attention as attention

    v = f"torch {torch.__version__}"
    assert describe("auto", "cpu") == {"requested": "auto", "backend": "sdpa", "version": v}
    assert describe("auto", "cuda") == {"requested": "auto", "backend": "sdpa", "version": v}
    assert describe("flex", "cuda") == {"requested": "flex", "backend": "flex", "version": v}
    assert describe("flex", "cuda", documents=False) == {"requested": "flex", "backend": "sdpa", "version": v}
    assert describe("flash", "cuda")["version"].startswith("flash-attn ")
    # a probe's flex variant is part of the record; it changes nothing for the other backends
    monkeypatch.setattr(attention, "_FLEX_VARIANT", frozenset({"outside", "contiguous"}))
    assert describe("flex", "cuda")["flex_variant"] == ["contiguous", "outside"]
    assert "flex_variant" not in describe("auto", "cuda")


def test_compiled_flex_on_cuda_warns_once_per_process(monkeypatch):
    """The warning comes for a compiled step with flex on CUDA only, once, and says what was checked
    and what to use for results."""
    import lrattnres.attention as attention

    monkeypatch.setattr(attention, "_warned", False)
    said = []
    for backend, device, compiled in (("flex", "cpu", True), ("flex", "cuda", False), ("auto", "cuda", True),
                                      ("sdpa", "cuda", True)):
        assert not attention.warn_compiled_flex(backend, device, compiled, said.append)
    assert said == []
    assert attention.warn_compiled_flex("flex", torch.device("cuda"), True, said.append)
    assert not attention.warn_compiled_flex("flex", "cuda", True, said.append)
    assert said == [attention.COMPILED_FLEX_WARNING]
    line = said[0]
    assert "\n" not in line and "create_block_mask" in line and "1B run" in line and "masked SDPA" in line


def test_flex_variant_is_parsed_strictly(monkeypatch):
    import lrattnres.attention as attention

    assert attention.parse_flex_variant(None) == frozenset()
    assert attention.parse_flex_variant(" contiguous, outside ,") == {"contiguous", "outside"}
    with pytest.raises(ValueError, match=r"LRATTNRES_FLEX_VARIANT='contigous'.*unknown.*contiguous"):
        attention.parse_flex_variant("contigous")
    monkeypatch.setattr(attention, "_FLEX_VARIANT", frozenset())
    assert attention.set_flex_variant(["tensor_mask"]) == frozenset()
    assert attention.flex_variant() == {"tensor_mask"}
    with pytest.raises(ValueError, match="set_flex_variant"):
        attention.set_flex_variant("inside")
    assert attention.flex_variant() == {"tensor_mask"}  # a refused variant changes nothing


# ---- flash-attn's varlen path, on the CPU with a stand-in for its kernel -----------------------------


def test_document_segments_cut_rows_and_documents():
    seg = document_segments(DOC_IDS)
    # rows of 16: [5, 7, 4], [16], [1, 14, 1]
    assert seg.cu_seqlens.dtype == torch.int32 and seg.cu_seqlens.device.type == "cpu"
    assert seg.cu_seqlens.tolist() == [0, 5, 12, 16, 32, 33, 47, 48]
    assert seg.max_seqlen == 16
    # equal ids in consecutive rows are still two documents (a row start opens one)
    same = document_segments(torch.zeros(2, 4, dtype=torch.int32))
    assert same.cu_seqlens.tolist() == [0, 4, 8] and same.max_seqlen == 4
    # labels that come back later are a new run
    back = document_segments(torch.tensor([[0, 0, 1, 0, 0, 0]]))
    assert back.cu_seqlens.tolist() == [0, 2, 3, 6] and back.max_seqlen == 3
    with pytest.raises(ValueError, match="on the host"):
        document_segments(DOC_IDS.to("meta"))


def _per_segment_sdpa(calls):
    """A stand-in for flash_attn_varlen_func: causal SDPA over each segment of the flattened tokens."""

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        assert causal and cu_q is cu_k and max_q == max_k and cu_q.dtype == torch.int32
        bounds = cu_q.tolist()
        assert max_q == max(b - a for a, b in zip(bounds, bounds[1:])), "max_seqlen is not the longest segment"
        calls.append((bounds, max_q))
        out = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True).transpose(0, 1)
               for a, b in zip(bounds, bounds[1:])]
        return torch.cat(out)

    return varlen


@pytest.fixture
def stand_in_flash(monkeypatch):
    import lrattnres.attention as attention

    calls = []
    monkeypatch.setattr(attention, "_flash_varlen", lambda: _per_segment_sdpa(calls))
    return calls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_varlen_bookkeeping_matches_block_diagonal_sdpa(stand_in_flash, seed):
    """The flash path's flattening, offsets and reshaping against SDPA with a block-diagonal mask."""
    g = torch.Generator().manual_seed(seed)
    B, H, T, hd = 3, 2, 40, 8
    doc = (torch.rand(B, T, generator=g) < 0.1).int().cumsum(1)
    q, k, v = (torch.randn(B, H, T, hd, generator=g) for _ in range(3))
    seg = document_segments(doc)
    out = causal_attention(q, k, v, doc, backend="flash", segments=seg)
    torch.testing.assert_close(out, causal_attention(q, k, v, doc, backend="sdpa"), atol=1e-6, rtol=1e-5)
    assert stand_in_flash == [(seg.cu_seqlens.tolist(), seg.max_seqlen)]


def test_flash_forward_reads_nothing_back_from_the_device(stand_in_flash, monkeypatch):
    """With every tensor on the meta device (no values at all), preparing and running the flash path
    works: nothing in it reads a device value on the host (the old path's nonzero() and int(max())
    did).  Only the kernel stand-in is replaced by a shape-only one."""
    import lrattnres.attention as attention

    monkeypatch.setattr(attention, "_flash_varlen", lambda: (lambda q, k, v, *a, causal: torch.empty_like(q)))
    B, H, T, hd = 2, 2, 16, 8
    q, k, v = (torch.empty(B, H, T, hd, device="meta") for _ in range(3))
    doc = torch.empty(B, T, dtype=torch.int32, device="meta")
    seg = Segments(torch.empty(5, dtype=torch.int32, device="meta"), 9)
    assert causal_attention(q, k, v, doc, backend="flash", segments=seg).shape == (B, H, T, hd)


def test_flash_needs_the_loaders_segments():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Segments"):
        causal_attention(q, k, v, DOC_IDS, backend="flash")


def test_flash_without_the_package_says_how_to_get_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_flash(name, *a, **kw):
        if name.split(".")[0] == "flash_attn":
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_flash)
    q, k, v = _qkv()
    with pytest.raises(ImportError, match=r"flash-attn.*\[flash\]"):
        causal_attention(q, k, v, DOC_IDS, backend="flash", segments=document_segments(DOC_IDS))


def test_bad_doc_ids_shape():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="doc_ids must be"):
        causal_attention(q, k, v, DOC_IDS[:, :8])


@pytest.mark.parametrize("T", [2048, 300, 128, 77])
def test_document_block_mask_equals_create_block_mask(T):
    """The tensor-op block mask (used inside torch.compile) has exactly create_block_mask's blocks:
    the same partial and full block counts and block sets, per q block and per kv block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from lrattnres.attention import document_block_mask

    g = torch.Generator().manual_seed(T)
    doc = (torch.rand(3, T, generator=g) < 1 / 150).int().cumsum(1)
    doc[1] = 7  # one document over the whole row
    doc[2] = (torch.arange(T) // 37) % 2  # labels that repeat: runs, not ids, define documents
    runs = torch.cat([torch.zeros(3, 1, dtype=torch.int32), (doc[:, 1:] != doc[:, :-1]).int()], 1).cumsum(1)
    ref = create_block_mask(lambda b, h, q, kv: (q >= kv) & (runs[b, q] == runs[b, kv]), 3, None, T, T, device="cpu")
    ours = document_block_mask(doc)

    def blocks(num, idx):
        return [sorted(idx[b, 0, i, : num[b, 0, i]].tolist()) for b in range(3) for i in range(num.shape[2])]

    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert blocks(ours.kv_num_blocks, ours.kv_indices) == blocks(ref.kv_num_blocks, ref.kv_indices)
    assert blocks(ours.full_kv_num_blocks, ours.full_kv_indices) == blocks(ref.full_kv_num_blocks, ref.full_kv_indices)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    # the transposed (q-direction) blocks that flex's backward reads
    assert torch.equal(ours.q_num_blocks, ref.q_num_blocks)
    assert torch.equal(ours.full_q_num_blocks, ref.full_q_num_blocks)
    assert blocks(ours.q_num_blocks, ours.q_indices) == blocks(ref.q_num_blocks, ref.q_indices)
    assert blocks(ours.full_q_num_blocks, ours.full_q_indices) == blocks(ref.full_q_num_blocks, ref.full_q_indices)


@pytest.mark.parametrize("variant", ["", "contiguous", "tensor_mask", "outside"])
def test_flex_inside_torch_compile_matches_sdpa(variant, monkeypatch):
    """flex with the tensor-op block mask traces into one graph (fullgraph) and computes the
    masked attention (forward only: flex has no CPU backward); so does every variant a GPU probe
    compares (``outside`` breaks the graph around the call, so it compiles without fullgraph)."""
    import lrattnres.attention as attention

    monkeypatch.setattr(attention, "_FLEX_VARIANT", attention.parse_flex_variant(variant))
    own = []  # calls of flex on its own (outside the model's graph), at run time
    real = attention._flex_fn
    monkeypatch.setattr(attention, "_flex_fn", lambda device_type: own.append(device_type) or real(device_type))
    g = torch.Generator().manual_seed(1)
    T = 200  # not a multiple of flex's 128-token block
    doc = (torch.rand(2, T, generator=g) < 1 / 60).int().cumsum(1)
    q, k, v = (torch.randn(2, 2, T, 16, generator=g) for _ in range(3))
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # a strided view, as the model's permuted qkv
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, d: causal_attention(q, k, v, d, backend="flex"),
                             fullgraph=variant != "outside", dynamic=False)
    out = compiled(q, k, v, doc)
    assert own == (["cpu"] if variant == "outside" else [])
    torch.testing.assert_close(out, causal_attention(q, k, v, doc, backend="sdpa"), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mean_doc", [1000.0, 60.0])
def test_flex_compiled_in_graph_matches_sdpa_gpu(mean_doc):
    """flex with the in-graph block mask, compiled as in the training step (bf16, T = 2048, synthetic
    documents), against masked SDPA, forward and backward: the path that reached NaN losses on the
    H200 with from_kv_blocks' argsort-built indices."""
    g = torch.Generator().manual_seed(int(mean_doc))
    B, H, T, hd = 2, 4, 2048, 128
    doc = (torch.rand(B, T, generator=g) < 1 / mean_doc).int().cumsum(1).cuda()
    q, k, v = (torch.randn(B, H, T, hd, generator=g).cuda().to(torch.bfloat16).requires_grad_() for _ in range(3))
    go = torch.randn(B, H, T, hd, generator=g).cuda().to(torch.bfloat16)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, d: causal_attention(q, k, v, d, backend="flex"), fullgraph=True, dynamic=False)
    out = fn(q, k, v, doc)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = causal_attention(q, k, v, doc, backend="sdpa")
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for name, a, b in (("out", out, ref), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        assert torch.isfinite(a).all(), f"{name}: non-finite"
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, f"{name}: relative L2 {rel:.2e} against masked SDPA"
