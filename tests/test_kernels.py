"""Fused depth-routing kernels (kernels.attnres) held to the reference lrattnres.routing.route.

CPU: the Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1) in fp32, on a small
token count and a subsampled grid that still covers every value of each axis (d, r, S, norm,
strided inputs).  GPU (marked ``gpu``, skipped without CUDA): bf16 with the paper's elementwise
criterion |x - ref| <= 0.05 + 0.05 |ref|, relative L2 errors printed for the output, the source
gradients and the query gradient.  Outputs and gradient buffers are filled with NaN before each
kernel runs (the settings' poison), so an element the kernels never write fails the test.  Each case
passes its settings (``_settings``): autotuning off, so that every case compiles only what it pins
or the first candidate; the tuner's own cases turn it on.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # must be set before triton is imported (tests/conftest.py does it first; this covers running the
    # module some other way)
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing
    HAS_TRITON = False

import kernels  # noqa: E402
import kernels.autograd as autograd  # noqa: E402
import kernels.configs as configs  # noqa: E402
import kernels.dispatch as dispatch  # noqa: E402
import kernels.launch as launch  # noqa: E402
import kernels.tuner as tuner  # noqa: E402
from kernels import DEFAULT, Settings  # noqa: E402
from lrattnres.routing import route  # noqa: E402

if HAS_TRITON and not HAS_CUDA:
    # tests/conftest.py sets TRITON_INTERPRET before anything imports triton; a kernel decorated
    # without it would fail in every interpreted launch
    from triton.runtime.interpreter import InterpretedFunction

    import kernels.fused_fwd  # noqa: E402

    assert isinstance(kernels.fused_fwd._attnres_fwd_kernel, InterpretedFunction), \
        "kernels were compiled-mode: set TRITON_INTERPRET=1 before triton is imported"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _settings(**changes) -> Settings:
    """The tests' settings: fresh outputs poisoned, CPU tensors through the interpreter, no tuning
    (``changes`` may turn it on)."""
    return Settings(**{"poison": True, "cpu_triton": not HAS_CUDA, "autotune": False, **changes})


def _with(fn, s: Settings):
    """``fn`` (an attnres-like callable) with these settings."""
    return lambda sources, query, norm="slice": fn(sources, query, norm=norm, settings=s)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


# The tokens of the fp32 cases, as leading dims [*LEAD, d]: two of them (the transposed layout then has
# no flat [N, d] view), an odd count (no token block of 2, 4 or 8 divides it: a partial last block).
# Through the interpreter, whose cost grows with the programs it runs one by one, 9; on a GPU 21.
LEAD = (3, 7) if HAS_CUDA else (3, 3)


def _make_sources(S, lead, d, dtype, device, layout, gen):
    """Fresh random sources of shape [*lead, d] laid out in different ways."""
    out = []
    for i in range(S):
        kind = layout if layout != "mixed" else ("contig", "rowpad", "transposed", "colstride")[i % 4]
        if kind == "contig":
            t = torch.randn(*lead, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
        elif kind == "rowpad":  # a feature slice of a wider buffer: row stride > d
            t = torch.randn(*lead, d + 5, generator=gen, device=device, dtype=torch.float32).to(dtype)[..., 3 : 3 + d]
        elif kind == "transposed":  # leading dims swapped: no flat [N, d] view exists
            t = torch.randn(*reversed(lead), d, generator=gen, device=device, dtype=torch.float32).to(dtype)
            t = t.transpose(0, 1) if len(lead) == 2 else t
        elif kind == "colstride":  # feature stride 2
            t = torch.randn(*lead, 2 * d, generator=gen, device=device, dtype=torch.float32).to(dtype)[..., ::2]
        else:
            raise ValueError(kind)
        assert t.shape == (*lead, d)
        out.append(t.requires_grad_())
    return out


def _run(fn, sources, query, g, norm):
    for s in sources:
        s.grad = None
    query.grad = None
    h = fn(sources, query, norm=norm)
    grads = torch.autograd.grad(h, [*sources, query], g)
    return h, grads[:-1], grads[-1]


# Every value of each axis appears; d/8 for 513 is 64.
CPU_CASES = [
    # d, r, S, norm, layout
    (64, 1, 1, "slice", "contig"),
    (64, 7, 33, "full", "contig"),
    (64, 8, 2, "slice", "mixed"),
    (64, 64, 9, "full", "contig"),
    (64, 16, 64, "slice", "contig"),
    (513, 1, 9, "full", "rowpad"),
    (513, 7, 2, "slice", "contig"),
    (513, 64, 1, "full", "contig"),
    (513, 513, 9, "slice", "mixed"),
    (1536, 1, 2, "slice", "transposed"),
    (1536, 7, 1, "full", "contig"),
    (1536, 192, 9, "slice", "contig"),
    (1536, 1536, 2, "full", "colstride"),
    (1024, 256, 5, "full", "mixed"),  # two chunks of 512
    (2560, 640, 3, "slice", "rowpad"),  # five chunks of 512
]


@needs_triton
@pytest.mark.parametrize("d,r,S,norm,layout", CPU_CASES)
def test_triton_matches_reference_fp32(d, r, S, norm, layout, s=None):
    device = "cuda" if HAS_CUDA else "cpu"
    gen = torch.Generator(device=device).manual_seed(1000 * d + 10 * r + S)
    lead = LEAD
    sources = _make_sources(S, lead, d, torch.float32, device, layout, gen)
    query = torch.randn(r, generator=gen, device=device).requires_grad_()
    g = torch.randn(*lead, d, generator=gen, device=device)
    h, gs, gq = _run(_with(kernels.attnres_triton, s or _settings()), sources, query, g, norm)
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, norm)
    assert h.dtype == h_ref.dtype and h.shape == h_ref.shape
    assert torch.isfinite(h).all()
    # logits of size ~sqrt(r)|q| carry fp32 rounding of ~1e-6 relative into the weights
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    assert _rel(h, h_ref) < 1e-5
    # Gradients: dz_i = w_i (g.o_i - g.h) cancels terms of size ~sqrt(d); fp32 rounding of those (the
    # fp32 reference's own error against float64 is ~1e-4 at d=1536) sets the absolute tolerance.
    for a, b in zip(gs, gs_ref):
        assert a.shape == b.shape and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        assert _rel(a, b) < 1e-4
    assert gq.shape == query.shape and torch.isfinite(gq).all()
    torch.testing.assert_close(gq, gq_ref, rtol=1e-3, atol=2e-3 * max(1.0, gq_ref.abs().max().item()))


@needs_triton
def test_triton_fused_reductions():
    """The GPU's multi-operand row reductions (the interpreter defaults to separate sums)."""
    s = _settings(fused_reductions=True)
    test_triton_matches_reference_fp32(64, 7, 5, "slice", "mixed", s)
    test_triton_matches_reference_fp32(48, 48, 3, "full", "contig", s)


# Launch configurations the default may not pick: every sources-per-step count, prefetch on and off,
# the eviction hint, Triton's loop pipelining, one column chunk and three; both kernel families.
CONFIG_CASES = [
    # forward (BLOCK_T, warps, prefetch, evict), backward (SB, warps, prefetch, evict), shape
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1}, {"SB": 1, "num_warps": 2, "PREFETCH": 1},
     (64, 7, 5, "slice", "mixed")),
    ({"BLOCK_T": 2, "num_warps": 4, "PREFETCH": 0, "EVICT": True, "SPLIT": False},
     {"SB": 2, "num_warps": 4, "PREFETCH": 0, "EVICT": True, "SPLIT": False},
     (513, 513, 3, "full", "rowpad")),
    ({"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "STAGES": 2}, {"SB": 2, "num_warps": 2, "PREFETCH": 0, "STAGES": 3},
     (300, 200, 7, "slice", "mixed")),  # three chunks of 128, the key across two of them; pipelined loops
    ({"BLOCK_T": 4, "num_warps": 4, "PREFETCH": 1}, {"SB": 4, "num_warps": 4, "PREFETCH": 1},
     (513, 64, 9, "slice", "transposed")),
    ({"BLOCK_T": 8, "num_warps": 8, "PREFETCH": 0}, {"SB": 8, "num_warps": 8, "PREFETCH": 0},
     (200, 40, 6, "slice", "colstride")),
    ({"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 1, "EVICT": True}, {"SB": 4, "num_warps": 1, "PREFETCH": 1, "EVICT": True},
     (96, 33, 2, "full", "contig")),
    # the token-tile backward (BLOCK_T tokens per program, no persistent loop)
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1}, {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},
     (300, 200, 7, "slice", "mixed")),  # three chunks
    ({"BLOCK_T": 2, "num_warps": 4, "PREFETCH": 0}, {"BLOCK_T": 4, "num_warps": 4, "PREFETCH": 0, "STAGES": 2},
     (513, 7, 9, "full", "transposed")),  # LEAD: a partial last block; pipelined loop
    ({"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 1}, {"BLOCK_T": 2, "num_warps": 1, "PREFETCH": 1, "SPLIT": False},
     (64, 64, 1, "slice", "colstride")),  # one source
    # key-chunk specialisation (KEYCH): the key inside the last chunk (KEY0 2) or the last two (KEY0 1)
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True}, {"SB": 1, "num_warps": 2, "PREFETCH": 0, "KEYCH": True},
     (300, 40, 5, "slice", "mixed")),
    ({"BLOCK_T": 2, "num_warps": 4, "PREFETCH": 0, "KEYCH": True},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True}, (513, 7, 4, "full", "transposed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True}, {"SB": 2, "num_warps": 2, "PREFETCH": 1, "KEYCH": True},
     (600, 50, 9, "full", "rowpad")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 0, "KEYCH": True}, {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "KEYCH": True},
     (300, 100, 3, "slice", "contig")),
    # other chunk counts (SPLIT forces one): two, four (the last chunk past d: empty), five
    ({"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 1, "SPLIT": 2},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "SPLIT": 2}, (300, 40, 2, "slice", "mixed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "SPLIT": 4},
     {"SB": 2, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "SPLIT": 4}, (513, 200, 7, "full", "transposed")),
    ({"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 0, "KEYCH": True, "SPLIT": 5},
     {"BLOCK_T": 2, "num_warps": 1, "PREFETCH": 0, "KEYCH": True, "SPLIT": 5}, (640, 100, 4, "slice", "colstride")),
    ({"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "SPLIT": 5},
     {"SB": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "SPLIT": 5}, (640, 250, 3, "full", "mixed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "SPLIT": 5}, {"SB": 1, "num_warps": 2, "PREFETCH": 0, "SPLIT": 5},
     (600, 600, 2, "slice", "contig")),  # the key in every chunk
    ({"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 1}, {"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 1, "SPLIT": False},
     (64, 64, 1, "slice", "colstride")),
    # the token-tile backward two sources per step (PAIR): S odd (a masked last source) and even, one source
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "PAIR": True}, (300, 40, 5, "slice", "mixed")),
    ({"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0},
     {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "PAIR": True, "SPLIT": 5}, (640, 250, 4, "full", "transposed")),
    ({"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 1},
     {"BLOCK_T": 4, "num_warps": 1, "PREFETCH": 1, "PAIR": True, "SPLIT": False}, (64, 64, 1, "slice", "colstride")),
    # the deferred backward (DEFER: two passes, g.h from the sources): the key from chunk 1 of 2 and of 3
    # (chunk 1 read again beside the last), from chunk 2 of 3, 3 of 5 and 4 of 5; one and two tokens
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "DEFER": True, "SPLIT": 2}, (256, 100, 2, "slice", "contig")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},
     {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "DEFER": True, "SPLIT": 3}, (384, 200, 6, "slice", "mixed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "DEFER": True}, (300, 40, 5, "slice", "mixed")),
    ({"BLOCK_T": 2, "num_warps": 1, "PREFETCH": 1, "SPLIT": 5},
     {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "DEFER": True, "SPLIT": 5}, (640, 250, 4, "slice", "transposed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "SPLIT": 5},
     {"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 1, "KEYCH": True, "DEFER": True, "SPLIT": 5}, (640, 100, 3, "slice", "colstride")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},  # the two-token deferred candidate (4 warps)
     {"BLOCK_T": 2, "num_warps": 4, "PREFETCH": 1, "KEYCH": True, "DEFER": True, "SPLIT": 3}, (384, 200, 9, "slice", "contig")),
    # PERSIST: the token blocks looped over by PERSIST programs per multiprocessor (2 on the CPU: each
    # program takes about half the blocks), deferred and with the residual, PAIR
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "DEFER": True, "SPLIT": 3, "PERSIST": 1},
     (384, 200, 6, "slice", "mixed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 0},
     {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 1, "KEYCH": True, "PAIR": True, "PERSIST": 1}, (300, 40, 5, "full", "contig")),
    # the resident pair (DEFER with PAIR, S = 2: one step, g.h from the pair): the key in every chunk
    # ("full", r = d), from chunk 2 of 3 (looped), in the last of 5 with two tokens, one chunk; with the
    # pair forward (PAIR, S = 2: both sources at once) in all but the second case
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 0, "PAIR": True, "SPLIT": 3},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "DEFER": True, "PAIR": True, "SPLIT": 3},
     (384, 384, 2, "full", "mixed")),
    ({"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "DEFER": True, "PAIR": True, "SPLIT": 3, "PERSIST": 1},
     (384, 100, 2, "slice", "transposed")),
    ({"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "EVICT": True, "PAIR": True, "SPLIT": 5},
     {"BLOCK_T": 2, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "DEFER": True, "PAIR": True, "SPLIT": 5},
     (640, 100, 2, "slice", "colstride")),
    ({"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 0, "PAIR": True},
     {"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 0, "DEFER": True, "PAIR": True, "SPLIT": False, "PERSIST": 1},
     (64, 7, 2, "slice", "contig")),
    # the pair forward beside a backward that is not the pair's: the key from chunk 1 of 3, three tokens
    ({"BLOCK_T": 4, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "PAIR": True},
     {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "KEYCH": True}, (300, 200, 2, "slice", "mixed")),
]


@needs_triton
@pytest.mark.parametrize("fwd_cfg,bwd_cfg,case", CONFIG_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("family", ["table", "args"])
def test_launch_configs_match_reference(fwd_cfg, bwd_cfg, case, family):
    """Launch configurations of both kernel families against the reference (unaligned d and r,
    strided sources, S smaller and larger than the backward's sources per step)."""
    fn = _attnres_args if family == "args" else kernels.attnres_triton
    _fp32_against_reference(fn, *case, seed=case[0] + 3 * case[1] + case[2], s=_settings(fwd=fwd_cfg, bwd=bwd_cfg))


def _fp32_against_reference(fn, d, r, S, norm, layout, seed, lead=LEAD, s=None):
    """``fn``'s output and gradients with settings ``s`` against the reference's on fresh fp32 data,
    LEAD tokens (the Triton interpreter on the CPU, the kernels themselves on a GPU)."""
    device = "cuda" if HAS_CUDA else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    sources = _make_sources(S, lead, d, torch.float32, device, layout, gen)
    query = torch.randn(r, generator=gen, device=device).requires_grad_()
    g = torch.randn(*lead, d, generator=gen, device=device)
    h, gs, gq = _run(_with(fn, s or _settings()), sources, query, g, norm)
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, norm)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(gs, gs_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gq, gq_ref, rtol=1e-3, atol=2e-3 * max(1.0, gq_ref.abs().max().item()))


# Every candidate family of kernels/configs.py at a shape that takes it: (kind, the forms whose
# candidates a call of that shape tunes among, d, r, S, norm, layout).  d = 300 is three chunks of 128
# (the key from chunk 2, or chunk 1 at r = 100), d = 96 one chunk; the widths and key widths unaligned.
CANDIDATE_FAMILIES = {
    "FWD_CHUNKS": ("fwd", (), 300, 40, 5, "slice", "mixed"),
    "FWD_ONE": ("fwd", (), 96, 33, 4, "full", "transposed"),
    "FWD_PAIR": ("fwd", ("pair",), 300, 100, 2, "slice", "rowpad"),
    "BWD_CHUNKS": ("bwd", (), 300, 40, 5, "slice", "colstride"),
    "BWD_ONE": ("bwd", (), 96, 33, 3, "full", "mixed"),
    "BWD_RESIDENT_PAIR": ("bwd", ("pair",), 300, 100, 2, "slice", "mixed"),
    "BWD_DEFERRED": ("bwd", ("passes",), 300, 40, 5, "slice", "contig"),
}


def test_candidate_families_are_all_run_on_the_cpu():
    """A family added to kernels/configs.py is added to CANDIDATE_FAMILIES too."""
    assert set(configs.FAMILIES) == set(CANDIDATE_FAMILIES)


def _family_table(family: str) -> list[dict]:
    """The built candidates of ``family`` at the column layout of its shape."""
    kind, _, d, r, *_ = CANDIDATE_FAMILIES[family]
    return configs.configs(family, configs.col_layout(d, None, r)[0])


def _family_cases():
    """(family, candidate) for each candidate of a family that the interpreter can tell apart from the
    family's others: every option but num_warps (PERSIST as on or off), the ARGS line among them."""
    cases = []
    for family in CANDIDATE_FAMILIES:
        seen = set()
        for i, cfg in enumerate(_family_table(family)):
            key = tuple(sorted((k, bool(v) if k == "PERSIST" else v) for k, v in cfg.items() if k != "num_warps"))
            if key not in seen:
                seen.add(key)
                cases.append(pytest.param(family, i, id=f"{family}-{i}"))
    return cases


@needs_triton
@pytest.mark.parametrize("family,cand", _family_cases())
def test_every_candidate_family_matches_reference(family, cand):
    """A representative subset of every candidate family, pinned as the only configuration of its
    kernel, against the reference in fp32 (the interpreter on the CPU): the shape is one whose calls
    tune among the family's candidates."""
    kind, forms, d, r, S, norm, layout = CANDIDATE_FAMILIES[family]
    cfg = _family_table(family)[cand]
    layout_d = dispatch.layout(kind, d, r, DEFAULT)
    assert cfg in configs.candidates(kind, *layout_d, forms)  # the shape tunes among this family's candidates
    s = _settings(**{kind: cfg})
    _fp32_against_reference(kernels.attnres_triton, d, r, S, norm, layout, seed=d + r + S + cand, s=s)
    if cfg == configs.args_config(kind, *layout_d, forms):  # the per-argument kernels' line: their path too
        _fp32_against_reference(_attnres_args, d, r, S, norm, layout, seed=d + r + S + cand, s=s)


def test_key_chunk(monkeypatch):
    """KEY0: the first column chunk that holds a key column, where a configuration asks for it
    (KEYCH); 0 otherwise or with one chunk."""
    assert configs.key_pos(1536, 384, 512, 3) == 2
    assert configs.key_pos(1536, 600, 512, 3) == 1
    assert configs.key_pos(1536, 1536, 512, 3) == 0
    assert configs.key_pos(2560, 640, 512, 5) == 3 and configs.key_pos(2560, 320, 512, 5) == 4
    assert configs.key_pos(1024, 256, 512, 2) == 1
    assert configs.key_pos(1024, 1, 1024, 1) == 0  # one chunk: nothing to skip
    for d in range(130, 5000, 7):  # the last chunk always holds column d - 1
        block_d, nch = configs.col_layout(d, True)
        if nch > 1:
            assert (nch - 1) * block_d < d <= nch * block_d
            assert configs.key_pos(d, 1, block_d, nch) == nch - 1
    assert dispatch.launch_kwargs({"BLOCK_T": 1, "KEYCH": True, "SPLIT": True}, "fwd", 2) == {
        "BLOCK_T": 1, "EVICT": False, "STAGES": 1, "KEY0": 2, "PAIR": False}
    assert dispatch.launch_kwargs({"BLOCK_T": 1}, "bwd", 2) == {"SB": 1, "BLOCK_T": 1, "PAIR": False, "DEFER": False, "EVICT": False,
                                                          "STAGES": 1, "KEY0": 0, "PERSIST": 0}
    assert dispatch.launch_kwargs({"SB": 1, "KEY0": 1}, "bwd", 2)["KEY0"] == 1  # a remembered choice keeps its own
    assert dispatch.launch_kwargs({"BLOCK_T": 1}, "fwd", 2)["KEY0"] == 0  # no KEYCH: no specialisation


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_tuner_times_each_shape_class(kind, monkeypatch):
    """Tuning times every distinct candidate once per shape class through the caller's whole launch
    and keeps the fastest: a keyed candidate whose key starts in chunk 0 is its plain twin and is
    timed once; every candidate carries the options the kernel needs (EVICT, STAGES, KEY0, the
    backward's grid); a choice is reused for the same class, not for another S, token class or key
    chunk; nothing is timed or remembered during a CUDA graph capture; a candidate that fails is
    passed over."""
    monkeypatch.setattr(dispatch, "_TUNED", {})
    s = Settings(autotune=True, compile_threads=4)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    launched, failing, warmed = [], [], []
    monkeypatch.setattr(tuner, "cuda_fault", lambda device: None)  # a healthy device (no CUDA here)

    def launch(cfg, warm=False):
        if warm:  # tuner.precompile: every candidate built before any is timed
            warmed.append(cfg)
            return
        launched.append(cfg)
        if cfg in failing:
            raise RuntimeError("out of resources")

    def fake_bench(fn, **kw):  # the last candidate that runs is the fastest
        fn()
        return 100.0 - len(launched)

    def choose(key_pos, key, forms=()):
        return dispatch.choose(kind, 512, 3, key_pos, cuda, key, launch, forms, s)

    monkeypatch.setattr(tuner, "gpu_time", fake_bench)
    cuda = torch.device("cuda")
    cands = configs.candidates(kind, 512, 3)
    for key_pos in (2, 0):
        launched.clear()
        warmed.clear()
        distinct = dispatch.distinct(cands, kind, key_pos)
        failing[:] = [distinct[-1]]  # the last would be the fastest, but does not run
        key = ("k",) + dispatch.tune_class(9, 8000)
        cfg = choose(key_pos, key)
        assert all({"EVICT", "STAGES", "KEY0", "num_warps"} <= set(c) for c in distinct)
        if kind == "bwd":
            assert all({"SB", "BLOCK_T", "PAIR"} <= set(c) for c in distinct) and any(c["BLOCK_T"] for c in distinct)
        want = sorted(key_pos if c.get("KEYCH") else 0 for c in cands)
        got = sorted(c["KEY0"] for c in distinct)
        assert got == want if key_pos else len(distinct) <= len(cands)
        # each candidate: a warm-up run, then the timed one; the failing one once
        assert launched == [c for c in distinct[:-1] for _ in (0, 1)] + [distinct[-1]]
        # compiled in threads, then built again (from the cache) and loaded one after another
        assert warmed == distinct + distinct
        assert cfg == distinct[-2]
        assert dispatch._TUNED[(kind, 512, 3, key_pos, ()) + key] == cfg
    twins = [c for c in cands if not c.get("KEYCH") and dict(c, KEYCH=True) in cands]
    assert len(dispatch.distinct(cands, kind, 0)) == len(cands) - len(twins)  # at key chunk 0 a keyed one is its twin
    launched.clear()
    assert choose(2, ("k",) + dispatch.tune_class(9, 5000)) == dispatch._TUNED[
        (kind, 512, 3, 2, (), "k", 9, 8192)] and not launched  # same class: 5000 and 8000 tokens round to 8192
    choose(2, ("k",) + dispatch.tune_class(2, 8000))
    assert launched  # another S is tuned again
    pairs, defer = configs.configs("BWD_RESIDENT_PAIR", 512), configs.configs("BWD_DEFERRED", 512)
    if kind == "bwd":  # a forward without residual: only the deferred forms' candidates are timed
        for forms, want in ((("passes",), defer), (("pair",), pairs), (("pair", "passes"), pairs + defer)):
            launched.clear()
            failing.clear()
            cfg = choose(2, ("k",) + dispatch.tune_class(2, 8000), forms)
            assert cfg["DEFER"] and all(c["DEFER"] for c in launched)
            assert launched[::2] == dispatch.distinct(want, kind, 2)
            assert all(c["PAIR"] == ("pair" in forms and i < len(pairs)) for i, c in enumerate(launched[::2]))
        assert "bwd/512x3/key2/deferred-pair+passes/S2/N8192" in dispatch.tuned_configs()
    else:  # at two sources the pair forward's candidates too, before the loop's
        launched.clear()
        failing.clear()
        cfg = choose(2, ("k",) + dispatch.tune_class(2, 8000), dispatch.fwd_forms(2, s))
        fwd_pairs = configs.configs("FWD_PAIR", 512)
        want = dispatch.distinct(fwd_pairs + configs.configs("FWD_CHUNKS", 512), kind, 2)
        assert launched[::2] == want and cfg == want[-1] and not cfg["PAIR"]
        assert [c["PAIR"] for c in want] == [True] * len(fwd_pairs) + [False] * (len(want) - len(fwd_pairs))
        assert dispatch.first(kind, 512, 3, 2, dispatch.fwd_forms(2, s))["PAIR"]  # the default at S = 2 untuned
        assert "fwd/512x3/key2/pair/S2/N8192" in dispatch.tuned_configs()
    capturing[0] = True
    launched.clear()
    n = len(dispatch._TUNED)
    assert choose(2, ("k",) + dispatch.tune_class(5, 8000)) == dispatch.launch_kwargs(
        cands[0], kind, 2) and not launched and len(dispatch._TUNED) == n
    assert "%s/512x3/key2/S9/N8192" % kind in dispatch.tuned_configs()
    capturing[0] = False
    with pytest.raises(RuntimeError, match="no launch configuration ran"):
        tuner.fastest([{"num_warps": 4}], lambda cfg, warm=False: None if warm else 1 / 0)
    pinned = Settings(**{kind: {"BLOCK_T": 2, "num_warps": 1, "PREFETCH": 0}})
    launched.clear()
    assert dispatch.choose(kind, 512, 3, 2, cuda, ("k", 9, 64), launch, (), pinned)["BLOCK_T"] == 2 and not launched


def test_launch_config_candidates():
    """Every candidate's tile has at least 512 elements and at most 32 per thread and column chunk
    unless 16 warps cannot spread it further."""
    for block_d in (1, 64, 1024, 2048, 8192):
        for nch in (1, 2, 3, 5):
            for cfg in configs.candidates("fwd", block_d, nch) + configs.candidates("bwd", block_d, nch):
                tile = cfg.get("BLOCK_T", cfg.get("SB")) * block_d
                assert tile >= 512 and 1 <= cfg["num_warps"] <= 16
                assert tile // (32 * cfg["num_warps"]) <= 32 or cfg["num_warps"] == 16


def test_column_layout():
    """Rows are read as the fewest columns (padding included) of 1 to 5 equal power-of-two chunks;
    among equals, chunks nearest 512 columns."""
    assert configs.col_layout(1536) == (512, 3)  # the 1B model: no padded columns
    assert configs.col_layout(2560) == (512, 5)  # 2560 columns instead of 3072 (3 x 1024) or 4096
    assert configs.col_layout(1024) == (512, 2)  # as few columns as one chunk, and a key chunk to specialise
    assert configs.col_layout(513) == (128, 5)
    assert configs.col_layout(64) == (64, 1)
    assert configs.col_layout(200) == (256, 1)  # chunks under MIN_CHUNK columns are not worth it
    assert configs.col_layout(2048) == (512, 4) and configs.col_layout(4096) == (1024, 4)
    assert configs.col_layout(1536, split=False) == (2048, 1)
    # given the key width: where no layout of the fewest columns can specialise the key, the fewest chunks
    assert configs.col_layout(1024, r=1024) == (1024, 1) and configs.col_layout(1024, r=256) == (512, 2)
    assert configs.col_layout(2048, r=2048) == (2048, 1) and configs.col_layout(2048, r=512) == (512, 4)
    assert configs.col_layout(1536, r=1536) == (512, 3) and configs.col_layout(2560, r=2560) == (512, 5)  # least padding first
    assert configs.col_layout(2560, split=3) == (1024, 3)  # a configuration's SPLIT forces a chunk count
    with pytest.raises(ValueError, match="SPLIT"):
        configs.col_layout(2560, split=6)
    for d in range(1, 5000, 7):
        block, nch = configs.col_layout(d)
        assert block * nch >= d and block & (block - 1) == 0 and 1 <= nch <= configs.MAX_CHUNKS
        assert nch == 1 or block >= configs.MIN_CHUNK
        assert block * nch <= configs.next_pow2(d)  # never more columns than one chunk


@pytest.mark.parametrize("eager_function", [False, True], ids=["custom-op", "function"])
@pytest.mark.parametrize("S", [1, 2])
def test_custom_op_triton_path(S, eager_function, monkeypatch):
    """``kernels.attnres`` on the Triton path (CPU: the interpreter), through the custom op with its
    registered autograd and through the eager autograd.Function.  S = 1 takes a host-side backward,
    whose output must not alias the upstream gradient (torch.library refuses it)."""
    calls = []
    real = autograd._AttnResTriton.apply
    monkeypatch.setattr(autograd._AttnResTriton, "apply", lambda *a: calls.append(1) or real(*a))
    device = "cuda" if HAS_CUDA else "cpu"
    gen = torch.Generator(device=device).manual_seed(11 + S)
    sources = _make_sources(S, (2, 5), 40, torch.float32, device, "contig", gen)
    query = torch.randn(9, generator=gen, device=device).requires_grad_()
    g = torch.randn(2, 5, 40, generator=gen, device=device)
    h, gs, gq = _run(_with(kernels.attnres, _settings(eager_function=eager_function)), sources, query, g, "slice")
    assert bool(calls) == eager_function  # the path asked for was taken
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, "slice")
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(gs, gs_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        assert a.data_ptr() != g.data_ptr()
    torch.testing.assert_close(gq, gq_ref, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("norm", ["slice", "full"])
def test_cpu_fallback_matches_reference(norm):
    """Without the Triton switch, CPU tensors take the torch path of the custom op."""
    gen = torch.Generator().manual_seed(7)
    sources = _make_sources(5, (2, 9), 48, torch.float32, "cpu", "mixed", gen)
    query = torch.randn(12, generator=gen).requires_grad_()
    g = torch.randn(2, 9, 48, generator=gen)
    h, gs, gq = _run(kernels.attnres, sources, query, g, norm)
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, norm)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(gs, gs_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gq, gq_ref, rtol=1e-4, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("lazy,block_t", [(1, 1), (2, 4), (0, 1)])
@pytest.mark.parametrize("order", ["rising", "falling", "shuffled"])
def test_lazy_softmax_with_steep_scores(lazy, block_t, order):
    """The forward's lazy online softmax (kernels.fused_fwd._lazy_rescale; LAZY 1: one-token programs, 2:
    every program, the branch then taken for the whole token block) against the reference where the
    scores span about +-60 and move by more than LAZY_TAU from source to source: rising (a rescale at
    every source), falling (only at the first) and shuffled, in fp32 with both families of kernels;
    LAZY 0 (the plain online softmax) as the control."""
    device = "cuda" if HAS_CUDA else "cpu"
    st = _settings(lazy_rescale=lazy, fwd={"BLOCK_T": block_t, "num_warps": 2, "PREFETCH": 1})
    gen = torch.Generator(device=device).manual_seed(17)
    d, r, S, lead = 64, 16, 9, LEAD
    query = torch.randn(r, generator=gen, device=device) * 4
    cos = torch.linspace(-1, 1, S, device=device)  # each source's alignment with the query
    if order == "falling":
        cos = cos.flip(0)
    elif order == "shuffled":
        cos = cos[torch.randperm(S, generator=gen, device=device)]
    qhat = query / query.norm()
    u = torch.randn(r, generator=gen, device=device)
    u = u - (u @ qhat) * qhat
    u = u / u.norm()  # a unit key direction orthogonal to the query
    sources = []
    for c in cos:  # key at angle arccos(c) to the query, RMS 1: score about c |q| sqrt(r)
        x = torch.randn(*lead, d, generator=gen, device=device) * 0.01
        x[..., d - r:] += (c * qhat + (1 - c * c).clamp_min(0).sqrt() * u) * r ** 0.5
        sources.append(x.requires_grad_())
    query.requires_grad_()
    g = torch.randn(*lead, d, generator=gen, device=device)
    z = autograd.scores_torch([s.detach() for s in sources], query.detach(), "slice", 1e-6)[0]
    assert float(z.max() - z.min()) > 80 and float((z[1:] - z[:-1]).abs().min()) > 8
    h, gs, gq = _run(_with(kernels.attnres_triton, st), sources, query, g, "slice")
    h_args = autograd.attnres_fwd_args([s.detach() for s in sources], query.detach(), "slice", 1e-6, st.key)[0]
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, "slice")
    for x in (h, h_args):  # the table kernels and the per-argument ones
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, h_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(gs, gs_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gq, gq_ref, rtol=1e-3, atol=2e-3 * max(1.0, gq_ref.abs().max().item()))


def _residual_probe_values() -> torch.Tensor:
    """fp32 mixes whose bf16 rounding is hard to undo: random of every sign and scale, values just
    below and above powers of two (rounded up into the next binade), halfway cases, zeros and
    subnormals, the largest finite bf16 neighbourhood."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-30, 30, (4096,), generator=gen).float())
    pow2 = torch.exp2(torch.arange(-20, 21).float())
    below = pow2 * (1 - 2.0 ** -9 + 2.0 ** -20)  # rounds up to the power of two
    halfway = pow2 * (1 + 2.0 ** -8)  # exactly between two bf16 values
    tiny = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.2e-38, -3e-39, 3.38e38, -3.38e38])
    coarse = (x[:1024].view(torch.int32) & ~0xFF).view(torch.float32)  # the dropped bits fit in 8
    return torch.cat([x, -x[:64], pow2, below, -below, halfway, -halfway, tiny, coarse])


if HAS_TRITON:
    import triton.language as tl

    from kernels.tiles import _res_code, _res_h

    @triton.jit
    def _residual_probe(h_ptr, hb_ptr, code_ptr, back_ptr, n, RES_STEP: tl.constexpr, BLOCK: tl.constexpr):
        """The residual helpers on fp32 inputs: h, its rounded value hb as an fp32, the code, h rebuilt."""
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        h = tl.load(h_ptr + offs, mask=ok, other=0.0)
        hb = tl.load(hb_ptr + offs, mask=ok, other=0.0)
        code = _res_code(h, hb, RES_STEP)
        tl.store(code_ptr + offs, code, mask=ok)
        tl.store(back_ptr + offs, _res_h(hb, code, RES_STEP), mask=ok)


@needs_triton
def test_residual_code_bit_exact():
    """The bf16 rounding residual (kernels.tiles._res_code / _res_h, RES_STEP 0: integer arithmetic
    on the fp32 bit patterns): the kernels' code and the torch fallback's are the same bytes, h comes
    back to 2^-16 of |h| (the 8 bits kept of the 16 dropped), exactly where the dropped bits fit in
    8, and the fp16 code (RES_STEP 2^-18) still matches its torch twin.  Run through the interpreter in
    fp32: the rounded value is handed to the helpers as an fp32 that bf16 represents exactly (on a GPU,
    the compiled helpers)."""
    h = _residual_probe_values().to("cuda" if HAS_CUDA else "cpu")
    for dtype in (torch.bfloat16, torch.float16):
        hb = h.to(dtype)
        fin = torch.isfinite(hb.float())
        hh, hbb = h[fin], hb[fin]
        step = dispatch.res_step(dtype, DEFAULT)
        assert (step == 0) == (dtype == torch.bfloat16 and DEFAULT.res_bits)
        code = torch.empty(hh.numel(), dtype=torch.int8, device=h.device)
        back = torch.empty(hh.numel(), device=h.device)
        _residual_probe[(1,)](hh, hbb.float(), code, back, hh.numel(), RES_STEP=step, BLOCK=triton.next_power_of_2(hh.numel()))
        ref_code = autograd._res_encode(hh, hbb, DEFAULT)
        assert torch.equal(code, ref_code), f"{dtype}: kernel and torch residual codes differ"
        torch.testing.assert_close(back, autograd._res_decode(hbb, ref_code, DEFAULT), rtol=0, atol=0)
        normal = hbb.float().abs() >= torch.finfo(dtype).tiny
        err = (back - hh).abs()[normal]
        # 2^-16 relative (bf16; 2^-19 for fp16); twice that at the clamped codes +-127 (exact ties)
        bound = (2.0 ** -16 if dtype == torch.bfloat16 else 2.0 ** -19) * hh.abs()[normal]
        bound = torch.where(ref_code[normal].abs() == 127, 2 * bound, bound)
        assert bool((err <= bound).all()), f"{dtype}: h rebuilt to {float((err / bound).max()):.2f} of the bound"
        assert float((back - hh).abs().max()) < 1e-3 * float(hh.abs().max())
    # bf16: the code is the dropped bits; where they fit in 8 bits, h comes back bit for bit
    hb = h.to(torch.bfloat16)
    drop = h.view(torch.int32) - hb.float().view(torch.int32)
    exact = ((h.view(torch.int32) & 0xFF) == 0) & (drop.abs() <= 127 * 256) & torch.isfinite(hb.float())
    assert int(exact.sum()) > 1000
    back = autograd._res_decode(hb, autograd._res_encode(h, hb, DEFAULT), DEFAULT)
    assert torch.equal(back[exact].view(torch.int32), h[exact].view(torch.int32))


@needs_triton
@pytest.mark.parametrize("n_rows,r", [(1, 1), (37, 7), (300, 65), (2112, 384), (1000, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_sum_triton(n_rows, r, dtype, monkeypatch):
    """The query gradient's partial rows summed by _sum_rows_kernel in two launches
    (kernels.launch.sum_rows) and by _sum_rows_once_kernel in one (sum_rows_once): one slab or
    many, unaligned rows and columns, fp32 and the query's dtype; the same bits from both and on a
    second run (fixed orders), and the one-launch sum's counters back at 0 after it.  On the CPU the
    multiprocessor count is 2, so sum_programs_per_sm is raised to get many slabs."""
    st = _settings(sum_programs_per_sm=64, sum_count_ring=2)
    monkeypatch.setattr(launch, "_SUM_COUNTS", {})
    device = "cuda" if HAS_CUDA else "cpu"
    gen = torch.Generator(device=device).manual_seed(n_rows + r)
    part = torch.randn(n_rows, r, generator=gen, device=device)
    got = launch.sum_rows(part, dtype, st)
    again = launch.sum_rows(part, dtype, st)
    once = [launch.sum_rows_once(part, dtype, st) for _ in range(3)]  # the third reuses the ring's first row
    ref = part.double().sum(0)
    assert got.dtype == dtype and got.shape == (r,)
    tol = 1e-5 * (n_rows ** 0.5) if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    assert torch.equal(got, again)
    assert all(torch.equal(got, o) for o in once)
    many_slabs = launch.sum_splits(n_rows, r, part.device, st) > 1
    assert [n for _, n in launch._SUM_COUNTS.values()] == ([1] if many_slabs else [])  # 3 calls on a ring of 2
    assert all(int(ring.abs().sum()) == 0 for ring, _ in launch._SUM_COUNTS.values())


def test_sum_counts_ring(monkeypatch):
    """_sum_counts: a zeroed ring per (device, column blocks), its rows taken in turn; None while a graph
    is being captured and no ring exists yet (one made then would live in the graph's memory), the
    existing ring during capture."""
    st = Settings(sum_count_ring=3)
    monkeypatch.setattr(launch, "_SUM_COUNTS", {})
    cpu = torch.device("cpu")
    rows = [launch.sum_counts(cpu, 5, st) for _ in range(4)]
    assert all(r.shape == (5,) and r.dtype == torch.int32 and int(r.abs().sum()) == 0 for r in rows)
    assert [r.data_ptr() for r in rows[:3]] == sorted({r.data_ptr() for r in rows[:3]})
    assert rows[3].data_ptr() == rows[0].data_ptr()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert launch.sum_counts(torch.device("cuda", 0), 5, st) is None and len(launch._SUM_COUNTS) == 1
    launch._SUM_COUNTS[(torch.device("cuda", 0), 5)] = [torch.zeros(3, 5, dtype=torch.int32), 2]
    assert launch.sum_counts(torch.device("cuda", 0), 5, st) is not None
    assert launch._SUM_COUNTS[(torch.device("cuda", 0), 5)][1] == 0


def test_partial_sum_choice(monkeypatch):
    """dq_sum: "torch", "triton" and "once" as asked; "auto" times all three (GPU time, tuner.gpu_time) once
    per (rows, r, dtype) on CUDA and keeps the fastest, and takes the two-launch Triton sum where nothing
    can be timed (CPU, graph capture); anything else is refused by name."""
    calls = []
    for name in ("triton", "once", "torch"):
        monkeypatch.setitem(launch.SUMS, name, (lambda name: lambda p, dt, s: calls.append(name) or p.sum(0).to(dt))(name))
    monkeypatch.setattr(dispatch, "_SUM_CHOSEN", {})
    part = torch.ones(4, 3)
    for mode in ("torch", "triton", "once"):
        calls.clear()
        assert torch.equal(launch.sum_partials(part, torch.float32, Settings(dq_sum=mode)), torch.full((3,), 4.0))
        assert calls == [mode]
    auto = Settings(dq_sum="auto")
    calls.clear()
    launch.sum_partials(part, torch.float32, auto)
    assert calls == ["triton"] and not dispatch._SUM_CHOSEN  # CPU: nothing timed, nothing remembered
    speed = {"triton": 2.0, "once": 1.5, "torch": 1.0}
    monkeypatch.setattr(tuner, "gpu_time", lambda fn: (fn(), speed[calls[-1]])[1])
    monkeypatch.setattr(tuner, "cuda_fault", lambda device: None)
    fake = types.SimpleNamespace(shape=(4, 3), device=torch.device("cuda"), sum=part.sum)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls.clear()
    launch.sum_partials(fake, torch.float32, auto)
    assert dispatch._SUM_CHOSEN == {(4, 3, torch.float32, torch.device("cuda")): "torch"} and calls[-1] == "torch"
    calls.clear()
    launch.sum_partials(fake, torch.float32, auto)
    assert calls == ["torch"]  # remembered
    speed.update(once=0.5)
    launch.sum_partials(types.SimpleNamespace(shape=(5, 3), device=torch.device("cuda"), sum=part.sum), torch.float32,
                        auto)
    assert dispatch._SUM_CHOSEN[(5, 3, torch.float32, torch.device("cuda"))] == "once" and calls[-1] == "once"
    assert dispatch.tuned_configs()["sum/5x3/float32"] == {"method": "once"}
    with pytest.raises(ValueError, match="dq_sum.*'atomic'"):
        Settings(dq_sum="atomic")


def test_precompile_builds_every_candidate_first(monkeypatch):
    """tuner.precompile hands each candidate to ``launch(cfg, warm=True)`` under Triton's
    AsyncCompileMode (with more than one thread), then, in this thread and one after another, builds each
    again and loads its module; a candidate that fails to build on a healthy device is left out (and
    returned with its error), the others are built; with COMPILE_THREADS 1 there is one build each."""
    pytest.importorskip("triton.runtime._async_compile")
    monkeypatch.setattr(tuner, "cuda_fault", lambda device: None)
    warmed, loaded = [], []

    class Compiled:  # what Triton's warmup returns: a kernel whose module loads on _init_handles
        def __init__(self, cfg):
            self.cfg = cfg

        def _init_handles(self):
            loaded.append(self.cfg)

    def launch(cfg, warm=False):
        assert warm, "precompile never launches"
        warmed.append(cfg)
        if cfg["num_warps"] == 2:
            raise RuntimeError("out of resource: shared memory")
        return Compiled(cfg)

    cands = [{"num_warps": w} for w in (1, 2, 4)]
    built, failed = tuner.precompile(cands, launch, threads=4)
    assert warmed == cands + cands and built == [cands[0], cands[2]] and loaded == built
    assert list(failed) == [1] and "shared memory" in str(failed[1])
    warmed.clear()
    assert tuner.precompile(cands, launch, threads=1)[0] == [cands[0], cands[2]] and warmed == cands


def test_deferral_rule_decides_the_residual():
    """The deferred backward (no residual kept) for bf16/fp16: its two-pass form for "slice" with the key
    past the backward layout's first chunk and at most defer_max_s sources, its resident pair for at
    most two sources (any norm, any key); not for fp32, defer off, or a pinned backward configuration
    without DEFER.  The fake forward's residual shape follows the same rule."""
    s = DEFAULT

    def kinds(dtype, r, norm, n, st=None, d=1536):
        return dispatch.defer_kinds(dtype, d, r, norm, n, st or s)

    assert kinds(torch.bfloat16, 384, "slice", 5) == ("passes",)
    assert kinds(torch.float16, 640, "slice", 2, d=2560) == ("pair", "passes")
    assert not kinds(torch.bfloat16, 384, "slice", s.defer_max_s + 1)  # many sources: the residual
    assert not kinds(torch.float32, 384, "slice", 5) and not kinds(torch.float32, 384, "slice", 2)
    assert not kinds(torch.bfloat16, 384, "full", 5)
    assert not kinds(torch.bfloat16, 1536, "slice", 5)  # the key starts in chunk 0
    for norm, r in (("full", 384), ("slice", 1536), ("full", 1536)):  # two sources: the pair only
        assert kinds(torch.bfloat16, r, norm, 2) == ("pair",)
    assert dispatch.res_kept(torch.bfloat16, 1536, 1536, "slice", 5, s)
    assert not dispatch.res_kept(torch.float32, 1536, 1536, "slice", 5, s)
    assert not dispatch.res_kept(torch.bfloat16, 1536, 1536, "slice", 2, s)
    no_pair = Settings(pair_defer=False)
    assert kinds(torch.float16, 640, "slice", 2, no_pair, d=2560) == ("passes",)
    assert not kinds(torch.bfloat16, 1536, "slice", 2, no_pair)
    keyed = Settings(bwd={"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1, "KEYCH": True})
    assert not kinds(torch.bfloat16, 384, "slice", 5, keyed) and not kinds(torch.bfloat16, 384, "slice", 2, keyed)
    deferred = Settings(bwd={"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1, "DEFER": True})
    assert kinds(torch.bfloat16, 384, "slice", 5, deferred) and kinds(torch.bfloat16, 384, "slice", 30, deferred)
    assert not kinds(torch.bfloat16, 384, "full", 5, deferred)  # the two-pass form needs "slice"
    pair = Settings(bwd={"BLOCK_T": 1, "num_warps": 2, "DEFER": True, "PAIR": True})
    assert kinds(torch.bfloat16, 1536, "full", 2, pair) == ("pair",)
    off = Settings(defer=False)
    assert not kinds(torch.bfloat16, 384, "slice", 5, off) and not kinds(torch.bfloat16, 384, "slice", 2, off)
    from torch._subclasses.fake_tensor import FakeTensorMode

    for r, n_src, kept in ((384, 3, False), (1536, 3, True), (1536, 2, False)):
        sources = [torch.randn(4, 1536, dtype=torch.bfloat16) for _ in range(n_src)]
        res = kernels.attnres_fwd(sources, torch.randn(r, dtype=torch.bfloat16), "slice", 1e-6, "")[2]
        assert (res.numel() > 0) == kept
        with FakeTensorMode() as mode:
            fake = kernels.attnres_fwd([mode.from_tensor(x) for x in sources],
                                       mode.from_tensor(torch.randn(r, dtype=torch.bfloat16)), "slice", 1e-6, "")[2]
        assert fake.shape == res.shape


def test_deferred_backward_checks():
    """A backward configuration that cannot serve a residual-free forward is refused with the reason:
    not DEFER; DEFER off the token tile; the pair with more than two sources; two passes with the key
    in the first chunk.  A residual-free forward whose shape no deferred form serves any more (the
    settings changed in between) is refused in the backward."""
    base = dict(dispatch._BWD_DEFAULTS, BLOCK_T=1, KEY0=2)
    with pytest.raises(ValueError, match="does not ask for DEFER"):
        dispatch.check_deferred(base, ("passes",), 2, 3)
    with pytest.raises(ValueError, match="token-tile grid"):
        dispatch.check_deferred(dict(base, BLOCK_T=0, DEFER=True), ("passes",), 2, 3)
    with pytest.raises(ValueError, match="at most 2"):
        dispatch.check_deferred(dict(base, DEFER=True, PAIR=True), ("pair",), 2, 3)
    with pytest.raises(ValueError, match="first column chunk"):
        dispatch.check_deferred(dict(base, DEFER=True, KEY0=0), ("passes",), 0, 3)
    dispatch.check_deferred(dict(base, DEFER=True, PAIR=True, KEY0=0), ("pair",), 0, 2)
    dispatch.check_deferred(dict(base, DEFER=True), ("passes",), 2, 8)
    sources = [torch.randn(3, 64, dtype=torch.bfloat16) for _ in range(2)]
    q = torch.randn(64, dtype=torch.bfloat16)
    h, stats, res = kernels.attnres_fwd(sources, q, "full", 1e-6, "")
    assert res.numel() == 0  # two sources: the pair, no residual
    with pytest.raises(ValueError, match="no deferred backward serves this shape"):
        launch.bwd_inputs(sources, q, h, res, torch.randn_like(h), "full", Settings(pair_defer=False))


def test_pair_forward_rule():
    """The pair forward's candidates are tuned among at exactly two sources (pair_fwd off: never),
    and a configuration that asks for it elsewhere is refused with the reason, in both kernel families."""
    assert dispatch.fwd_forms(2, DEFAULT) == ("pair",) and not dispatch.fwd_forms(1, DEFAULT)
    assert not dispatch.fwd_forms(3, DEFAULT) and not dispatch.fwd_forms(2, Settings(pair_fwd=False))
    assert all(not c.get("PAIR") for c in configs.candidates("fwd", 512, 3))
    assert all(c["PAIR"] and not c["PREFETCH"] for c in configs.configs("FWD_PAIR", 512))
    dispatch.check_fwd_pair({"PAIR": True}, 2)
    dispatch.check_fwd_pair({"PAIR": False}, 3)
    st = Settings(cpu_triton=True, fwd={"BLOCK_T": 1, "num_warps": 1, "PREFETCH": 0, "PAIR": True})
    sources = [torch.randn(3, 64) for _ in range(3)]
    for fn in (launch.fwd, launch.fwd_args):
        with pytest.raises(ValueError, match="reads exactly two sources; this call has 3"):
            fn(sources, torch.randn(8), "slice", 1e-6, st)


def test_cpu_fallback_without_residual_matches_reference():
    """bf16 on the CPU where the backward defers: no residual kept, g.h from the sources, gradients
    within the paper's criterion of the fp32 reference's."""
    gen = torch.Generator().manual_seed(11)
    d, r = 1536, 384
    sources = [torch.randn(2, 5, d, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(4)]
    query = (torch.randn(r, generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    g = torch.randn(2, 5, d, generator=gen).to(torch.bfloat16)
    assert kernels.attnres_fwd(sources, query, "slice", 1e-6, "")[2].numel() == 0
    h, gs, gq = _run(kernels.attnres, sources, query, g, "slice")
    s32 = [s.detach().float().requires_grad_() for s in sources]
    q32 = query.detach().float().requires_grad_()
    h_ref, gs_ref, gq_ref = _run(route, s32, q32, g.float(), "slice")
    for x, ref in [(h, h_ref), *zip(gs, gs_ref), (gq, gq_ref)]:
        assert bool(((x.float() - ref).abs() <= 0.05 + 0.05 * ref.abs()).all())


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randn(4, 16, generator=gen, requires_grad=True) for _ in range(3)]
    q = torch.randn(5, generator=gen, requires_grad=True)
    torch.library.opcheck(kernels.attnres_fwd, (srcs, q, "slice", 1e-6, ""))
    h, lse, res = kernels.attnres_fwd(srcs, q, "full", 1e-6, "")
    args = ([s.detach() for s in srcs], q.detach(), h.detach(), lse.detach(), res, torch.randn(4, 16, generator=gen), "full", 1e-6, "")
    torch.library.opcheck(kernels.attnres_bwd, args)
    srcs16 = [s.detach().to(torch.bfloat16).requires_grad_() for s in srcs]
    torch.library.opcheck(kernels.attnres_fwd, (srcs16, q, "slice", 1e-6, ""))
    # the triton_op pair of the compiled path (its CPU body: the torch fallback)
    torch.library.opcheck(autograd.attnres_fwd_args, (srcs, q, "slice", 1e-6, ""))
    torch.library.opcheck(autograd.attnres_bwd_args, args)


def test_input_validation():
    with pytest.raises(ValueError):
        kernels.attnres([torch.randn(3, 8)], torch.randn(9))
    with pytest.raises(ValueError):
        kernels.attnres([torch.randn(3, 8), torch.randn(3, 7)], torch.randn(2))
    with pytest.raises(ValueError):
        kernels.attnres([torch.randn(3, 8)], torch.randn(2), norm="other")


class _Tiny(torch.nn.Module):
    """A stack of sub-layers reading a growing list of sources through the op."""

    def __init__(self, d, r, layers):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.randn(layers + 1, r) * 0.5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        sources = [x]
        for t, lin in enumerate(self.layers):
            h = kernels.attnres(sources, self.queries[t], norm="slice" if t % 2 else "full")
            sources.append(lin(h))
        return kernels.attnres(sources, self.queries[-1])


def _compile_check(device, dtype, backend, tol):
    torch.manual_seed(0)
    m = _Tiny(64, 16, 4).to(device=device, dtype=dtype)
    x = torch.randn(2, 16, 64, device=device, dtype=dtype)
    torch._dynamo.reset()
    mc = torch.compile(m, fullgraph=True, backend=backend)
    y = mc(x)
    y.float().square().mean().backward()
    gq = m.queries.grad.clone()
    m.zero_grad()
    y_ref = m(x)
    y_ref.float().square().mean().backward()
    assert _rel(y, y_ref) < tol
    assert _rel(gq, m.queries.grad) < tol


def test_compile_fullgraph_cpu():
    # aot_eager traces the custom op (fake impl, registered autograd) exactly as inductor does,
    # without a C++ compile that would dominate CI time
    _compile_check("cpu", torch.float32, "aot_eager", 1e-5)


# ------------------------------------------------------------------------------------------ GPU

GPU_CASES = [
    # d, r, S, norm
    (1024, 1024, 9, "slice"),
    (1024, 128, 9, "full"),
    (1536, 384, 5, "slice"),
    (1536, 192, 33, "slice"),
    (1536, 1536, 2, "full"),
    (2560, 320, 64, "slice"),
    (2560, 2560, 25, "slice"),
    (513, 7, 9, "full"),
    (513, 1, 1, "slice"),
    (64, 8, 49, "slice"),
]


def _paper_check(name, x, ref):
    x, ref = x.float(), ref.float()
    bad = (x - ref).abs() > 0.05 + 0.05 * ref.abs()
    assert torch.isfinite(x).all(), f"{name}: non-finite values"
    assert not bad.any(), f"{name}: {int(bad.sum())} elements fail |x-ref| <= 0.05 + 0.05|ref|"


def bf16_check(d, r, S, norm, tokens=2048, layout="contig", seed=0, fn=None, s=None):
    """bf16 check of ``fn`` (kernels.attnres unless given) with settings ``s`` against the reference
    on identical inputs; returns relative L2 errors."""
    s = s or _settings()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead = (2, tokens // 2)
    sources = _make_sources(S, lead, d, torch.bfloat16, "cuda", layout, gen)
    query = (torch.randn(r, generator=gen, device="cuda") * 0.5).requires_grad_()
    g = torch.randn(*lead, d, generator=gen, device="cuda").to(torch.bfloat16)
    h, gs, gq = _run(_with(fn or kernels.attnres, s), sources, query, g, norm)
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, norm)
    _paper_check("output", h, h_ref)
    for i, (a, b) in enumerate(zip(gs, gs_ref)):
        _paper_check(f"grad source {i}", a, b)
    _paper_check("grad query", gq, gq_ref)
    res = kernels.attnres_fwd(sources, query, norm, 1e-6, s.key)[2]
    if dispatch.res_kept(h.dtype, d, r, norm, S, s):
        assert res.shape == h.shape and bool((res > -128).all()), "residual not fully written"
    else:  # the deferred backward: g.h from the sources, no residual
        assert res.numel() == 0
    return {
        "out_rel_l2": _rel(h, h_ref),
        "src_grad_rel_l2": max(_rel(a, b) for a, b in zip(gs, gs_ref)),
        "query_grad_rel_l2": _rel(gq, gq_ref),
    }


@gpu
@needs_cuda
@pytest.mark.parametrize("d,r,S,norm", GPU_CASES)
def test_gpu_bf16_paper_criterion(d, r, S, norm):
    errs = bf16_check(d, r, S, norm, layout="mixed" if S % 2 else "contig", seed=d + r + S)
    print(f"\nbf16 d={d} r={r} S={S} {norm}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    assert errs["out_rel_l2"] < 1e-2 and errs["src_grad_rel_l2"] < 2e-2


@gpu
@needs_cuda
def test_gpu_one_launch_sum_graphs_and_streams(monkeypatch):
    """The one-launch partial sum on the GPU: the two-launch sum's bits eagerly, in CUDA-graph replays
    (the ring made before capture, its counters back at 0 after every replay) and from sums issued on
    two streams at once; a capture before any ring exists takes the two-launch sum."""
    monkeypatch.setattr(launch, "_SUM_COUNTS", {})
    st = _settings()
    gen = torch.Generator(device="cuda").manual_seed(11)
    parts = [torch.randn(n, r, generator=gen, device="cuda") for n, r in ((4224, 320), (8192, 2560), (1056, 384))]
    want = [launch.sum_rows(p, torch.bfloat16, st) for p in parts]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # no ring yet for (1056, 384)'s width: captured as the two-launch sum
        graph0 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph0):
            out0 = launch.sum_rows_once(parts[2], torch.bfloat16, st)
    assert len(launch._SUM_COUNTS) == 0
    got = [launch.sum_rows_once(p, torch.bfloat16, st) for p in parts]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [launch.sum_rows_once(p, torch.bfloat16, st) for p in parts]
    for _ in range(3):
        graph.replay()
        graph0.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, want)) and torch.equal(out0, want[2])
        assert all(int(ring.abs().sum()) == 0 for ring, _ in launch._SUM_COUNTS.values())
    streams = [torch.cuda.Stream() for _ in range(2)]
    results = [[], []]
    torch.cuda.synchronize()
    for _ in range(20):  # interleaved on two streams: each call has its own ring row
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                results[i].append(launch.sum_rows_once(parts[i], torch.bfloat16, st))
    torch.cuda.synchronize()
    assert all(torch.equal(x, want[i]) for i in range(2) for x in results[i])


@gpu
@pytest.mark.gpu_alone
@needs_cuda
def test_gpu_tuner_times_gpu_work_only():
    """tuner.gpu_time counts GPU time, not the host's: a launch preceded by 2 ms of host work times as the
    launch alone (the tuner's choice once followed host overhead where GPU work is short)."""
    import time

    x = torch.randn(1 << 20, device="cuda")

    def slow_host():
        time.sleep(0.002)
        x.mul_(1.0)

    assert tuner.gpu_time(slow_host) < 0.5  # ms; the multiply alone is a few microseconds


@gpu
@needs_cuda
@pytest.mark.parametrize("dq_sum", ["triton", "once", "torch"])
def test_gpu_tuner_precompiles_and_sums(dq_sum, monkeypatch):
    """On the GPU: the tuner builds a new shape class's candidates before timing them (tuner.precompile
    builds every one, forward and backward) and the paper's criterion holds with either sum of the query-gradient
    partials (S = 3: the deferred backward; S = 12: the residual one, its PERSIST candidates)."""
    monkeypatch.setattr(dispatch, "_TUNED", {})
    st = _settings(autotune=True, dq_sum=dq_sum)
    submitted = []
    real = tuner.precompile

    def counting(cands, *args):
        built, failed = real(cands, *args)
        submitted.append((len(built), len(cands)))
        return built, failed

    monkeypatch.setattr(tuner, "precompile", counting)
    for S in (3, 12):
        bf16_check(1536, 384, S, "slice", tokens=1024, seed=5 + S, s=st)
    assert len(submitted) == 4 and all(b == n >= 2 for b, n in submitted), submitted


# Both backward grids (the token tile also two sources per step and deferred) at every chunk count the
# grid's widths take.  The deferred backward serves "slice" only (under "full" every chunk is in the
# key: kernels.dispatch.defer_kinds), so it is not paired with the "full" shapes.
KEY_CHUNK_BWD = {
    "persistent": {"SB": 1, "num_warps": 4, "PREFETCH": 0},
    "tile": {"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1},
    "tile-pair": {"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1, "PAIR": True},
    "tile-deferred": {"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1, "DEFER": True},
    "tile2-deferred": {"BLOCK_T": 2, "num_warps": 4, "PREFETCH": 1, "DEFER": True},
    "tile-deferred-looped": {"BLOCK_T": 1, "num_warps": 2, "PREFETCH": 1, "DEFER": True, "PERSIST": 16},
}
KEY_CHUNK_CASES = [
    pytest.param(d, r, S, norm, bwd, id=f"{d}-{r}-{S}-{norm}-{name}")
    for name, bwd in KEY_CHUNK_BWD.items()
    for d, r, S, norm in [(1536, 384, 9, "slice"), (2560, 640, 5, "full"), (1536, 700, 8, "slice"),
                          (2560, 320, 9, "slice"), (1024, 256, 9, "full")]
    if not (bwd.get("DEFER") and norm == "full")
]


@gpu
@needs_cuda
@pytest.mark.parametrize("d,r,S,norm,bwd", KEY_CHUNK_CASES)
def test_gpu_bf16_key_chunks(d, r, S, norm, bwd, monkeypatch):
    """The key-chunk specialisation at every chunk count the grid's widths take (3 x 512, 5 x 512 with
    the key in the last two chunks or the last one, 2 x 512), both backward grids (the token tile also
    two sources per step, odd S and even, and deferred: no residual, g.h from the sources), under the paper's
    bf16 criterion, which the interpreter cannot check (its bf16 is wrong)."""
    st = _settings(fwd={"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1, "KEYCH": True}, bwd=dict(bwd, KEYCH=True))
    errs = bf16_check(d, r, S, norm, layout="mixed", seed=d + r + S, s=st)
    assert errs["out_rel_l2"] < 1e-2 and errs["src_grad_rel_l2"] < 2e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("cand", range(len(configs.configs("BWD_RESIDENT_PAIR", 512))))
@pytest.mark.parametrize("d,r,norm", [(1536, 384, "slice"), (2560, 2560, "full"), (1024, 1024, "slice"),
                                      (513, 7, "full")])
def test_gpu_bf16_resident_pair(d, r, norm, cand, monkeypatch):
    """Every candidate of the resident pair (S = 2, no residual kept, g.h from the pair) under the
    paper's bf16 criterion: the key in the last chunks, in every chunk ("full" and r = d), an unaligned
    width."""
    block_d, nch = dispatch.layout("bwd", d, r, DEFAULT)
    st = _settings(bwd=configs.configs("BWD_RESIDENT_PAIR", block_d)[cand])
    errs = bf16_check(d, r, 2, norm, layout="mixed", seed=d + r + cand, s=st)
    assert errs["out_rel_l2"] < 1e-2 and errs["src_grad_rel_l2"] < 2e-2


def _fwd_loop(block_d, nch):
    return configs.configs(configs.family("fwd", nch), block_d)


def _fwd_pair(block_d, nch):
    return configs.configs("FWD_PAIR", block_d)


def _forward_candidates(table, shapes, family):
    """(shape..., candidate index, family) of every distinct forward candidate of ``table`` (_fwd_loop
    or _fwd_pair) at each shape's column layout (narrow chunks merge some lines of a table, so a
    shape has as many cases as it has distinct candidates).  The per-argument family ("args") runs
    the ARGS line alone: its kernel shares the body with the table kernel and differs only in how
    it addresses the sources, which no launch option touches, so each other candidate is held by
    the table family's case and the addressing by the ARGS line's; compiled calls run that line."""
    forms = ("pair",) if table is _fwd_pair else ()
    out = []
    for shape in shapes:
        layout = dispatch.layout("fwd", shape[0], shape[1], DEFAULT)
        cands = table(*layout)
        keep = [cands.index(configs.args_config("fwd", *layout, forms))] if family == "args" else range(len(cands))
        out += [pytest.param(*shape, cand, family, id="-".join(map(str, (*shape, cand, family)))) for cand in keep]
    return out


@gpu
@needs_cuda
@pytest.mark.parametrize("d,r,norm,cand,family", [
    p for family in ("table", "args")
    for p in _forward_candidates(_fwd_pair, [(1536, 384, "slice"), (2560, 2560, "full"), (2560, 320, "slice"),
                                             (1024, 256, "slice"), (513, 7, "full")], family)])
def test_gpu_bf16_pair_forward(d, r, norm, cand, family, monkeypatch):
    """Every candidate of the pair forward (S = 2, both sources at once) under the paper's bf16
    criterion, before the default backward, in the table kernel (the per-argument one: its ARGS line,
    _forward_candidates): the key in the last chunk or chunks, in every chunk, an unaligned width."""
    cands = _fwd_pair(*dispatch.layout("fwd", d, r, DEFAULT))
    errs = bf16_check(d, r, 2, norm, layout="mixed", seed=d + r + cand, fn=_attnres_args if family == "args" else None,
                      s=_settings(fwd=cands[cand]))
    assert errs["out_rel_l2"] < 1e-2 and errs["src_grad_rel_l2"] < 2e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("d,r,S,norm,cand,family", [
    p for family in ("table", "args")
    for p in _forward_candidates(_fwd_loop, [(1024, 1024, 9, "slice"), (1536, 384, 9, "slice"),
                                             (2560, 2560, 5, "full")], family)])
def test_gpu_bf16_loop_forward(d, r, S, norm, cand, family, monkeypatch):
    """Every candidate of the loop forward under the paper's bf16 criterion, before the default
    backward, in the table kernel (the per-argument one: its ARGS line, _forward_candidates): one
    chunk of 1024 with the key over the whole row (1 warp for 1024 columns among them), three chunks
    with the key in the last, five chunks under "full" (Triton's pipelining with 2 warps per chunk
    among them)."""
    cands = _fwd_loop(*dispatch.layout("fwd", d, r, DEFAULT))
    errs = bf16_check(d, r, S, norm, layout="mixed", seed=d + r + cand, fn=_attnres_args if family == "args" else None,
                      s=_settings(fwd=cands[cand]))
    assert errs["out_rel_l2"] < 1e-2 and errs["src_grad_rel_l2"] < 2e-2


# The gpu scale's routing reads (gpu-small: d = 384 as three chunks of 128, r = 48 and r = d, S up to
# 9, 32 x 512 tokens, bf16): where seven processes autotuning at once on one H200 met a CUDA fault
# (docs/kernel.md, Known limits).
GPU_SMALL = dict(d=384, tokens=32 * 512)


@gpu
@needs_cuda
@pytest.mark.parametrize("r", [48, 384])
@pytest.mark.parametrize("S", [2, 3, 9])
def test_gpu_every_candidate_at_the_gpu_scale_shapes(r, S, monkeypatch):
    """Every forward and backward candidate the tuner may time at the gpu scale's shapes runs under
    the paper's bf16 criterion, one at a time (a candidate with a latent fault would stop here with
    its configuration named, not inside a tuner)."""
    d = GPU_SMALL["d"]
    fwd_layout, bwd_layout = dispatch.layout("fwd", d, r, DEFAULT), dispatch.layout("bwd", d, r, DEFAULT)
    forms = dispatch.defer_kinds(torch.bfloat16, d, r, "slice", S, DEFAULT)
    cases = [{"fwd": c} for c in configs.candidates("fwd", *fwd_layout, dispatch.fwd_forms(S, DEFAULT))]
    cases += [{"bwd": c} for c in configs.candidates("bwd", *bwd_layout, forms)]
    if forms:  # the residual backward's candidates too (a pinned backward without DEFER keeps the residual)
        cases += [{"bwd": c} for c in configs.candidates("bwd", *bwd_layout)]
    for i, override in enumerate(cases):
        try:
            errs = bf16_check(d, r, S, "slice", tokens=GPU_SMALL["tokens"], layout="contig", seed=i,
                              s=_settings(**override))
            torch.cuda.synchronize()
        except Exception as e:
            raise AssertionError(f"d={d} r={r} S={S} configuration {override}: {e}") from e
        assert errs["out_rel_l2"] < 1e-2 and errs["src_grad_rel_l2"] < 2e-2, override


_SIDE_BY_SIDE = r"""
import os, sys, time, torch
import kernels
folder, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
assert kernels.DEFAULT.autotune
open(os.path.join(folder, f"ready.{me}"), "w").close()
t0 = time.time()
while sum(f.startswith("ready.") for f in os.listdir(folder)) < n and time.time() - t0 < 300:
    time.sleep(0.01)  # every process reaches its first call together
gen = torch.Generator(device="cuda").manual_seed(me)
d, r = 384, 48
q = (torch.randn(r, device="cuda", generator=gen) * 0.5).requires_grad_()
for S in (2, 9):  # S = 2: the pair forms, the deferred backward; S = 9: the loop forward, the residual one
    srcs = [torch.randn(32, 512, d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in range(S)]
    with torch.no_grad():  # a validation read: the forward alone
        kernels.attnres(srcs, q)
    kernels.attnres(srcs, q).float().square().mean().backward()
torch.cuda.synchronize()
print("tuned", len(kernels.tuned_configs()), flush=True)
"""


@gpu
@pytest.mark.gpu_alone
@needs_cuda
@pytest.mark.parametrize("threads", ["8", "1"], ids=["parallel-compile", "serial-compile"])
def test_gpu_tuner_side_by_side_processes(threads, tmp_path):
    """Seven processes on one GPU reach their first eager calls together and autotune the gpu
    scale's reads (forward alone, then forward and backward) with one fresh Triton cache between
    them: every one finishes.  With the candidates compiled in threads and one after another
    (KERNELS_COMPILE_THREADS).  Two shape classes of each kind (d = 384, r = 48; S = 2 and 9: the
    pair forms and the deferred backward, the loop forward and the residual backward) are enough
    for what this holds, the processes' concurrency; every candidate at the gpu scale's shapes is
    held by test_gpu_every_candidate_at_the_gpu_scale_shapes."""
    import subprocess

    n = 7
    env = dict(os.environ, KERNELS_COMPILE_THREADS=threads, KERNELS_AUTOTUNE="1",
               TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", _SIDE_BY_SIDE, str(tmp_path), str(i), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = [p.communicate(timeout=900) for p in procs]
    failed = [(i, err[-3000:]) for i, (p, (out, err)) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not failed, failed
    assert all("tuned" in out for out, _ in outs)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    sources = _make_sources(7, (3, 333), 768, dtype, "cuda", "mixed", gen)
    query = torch.randn(96, generator=gen, device="cuda").requires_grad_()
    g = torch.randn(3, 333, 768, generator=gen, device="cuda").to(dtype)
    h, gs, gq = _run(kernels.attnres, sources, query, g, "slice")
    h_ref, gs_ref, gq_ref = _run(route, sources, query, g, "slice")
    assert h.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert _rel(h, h_ref) < tol
    assert max(_rel(a, b) for a, b in zip(gs, gs_ref)) < tol * 4
    assert _rel(gq, gq_ref) < tol * 20


@gpu
@needs_cuda
def test_compile_fullgraph_gpu():
    _compile_check("cuda", torch.float32, "inductor", 1e-4)


@gpu
@needs_cuda
@pytest.mark.parametrize("layers,inlined", [(15, True), (16, False)], ids=["S<=16", "S=17"])
def test_compile_inlines_kernels_gpu(layers, inlined):
    """Under torch.compile, reads of at most MAX_ARG_SOURCES sources become Triton launches in
    Inductor's own code (no call back into the custom op); a read of more keeps the custom op.
    bf16, the paper's criterion against the eager model."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    m = _Tiny(256, 64, layers).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    mc = torch.compile(m, fullgraph=True)

    def step():
        y = mc(x)
        y.float().square().mean().backward()
        return y

    y, codes = run_and_get_code(step)
    code = "\n".join(codes)
    gq = m.queries.grad.clone()
    m.zero_grad()
    y_ref = m(x)
    y_ref.float().square().mean().backward()
    _paper_check("compiled output", y, y_ref)
    _paper_check("compiled query gradient", gq, m.queries.grad)
    assert ("_attnres_fwd_args_kernel" in code) and ("_attnres_bwd_args_kernel" in code)
    assert ("lrattnres_kernels.attnres_fwd.default" in code) == (not inlined), "custom op called back"


def test_row_stride_reads_in_place_only_when_rows_flatten():
    """The launchers address a source in place when its leading dims flatten into rows of unit
    feature stride, and copy it otherwise; the copy and the in-place read give the same rows."""
    _as_rows, _row_stride = launch.as_rows, launch.row_stride

    base = torch.randn(4, 6, 10)
    assert _row_stride(base, 10) == 10  # contiguous
    assert _row_stride(base[:, :, 2:7], 5) == 10  # column slice: rows 10 apart
    assert _row_stride(base[:, 1:4, :], 10) is None  # rows of the middle dim skip: no single stride
    assert _row_stride(base[1:2, 1:4, :], 10) == 10  # a size-1 leading dim does not matter
    assert _row_stride(base.transpose(0, 1), 10) is None  # leading dims out of order
    assert _row_stride(base.transpose(1, 2), 6) is None  # feature stride != 1
    assert _row_stride(torch.randn(7), 7) == 7  # one row
    srcs = [base[:, :, 2:7], base[:, 1:4, 2:7], base.transpose(0, 1)[:, :, :5]]
    rows, strides = _as_rows(srcs, 5, torch.float32)
    for src, t, rs in zip(srcs, rows, strides):
        n = src.numel() // 5
        got = torch.as_strided(t, (n, 5), (rs, 1))
        torch.testing.assert_close(got, src.reshape(n, 5))


# --------------------------------------------------------------------- per-argument (compiled) path

ARGS_CASES = [
    # d, r, S, norm, layout, configurations: prefetch on and off, SB 1 to 8, one chunk and five
    (64, 1, 1, "slice", "contig", {"fwd": {"BLOCK_T": 8, "num_warps": 1, "PREFETCH": 1},
                                   "bwd": {"SB": 8, "num_warps": 2, "PREFETCH": 1}}),
    (64, 7, 2, "full", "mixed", {"bwd": {"SB": 8, "num_warps": 1, "PREFETCH": 1}}),  # the pair forward's own
    (513, 64, 3, "slice", "rowpad", {"fwd": {"BLOCK_T": 4, "num_warps": 4, "PREFETCH": 1},
                                     "bwd": {"SB": 4, "num_warps": 4, "PREFETCH": 0, "KEYCH": True}}),
    (513, 513, 9, "full", "mixed", {"fwd": {"BLOCK_T": 4, "num_warps": 4, "PREFETCH": 1, "KEYCH": True, "EVICT": True},
                                    "bwd": {"BLOCK_T": 4, "num_warps": 2, "PREFETCH": 0, "KEYCH": True, "STAGES": 3}}),
    # S = MAX_ARG_SOURCES over two column chunks, the last one partial (640 = 512 + 128: a third of the
    # interpreter's time at 1536)
    (640, 192, 16, "slice", "contig", {"fwd": {"BLOCK_T": 1, "num_warps": 4, "PREFETCH": 1, "KEYCH": True,
                                               "EVICT": True},
                                       "bwd": {"SB": 1, "num_warps": 4, "PREFETCH": 0}}),
]


def _attnres_args(sources, query, norm="slice", settings=DEFAULT):
    """The triton_op pair with its registered autograd, called eagerly."""
    h, _, _ = autograd.attnres_fwd_args(list(sources), query, norm, 1e-6, settings.key)
    return h


@needs_triton
@pytest.mark.parametrize("d,r,S,norm,layout,cfg", ARGS_CASES)
def test_args_kernels_match_reference(d, r, S, norm, layout, cfg):
    """The per-argument kernels (the triton_op torch.compile traces) against the reference: S as a
    compile-time constant from 1 to 16, strided inputs, each prefetch depth."""
    _fp32_against_reference(_attnres_args, d, r, S, norm, layout, seed=d + r + S, s=_settings(**cfg))


@pytest.mark.parametrize("dtype,d,r,S", [("float32", 64, 16, 3), ("bfloat16", 1536, 384, 3),  # deferred, two passes
                                         ("bfloat16", 1536, 1536, 2)])  # the resident pair
def test_args_path_traces_to_kernels(dtype, d, r, S):
    """The triton_op's body traces into Triton kernel launches (no opaque op, no data pointers), as
    torch.compile needs, also where the backward is deferred (bf16, the key past the first chunk: no
    residual, a scratch the backward writes; two sources: the resident pair); run in a fresh interpreter
    without TRITON_INTERPRET (whose kernels cannot be traced), tracing only, so no GPU is needed."""
    import subprocess

    code = r'''
import sys, torch
from torch._functorch.aot_autograd import aot_function
from kernels import Settings, autograd, dispatch
s = Settings(cpu_triton=True)
dtype, d, r, S = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
kinds = dispatch.defer_kinds(dtype, d, r, "slice", S, s)
deferred = bool(kinds)
graphs = []
class Traced(Exception):
    pass
def capture(gm, inputs):  # AOTAutograd's functionalized graph, as Inductor would receive it
    graphs.append(gm.code)
    raise Traced
def step(q, g, *xs):
    h, lse, res = autograd.attnres_fwd_args(list(xs), q, "slice", 1e-6, s.key)
    assert (res.numel() == 0) == (deferred or dtype == torch.float32)
    return h, autograd.attnres_bwd_args(list(xs), q, h, lse, res, g, "slice", 1e-6, s.key)
x = [torch.randn(2, 5, d, dtype=dtype) for _ in range(S)]
try:
    aot_function(step, fw_compiler=capture)(torch.randn(r, dtype=dtype), torch.randn(2, 5, d, dtype=dtype), *x)
except Traced:
    pass
text = graphs[0]
print(text)
assert text.count("higher_order.triton_kernel_wrapper_functional(") == 2, "expected one forward and one backward launch"
assert "attnres_fwd_args" not in text and "attnres_bwd_args" not in text
assert ("DEFER': True" in text) == deferred, "the backward launch's DEFER"
assert text.count("PAIR': True") == ("pair" in kinds) + ("pair" in dispatch.fwd_forms(S, s)), "the launches' PAIR (the resident pair, the pair forward)"
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code, dtype, str(d), str(r), str(S)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@needs_triton
def test_compiled_calls_pick_the_args_path():
    """Compiled CUDA calls with S <= 16 take the triton_op; more sources, CPU tensors or the settings'
    compiled_path "op" take the custom op."""

    class _Fake:  # what the choice reads of a source
        def __init__(self, is_cuda, dtype=torch.bfloat16):
            self.is_cuda, self.dtype = is_cuda, dtype

    path = autograd.compiled_args_path
    assert path([_Fake(True)] * 16, DEFAULT)
    assert not path([_Fake(True)] * 17, DEFAULT)
    assert not path([_Fake(False)] * 3, DEFAULT)
    assert not path([_Fake(True, torch.float64)] * 3, DEFAULT)
    assert not path([_Fake(True)] * 3, Settings(compiled_path="op"))


_WRITES_SCRIPT = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap as tkw
from kernels import fused_bwd, fused_fwd
analyse = getattr(tkw, "identify_accessed_tensors", None)
if analyse is None:
    print(json.dumps(None)); sys.exit(0)
class _Target:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
def analysed(argv):  # one case: its arguments as the test names them
    S, N, d, r = 3, 40, 96, 16
    BLOCK_D, NCH, STAGES = (32, 3, 2) if argv[1] == "3" else (128, 1, 1)  # the pipelined loop with three chunks
    DEFER = argv[5] == "1"  # the deferred backward: no residual, a g.o scratch (not for the resident pair)
    RESIDENT = DEFER and argv[4] == "1"  # the resident pair: no prefetch, no scratch
    common = dict(N=N, S=S, d=d, r=r, NSLOT=S, EPS=1e-6, SLICE=True, HAS_RES=not DEFER, RES_STEP=0.0, BLOCK_D=BLOCK_D,
                  NCH=NCH, KEY0=int(argv[3]), PREFETCH=0 if RESIDENT else 1, EVICT=False, STAGES=STAGES, q_ptr=torch.empty(r, dtype=torch.bfloat16),
                  res_ptr=None if DEFER else torch.empty(N, d, dtype=torch.int8), st_ptr=torch.empty(1 + 2 * S, N))
    fwd = dict(common, out_ptr=torch.empty(N, d, dtype=torch.bfloat16), BLOCK_T=2, FUSED=True, LAZY=int(argv[6]),
               PAIR=argv[8] == "1")  # the pair forward (analysed only, so S = 3 does not matter)
    bwd = dict(common, h_ptr=torch.empty(N, d, dtype=torch.bfloat16), g_ptr=torch.empty(N, d, dtype=torch.bfloat16),
               dq_part_ptr=torch.empty(4, r), go_ptr=torch.empty(S, N) if (DEFER and not RESIDENT) else None, stride_g=d, SB=2,
               BLOCK_T=int(argv[2]), PAIR=argv[4] == "1", DEFER=DEFER,  # BLOCK_T 0: persistent grid
               PERSIST=int(argv[7]))
    for i in range(16):
        for kw in (fwd, bwd):
            kw[f"x{i}"] = torch.empty(N, d, dtype=torch.bfloat16) if i < S else None
            kw[f"xs{i}"] = d if i < S else None
        bwd[f"dx{i}"] = torch.empty(N, d, dtype=torch.bfloat16) if i < S else None
    out = {}
    for name, kernel, kw in (("fwd", fused_fwd._attnres_fwd_args_kernel, fwd), ("bwd", fused_bwd._attnres_bwd_args_kernel, bwd)):
        out[name] = sorted(dep.name for dep in analyse(kernel, kw, {}).read_writes.writes)
    return out
triton.runtime.driver.set_active(_Target())
print(json.dumps([analysed([None, *case]) for case in json.loads(sys.argv[1])]))
"""


@needs_triton
def test_compiled_kernels_write_only_their_outputs():
    """Inductor decides which arguments a user-defined Triton kernel writes by following store
    addresses back through the kernel's values and helper calls; an argument it wrongly counts as
    written is cloned and copied back after the launch.  For the query (a view of the model's
    parameter) that copy-back made the compiled model's outputs wrong on the H200 (2026-11-29), so
    the per-argument kernels must show writes to their outputs only.  Torch's analysis runs offline
    against an sm_90 target, in a subprocess without the interpreter (it needs compiled kernels)."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    # column chunks; the backward's grid (0 persistent, 2 tokens per program); KEY0 (key-chunk specialisation);
    # PAIR (the token tile two sources per step); DEFER (the deferred backward, whose forward keeps no residual);
    # LAZY (the forward's lazy online softmax: 2 for its two-token blocks); PERSIST (looped token blocks);
    # PAIR with DEFER, the resident pair (its block loop pipelined: three chunks build with STAGES 2); the
    # forward's PAIR (the pair forward)
    cases = (("1", "0", "0", "0", "0", "0", "0", "0"), ("3", "0", "0", "0", "0", "1", "0", "0"),
             ("3", "2", "2", "0", "0", "2", "0", "0"), ("3", "0", "2", "0", "0", "0", "0", "0"),
             ("3", "2", "2", "1", "0", "1", "8", "0"), ("3", "2", "2", "0", "1", "2", "0", "0"),
             ("3", "1", "2", "0", "1", "2", "16", "0"), ("3", "1", "2", "1", "1", "1", "8", "1"),
             ("1", "0", "0", "0", "0", "0", "0", "1"))
    proc = subprocess.run([sys.executable, "-c", _WRITES_SCRIPT, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)  # one process: torch imported once
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    if results is None:
        pytest.skip("this torch has no identify_accessed_tensors")
    assert len(results) == len(cases)
    for case, written in zip(cases, results):
        deferred = case[4] == "1"
        assert written["fwd"] == (["out_ptr", "st_ptr"] if deferred else ["out_ptr", "res_ptr", "st_ptr"]), case
        scratch = deferred and case[3] == "0"  # the two-pass form's g.o scratch
        assert written["bwd"] == ["dq_part_ptr", "dx0", "dx1", "dx2"] + (["go_ptr"] if scratch else []), case
