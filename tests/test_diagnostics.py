"""Routing diagnostics (lrattnres.diagnostics) and its report section.

Known routing: a freshly built model has zero queries, so every read weights its S_t sources
uniformly: N_eff = S_t and the mean heatmap row is 1/S_t.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lrattnres import diagnostics as dg
from lrattnres.model import build_model

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "reports" / "published.yaml"

SMALL = dict(vocab_size=50, n_layers=3, d_model=16, n_heads=2, d_ff=44, max_seq_len=32)


def _routing(method="lr", blocks="full", rank=4, B=2, T=8):
    model = build_model(dict(SMALL, method=method, blocks=blocks, rank=rank))
    ids = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, routing = model(ids, None, return_routing=True)
    return model, routing


@pytest.mark.parametrize("method,blocks,rank", [("lr", "full", 4), ("lr", 3, 4), ("attnres", 2, 16), ("plr", "full", 4),
                                                ("lr-fullrms", 4, 8)])
def test_uniform_model_n_eff_equals_source_count(method, blocks, rank):
    _, routing = _routing(method, blocks, rank)
    acc = dg.RoutingAccumulator()
    acc.update(routing)
    res = acc.result()
    S = dg.sources_per_read(2 * SMALL["n_layers"], blocks)
    assert res["sources"] == S
    assert res["tokens"] == 16
    assert res["n_eff"] == pytest.approx([float(s) for s in S], rel=1e-6)
    # the heatmap of a uniform model: 1/S_t on the visible sources of each read, null beyond
    width = S[-1]
    for row, s in zip(res["heatmap"], S):
        assert len(row) == width
        assert row[:s] == pytest.approx([1.0 / s] * s, rel=1e-6)
        assert row[s:] == [None] * (width - s)


def test_sources_and_columns():
    assert dg.sources_per_read(6, "full") == [2, 3, 4, 5, 6, 7]
    assert dg.sources_per_read(6, 3) == [2, 2, 3, 3, 4, 4]  # ends 2, 4, 6
    assert dg.sources_per_read(6, 2) == [2, 2, 2, 3, 3, 3]  # ends 3, 6: the partial block shares its column
    assert dg.source_columns(6, "full") == ["emb", "o1", "o2", "o3", "o4", "o5", "o6"]
    assert dg.source_columns(6, 2) == ["emb", "B1 (o1-o3)", "B2 (o4-o6)"]


def test_effective_sources_known_values():
    w = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    got = dg.effective_sources(w)
    assert got.tolist() == pytest.approx([1.0, 2.0, math.exp(-(0.5 * math.log(0.25) + 0.5 * math.log(0.5)))])


def test_accumulator_mask_counts_only_kept_tokens():
    w = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])  # [B=1, T=2, S=2]
    acc = dg.RoutingAccumulator()
    acc.update([w], mask=torch.tensor([[False, True]]))
    assert acc.result()["n_eff"] == pytest.approx([2.0]) and acc.tokens == 1


def test_grad_norm_stats_by_hand(tmp_path):
    norms = [0.5, 1.5, 1.0, 2.0]
    st = dg.grad_norm_stats(norms, clip=1.0)
    assert st["mean"] == pytest.approx(1.25)
    assert st["var"] == pytest.approx(((0.75 ** 2) * 2 + (0.25 ** 2) * 2) / 4)  # population variance 0.3125
    assert st["above_clip_pct"] == pytest.approx(50.0)  # 1.0 is not above 1
    assert st["count"] == 4
    p = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": i + 1, "grad_norm": g, "ce": 3.0} for i, g in enumerate(norms)]
    lines.insert(2, {"kind": "val", "step": 2, "val_ce": 3.1})
    lines.append({"kind": "final_val", "step": 4, "val_ce": 3.0})
    p.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "tr', encoding="utf-8")  # cut last line
    got = dg.read_grad_norms(p)
    assert got == [(1, 0.5), (2, 1.5), (3, 1.0), (4, 2.0)]
    assert dg.trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert dg.trailing_mean([1.0, 2.0, 3.0], 10) == [1.0, 1.5, 2.0]


def test_query_effective_dimension_and_zeros():
    d = 12
    one_hot = torch.zeros(d)
    one_hot[3] = -2.5
    assert dg.coordinate_effective_dim(one_hot) == pytest.approx(1.0)
    signs = torch.tensor([1.0, -1.0] * (d // 2)) * 0.7
    assert dg.coordinate_effective_dim(signs) == pytest.approx(float(d))
    two = torch.zeros(d)
    two[:2] = torch.tensor([1.0, 1.0])
    assert dg.coordinate_effective_dim(two) == pytest.approx(2.0)
    assert dg.coordinate_effective_dim(torch.zeros(d)) is None
    assert dg.zero_fraction(one_hot) == pytest.approx(11 / 12)
    assert dg.zero_fraction(signs) == 0.0
    q = torch.stack([one_hot, signs, torch.zeros(d), two, signs, one_hot])  # 2L = 6 queries
    qu = dg.query_utilisation(q)
    assert [r["group"] for r in qu["per_query"]] == ["pre_mlp", "pre_attention", "pre_mlp", "pre_attention", "pre_mlp",
                                                      "final_output"]
    assert qu["groups"]["all"]["count"] == 6 and qu["n_zero_queries"] == 1
    assert qu["d_eff_mean"] == pytest.approx((1 + 12 + 2 + 12 + 1) / 5)
    assert qu["zero_frac"] == pytest.approx((11 / 12 + 0 + 1 + 10 / 12 + 0 + 11 / 12) / 6)
    assert qu["groups"]["final_output"]["d_eff_mean"] == pytest.approx(1.0)
    assert qu["groups"]["pre_attention"]["count"] == 2 and qu["width"] == d


def test_settings_validation_names_the_key():
    assert dg.validate_settings(None)["tokens"] == dg.DEFAULTS["tokens"]
    with pytest.raises(dg.DiagnosticsError, match="tokenz"):
        dg.validate_settings({"tokenz": 100})
    with pytest.raises(dg.DiagnosticsError, match="diagnostics.tokens"):
        dg.validate_settings({"tokens": 0})
    with pytest.raises(dg.DiagnosticsError, match="device"):
        dg.validate_settings({"device": "tpu"})
    with pytest.raises(dg.DiagnosticsError, match="batch_size"):
        dg.validate_settings({"batch_size": True})


# ------------------------------------------------------------------------------------ end to end


SETTINGS = {
    "scale": "smoke",
    "presets": {"main": "smoke", "small": "smoke", "large": "tiny"},
    "recipe": {"grad_clip": 1.0},
    "train": {"steps": 6, "seq_len": 32},
    "grid": {
        "ranks": ["d/8", "d/4", "d"],
        "blocks": ["full", 2],
        "seeds": 1,
        "headline": {"blocks": 2, "rank": "d/4"},
        "control": {"blocks": 2, "rank": "d/4"},
        "projected": [{"blocks": 2, "rank": "d/8"}],
        "pair": {"blocks": 2, "rank": "d/4"},
    },
    "diagnostics": {"tokens": 200, "batch_size": 2, "trailing_window": 3},
}
ATTNRES_NORMS = [1.5, 0.5, 2.0, 0.8, 1.2, 1.0]
LR_NORMS = [0.5, 0.6, 0.7, 1.1, 0.4, 0.3]


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory):
    from lrattnres.data import prepare

    try:
        from test_data import make_docs, write_jsonl
    except ImportError:  # tests/ as a package
        from .test_data import make_docs, write_jsonl
    d = tmp_path_factory.mktemp("diagdata")
    write_jsonl(d / "c.jsonl", make_docs(300, seed=5))
    spec = {"source": "local", "local": {"glob": str(d / "c.jsonl")}, "val_tokens": 2000, "shard_tokens": 5000,
            "vocab": "compact"}
    prepare(spec, d / "data", progress=False)
    return d / "data" / "manifest.json"


def _fake_runs(root: Path, manifest_path: Path) -> None:
    from lrattnres.data import load_manifest
    from lrattnres.grid import plan
    from lrattnres.train import checkpoint as ckpt

    m = load_manifest(manifest_path)
    for run in plan(SETTINGS):
        folder = root / run.run_id
        folder.mkdir(parents=True)
        model = build_model({**run.model(), "vocab_size": m["vocab_size"]})  # fresh: zero queries, uniform routing
        spec = {"seq_len": 32, "grad_clip": 1.0, "precision": "fp32"}
        ckpt.save_model(model.state_dict(), {"model_config": model.cfg.to_dict(), "spec": spec,
                                             "manifest_sha256": m["_sha256"], "step": 6, "tokens": 6 * 64},
                        folder / "model.safetensors")
        norms = ATTNRES_NORMS if run.method in ("attnres", "baseline") else LR_NORMS
        recs = [{"kind": "train", "step": i + 1, "tokens": 64 * (i + 1), "grad_norm": g} for i, g in enumerate(norms)]
        recs.insert(3, {"kind": "val", "step": 3, "tokens": 192, "val_ce": 4.0})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")


@pytest.fixture(scope="module")
def cli_result(tmp_path_factory, manifest_path):
    tmp = tmp_path_factory.mktemp("diagcli")
    runs = tmp / "runs"
    _fake_runs(runs, manifest_path)
    (tmp / "settings.json").write_text(json.dumps(SETTINGS), encoding="utf-8")
    out = tmp / "diagnostics.json"
    from lrattnres.cli import main

    rc = main(["diagnostics", "--settings", str(tmp / "settings.json"), "--runs", str(runs), "--data",
               str(manifest_path), "--published", str(PUBLISHED), "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text(encoding="utf-8"))


def test_cli_end_to_end(cli_result):
    from lrattnres.claims import judge, load_published
    from lrattnres.grid import plan

    res = cli_result
    assert res["stage"] == "diagnostics" and "provenance" in res and "figures_data" in res
    # every routed run's forward: auto on the CPU is masked SDPA (the baseline runs no model here)
    routed = {r.run_id for r in plan(SETTINGS) if r.method != "baseline"}
    assert set(res["provenance"]["attention"]) == routed
    assert all(a == {"requested": "auto", "backend": "sdpa", "version": f"torch {torch.__version__}"}
               for a in res["provenance"]["attention"].values())
    planned = plan(SETTINGS)
    assert set(res["runs"]) == {r.run_id for r in planned}
    for run in planned:
        row = res["runs"][run.run_id]
        n_writes = 2 * row["n_layers"]
        if run.method == "baseline":
            assert row["n_eff"] is None and row["query_util"] is None
        else:
            S = dg.sources_per_read(n_writes, run.blocks)
            assert row["n_eff"] == pytest.approx([float(s) for s in S], rel=1e-5)
            assert row["tokens"] == 200  # 7 windows of 32 cut to the 200 asked for
            assert row["heatmap"][-1][: S[-1]] == pytest.approx([1 / S[-1]] * S[-1], rel=1e-5)
            assert row["query_util"]["zero_frac"] == 1.0 and row["query_util"]["d_eff_mean"] is None
        norms = ATTNRES_NORMS if run.method in ("attnres", "baseline") else LR_NORMS
        g = row["grad_norm"]
        mean = sum(norms) / len(norms)
        assert g["mean"] == pytest.approx(mean)
        assert g["var"] == pytest.approx(sum((x - mean) ** 2 for x in norms) / len(norms))
        assert g["above_clip_pct"] == pytest.approx(100 * sum(x > 1 for x in norms) / len(norms))
        assert row["grad_norm_trace"]["trailing_mean"][-1] == pytest.approx(sum(norms[-3:]) / 3)
    # claims: only published diagnostics ids, with the expected values
    published = load_published(PUBLISHED)
    claims = res["claims"]
    assert claims and all(cid in published and published[cid]["stage"] == "diagnostics" for cid in claims)
    at_mean = sum(ATTNRES_NORMS) / 6
    lr_mean = sum(LR_NORMS) / 6
    assert claims["table9.grad_norm_mean.1b.attnres"]["reproduced"] == pytest.approx(at_mean)
    assert claims["table9.grad_norm_mean.4b.lr"]["reproduced"] == pytest.approx(lr_mean)
    verdict = {cid: judge(published[cid], c, "smoke")["verdict"] for cid, c in claims.items()}
    # the mean norm is 48.6% lower, but per segment of the six steps the pair disagrees: not resolved
    lower = claims["appG.1.lr_lower_grad_norm.1b"]
    assert lower["reproduced"] == pytest.approx(100 * (at_mean - lr_mean) / at_mean)
    seg = [(ATTNRES_NORMS[i:j], LR_NORMS[i:j]) for i, j in ((0, 1), (1, 2), (2, 4), (4, 5), (5, 6))]
    assert lower["samples"] == pytest.approx([100 * (1 - sum(b) / sum(a)) for a, b in seg])
    assert lower["unit"].startswith("segments") and verdict["appG.1.lr_lower_grad_norm.1b"] == "inconclusive"
    assert claims["appG.1.lr_fewer_clipped.4b"]["reproduced"] == pytest.approx(50 - 100 / 6)
    assert claims["appG.1.lr_lower_grad_norm_var.1b"]["reproduced"] > 0
    assert claims["appG.1.grad_norm_mean_reduction_pct.1b"]["reproduced"] == pytest.approx(100 * (at_mean - lr_mean) / at_mean)
    assert claims["appC.5.grad_norm_mean.baseline"]["reproduced"] == pytest.approx(at_mean)
    assert claims["appC.5.fullrms_above_slice"]["reproduced"] == 0.0  # equal norms: no effect
    assert verdict["appC.5.fullrms_above_slice"] == "inconclusive"
    assert "smoke-plr-n2-r4-s0" in claims["appC.5.plr_full_below_baseline"]["note"]  # block run stood in
    assert claims["appC.5.grad_norm_argmin_rank.nfull"]["reproduced"] in (128, 256)
    # uniform routing: N_eff at the final read = S, so low rank is not broader and N_eff does not fall with
    # rank; within the claims' 10% threshold that is no effect either way
    assert claims["appD.1.lowrank_broader_final_read.n8"]["reproduced"] == pytest.approx(0.0, abs=1e-3)
    assert claims["sec4.6.n_eff_full_decreases_with_rank"]["reproduced"] == pytest.approx(0.0, abs=1e-3)
    assert verdict["appD.1.lowrank_broader_final_read.n8"] == verdict["sec4.6.n_eff_full_decreases_with_rank"] == "inconclusive"
    assert claims["appD.1.n_eff_final.attnres.n8.r1024"]["reproduced"] == pytest.approx(3.0, rel=1e-5)  # N=2: emb+2
    fd = res["figures_data"]
    assert [c["rank"] for c in fd["fig4"]] == [4, 8, 32]
    assert fd["fig6"]["blocks"] == 2 and fd["fig6"]["runs"]["plr"]["run_id"] == "smoke-plr-n2-r4-s0"
    assert set(fd["fig10"]) == {"1b", "4b"} and set(fd["fig10"]["4b"]) == {"attnres", "lr"}


def test_cli_missing_run_is_named(tmp_path, manifest_path, capsys):
    (tmp_path / "settings.json").write_text(json.dumps(SETTINGS), encoding="utf-8")
    from lrattnres.cli import main

    argv = ["--settings", str(tmp_path / "settings.json"), "--runs", str(tmp_path / "none"),
            "--data", str(manifest_path), "--published", str(PUBLISHED), "--out", str(tmp_path / "o.json")]
    with pytest.raises(dg.DiagnosticsError, match="smoke-baseline-s0"):
        dg.main(argv)
    assert main(["diagnostics", *argv]) == 2  # the command line: one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("diagnostics: ") and "smoke-baseline-s0" in err[-1] and "Traceback" not in err[-1]


def _ctx(results, scale="smoke"):
    from lrattnres import claims as engine
    from lrattnres.report.context import ReportContext

    published = engine.load_published(PUBLISHED)
    produced = {cid: c for r in results for cid, c in r.get("claims", {}).items()}
    claims = engine.evaluate_claims(published, produced, scale)
    return ReportContext(scale=scale, published=published, claims={c["id"]: c for c in claims},
                         by_stage={"diagnostics": results} if results else {})


def test_report_section_with_results(cli_result):
    from lrattnres.report.html import matplotlib_setup
    from lrattnres.report.sections import diagnostics as sec

    matplotlib_setup()
    html = sec.build(_ctx([cli_result]))
    assert sec.ORDER == 50 and sec.TITLE
    for fig_id in ("fig4", "fig6", "fig7", "fig8", "fig10"):
        assert f'id="{fig_id}"' in html
    assert html.count("data:image/png;base64,") == 5
    assert "Table 9" in html and "0.9754" in html and "44.57" in html and "602.6" in html  # published beside ours
    assert "smoke-lr-n2-r8-s0" in html and "different scale" in html
    assert "Kimi K3" in html and "different" in html


def test_report_section_without_results():
    from lrattnres.report.sections import diagnostics as sec

    html = sec.build(_ctx([]))
    assert "has not run" in html
    assert "0.9754" in html and "3.62" in html and "602.6" in html and "not run" in html
    assert "data:image/png" not in html


@pytest.mark.parametrize("device,rel", [
    # the reference routing under CPU autocast mixes in bf16: uniform to bf16's resolution (2^-8)
    ("cpu", 2.0**-8),
    # the fused kernel accumulates in fp32
    pytest.param("cuda", 1e-5, marks=pytest.mark.gpu),
])
def test_routing_diagnostics_with_bf16_autocast(device, rel):
    """bf16 autocast, as for a bf16-trained run: uniform routing stays uniform, and a token budget that
    cuts a batch counts exactly that many tokens."""
    from lrattnres.data.loader import Batch

    model = build_model(dict(SMALL, method="lr", blocks=3, rank=4)).to(device)
    g = torch.Generator().manual_seed(1)
    batches = [Batch(torch.randint(0, 50, (4, 16), generator=g), torch.zeros(4, 16, dtype=torch.long),
                     torch.zeros(4, 16, dtype=torch.int32)) for _ in range(3)]
    with torch.autocast(device, dtype=torch.bfloat16):  # what the stage's forward runs under
        logits = model(batches[0].inputs.to(device), batches[0].doc_ids.to(device))
    assert logits.dtype == torch.bfloat16
    res = dg.routing_diagnostics(model, batches, torch.device(device), 150, torch.bfloat16)
    assert res["tokens"] == 150
    S = dg.sources_per_read(6, 3)
    assert res["n_eff"] == pytest.approx([float(s) for s in S], rel=rel)
    assert res["heatmap"][-1][: S[-1]] == pytest.approx([1 / S[-1]] * S[-1], rel=rel)
    assert all(row[s:] == [None] * (S[-1] - s) for row, s in zip(res["heatmap"], S))
