"""kernels.naive (the plain torch reference of the fused forward and backward) against the model's
reference, and the fused kernels (Triton's interpreter on the CPU, fp32) against kernels.naive:
the output, the saved statistics (logsumexp, scores, key 1/RMS) and every gradient, on random and
unaligned shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py does it too)

import kernels  # noqa: E402
import kernels.launch as launch  # noqa: E402
from kernels import Settings  # noqa: E402
from kernels.naive import naive_attnres, naive_attnres_bwd, naive_attnres_fwd  # noqa: E402
from lrattnres.routing import route  # noqa: E402

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing
    HAS_TRITON = False

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the fused cases' tokens: 21 on a GPU, 9 through the interpreter (odd: no token block divides them)
LEAD = (3, 7) if DEVICE == "cuda" else (3, 3)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _inputs(S, lead, d, r, dtype, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    sources = [torch.randn(*lead, d, generator=gen, device=device, dtype=torch.float64).to(dtype).requires_grad_()
               for _ in range(S)]
    query = torch.randn(r, generator=gen, device=device, dtype=torch.float64).to(dtype).requires_grad_()
    g = torch.randn(*lead, d, generator=gen, device=device, dtype=torch.float64).to(dtype)
    return sources, query, g


def _grads(fn, sources, query, g, norm):
    h = fn(sources, query, norm=norm)
    return h, torch.autograd.grad(h, [*sources, query], g)


@pytest.mark.parametrize("d,r,S,norm", [(64, 16, 5, "slice"), (64, 64, 3, "full"), (37, 5, 2, "slice"),
                                        (96, 7, 9, "full"), (33, 33, 1, "slice")])
def test_naive_matches_the_model_reference_fp64(d, r, S, norm):
    """The naive forward and its hand-written backward equal autograd through lrattnres.routing.route
    (fp64: agreement to rounding)."""
    sources, query, g = _inputs(S, (3, 5), d, r, torch.float64, seed=d + r + S)
    h, grads = _grads(naive_attnres, sources, query, g, norm)
    h_ref, grads_ref = _grads(route, sources, query, g, norm)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_naive_statistics_layout():
    """Statistics [1 + 2S, ...]: the logsumexp, the S scores, the S key 1/RMS; the weights they give
    sum to one and mix the sources into h."""
    sources, query, _ = _inputs(4, (2, 3), 40, 8, torch.float64, seed=1)
    h, stats = naive_attnres_fwd(sources, query, norm="slice", eps=1e-6)
    assert stats.shape == (9, 2, 3)
    w = torch.exp(stats[1:5] - stats[0])
    torch.testing.assert_close(w.sum(0), torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(h, sum(wi.unsqueeze(-1) * o for wi, o in zip(w, sources)))
    rms = sources[2][..., -8:].pow(2).mean(-1).add(1e-6).sqrt()
    torch.testing.assert_close(stats[5 + 2], 1 / rms)
    torch.testing.assert_close(stats[1 + 2], (sources[2][..., -8:] @ query) / rms)
    with pytest.raises(ValueError, match="norm"):
        naive_attnres(sources, query, norm="other")


# d, r, S, norm, launch configuration overrides (None: the first candidates): unaligned widths and
# key widths, LEAD tokens (no token block divides them), one to five column chunks, both backward grids
FUSED_CASES = [
    (64, 7, 3, "slice", None),
    (513, 64, 4, "full", None),  # five chunks of 128
    (300, 100, 5, "slice", {"fwd": {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 1, "KEYCH": True},
                            "bwd": {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True}}),
    (200, 200, 2, "slice", None),  # two sources: the pair forward's first candidate
    (96, 33, 6, "full", {"fwd": {"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 0},
                         "bwd": {"SB": 2, "num_warps": 2, "PREFETCH": 0}}),
]


def _fused_fwd_bwd(fn_fwd, fn_bwd, sources, query, g, norm, s):
    srcs = [x.detach() for x in sources]
    h, stats, res = fn_fwd(srcs, query.detach(), norm, 1e-6, s)
    grads, dq = fn_bwd(srcs, query.detach(), h, stats, res, g, norm, 1e-6, s)
    return h, stats, grads, dq


@needs_triton
@pytest.mark.parametrize("family", ["table", "args"])
@pytest.mark.parametrize("d,r,S,norm,override", FUSED_CASES)
def test_fused_kernels_match_naive_fp32(d, r, S, norm, override, family):
    """The fused forward's output and statistics, and the fused backward's gradients (from those
    statistics), against kernels.naive in fp32, in both kernel families (fresh outputs poisoned with
    NaN, so that an element the kernels never write shows up)."""
    s = Settings(poison=True, cpu_triton=DEVICE == "cpu", autotune=False, **(override or {}))
    sources, query, g = _inputs(S, LEAD, d, r, torch.float32, seed=7 * d + r + S, device=DEVICE)
    fwd, bwd = (launch.fwd, launch.bwd) if family == "table" else (launch.fwd_args, launch.bwd_args)
    h, stats, grads, dq = _fused_fwd_bwd(fwd, bwd, sources, query, g, norm, s)
    h_ref, stats_ref = naive_attnres_fwd([s.detach() for s in sources], query.detach(), norm=norm, eps=1e-6)
    grads_ref, dq_ref = naive_attnres_bwd([s.detach() for s in sources], query.detach(), h_ref, stats_ref, g, norm=norm)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    assert stats.shape == stats_ref.shape == (1 + 2 * S, *LEAD)
    torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-4, atol=1e-4 * max(1.0, dq_ref.abs().max().item()))


def test_cpu_fallback_matches_naive():
    """The custom op's CPU path (no Triton) gives the naive statistics and gradients."""
    sources, query, g = _inputs(5, (2, 9), 48, 12, torch.float32, seed=3)
    srcs = [s.detach() for s in sources]
    for norm in ("slice", "full"):
        h, stats, res = kernels.attnres_fwd(srcs, query.detach(), norm, 1e-6, "")
        h_ref, stats_ref = naive_attnres_fwd(srcs, query.detach(), norm=norm, eps=1e-6)
        torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(stats, stats_ref, rtol=1e-6, atol=1e-6)
        out = kernels.attnres_bwd(srcs, query.detach(), h, stats, res, g, norm, 1e-6, "")
        grads_ref, dq_ref = naive_attnres_bwd(srcs, query.detach(), h_ref, stats_ref, g, norm=norm)
        for a, b in zip(out[:-1], grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[-1], dq_ref, rtol=1e-5, atol=1e-5)
