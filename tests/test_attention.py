"""Document-masked causal attention: every backend this machine has computes the same function."""

import importlib.util

import pytest
import torch

from lrattnres.attention import causal_attention, resolve_backend

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
    out = causal_attention(q, k, v, DOC_IDS.to(device), backend=backend)
    ref = _explicit_reference(q.cpu(), k.cpu(), v.cpu(), DOC_IDS)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else _tol(device)
    torch.testing.assert_close(out.cpu().double(), ref, **tol)


@BACKENDS
def test_changing_one_document_leaves_the_others(backend, device):
    dtype = torch.bfloat16 if backend == "flash" else torch.float32
    q, k, v = _qkv(dtype, device)
    doc = DOC_IDS.to(device)
    out = causal_attention(q, k, v, doc, backend=backend)
    in_doc1 = (doc == 1)[:, None, :, None]
    q2, k2, v2 = (torch.where(in_doc1, torch.randn_like(x), x) for x in (q, k, v))
    out2 = causal_attention(q2, k2, v2, doc, backend=backend)
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
    import lrattnres.attention as attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, torch.float32) == "sdpa"
    monkeypatch.setattr(attention, "_has_flash_attn", lambda: True)
    assert resolve_backend("auto", cuda, torch.bfloat16) == "flash"
    assert resolve_backend("auto", cuda, torch.float32) == "flex"  # flash-attn has no fp32 kernel
    monkeypatch.setattr(attention, "_has_flash_attn", lambda: False)
    assert resolve_backend("auto", cuda, torch.bfloat16) == "flex"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_backend("auto", cuda, torch.bfloat16) == "flex"  # inside torch.compile too
    assert resolve_backend("sdpa", cuda, torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        resolve_backend("xformers", cpu, torch.float32)


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


def test_flex_inside_torch_compile_matches_sdpa():
    """flex with the tensor-op block mask traces into one graph (fullgraph) and computes the
    masked attention (forward only: flex has no CPU backward)."""
    g = torch.Generator().manual_seed(1)
    T = 200  # not a multiple of flex's 128-token block
    doc = (torch.rand(2, T, generator=g) < 1 / 60).int().cumsum(1)
    q, k, v = (torch.randn(2, 2, T, 16, generator=g) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, d: causal_attention(q, k, v, d, backend="flex"), fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, doc), causal_attention(q, k, v, doc, backend="sdpa"), atol=1e-5, rtol=1e-5)


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
