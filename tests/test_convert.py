"""Checkpoint conversion (Section 4.8, Appendix B): AttnRes -> full-width-RMS LR-AttnRes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import head_commit

from lrattnres import convert as C
from lrattnres.model import build_model
from lrattnres.train import checkpoint as ckpt

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "reports" / "published.yaml"
VOCAB = 61


def attnres(preset: str, blocks, seed: int = 0, scale: float = 0.5, vocab: int = VOCAB):
    """A random AttnRes model whose queries are non-zero (they are zero at init)."""
    torch.manual_seed(seed)
    m = build_model({"preset": preset, "vocab_size": vocab, "method": "attnres", "blocks": blocks, "router": "reference"})
    with torch.no_grad():
        m.queries.copy_(torch.randn_like(m.queries) * scale)
    return m.eval()


def deficient_queries(m, k: int, seed: int = 1) -> None:
    """Set the 2L queries to an exactly rank-k matrix: small-integer combinations of k dyadic vectors,
    exact in fp32, so the stored queries have rank k exactly."""
    g = torch.Generator().manual_seed(seed)
    T, d = m.queries.shape
    while True:
        A = torch.randint(-3, 4, (T, k), generator=g).float()
        B = torch.randint(-4, 5, (k, d), generator=g).float() / 16
        Q = A @ B
        if torch.linalg.matrix_rank(Q.double()) == k:
            break
    with torch.no_grad():
        m.queries.copy_(Q)


def inputs_for(m, batch: int = 2, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    T = m.cfg.max_seq_len
    x = torch.randint(0, m.cfg.vocab_size, (batch, T), generator=g)
    doc = torch.cumsum((torch.rand(batch, T, generator=g) < 0.05).int(), dim=1)  # a few documents per row
    return x, doc


def fp64_pair(m, rank, **kw):
    orig = C._fp64_view(m)
    conv = C.convert_model(orig, rank, **kw)
    return orig, conv, C.with_config(conv.model, router="reference", attention="sdpa")


def rel_err(a, b, x, doc):
    err, scale = C.max_logit_diff(a, b, x, doc)
    return err / scale


ROUTINGS = [("smoke", "full"), ("smoke", 1), ("smoke", 3), ("tiny", "full"), ("tiny", 3), ("tiny", 8)]


@pytest.mark.parametrize("preset,blocks", ROUTINGS)
def test_conversion_preserves_logits_and_routing_in_fp64(preset, blocks):
    m = attnres(preset, blocks)
    T, d = m.queries.shape
    orig, conv, new = fp64_pair(m, d // 8 if d // 8 >= T else T)
    assert conv.span.joint_rank == T == conv.span.active_queries == 2 * m.cfg.n_layers
    assert new.cfg.method == "lr-fullrms" and new.cfg.blocks == blocks
    assert tuple(new.queries.shape) == (T, conv.rank)
    assert conv.query_residual < 1e-13
    x, doc = inputs_for(m)
    assert rel_err(orig, new, x, doc) < 1e-9
    with torch.no_grad():
        lo, wo = orig(x, doc, return_routing=True)
        ln, wn = new(x, doc, return_routing=True)
    assert len(wo) == len(wn) == T
    for a, b in zip(wo, wn):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) < 1e-12
    # the routing is not trivial: the queries matter
    assert max(float(w.max()) for w in wo) > 1.5 / wo[-1].shape[-1]


@pytest.mark.parametrize("preset,blocks,k", [("smoke", "full", 2), ("smoke", 2, 3), ("tiny", "full", 3), ("tiny", 4, 5)])
def test_deficient_rank_converts_at_r_equal_k(preset, blocks, k):
    m = attnres(preset, blocks)
    deficient_queries(m, k)
    orig, conv, new = fp64_pair(m, k)
    assert conv.span.joint_rank == k < conv.span.active_queries
    assert conv.rank == k and tuple(new.queries.shape) == (2 * m.cfg.n_layers, k)
    x, doc = inputs_for(m)
    assert rel_err(orig, new, x, doc) < 1e-9
    assert conv.query_residual < 1e-13
    # "k" as the rank spec gives the same
    assert C.convert_model(orig, "k").rank == k


def test_rank_below_joint_rank_is_refused_with_k():
    m = attnres("smoke", "full")
    deficient_queries(m, 3)
    with pytest.raises(C.RankError, match=r"k=3"):
        C.convert_model(C._fp64_view(m), 2)
    m = attnres("tiny", 4)  # full rank 8
    with pytest.raises(C.RankError, match=r"r=4 is below the joint query rank k=8"):
        C.convert_model(m, "d/16")


def test_rotation_is_orthogonal_and_moves_the_span_last():
    torch.manual_seed(0)
    d, T, k, r = 24, 6, 4, 5
    Q = torch.randn(T, k, dtype=torch.float64) @ torch.randn(k, d, dtype=torch.float64)
    span = C.query_span(Q)
    assert span.joint_rank == k
    R = C.rotation(span, r)
    I = torch.eye(d, dtype=torch.float64)
    assert torch.allclose(R @ R.T, I, atol=1e-13)
    RQ = Q @ R.T
    assert float(RQ[:, : d - r].abs().max()) < 1e-12 * float(Q.abs().max())
    assert torch.allclose((RQ[:, d - r:] ** 2).sum(-1), (Q ** 2).sum(-1))  # nothing lost
    # the span basis is orthonormal and spans Q
    U = span.span_basis
    assert torch.allclose(U.T @ U, torch.eye(k, dtype=torch.float64), atol=1e-13)
    assert torch.allclose(U @ (U.T @ Q.T), Q.T, atol=1e-12)
    with pytest.raises(C.RankError, match="k=4"):
        C.rotation(span, 3)


def test_rotation_rules_for_weight_layouts():
    """Column-vector convention with nn.Linear [out, in] weights: in-projections W R^T, out-projections
    R W, embedding rows R e, residual-output biases R b."""
    torch.manual_seed(0)
    d, r = 8, 3
    R = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0]
    state = {
        "embed.weight": torch.randn(5, d), "head.weight": torch.randn(5, d), "queries": torch.randn(2, d),
        "layers.0.attn.qkv.weight": torch.randn(3 * d, d), "layers.0.attn.out.weight": torch.randn(d, d),
        "layers.0.mlp.gate_up.weight": torch.randn(4, d), "layers.0.mlp.down.weight": torch.randn(d, 2),
        "layers.0.attn.out.bias": torch.randn(d),
    }
    new = C.rotate_state_dict(state, R, d)  # r = d keeps every query coordinate
    s = {k: v.double() for k, v in state.items()}
    h = torch.randn(d, dtype=torch.float64)  # a residual vector, and h' = R h
    assert torch.allclose(new["embed.weight"][1], R @ s["embed.weight"][1])
    for name in ("head.weight", "layers.0.attn.qkv.weight", "layers.0.mlp.gate_up.weight"):
        assert torch.allclose(new[name] @ (R @ h), s[name] @ h)  # reads the same from the new basis
    a = torch.randn(d, dtype=torch.float64)
    assert torch.allclose(new["layers.0.attn.out.weight"] @ a, R @ (s["layers.0.attn.out.weight"] @ a))
    assert torch.allclose(new["layers.0.attn.out.bias"], R @ s["layers.0.attn.out.bias"])
    assert torch.allclose(new["queries"] @ (R @ h), s["queries"] @ h)
    with pytest.raises(ValueError, match="layers.0.attn.route_key.weight"):
        C.rotate_state_dict({**state, "layers.0.attn.route_key.weight": torch.randn(r, d)}, R, r)


def test_fold_of_routing_norm_weights():
    """w . (gamma * o / rho(o)) = (gamma * w) . o / rho(o): the effective query folds the weight in."""
    torch.manual_seed(0)
    T, d = 4, 16
    q, gamma, o = torch.randn(T, d), torch.rand(T, d) + 0.5, torch.randn(d)
    rho = torch.sqrt((o ** 2).mean() + 1e-6)
    eff = C.effective_queries(q, gamma)
    assert torch.allclose(eff.float() @ (o / rho), (q * (gamma * o / rho)).sum(-1), atol=1e-5)
    assert torch.equal(C.effective_queries(q), q.double())  # weightless norms: the identity
    shared = C.effective_queries(q, gamma[0])
    assert torch.allclose(shared, (q * gamma[0]).double())
    with pytest.raises(ValueError, match="routing_norm_weight"):
        C.effective_queries(q, torch.ones(d + 1))


def test_zero_queries_convert_at_any_rank():
    m = build_model({"preset": "smoke", "vocab_size": VOCAB, "method": "attnres", "blocks": 2})
    orig, conv, new = fp64_pair(m, 1)
    assert conv.span.joint_rank == 0
    x, doc = inputs_for(m)
    assert rel_err(orig, new, x, doc) < 1e-9


def test_refuses_non_attnres_checkpoints():
    m = build_model({"preset": "smoke", "vocab_size": VOCAB, "method": "lr", "blocks": 2, "rank": 8})
    with pytest.raises(ValueError, match="method 'lr'"):
        C.convert_model(m, 8)


def test_slice_view_shares_weights_and_drifts():
    m = attnres("smoke", 2)
    orig, conv, new = fp64_pair(m, 4)
    lr = C.with_config(new, method="lr")
    assert lr.queries is new.queries and lr.cfg.method == "lr" and new.cfg.method == "lr-fullrms"
    x, doc = inputs_for(m)
    drift = rel_err(orig, lr, x, doc)
    assert drift == drift and drift > 1e-9  # finite and not covered by the theorem


def test_spec_validation_names_the_key():
    ok = C.validate_spec({"rank": "d/8", "batch_size": 2})
    assert ok["val_tokens"] is None and ok["claim_row"] is None and ok["precision"] == "auto"
    with pytest.raises(ValueError, match="spec.bogus"):
        C.validate_spec({"rank": 8, "batch_size": 2, "bogus": 1})
    with pytest.raises(ValueError, match="spec.rank: missing"):
        C.validate_spec({"batch_size": 2})
    with pytest.raises(ValueError, match="spec.batch_size"):
        C.validate_spec({"rank": 8, "batch_size": 0})
    with pytest.raises(ValueError, match="spec.claim_row"):
        C.validate_spec({"rank": 8, "batch_size": 2, "claim_row": "2b.n8"})


def _fake_result(run_id, row, err, dce, k=8, t=8, scale=1.0):
    return {"stage": "convert", "run_id": run_id, "claim_row": row, "blocks": 8, "n_layers": t // 2, "d": 64,
            "rank": 8, "joint_rank": k, "active_queries": t, "fp64_max_logit_err": err, "logit_scale": scale,
            "fp64_rel_logit_err": err / scale, "fp64_seq_len": 128, "original_ce": 3.0, "converted_ce": 3.0 + dce,
            "delta_ce": dce, "val_tokens_evaluated": 1000, "precision": "fp32", "device": "cpu",
            "slice_drift": {"max_logit_err": 0.1}}


def test_result_claims_only_published_ids():
    from lrattnres.claims import load_published

    pub = load_published(PUBLISHED)
    claims = C.result_claims(_fake_result("a", "0.5b.n8", 1e-14, 2e-6), pub)
    assert set(claims) == {"table2.fp64_max_err.0.5b.n8", "table2.delta_ce.0.5b.n8", "table2.orig_ce.0.5b.n8",
                           "table2.conv_ce.0.5b.n8", "appB.2.joint_rank.0.5b"}
    rank = claims["appB.2.joint_rank.0.5b"]  # a value claim: the rank, with the model's active queries
    assert isinstance(rank["reproduced"], int) and "the paper's model has 48" in rank["note"]
    paper = C.result_claims(_fake_result("b", "4b.n8", 1e-13, 7e-5, k=88, t=88), pub)
    assert paper["appB.2.joint_rank.4b"]["reproduced"] == 88  # the paper's shape: the rank itself
    only_rank = C.result_claims(_fake_result("c", "1b.nfull", 1e-14, 1e-6), pub)  # no Table 2 row 1b N=full
    assert set(only_rank) == {"appB.2.joint_rank.1b"}
    assert C.result_claims(_fake_result("d", None, 1e-14, 1e-6), pub) == {}


def test_aggregate_takes_the_worst_case():
    from lrattnres.claims import load_published

    pub = load_published(PUBLISHED)
    rs = [_fake_result("full", "0.5b.nfull", 3e-14, 1e-6), _fake_result("n4", "0.5b.n4", 5e-14, -4e-6),
          _fake_result("n4b", "0.5b.n4", 9e-14, 2e-6), _fake_result("bad", "0.5b.n8", 1e-14, 1e-6, k=9, t=8),
          _fake_result("free", None, 1e-12, 5e-3)]
    for r in rs:
        r["claims"] = C.result_claims(r, pub)
    agg = C.aggregate(rs)
    assert agg["table2.fp64_max_err.0.5b.nfull"]["reproduced"] == 3e-14
    assert agg["table2.fp64_max_err.0.5b.n4"]["reproduced"] == 9e-14  # worst of two
    assert agg["table2.delta_ce.0.5b.n4"]["reproduced"] == -4e-6  # largest |delta|, sign kept
    assert agg["table2.orig_ce.0.5b.n4"]["reproduced"] == pytest.approx(3.0)
    assert agg["appB.2.joint_rank.0.5b"]["reproduced"] == 9 and "bad" in agg["appB.2.joint_rank.0.5b"]["note"]
    assert set(agg) <= set(pub)
    full = C.aggregate_results(rs)
    assert full["stage"] == "convert" and len(full["conversions"]) == 5 and "provenance" in full
    inv = full["invariants"]
    assert inv["fp64_max_logit_err"] == 1e-12 and inv["max_abs_delta_ce"] == 5e-3
    assert inv["abs_delta_ce_below_1e-3"] is False and inv["joint_rank_within_active_queries"] is False


def test_report_section_with_and_without_results():
    from lrattnres import claims as engine
    from lrattnres.report.context import ReportContext
    from lrattnres.report.html import matplotlib_setup
    from lrattnres.report.sections import convert as sec

    matplotlib_setup()
    pub = engine.load_published(PUBLISHED)
    empty = ReportContext(scale="tiny", published=pub,
                          claims={c["id"]: c for c in engine.evaluate_claims(pub, {}, "tiny")})
    html = sec.build(empty)
    assert "has not run" in html and "7.407e-13" in html and "2.972" in html
    rs = [_fake_result("full", "0.5b.nfull", 3e-14, 1e-6), _fake_result("other", None, 2e-14, 1e-6)]
    for r in rs:
        r["claims"] = C.result_claims(r, pub)
        r["singular_values"] = [1.0, 0.5, 1e-17]
        r["rtol"] = 1e-14
    agg = C.aggregate_results(rs)
    claims = engine.evaluate_claims(pub, agg["claims"], "tiny")
    ctx = ReportContext(scale="tiny", published=pub, claims={c["id"]: c for c in claims}, by_stage={"convert": [agg]})
    html = sec.build(ctx)
    assert "has not run" not in html and "3.000e-14" in html and "ours (no paper row)" in html
    assert "data:image/png;base64" in html and "match" in html
    assert sec.TITLE and sec.ORDER == 40


def test_converted_checkpoint_round_trip(tmp_path):
    """The converted weights saved as checked safetensors load with load_model and give the same logits."""
    m = attnres("smoke", "full")
    conv = C.convert_model(m, "d/8", dtype=torch.float32)
    path = tmp_path / "conv" / "model.safetensors"
    ckpt.save_model(conv.model.state_dict(), {"model_config": dataclasses.asdict(conv.config), "spec": None,
                                              "manifest_sha256": None, "step": 0, "tokens": 0}, path)
    back, info = ckpt.load_model(path)
    assert back.cfg.method == "lr-fullrms" and back.cfg.rank == 4 and back.cfg.blocks == "full"
    x, doc = inputs_for(m, batch=1)
    with torch.no_grad():
        assert torch.equal(back(x, doc), conv.model(x, doc))
        # fp32 storage: the exported model matches the original to fp32 rounding
        assert float((back(x, doc) - m(x, doc)).abs().max()) < 1e-4


# ------------------------------------------------------------------------------------ end to end


def _tiny_manifest(root: Path) -> Path:
    data = pytest.importorskip("lrattnres.data")
    import random

    rng = random.Random(0)
    words = "depth routing residual query key value block source rank width norm head layer token".split()
    txt = root / "txt"
    txt.mkdir(parents=True)
    for i in range(12):
        (txt / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(120)), encoding="utf-8")
    spec = {"source": "local", "local": {"glob": str(txt / "*.txt"), "format": "txt"}, "val_tokens": 600,
            "shard_tokens": 100_000, "vocab": "compact"}
    try:
        data.prepare(spec, root / "data", progress=False)
    except (ImportError, OSError) as e:  # the offline tokenizer is not installed
        pytest.skip(f"cannot build a data manifest here: {e}")
    return root / "data"


@pytest.fixture(scope="module")
def tiny_manifest(tmp_path_factory) -> Path:
    return _tiny_manifest(tmp_path_factory.mktemp("convert-data"))


def test_cli_end_to_end(tmp_path, tiny_manifest):
    from lrattnres.data import load_manifest, manifest_sha256

    mdir = tiny_manifest
    man = load_manifest(mdir)
    results = []
    for blocks, row in (("full", "0.5b.nfull"), (2, None)):
        m = attnres("smoke", blocks, vocab=man["vocab_size"])
        run = tmp_path / "runs" / f"smoke-attnres-n{blocks}-r32-s0"
        ckpt.save_model(m.state_dict(), {"model_config": dataclasses.asdict(m.cfg), "spec": {"seq_len": 64},
                                         "manifest_sha256": manifest_sha256(man), "step": 1, "tokens": 64},
                        run / "model.safetensors")
        out = tmp_path / f"convert-{blocks}.json"
        spec = {"rank": "d/8", "val_tokens": 300, "batch_size": 2, "claim_row": row}
        argv = ["--checkpoint", str(run / "model.safetensors"), "--data", str(mdir), "--spec", json.dumps(spec),
                "--out", str(out), "--no-progress"]
        if row:
            argv += ["--save", str(tmp_path / "converted" / "model.safetensors")]
        assert C.main(argv) == 0
        r = json.loads(out.read_text())
        results.append(out)
        assert r["stage"] == "convert" and r["run_id"] == run.name and r["blocks"] == blocks
        assert r["d"] == 32 and r["rank"] == 4 and r["joint_rank"] == 4 == r["active_queries"]
        assert r["fp64_seq_len"] == 64 and r["fp64_max_logit_err"] / r["logit_scale"] < 1e-9
        assert 0 <= r["fp64_noise_floor"] < 1e-9 and r["routing_max_err"] < 1e-9
        assert abs(r["delta_ce"]) < 1e-4 and r["original_ce"] > 0
        assert r["val_tokens_evaluated"] == 256  # 300 // 64 windows of 64
        assert r["slice_drift"]["max_logit_err"] >= 0 and "delta_ce" in r["slice_drift"]
        assert r["provenance"]["commit"] == head_commit()  # the checkout the conversion ran in
        # the attention each forward ran: the FP64 check in SDPA, the paired CE on the CPU in SDPA too
        att = r["provenance"]["attention"]
        assert set(att) == {"fp64_check", "original", "converted", "slice"}
        assert all(a["backend"] == "sdpa" and a["version"].startswith("torch ") for a in att.values())
        if row:
            assert set(r["claims"]) == {"table2.fp64_max_err.0.5b.nfull", "table2.delta_ce.0.5b.nfull",
                                        "table2.orig_ce.0.5b.nfull", "table2.conv_ce.0.5b.nfull",
                                        "appB.2.joint_rank.0.5b"}
            back, info = ckpt.load_model(r["saved"])
            assert back.cfg.method == "lr-fullrms" and back.cfg.rank == 4
            assert info["converted_from"]["run_id"] == run.name
        else:
            assert r["claims"] == {}
    out = tmp_path / "convert_all.json"
    assert C.main(["--aggregate", *map(str, results), "--out", str(out)]) == 0
    agg = json.loads(out.read_text())
    assert agg["stage"] == "convert" and len(agg["conversions"]) == 2
    assert set(agg["claims"]) == set(json.loads(results[0].read_text())["claims"])
    assert agg["invariants"]["fp64_rel_below_1e-9"] is True
    with pytest.raises(SystemExit):
        C.main(["--checkpoint", "x.safetensors", "--out", str(out)])  # --data/--spec missing


def test_cli_refuses_rank_below_k(tmp_path, capsys, tiny_manifest):
    from lrattnres.data import load_manifest

    mdir = tiny_manifest
    man = load_manifest(mdir)
    m = attnres("smoke", 2, vocab=man["vocab_size"])
    path = tmp_path / "run" / "model.safetensors"
    ckpt.save_model(m.state_dict(), {"model_config": dataclasses.asdict(m.cfg), "spec": None,
                                     "manifest_sha256": None, "step": 0, "tokens": 0}, path)
    spec = json.dumps({"rank": 2, "val_tokens": 64, "batch_size": 1, "claim_row": None})
    rc = C.main(["--checkpoint", str(path), "--data", str(mdir), "--spec", spec, "--out", str(tmp_path / "o.json")])
    assert rc == 2 and not (tmp_path / "o.json").exists()
    assert "joint query rank k=4" in capsys.readouterr().err


def test_paired_ce_uses_bf16_exports_reloaded_strictly(tmp_path, tiny_manifest):
    """Appendix B.2: the FP64 check first, then the original and the converted weights exported as
    BF16 safetensors, strictly reloaded, and evaluated in pairs; spec export_dtype: storage keeps fp32."""
    from safetensors import safe_open

    from lrattnres.data import load_manifest

    man = load_manifest(tiny_manifest)
    m = attnres("smoke", 2, vocab=man["vocab_size"])
    path = tmp_path / "run" / "model.safetensors"
    ckpt.save_model(m.state_dict(), {"model_config": dataclasses.asdict(m.cfg), "spec": {"seq_len": 64},
                                     "manifest_sha256": None, "step": 1, "tokens": 64}, path)
    got = {}
    for export in ("bf16", "storage"):
        save = tmp_path / export / "model.safetensors"
        spec = {"rank": "d/8", "val_tokens": 128, "batch_size": 2, "claim_row": None, "export_dtype": export}
        r = C.run(path, tiny_manifest, spec, save=save, progress=False)
        with safe_open(str(save), framework="pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        got[export] = (r, dtypes)
    (bf, bf_dtypes), (st, st_dtypes) = got["bf16"], got["storage"]
    assert bf["exported_dtype"] == "bfloat16" and bf_dtypes == {torch.bfloat16}
    assert st["exported_dtype"] == "float32" and st_dtypes == {torch.float32}
    assert bf["fp64_max_logit_err"] == st["fp64_max_logit_err"]  # the FP64 check comes before the export
    # BF16 rounding moves the logits of both models alike; fp32 storage barely at all
    assert bf["exported_original_max_logit_err"] > 100 * st["exported_original_max_logit_err"]
    assert bf["exported_max_logit_err"] > 100 * st["exported_max_logit_err"]
    assert bf["original_ce"] != st["original_ce"]  # the CE pair is of the exported, reloaded models
    assert abs(bf["delta_ce"]) < 1e-3 and bf["native_vs_reference_max_logit_err"] is None  # no GPU here
    with pytest.raises(ValueError, match=r"spec.export_dtype: expected 'bf16' or 'storage', got 'fp8'"):
        C.validate_spec({"rank": 4, "batch_size": 1, "export_dtype": "fp8"})
