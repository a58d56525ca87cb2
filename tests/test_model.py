"""The model: parameter accounting (Appendix F.5), every variant against the explainer's loop,
document masking, router switch, and bad configs."""

import math
import sys
import types

import pytest
import torch

import lrattnres.model as model_mod
from lrattnres.attention import make_attention
from lrattnres.model import METHODS, ModelConfig, apply_rope, build_model, count_parameters, model_config, rope_tables
from lrattnres.presets import PRESETS
from lrattnres.routing import block_ends, rms_norm

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

V = 97  # vocabulary of the small test models


def smoke(method="lr", blocks="full", rank=None, **kw):
    rank = rank if rank is not None else (32 if method == "attnres" else 8)
    return model_config({"preset": "smoke", "vocab_size": V, "method": method, "blocks": blocks, "rank": rank, **kw})


def variants():
    return [pytest.param(m, b, id=f"{m}-{b}") for m in METHODS for b in ("full", 3)]


def tokens(B=2, T=24, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- parameter accounting -----------------------------------------------------------------------


def analytic_parameters(L, d, m, vocab, method, r):
    """Backbone 2Vd + L(4d^2 + 3dm); Delta P_S = 2Lr; Delta P_P = r[L(d+m) + d + 2L] (Appendix F.5)."""
    base = 2 * vocab * d + L * (4 * d * d + 3 * d * m)
    if method == "baseline":
        return base
    if method == "plr":
        return base + r * (L * (d + m) + d + 2 * L)
    return base + 2 * L * r


def test_paper_0_5b_full_attnres_parameter_count():
    assert count_parameters({"preset": "0.5B", "method": "attnres", "blocks": "full"}) == 513_697_792


def test_appendix_f6_projected_delta():
    base = count_parameters({"preset": "0.5B", "method": "baseline"})
    assert count_parameters({"preset": "0.5B", "method": "plr", "blocks": "full", "rank": 32}) - base == 2_983_424
    assert count_parameters({"preset": "0.5B", "method": "lr", "blocks": 8, "rank": 128}) - base == 48 * 128


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_counts_of_every_preset_and_variant(preset):
    p = PRESETS[preset]
    L, d, m = p["n_layers"], p["d_model"], p["d_ff"]
    vocab = p["vocab_size"] or 1000
    for method, blocks in zip(METHODS, ("full", 2, "full", 2, 2)):  # N does not change the count
        r = d if method == "attnres" else d // 4
        cfg = {"preset": preset, "vocab_size": vocab, "method": method, "blocks": blocks, "rank": r}
        assert count_parameters(cfg) == analytic_parameters(L, d, m, vocab, method, r), (preset, method)


def test_instantiated_count_and_parameter_names():
    cfg = smoke("plr", blocks=2)
    model = build_model(cfg)
    assert model.num_parameters() == count_parameters(cfg)
    names = set(model.state_dict())
    expected = {"embed.weight", "head.weight", "queries", "embed_route_key.weight"}
    for i in range(cfg.n_layers):
        expected |= {f"layers.{i}.attn.{n}.weight" for n in ("qkv", "out", "route_key")}
        expected |= {f"layers.{i}.mlp.{n}.weight" for n in ("gate_up", "down", "route_key")}
    assert names == expected  # RoPE tables are not saved
    assert model.queries.shape == (4, 8)
    assert model.layers[0].mlp.route_key.weight.shape == (8, cfg.d_ff)
    assert model.layers[0].attn.route_key.weight.shape == (8, cfg.d_model)


def test_initialisation():
    torch.manual_seed(0)
    model = build_model(model_config({"preset": "tiny", "vocab_size": 1000, "method": "lr", "rank": 16}))
    assert torch.all(model.queries == 0)
    for name, p in model.named_parameters():
        if name != "queries":
            assert abs(p.std().item() - 0.02) < 0.002, name
            assert abs(p.mean().item()) < 0.002, name


# ---- forward, backward, routing weights ---------------------------------------------------------


def expected_num_sources(t, n_writes, blocks):
    ends = block_ends(n_writes, blocks)
    done = sum(e <= t for e in ends)
    return 1 + done + (t not in ends)


@pytest.mark.parametrize("method,blocks", variants())
def test_forward_backward_and_routing_weights(method, blocks):
    torch.manual_seed(0)
    cfg = smoke(method, blocks)
    model = build_model(cfg)
    x = tokens()
    logits, routing = model(x, return_routing=True)
    assert logits.shape == (2, 24, V) and logits.dtype == torch.float32
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    if method == "baseline":
        assert routing == []
        return
    n_writes = 2 * cfg.n_layers
    assert len(routing) == n_writes
    for t, w in enumerate(routing, start=1):
        S = expected_num_sources(t, n_writes, blocks)
        assert w.shape == (2, 24, S) and w.dtype == torch.float32
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 24))
        torch.testing.assert_close(w, torch.full_like(w, 1 / S))  # zero queries: uniform
    torch.testing.assert_close(model(x), logits)  # the same function without the weights


def explainer_forward(model, x, *, keys_from="slice"):
    """The explainer's teaching loop (bank, partial, ends), written independently of the model's."""
    cfg = model.cfg
    eps, r, M = cfg.norm_eps, cfg.rank, 2 * cfg.n_layers
    T = x.shape[1]
    attend = make_attention(None, seq_len=T, device=x.device, dtype=torch.float32, backend="sdpa")
    aux = (model.rope_cos[:T], model.rope_sin[:T], attend)
    e = model.embed(x)
    if cfg.method == "baseline":
        h = e
        for sub in model.sublayers():
            h = h + sub(rms_norm(h, eps), *aux)[0]
        return model.head(rms_norm(h, eps))
    N = M if cfg.blocks == "full" else cfg.blocks
    ends = {math.ceil(M * j / N) for j in range(1, N + 1)}
    bank = [(e, model.embed_route_key(e) if cfg.method == "plr" else None)]
    partial, h = None, e
    for t, (sub, q) in enumerate(zip(model.sublayers(), model.queries), 1):
        write = sub(rms_norm(h, eps), *aux)
        partial = write if partial is None else (partial[0] + write[0], None if write[1] is None else partial[1] + write[1])
        if t in ends:
            bank.append(partial)
            partial = None
        sources = bank + ([] if partial is None else [partial])
        values = torch.stack([s[0] for s in sources])
        if cfg.method == "plr":
            keys = rms_norm(torch.stack([s[1] for s in sources]), eps)
        elif cfg.method == "lr-fullrms":
            keys = rms_norm(values, eps)[..., -r:]
        else:
            keys = rms_norm(values[..., -r:], eps)
        weights = (keys @ q).softmax(0)
        h = (weights[..., None] * values).sum(0)
    return model.head(rms_norm(h, eps))


@pytest.mark.parametrize("method,blocks", variants())
def test_model_matches_the_explainer_loop(method, blocks):
    torch.manual_seed(1)
    model = build_model(smoke(method, blocks, router="reference"))
    if method != "baseline":
        with torch.no_grad():
            model.queries.normal_(0, 2.0)  # non-uniform routing
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), explainer_forward(model, x), atol=1e-5, rtol=1e-5)


def test_lr_with_rank_d_is_attnres():
    torch.manual_seed(0)
    a = build_model(smoke("attnres", blocks=3))
    b = build_model(smoke("lr", blocks=3, rank=32))
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.queries.normal_()
        b.queries.copy_(a.queries)
        torch.testing.assert_close(a(tokens()), b(tokens()))


def test_first_read_is_the_embedding():
    model = build_model(smoke("lr", blocks=2))
    seen = {}
    model.layers[0].attn.register_forward_hook(lambda mod, args, out: seen.update(x=args[0]))
    x = tokens()
    with torch.no_grad():
        model(x)
        torch.testing.assert_close(seen["x"], rms_norm(model.embed(x), 1e-6))


def test_fp64_forward_for_conversion_checks():
    model = build_model(smoke("lr-fullrms", blocks=2)).double()
    logits, routing = model(tokens(), return_routing=True)
    assert logits.dtype == torch.float64 and routing[0].dtype == torch.float64


def test_rope_rotates_interleaved_pairs():
    cos, sin = rope_tables(4, 8, 500000.0)
    x = torch.tensor([1.0, 0.0, 1.0, 0.0]).expand(1, 1, 8, 4)
    out = apply_rope(x, cos, sin)
    p = torch.arange(8.0)
    torch.testing.assert_close(out[0, 0, :, 0], torch.cos(p))  # pair (0, 1) at frequency 1
    torch.testing.assert_close(out[0, 0, :, 1], torch.sin(p))
    slow = p * 500000.0 ** (-0.5)  # pair (2, 3) at frequency base^(-2/4)
    torch.testing.assert_close(out[0, 0, :, 2], torch.cos(slow))
    # scores depend only on the distance between positions
    q, k = torch.randn(2, 1, 1, 1, 4).unbind(0)
    qr, kr = apply_rope(q.expand(1, 1, 8, 4), cos, sin), apply_rope(k.expand(1, 1, 8, 4), cos, sin)
    s = qr[0, 0] @ kr[0, 0].T
    torch.testing.assert_close(s[5, 3], s[4, 2])


# ---- document masking ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("method", ["baseline", "lr", "plr"])
def test_changing_one_document_leaves_the_others(method, backend):
    torch.manual_seed(0)
    model = build_model(smoke(method, blocks=3, attention=backend))
    doc = torch.tensor([[0] * 7 + [1] * 9 + [2] * 8, [0] * 24])
    x = tokens()
    x2 = torch.where(doc == 1, tokens(seed=5), x)
    with torch.no_grad():
        a, b = model(x, doc), model(x2, doc)
    keep = doc != 1
    torch.testing.assert_close(a[keep], b[keep], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[~keep], b[~keep])
    # one document per row is plain causal attention
    with torch.no_grad():
        torch.testing.assert_close(model(x, torch.zeros_like(doc)), model(x), atol=1e-5, rtol=1e-5)


# ---- router switch ------------------------------------------------------------------------------


@pytest.fixture
def fake_kernels(monkeypatch):
    """A stand-in ``kernels`` package that records its calls and computes the reference math."""
    from lrattnres.routing import route

    calls = []
    fake = types.ModuleType("kernels")

    def attnres(sources, query, *, norm="slice", eps=1e-6):
        calls.append(norm)
        return route(sources, query, norm=norm, eps=eps)

    fake.attnres = attnres
    monkeypatch.setitem(sys.modules, "kernels", fake)
    model_mod._kernels.cache_clear()
    yield calls
    model_mod._kernels.cache_clear()


def test_fused_router_calls_kernels(fake_kernels):
    torch.manual_seed(0)
    model = build_model(smoke("lr-fullrms", blocks=3, router="fused"))
    with torch.no_grad():
        model.queries.normal_()
    x = tokens()
    out = model(x)
    assert fake_kernels == ["full"] * 4
    model.cfg.router = "reference"
    torch.testing.assert_close(out, model(x))
    assert len(fake_kernels) == 4
    model.cfg.router = "auto"  # auto stays on the reference path on the CPU
    model(x)
    assert len(fake_kernels) == 4


def test_plr_and_routing_weights_do_not_use_the_kernel(fake_kernels):
    build_model(smoke("plr", blocks=3, router="fused"))(tokens())
    build_model(smoke("lr", blocks=3, router="fused"))(tokens(), return_routing=True)
    assert fake_kernels == []


def test_fused_router_without_kernels(monkeypatch):
    monkeypatch.setattr(model_mod, "_kernels", lambda: None)
    with pytest.raises(ValueError, match="router='fused'"):
        build_model(smoke("lr", router="fused"))(tokens())


def test_real_kernels_match_reference():
    kernels = pytest.importorskip("kernels")
    if not hasattr(kernels, "attnres"):
        pytest.skip("kernels.attnres not there yet")
    torch.manual_seed(0)
    model = build_model(smoke("lr", blocks=3, router="fused"))
    with torch.no_grad():
        model.queries.normal_()
        out = model(tokens())
        model.cfg.router = "reference"
        torch.testing.assert_close(out, model(tokens()), atol=1e-5, rtol=1e-5)


# ---- configs and bad input ----------------------------------------------------------------------


def test_config_from_name_dict_and_dataclass():
    cfg = model_config("0.5B")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.max_seq_len, cfg.vocab_size) == (24, 1024, 16, 2816, 2048, 100277)
    assert (cfg.method, cfg.blocks, cfg.rank) == ("lr", 8, 128)
    assert model_config({"preset": "1B", "method": "attnres"}).rank == 1536
    assert model_config({"preset": "4B", "method": "lr", "rank": 640}).n_layers == 44
    assert model_config(cfg) is cfg
    assert model_config(cfg.to_dict()) == cfg
    assert ModelConfig(100, 2, 32, 2, 88, 64, method="attnres", blocks=2, rank=None).rank == 32


@pytest.mark.parametrize(
    "override,match",
    [
        ({"method": "hyper"}, r"method='hyper': expected one of \('baseline'"),
        ({"rank": 33}, r"rank=33: expected an int r with 1 <= r <= d_model=32"),
        ({"rank": 0}, r"rank=0: expected an int r with 1 <= r <= d_model=32"),
        ({"blocks": 5}, r"blocks=5: expected 'full' or an int N with 1 <= N <= 2L = 4"),
        ({"blocks": 0}, r"blocks=0"),
        ({"blocks": "8"}, r"blocks='8'"),
        ({"method": "attnres", "rank": 8}, r"rank=8: expected r = d_model = 32 for method 'attnres'"),
        ({"router": "triton"}, r"router='triton'"),
        ({"attention": "xformers"}, r"attention='xformers'"),
        ({"n_heads": 3}, r"n_heads=3"),
        ({"vocab_size": 0}, r"vocab_size=0"),
        ({"colour": "red"}, r"unknown model config field\(s\) \['colour'\]"),
    ],
)
def test_bad_config(override, match):
    with pytest.raises(ValueError, match=match):
        model_config({"preset": "smoke", "vocab_size": V, "method": "lr", "rank": 8, **override})


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model preset '7B'; expected one of \[.*'0.5B'.*'tiny'"):
        build_model("7B")


def test_small_preset_needs_a_vocabulary():
    with pytest.raises(ValueError, match="vocab_size: preset 'tiny' takes it from the data manifest"):
        build_model("tiny")


def test_dict_without_preset_names_missing_fields():
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['d_ff'"):
        model_config({"vocab_size": 10, "n_layers": 2, "d_model": 32, "n_heads": 2, "max_seq_len": 64})


def test_too_long_input():
    with pytest.raises(ValueError, match="max_seq_len=64"):
        build_model(smoke())(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("stream_dtype,expected", [("autocast", torch.bfloat16), ("param", torch.float32)])
def test_autocast_sources_share_one_dtype(fake_kernels, monkeypatch, stream_dtype, expected):
    """Under bf16 autocast every source of a read has the stream's dtype (bf16 by default, as the
    paper and the published kernels have it; fp32 with stream_dtype="param"), so a fused kernel
    gets one dtype."""
    import kernels

    seen = []
    inner = kernels.attnres
    monkeypatch.setattr(kernels, "attnres", lambda s, q, **kw: seen.append({x.dtype for x in s}) or inner(s, q, **kw))
    model = build_model(smoke("lr", blocks=3, router="fused", stream_dtype=stream_dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens()).float().mean().backward()
    assert seen and all(s == {expected} for s in seen)


def test_stream_dtype_is_checked():
    with pytest.raises(ValueError, match="ModelConfig.stream_dtype='fp16': expected one of"):
        smoke("lr", blocks=3, stream_dtype="fp16")


# ---- the flash path's plumbing, with a stand-in for flash-attn's kernel ------------------------------


def test_flash_plumbing_from_the_loader_batch_to_the_kernel(monkeypatch):
    """A loader-built batch through the trainer's step (LossModule, accumulate_gradients): with
    attention 'flash' the kernel gets the batch's own host-built offsets, and loss and gradients equal
    SDPA's with the block-diagonal mask.  The stand-in computes causal SDPA per segment."""
    import numpy as np
    import torch.nn.functional as F

    import lrattnres.attention as attention
    from lrattnres.data.loader import batch_from_rows
    from lrattnres.train.loop import LossModule, accumulate_gradients

    seen = []

    def per_segment(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        seen.append((cu_q, max_q))
        b = cu_q.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True)
                          .transpose(0, 1) for s, e in zip(b, b[1:])])

    monkeypatch.setattr(attention, "_flash_varlen", lambda: per_segment)
    rng = np.random.default_rng(0)
    rows = rng.integers(1, V, size=(3, 25))
    rows[rng.random(rows.shape) < 0.15] = 0  # end-of-text id 0
    batch = batch_from_rows(rows, eot_id=0)
    results = {}
    for backend in ("sdpa", "flash"):
        torch.manual_seed(0)
        model = build_model(smoke("lr", blocks=3, attention=backend))
        lm = LossModule(model, "fp32")
        params = list(model.parameters())
        ce, zl, gn = accumulate_gradients(lm, lm, [batch], params, torch.device("cpu"), 1e-4, None,
                                          segments=backend == "flash")
        results[backend] = (ce, zl, gn, [p.grad.clone() for p in params])
    assert len(seen) == model.cfg.n_layers  # one call per attention layer, each with the loader's offsets
    assert all(cu is batch.segments.cu_seqlens or torch.equal(cu, batch.segments.cu_seqlens) for cu, _ in seen)
    assert all(m == batch.segments.max_seqlen for _, m in seen)
    (ce_s, zl_s, gn_s, g_s), (ce_f, zl_f, gn_f, g_f) = results["sdpa"], results["flash"]
    assert ce_f == pytest.approx(ce_s, rel=1e-6) and zl_f == pytest.approx(zl_s, rel=1e-6)
    assert gn_f == pytest.approx(gn_s, rel=1e-5)
    for a, b in zip(g_f, g_s):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    # without the loader's segments the flash model refuses rather than computing them on the device
    with pytest.raises(ValueError, match="Segments"):
        build_model(smoke("lr", blocks=3, attention="flash"))(batch.inputs, batch.doc_ids)


# ---- activation checkpointing -----------------------------------------------------------------------


def _loss_and_grads(cfg: dict, checkpointing: bool, compile_backend: str | None = None):
    torch.manual_seed(0)
    model = build_model(cfg)
    if hasattr(model, "queries"):
        with torch.no_grad():
            model.queries.normal_(0, 0.5)  # routing that is not uniform
    model.activation_checkpointing = checkpointing
    x = tokens()
    doc = torch.zeros_like(x, dtype=torch.int32)
    doc[:, x.shape[1] // 2:] = 1  # two documents per row: the attention mask goes through the recompute
    saved = {"bytes": 0}

    def pack(t):
        saved["bytes"] += t.numel() * t.element_size()
        return t

    fwd = torch.compile(model, backend=compile_backend) if compile_backend else model
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fwd(x, doc).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, saved["bytes"]


@pytest.mark.parametrize("method, blocks, router", [("baseline", 2, "reference"), ("attnres", 2, "reference"),
                                                    ("lr", "full", "reference"), ("lr-fullrms", 3, "reference"),
                                                    ("plr", 2, "reference"), ("lr", 2, "fused")])
def test_activation_checkpointing_gives_the_same_gradients(method, blocks, router):
    """Each layer recomputed in the backward (torch.utils.checkpoint per layer, the routing sources
    passed through as its inputs and outputs): the loss and every gradient are those without it, bit
    for bit, and autograd keeps only what lies outside the layers (the head, the logits)."""
    cfg = smoke(method, blocks=blocks, router=router)
    loss0, g0, kept0 = _loss_and_grads(cfg, False)
    loss1, g1, kept1 = _loss_and_grads(cfg, True)
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys()
    assert all(g0[k] is not None and torch.equal(g0[k], g1[k]) for k in g0), [k for k in g0 if not torch.equal(g0[k], g1[k])]
    assert kept1 < kept0 / 4, (kept0, kept1)


def test_activation_checkpointing_under_torch_compile():
    """torch.compile traces the checkpointed layers (dynamo and AOT autograd; aot_eager on the CPU) with
    the fused router's op; the gradients are the eager ones without checkpointing. (The GPU suite runs
    the same with Inductor.)"""
    cfg = smoke("lr", blocks=2, router="fused")
    loss0, g0, _ = _loss_and_grads(cfg, False)
    loss1, g1, _ = _loss_and_grads(cfg, True, compile_backend="aot_eager")
    torch.testing.assert_close(loss1, loss0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_activation_checkpointing_compiled_on_the_gpu():
    """On CUDA, compiled (Inductor) with the fused router under bf16 autocast: the gradients with
    activation checkpointing match those without it, and the peak memory of the step falls."""
    def run(checkpointing):
        torch.manual_seed(0)
        model = build_model({"preset": "gpu-small", "vocab_size": 512, "method": "lr", "blocks": 8, "rank": 48,
                             "router": "fused"}).cuda()
        with torch.no_grad():
            model.queries.normal_(0, 0.5)
        model.activation_checkpointing = checkpointing
        fwd = torch.compile(model)
        x = torch.randint(0, 512, (8, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for _ in range(2):  # the first step compiles and tunes; the second is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x).float().logsumexp(-1).mean()
            loss.backward()
            torch.cuda.synchronize()
        return {n: p.grad.float() for n, p in model.named_parameters()}, torch.cuda.max_memory_allocated()

    g0, peak0 = run(False)
    g1, peak1 = run(True)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=2e-2, atol=1e-4, msg=k)
    assert peak1 < peak0
