"""The accounting stage (Appendix F): every analytic number of the paper, to the precision printed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lrattnres import accounting as acc
from lrattnres import claims

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "reports" / "published.yaml"
L, D, M = 24, 1024, 2816


@pytest.fixture(scope="module")
def published():
    return claims.load_published(PUBLISHED)


def sig4(x: float) -> float:
    return float(f"{x:.4g}")


def test_core_and_full_attnres():
    assert acc.core_flops(L, D, M) == 308_281_344
    assert sum(acc.source_counts(L, "full")) == 1224
    assert sig4(acc.added_flops(L, D, M, "attnres", "full", D)["pct"]) == 0.8131


def test_source_counts_block_semantics():
    # six writes in three pairs: after write 3 -> {o0, o1+o2, o3}; after write 4 -> {o0, b1, b2}
    assert acc.source_counts(3, 3) == [2, 2, 3, 3, 4, 4]
    # N = 2L is full routing
    assert acc.source_counts(3, 6) == acc.source_counts(3, "full")
    assert max(acc.source_counts(24, 8)) == 9  # embedding + 8 blocks (Kimi K3's "at most nine")
    with pytest.raises(ValueError, match="blocks"):
        acc.source_counts(2, 5)


def test_source_counts_match_routing_block_ends():
    routing = pytest.importorskip("lrattnres.routing")
    for Lx, N in [(24, 4), (24, 8), (24, 16), (44, 8), (3, 4), (5, 3)]:
        ends = set(routing.block_ends(2 * Lx, N))
        expect, done = [], 0
        for t in range(1, 2 * Lx + 1):
            done += t in ends
            expect.append(1 + done + (t not in ends))
        assert acc.source_counts(Lx, N) == expect


@pytest.mark.parametrize("method,N,r", acc.TABLE5)
def test_table5_added_flops_to_printed_precision(published, method, N, r):
    key = method if method == "baseline" else f"{method}.n{N}.r{r}"
    rec = published[f"table5.added_flops.{key}"]
    got = acc.added_flops(L, D, M, method, N, r)["pct"]
    if rec["published"] == 0:
        assert got == 0
    else:
        assert sig4(got) == rec["published"], (key, got)


def test_table5_all_rows_covered(published):
    t5 = [k for k in published if k.startswith("table5.added_flops.")]
    assert len(t5) == len(acc.TABLE5) == 40
    routed = [k for k in t5 if not k.endswith("baseline") and "fullrms" not in k]
    assert len(routed) == 38


def test_f6_worked_numbers():
    claimed, worked = acc.paper_claims()
    # (d - r)/(2d): the kernel FLOPs LR-AttnRes saves against AttnRes at r = 32, for any grouping
    for N in ("full", 8):
        lr, attn = (acc.added_flops(L, D, M, m, N, r)["kernel"] for m, r in (("lr", 32), ("attnres", D)))
        assert round(100 * (1 - lr / attn), 2) == 48.44
    assert round(claimed["appF.6.flops_reduction_pct.r32"]["reproduced"], 2) == 48.44 == round(worked["flops_reduction_pct"], 2)
    assert acc.key_proj_flops(L, D, M, 32) == 2_981_888
    assert acc.param_delta(L, D, M, "plr", 32)["delta_vs_baseline"] == 2_983_424
    # a projected key travels with its value: the payload per source grows from d to d + r
    ratio = acc.activation_memory(L, D, "plr", 8, 32)["ratio_vs_attnres"]
    assert 100 * (ratio - 1) == 3.125 == worked["payload_increase_pct"]
    assert claimed["appF.6.payload_increase_pct.plr.r32"]["reproduced"] == 3.125
    assert sig4(100 * acc.key_proj_flops(L, D, M, 32) / acc.core_flops(L, D, M)) == 0.9673
    assert sig4(acc.added_flops(L, D, M, "plr", "full", 32)["pct"]) == 1.387
    assert sig4(acc.added_flops(L, D, M, "plr", 8, 32)["pct"]) == 1.058
    assert sig4(acc.added_flops(L, D, M, "lr", "full", 32)["kernel_pct"]) == 0.4193
    assert sig4(acc.added_flops(L, D, M, "lr", 8, 32)["kernel_pct"]) == 0.09043


def test_reductions():
    r = D // 8
    claimed, worked = acc.paper_claims()
    assert claimed["explainer.flops_reduction_pct.r_d8"]["reproduced"] == 43.75 == worked["reduction_r_d8_pct"]
    a = acc.added_flops(L, D, M, "attnres", 8, D)
    b = acc.added_flops(L, D, M, "lr", 8, 128)
    assert sig4(a["pct"]) == 0.1754 and sig4(b["pct"]) == 0.09865
    red = 100 * (1 - b["total"] / a["total"])
    assert red == pytest.approx(43.75) and round(red) == 44
    # the source-count term cancels: the same reduction for every grouping
    for N in ("full", 4, 16):
        x = acc.added_flops(L, D, M, "lr", N, 128)["total"] / acc.added_flops(L, D, M, "attnres", N, D)["total"]
        assert x == pytest.approx(1 - 0.4375)


def test_parameters():
    # 0.5B Full AttnRes of the author's repository
    assert acc.total_params(L, D, M, 100_277, "attnres", D) == 513_697_792
    p = acc.param_delta(L, D, M, "lr", 128)
    assert p["query_params"] == 2 * L * 128 and p["delta_vs_attnres"] == -2 * L * (D - 128)
    q = acc.param_delta(L, D, M, "plr", 32)
    assert q["delta_vs_attnres"] == 32 * (L * (D + M) + D + 2 * L) - 2 * L * D
    assert acc.param_delta(L, D, M, "baseline", None)["delta_vs_baseline"] == 0


def test_activation_memory():
    a = acc.activation_memory(L, D, "attnres", 8, D)
    s = acc.activation_memory(L, D, "lr", 8, 128)
    p = acc.activation_memory(L, D, "plr", 8, 32)
    assert a["elements"] == s["elements"] == 9 * D
    assert p["elements"] == 9 * (D + 32) and p["bytes_bf16"] == 2 * 9 * (D + 32)
    assert acc.activation_memory(L, D, "lr", "full", 64)["max_sources"] == 2 * L + 1


def test_paper_claims_cover_every_accounting_record_and_match(published):
    produced, _ = acc.paper_claims()
    want = {k for k, v in published.items() if v["stage"] == "accounting"}
    assert set(produced) == want
    for cid, c in produced.items():
        v, note = claims.verdict(published[cid], c["reproduced"], "smoke")
        assert v in ("match", "reproduced"), (cid, c, note)


def test_spec_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown key 'rank'"):
        acc.parse_spec({"rank": []})
    with pytest.raises(ValueError, match=r"architectures\.a\.d_ff"):
        acc.parse_spec({"architectures": {"a": {"n_layers": 2, "d_model": 8}}})
    with pytest.raises(ValueError, match="blocks"):
        acc.parse_spec({"blocks": ["all"]})


def test_cli_writes_result_without_torch(tmp_path):
    out = tmp_path / "acc.json"
    spec = {"architectures": {"tiny": "tiny", "x": {"n_layers": 2, "d_model": 32, "d_ff": 88}},
            "ranks": ["d/8", "d/4", "d"], "blocks": ["full", 2, 8]}
    code = (
        "import sys; from lrattnres.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'accounting imported torch'; raise SystemExit(rc)"
    )
    subprocess.run([sys.executable, "-c", code, "accounting", "--spec", json.dumps(spec), "--out", str(out)],
                   check=True, cwd=REPO, capture_output=True, text=True)
    res = json.loads(out.read_text())
    assert res["stage"] == "accounting" and "provenance" in res
    assert set(res["tables"]["extra"]) == {"tiny", "x"}
    assert res["tables"]["skipped"] == {"x": ["N=8 exceeds 2L=4 writes"]}
    tiny = res["tables"]["extra"]["tiny"]
    methods = {(r["method"], r["N"], r["r"]) for r in tiny["rows"]}
    d = tiny["shape"]["d_model"]
    assert ("lr", 2, d // 8) in methods and ("attnres", "full", d) in methods and ("lr", 2, d) not in methods
    assert math.isclose(res["claims"]["table5.added_flops.lr.n8.r128"]["reproduced"], 0.0986527, rel_tol=1e-5)


def test_cli_bad_spec_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lrattnres", "accounting", "--spec", '{"ranks": "d"}',
                        "--out", str(tmp_path / "x.json")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and "ranks" in r.stderr and not (tmp_path / "x.json").exists()


def test_report_section_with_and_without_results(published, tmp_path):
    pytest.importorskip("lrattnres.report.html")
    from lrattnres.report.context import ReportContext
    from lrattnres.report.sections import accounting as section

    result = {"stage": "accounting", **acc.run({"architectures": {"tiny": "tiny"}, "ranks": ["d/4", "d"],
                                                "blocks": ["full", 2]})}
    ev = claims.evaluate_claims(published, result["claims"], "tiny")
    ctx = ReportContext(scale="tiny", published=published, claims={c["id"]: c for c in ev},
                        by_stage={"accounting": [result]})
    page = section.build(ctx)
    assert page.count('class="badge ok">match') >= 66 and "mismatch" not in page
    assert "0.09865" in page and "0.4320" in page and "tiny" in page
    empty = ReportContext(scale="tiny", published=published,
                          claims={c["id"]: c for c in claims.evaluate_claims(published, {}, "tiny")})
    page = section.build(empty)
    assert "has not run" in page and "0.8131" in page and "not run" in page
