"""Throughput stage (Section 4.9, Appendix I): stopping rule, intervals, paired gains, matched weights,
a CPU run of the protocol, claims and the report section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import head_commit

from lrattnres.errors import SpecError
from lrattnres.throughput import matched as tp_matched
from lrattnres.throughput import measure as tp_measure
from lrattnres.throughput import partial as tp_partial
from lrattnres.throughput import protocol as tp_protocol
from lrattnres.throughput import spec as tp_spec
from lrattnres.throughput import summary as tp_summary
from lrattnres.throughput import cli as tp_cli

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "reports" / "published.yaml"

# ------------------------------------------------------------------------------ stopping rule


def test_window_stats_by_hand():
    cv, drift = tp_protocol.window_stats([1.0, 1.0, 1.0, 1.1, 1.1, 1.1])
    mean = 6.3 / 6
    sd = math.sqrt(6 * 0.05**2 / 5)  # every value 0.05 from the mean
    assert cv == pytest.approx(sd / mean)
    assert drift == pytest.approx(0.1 / mean)
    # odd window: the middle update belongs to neither half
    assert tp_protocol.window_stats([1.0, 5.0, 1.0])[1] == 0.0


def test_stop_on_a_flat_sequence_at_the_minimum():
    times = []
    for i in range(30):
        times.append(1.0)
        stop, why = tp_protocol.should_stop(times)
        if stop:
            break
    assert len(times) == 8 and why == "converged"  # 6 + stride 2 = the paper's minimum of eight


def test_noise_above_one_percent_runs_to_the_maximum():
    times = [1.0 + (0.03 if i % 2 else -0.03) for i in range(40)]  # CV 3%
    n = next(k for k in range(1, 41) if tp_protocol.should_stop(times[:k])[0])
    assert n == 30 and tp_protocol.should_stop(times[:30]) == (True, "max_updates")


def test_drift_blocks_stopping_even_with_small_cv():
    # 0.4% per update: CV of six updates ~0.8% < 1%, but the halves differ by 1.2% > 0.5%
    times = [1.0 * (1.004**i) for i in range(30)]
    cv, drift = tp_protocol.window_stats(times[:6])
    assert cv <= 0.01 and drift > 0.005
    assert not any(tp_protocol.should_stop(times[:k])[0] for k in range(1, 30))


def test_stops_once_both_windows_settle():
    # three noisy updates (e.g. allocator warm-up), then flat: both windows are clean at 3 + 8 = 11
    times = [1.3, 0.8, 1.2] + [1.0] * 20
    n = next(k for k in range(1, len(times) + 1) if tp_protocol.should_stop(times[:k])[0])
    assert n == 11
    # disjoint windows (stride = window) need 12 clean updates
    n2 = next(k for k in range(1, len(times) + 1) if tp_protocol.should_stop(times[:k], stride=6)[0])
    assert n2 == 15


def test_min_updates_binds():
    assert tp_protocol.should_stop([1.0] * 7, min_updates=8) == (False, "")
    assert tp_protocol.should_stop([1.0] * 9, min_updates=10) == (False, "")
    assert tp_protocol.should_stop([1.0] * 10, min_updates=10) == (True, "converged")


# ------------------------------------------------------------------------------ intervals and gains


def test_ci_hand_computed():
    g = [1.0, 2.0, 3.0, 4.0, 5.0]
    r = tp_protocol.mean_ci95(g, use_scipy=False)
    sd = math.sqrt(2.5)
    assert r["mean"] == 3.0 and r["sd"] == pytest.approx(sd)
    assert r["t"] == 2.776
    hw = 2.776 * sd / math.sqrt(5)  # s / sqrt(n), not the paper's s / 5
    assert r["half_width"] == pytest.approx(hw) and hw == pytest.approx(1.96293, abs=1e-5)
    assert r["ci95"] == pytest.approx([3.0 - hw, 3.0 + hw])


def test_t_table_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 30, 45, 120):
        assert tp_protocol.t975(df, use_scipy=False) == pytest.approx(float(scipy_stats.t.ppf(0.975, df)), abs=2e-3)
    assert tp_protocol.t975(4) == pytest.approx(2.776445, abs=1e-6)


def test_paired_gains():
    assert tp_protocol.paired_gains([110.0, 99.0], [100.0, 100.0]) == pytest.approx([10.0, -1.0])
    r = tp_protocol.paired_gain([101.0, 102.0, 103.0], [100.0, 100.0, 100.0], use_scipy=False)
    assert r["per_repeat"] == pytest.approx([1.0, 2.0, 3.0])
    assert r["mean"] == pytest.approx(2.0) and r["ci95"][0] == pytest.approx(2.0 - 4.303 * 1.0 / math.sqrt(3))
    with pytest.raises(ValueError):
        tp_protocol.paired_gains([1.0], [1.0, 2.0])
    one = tp_protocol.mean_ci95([5.0])
    assert one["mean"] == 5.0 and one["ci95"] == [None, None]


def test_rotation():
    m = ["a", "b", "c"]
    assert [tp_measure.rotation(m, j) for j in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


# ------------------------------------------------------------------------------ spec


def test_spec_names_bad_keys():
    with pytest.raises(SpecError, match="'repeat'"):
        tp_spec.resolve_spec({"repeat": 5})
    with pytest.raises(SpecError, match="'presets'"):
        tp_spec.resolve_spec({"presets": ["nope"]})
    with pytest.raises(SpecError, match="'methods'"):
        tp_spec.resolve_spec({"methods": ["fast"]})
    with pytest.raises(SpecError, match="'max_updates'"):
        tp_spec.resolve_spec({"min_updates": 8, "max_updates": 4})
    with pytest.raises(SpecError, match="'seq_len'"):
        tp_spec.resolve_spec({"presets": ["smoke"], "seq_len": 128})
    with pytest.raises(SpecError, match="repeats_by_preset"):
        tp_spec.resolve_spec({"presets": ["tiny"], "repeats_by_preset": {"4B": 3}})
    assert tp_spec.resolve_spec({})["repeats"] == 5
    assert tp_cli.main(["--spec", '{"bogus": 1}', "--out", "/dev/null"]) == 2


# ------------------------------------------------------------------------------ matched weights


def test_matched_weights_identical_across_methods():
    import torch

    s = tp_spec.resolve_spec({"presets": ["smoke"], "seq_len": 32})
    dev = torch.device("cpu")
    shared = tp_matched.shared_backbone("smoke", s, 97, 0, dev)
    again = tp_matched.shared_backbone("smoke", s, 97, 0, dev)
    other = tp_matched.shared_backbone("smoke", s, 97, 1, dev)
    assert all(torch.equal(shared[k], again[k]) for k in shared)  # seeded: same init for a repeat
    assert not torch.equal(shared["embed.weight"], other["embed.weight"])  # fresh per repeat
    models = {n: tp_matched.matched_model("smoke", n, s, 97, shared, dev) for n in ("baseline", "fused-rd", "fused-rd4", "reference-rd4")}
    for name, m in models.items():
        sd = m.state_dict()
        for k, v in shared.items():
            assert torch.equal(sd[k], v), (name, k)
        extra = set(sd) - set(shared)
        assert extra == (set() if name == "baseline" else {"queries"}), name
        if name != "baseline":
            assert torch.count_nonzero(m.queries) == 0
    assert models["fused-rd"].cfg.rank == 32 and models["fused-rd4"].cfg.rank == 8
    assert models["fused-rd4"].cfg.blocks == 4  # N = 8 clipped to 2L = 4 writes
    assert models["fused-rd4"].cfg.router == "fused" and models["reference-rd4"].cfg.router == "reference"


def test_synthetic_buffer_has_document_boundaries():
    b = tp_matched.synthetic_buffer(2, 3, 64, 100, 99, 16, 0)
    assert len(b) == 2 and tuple(b[0].inputs.shape) == (3, 64)
    assert (b[0].inputs[:, 1:] == b[0].targets[:, :-1]).all()
    assert int(b[0].doc_ids.max()) >= 1  # several documents per row
    again = tp_matched.synthetic_buffer(2, 3, 64, 100, 99, 16, 0)
    assert all((x.inputs == y.inputs).all() for x, y in zip(b, again))


def test_fla_skipped_on_cpu():
    ok, why = tp_matched.fla_available("cpu")
    assert not ok and "CUDA" in why


# ------------------------------------------------------------------------------ a CPU run


SMALL = {"presets": ["smoke"], "micro_batch": 2, "seq_len": 32, "repeats": 2, "warmup": 1, "min_updates": 3,
         "max_updates": 4, "window": 2, "stride": 1, "cv": 0.5, "drift": 0.5,
         "methods": ["baseline", "fused-rd", "fused-rd4", "reference-rd4", "fla-rd"]}


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "throughput.json"
    assert tp_cli.main(["--spec", json.dumps(SMALL), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_cpu_run_json_shape(cpu_result):
    r = cpu_result
    assert r["stage"] == "throughput" and r["device"].startswith("cpu") and r["complete"] is True
    assert r["provenance"]["commit"] == head_commit() and isinstance(r["provenance"]["dirty"], bool)
    assert r["provenance"]["attention"]["backend"] == "sdpa"  # auto on the CPU
    names = [row["name"] for row in r["rows"]]
    assert names == ["baseline", "fused-rd", "fused-rd4", "reference-rd4"]
    assert r["skipped"] and r["skipped"][0]["method"] == "fla-rd"
    for row in r["rows"]:
        assert row["preset"] == "smoke" and len(row["repeats"]) == 2 and row["mean"] > 0 and row["sd"] is not None
        assert row["tokens_per_update"] == 64
    by = {row["name"]: row for row in r["rows"]}
    assert by["fused-rd"]["r"] == 32 and by["fused-rd4"]["r"] == 8 and by["baseline"]["r"] is None
    g = r["gains"]["smoke"]
    assert set(g) == {"rank", "kernel", "routing_rd4", "routing_rd"}
    assert len(g["rank"]["per_repeat"]) == 2
    exp = tp_protocol.paired_gains(by["fused-rd4"]["repeats"], by["fused-rd"]["repeats"])
    assert g["rank"]["per_repeat"] == pytest.approx(exp)
    assert r["claims"] == {}  # small presets on a CPU map onto no published claim
    runs = r["runs"]
    assert len(runs) == 8 and all(3 <= x["updates"] <= 4 for x in runs)
    # rotated order: repeat 1 starts with the second method
    assert [x["name"] for x in runs if x["repeat"] == 1][0] == "fused-rd"


# ------------------------------------------------------------------------------ claims


def _fake_gpu_result(device: str, rd4: tuple = (48100, 48200, 48150)) -> dict:
    s = tp_spec.resolve_spec({"presets": ["1B", "4B"], "micro_batch": 2, "seq_len": 2048, "grad_accum": 4})
    per = {"fla-rd": [47000, 47100, 47050], "fused-rd": [47800, 47900, 47850], "fused-rd4": list(rd4),
           "baseline": [60000, 60100, 60050]}
    rows = []
    for preset in ("1B", "4B"):
        for name, v in per.items():
            st = tp_protocol.mean_ci95(v)
            rows.append({"preset": preset, "size": preset.lower(), "name": name, "method": tp_spec.METHOD_TABLE[name]["method"],
                         "impl": tp_spec.METHOD_TABLE[name]["impl"], "r": 1536, "d": 1536, "N": 8, "grad_accum": 4,
                         "tokens_per_update": 16384, "micro_batch": 2, "seq_len": 2048,
                         "repeats": v, "mean": st["mean"], "sd": st["sd"]})
    res = {"stage": "throughput", "device": device, "device_type": "cuda", "spec": s, "precision": "bf16",
           "compile": False, "rows": rows, "gains": {p: tp_measure._gains(per) for p in ("1B", "4B")}, "complete": True,
           "tokens": "synthetic", "provenance": {"device": device, "finished": "2026-11-29T12:00:00+00:00", "commit": "abc"}}
    return res, s


def test_claims_only_for_paper_shapes_and_gpus():
    if not PUBLISHED.exists():
        pytest.skip("reports/published.yaml not present")
    from lrattnres.claims import judge, load_published

    pub = load_published(PUBLISHED)
    ids = tp_summary.published_ids(str(PUBLISHED))
    # an H200 stands in for the H100 in the gains' directions, never in Table 3's values
    res, s = _fake_gpu_result("NVIDIA H200")
    c = tp_summary.claims_for(res, s)
    assert set(c) == {f"sec4.9.{k}.h100.{size}" for k in ("rank_gain_positive", "fast_beats_fla", "combined_gain_positive")
                      for size in ("1b", "4b")}
    rank = c["sec4.9.rank_gain_positive.h100.1b"]
    assert rank["samples"] == pytest.approx(res["gains"]["1B"]["rank"]["per_repeat"]) and rank["unit"] == "repeats"
    assert rank["reproduced"] == pytest.approx(res["gains"]["1B"]["rank"]["mean"]) and "H200" in rank["note"]
    assert judge(pub["sec4.9.rank_gain_positive.h100.1b"], rank, "tiny")["verdict"] == "reproduced"
    # a positive mean whose interval straddles 0 does not establish the sign
    res, s = _fake_gpu_result("NVIDIA H200", rd4=(48500, 47300, 48000))
    c = tp_summary.claims_for(res, s)
    out = judge(pub["sec4.9.rank_gain_positive.h100.1b"], c["sec4.9.rank_gain_positive.h100.1b"], "tiny")
    assert c["sec4.9.rank_gain_positive.h100.1b"]["reproduced"] > 0 and out["verdict"] == "inconclusive"
    assert out["interval"][0] < 0 < out["interval"][1] and out["n"] == 3
    res, s = _fake_gpu_result("NVIDIA H100 80GB HBM3")
    c = tp_summary.claims_for(res, s)
    assert set(c) <= ids
    assert c["table3.tokens_per_s.h100.1b.fla.rd"]["reproduced"] == pytest.approx(47050)
    assert "table3.rank_gain_ci_high.h100.4b" in c and "sec4.9.combined_gain_pct.h100.1b" in c
    assert "H200" not in c["sec4.9.rank_gain_positive.h100.1b"]["note"]
    assert tp_summary.claims_for(*_fake_gpu_result("NVIDIA A100-SXM4-80GB")) == {}  # no paper GPU, no stand-in
    res["device_type"] = "cpu"
    assert tp_summary.claims_for(res, s) == {}


def test_stopping_rule_claim_names_the_runs_that_missed_it():
    res, s = _fake_gpu_result("NVIDIA H200")
    res["runs"] = [{"preset": "1B", "repeat": j, "name": n, "stopped": "converged" if (j, n) != (1, "fused-rd") else
                    "max_updates", "updates": 30 if (j, n) == (1, "fused-rd") else 12}
                   for j in range(3) for n in ("fla-rd", "fused-rd", "fused-rd4")]
    c = tp_summary.claims_for(res, s)["appI.repeats_met_stopping_rule.1b"]
    assert c["reproduced"] == 1 and "8 of 9" in c["note"] and "repeat 1 fused-rd (max_updates, 30 updates)" in c["note"]


# ------------------------------------------------------------------------------ report section


def _ctx(by_stage: dict, recorded: dict, scale: str = "tiny"):
    from lrattnres import claims as engine
    from lrattnres.report import collect_produced
    from lrattnres.report.context import ReportContext

    published = engine.load_published(PUBLISHED)
    produced = collect_produced(by_stage, recorded)
    claims = engine.evaluate_claims(published, produced, scale)
    return ReportContext(scale=scale, published=published, claims={c["id"]: c for c in claims},
                         by_stage=by_stage, recorded=recorded)


def test_section_without_recorded(cpu_result):
    if not PUBLISHED.exists():
        pytest.skip("reports/published.yaml not present")
    from lrattnres.report.sections import throughput as sec

    assert sec.ORDER == 70 and sec.TITLE
    html = sec.build(_ctx({"throughput": [dict(cpu_result, _path="t.json")]}, {}))
    assert "47,436 ± 34" in html and "68,400 ± 309" in html and "[0.030, 1.157]" in html  # published Table 3
    assert "This run (scale tiny)" in html and "smoke" in html and "Recorded GPU" not in html
    assert "s/sqrt(n)" in html and "fla-rd skipped" in html
    empty = sec.build(_ctx({}, {}))
    assert "Not run" in empty and "47,436 ± 34" in empty


def test_section_with_recorded(cpu_result):
    if not PUBLISHED.exists():
        pytest.skip("reports/published.yaml not present")
    from lrattnres.report.sections import throughput as sec

    res, s = _fake_gpu_result("NVIDIA H200")
    res["claims"] = tp_summary.claims_for(res, s)
    res["_path"] = "benchmarks/results/throughput_1b_h200_2026-11-29.json"
    ctx = _ctx({"throughput": [dict(cpu_result, _path="t.json")]}, {"throughput_gpu": res})
    html = sec.build(ctx)
    assert "Recorded GPU result (NVIDIA H200, eager, accumulation 4)" in html and "2026-11-29T12:00:00" in html
    assert "Not the paper's protocol:</b> eager, accumulation 4" in html and "Appendix I" in html
    assert "benchmarks/results/throughput_1b_h200_2026-11-29.json" in html
    assert "48,150 ±" in html  # ours r = d/4 mean
    assert "sec4.9.rank_gain_positive.h100.1b" in html and "reproduced" in html
    assert ctx.claims["sec4.9.rank_gain_positive.h100.1b"]["verdict"] == "reproduced"
    # the CPU run's measurements: how many met the stopping rule, how many ran to the cap
    n = sum(1 for r in cpu_result["runs"] if r["preset"] == "smoke")
    met = sum(1 for r in cpu_result["runs"] if r["preset"] == "smoke" and r["stopped"] == "converged")
    assert f"smoke: {met} of {n} measurements met the stopping rule" in html


def test_failing_method_is_dropped_and_deadline_cuts(tmp_path, monkeypatch):
    real = tp_measure.time_method

    def flaky(model, *a, **k):
        if model.cfg.method == "lr" and model.cfg.router == "reference":
            raise RuntimeError("boom")
        return real(model, *a, **k)

    monkeypatch.setattr(tp_measure, "time_method", flaky)
    spec = dict(SMALL, methods=["fused-rd", "fused-rd4", "reference-rd4"], repeats=2, max_updates=3)
    r = tp_measure.run(spec)
    assert [row["name"] for row in r["rows"]] == ["fused-rd", "fused-rd4"]
    assert any(x["method"] == "reference-rd4" and "boom" in x["why"] for x in r["skipped"])
    assert len(r["gains"]["smoke"]["rank"]["per_repeat"]) == 2 and r["complete"]
    cut = tp_measure.run(dict(spec, deadline_s={"smoke": 1e-9}))
    assert cut["complete"] is False and cut["rows"] == [] and "deadline" in cut["notes"][-1]


def test_gpu_script_times_the_gpu_scales_protocol(tmp_path):
    """benchmarks/run_gpu_benchmarks.sh's throughput-1b/4b: the gpu scale's spec of config.yaml (the paper's
    compiled protocol at accumulation 64, resolving the rank gain within 15 minutes a size), on CUDA,
    written where benchmarks/results/ names such files, continuing a partial state of another date, and
    stopping at THROUGHPUT_DEADLINE_S."""
    import os
    import re
    import subprocess

    from lrattnres.config import load_and_resolve

    text = (ROOT / "benchmarks" / "run_gpu_benchmarks.sh").read_text()
    func = re.search(r"^throughput\(\) \{.*?^\}$", text, re.S | re.M).group(0)
    assert re.findall(r"throughput (\w+) (\w+)\n", text) == [("1b", "1B"), ("4b", "4B")]
    stub = tmp_path / "py"
    stub.write_text('#!/bin/sh\necho "deadline=${LRATTNRES_DEADLINE:-}"; printf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()

    def call(*env):
        script = f"OUT={out}; GPU=h200; DATE=2026-12-10; PY={stub}\n{func}\nthroughput 1b 1B"
        return subprocess.run(["env", *env, "bash", "-uc", script], capture_output=True, text=True, check=True,
                              env={"PATH": os.environ["PATH"]}).stdout.splitlines()

    args = call()
    assert args[0] == "deadline=" and args[1:5] == ["-m", "lrattnres", "throughput", "--scale"] and args[5] == "gpu"
    spec = json.loads(args[args.index("--spec") + 1])
    assert spec == {"presets": ["1B"], "device": "cuda"}
    assert args[args.index("--out") + 1] == f"{out}/throughput_1b_h200_2026-12-10.json"
    (out / "throughput_1b_h200_2026-12-09.partial.json").write_text("{}")
    args = call("THROUGHPUT_DEADLINE_S=500")
    assert args[args.index("--partial") + 1] == f"{out}/throughput_1b_h200_2026-12-09.partial.json"
    assert args[args.index("--out") + 1] == f"{out}/throughput_1b_h200_2026-12-09.json"
    assert 400 < float(args[0].removeprefix("deadline=")) - __import__("time").time() <= 500
    s = tp_spec.resolve_spec({**load_and_resolve(ROOT / "config.yaml", {"scale": "gpu"})["throughput"], **spec})
    assert (s["compile"], s["micro_batch"], s["seq_len"], s["grad_accum"], s["repeats"], s["blocks"]) == (
        True, 2, 2048, 64, 5, 8)
    assert (s["warmup"], s["min_updates"], s["max_updates"], s["window"], s["cv"], s["drift"]) == (3, 8, 30, 6, 0.01, 0.005)
    assert s["methods"] == ["fla-rd", "fused-rd", "fused-rd4"] and s["attention"] == "auto"
    assert s["target_half_width"] == 0.3 and s["budget_s"] == 900 and s["resolve_gain"] == "rank"
    assert "PYTHONUNBUFFERED=1" in text and "TORCHINDUCTOR_CACHE_DIR" in text


def test_fla_adapter_wiring_with_a_stand_in(monkeypatch):
    """The FLA router is wired into the model through the adapter (rms_weight = ones, r = d); a stand-in
    fused_attnres with FLA's signature and semantics gives the reference router's logits."""
    import sys
    import types

    import torch

    from lrattnres.routing import rms_norm

    calls = []

    def fused_attnres(query, residuals, rms_weight, output_rms_weight=None, rms_eps=1e-6, **kw):
        calls.append(rms_weight)
        v = torch.stack(list(residuals))
        logits = (rms_norm(v, rms_eps) * rms_weight * query).sum(-1)
        return (logits.softmax(0).unsqueeze(-1) * v).sum(0)

    mod = types.ModuleType("fla.ops.attnres")
    mod.fused_attnres = fused_attnres
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.attnres", mod)
    monkeypatch.setattr(tp_matched, "fla_available", lambda device_type: (True, "stand-in"))

    s = tp_spec.resolve_spec({"presets": ["smoke"], "seq_len": 32})
    dev = torch.device("cpu")
    shared = tp_matched.shared_backbone("smoke", s, 97, 0, dev)
    fla = tp_matched.matched_model("smoke", "fla-rd", s, 97, shared, dev)
    ref = tp_matched.matched_model("smoke", "fused-rd", s, 97, shared, dev)
    torch.manual_seed(1)
    q = torch.randn_like(fla.queries) * 0.5
    with torch.no_grad():
        fla.queries.copy_(q)
        ref.queries.copy_(q)
    x = torch.randint(0, 97, (2, 32))
    out = fla(x)
    assert calls and all(torch.equal(w, torch.ones(32)) for w in calls)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    route = tp_matched.fla_router()
    with pytest.raises(ValueError, match="r = d"):
        route([torch.zeros(2, 32)], torch.zeros(8))


def test_recorded_claims_are_derived_again_by_this_code():
    """A recorded file keeps its measurements; its claims (and notes) come from the current rules."""
    if not PUBLISHED.exists():
        pytest.skip("reports/published.yaml not present")
    from lrattnres import report

    res, s = _fake_gpu_result("NVIDIA H200")
    res["spec"] = s
    res["claims"] = {"sec4.9.rank_gain_positive.h100.1b": {"reproduced": False, "note": "stale"}}
    report.rederive_claims({"throughput_gpu_1b": res, "kernel": {"stage": "kernel", "claims": {"x": 1}}},
                           tp_summary.published_ids(str(PUBLISHED)))
    assert res["claims"]["sec4.9.rank_gain_positive.h100.1b"]["reproduced"] > 0
    assert len(res["claims"]["sec4.9.rank_gain_positive.h100.1b"]["samples"]) == 3


# ------------------------------------------------------------------------------ resume and deadline


def _fake_timing(calls: list, monkeypatch, stop_after: int | None = None):
    """A stand-in for time_method: fixed update times; once ``stop_after`` runs are timed, the
    deadline (LRATTNRES_DEADLINE) is set in the past, through ``monkeypatch`` so that it is gone after
    the test (set directly, a later monkeypatch.delenv would put it back for every test after)."""
    import time as _time

    def timed(model, batches, s, device, precision, log=None, guard=None, **kw):
        calls.append(model.cfg.rank)
        if stop_after is not None and len(calls) == stop_after:
            monkeypatch.setenv("LRATTNRES_DEADLINE", str(_time.time() - 1))
        return {"times_s": [0.01 * len(calls)] * 3, "warmup_s": 0.0, "stopped": "converged", "final_ce": 1.0,
                "peak_mem_gib": None, "weights_dtype": "float32"}

    return timed


def test_default_methods_are_table_3s():
    assert tp_spec.resolve_spec({})["methods"] == ["fla-rd", "fused-rd", "fused-rd4"]


def test_a_stage_at_its_deadline_keeps_its_runs_and_the_next_continues(tmp_path, monkeypatch):
    out = tmp_path / "throughput" / "smoke.json"
    spec = json.dumps(dict(SMALL, methods=["fused-rd", "fused-rd4"], repeats=3))
    first: list = []
    monkeypatch.delenv("LRATTNRES_DEADLINE", raising=False)
    monkeypatch.setattr(tp_measure, "time_method", _fake_timing(first, monkeypatch, stop_after=3))
    assert tp_cli.main(["--spec", spec, "--out", str(out)]) == 75  # EX_TEMPFAIL: a retry continues
    part = tp_partial.partial_path(out)
    assert not out.exists() and part.name == "smoke.partial.json"
    state = json.loads(part.read_text())
    assert state["format"] == tp_partial.PARTIAL_FORMAT and len(state["runs"]) == 3 and len(first) == 3
    # the deadline has passed: a retry now starts nothing
    assert tp_cli.main(["--spec", spec, "--out", str(out)]) == 75 and len(first) == 3
    # with time again, only the three missing runs are timed; the earlier ones are kept as they were
    monkeypatch.delenv("LRATTNRES_DEADLINE")
    second: list = []
    monkeypatch.setattr(tp_measure, "time_method", _fake_timing(second, monkeypatch))
    assert tp_cli.main(["--spec", spec, "--out", str(out)]) == 0
    assert len(second) == 3 and not part.exists()
    r = json.loads(out.read_text())
    assert r["complete"] and len(r["runs"]) == 6 and [x["repeat"] for x in r["runs"]] == [0, 0, 1, 1, 2, 2]
    assert r["runs"][:3] == state["runs"] and len(r["gains"]["smoke"]["rank"]["per_repeat"]) == 3
    assert any("earlier, unfinished process" in n for n in r["notes"])


def test_a_partial_state_of_another_spec_is_not_continued(tmp_path, monkeypatch):
    out = tmp_path / "smoke.json"
    monkeypatch.delenv("LRATTNRES_DEADLINE", raising=False)
    calls: list = []
    monkeypatch.setattr(tp_measure, "time_method", _fake_timing(calls, monkeypatch, stop_after=2))
    spec = dict(SMALL, methods=["fused-rd", "fused-rd4"], repeats=2)
    assert tp_cli.main(["--spec", json.dumps(spec), "--out", str(out)]) == 75
    monkeypatch.delenv("LRATTNRES_DEADLINE")
    again: list = []
    monkeypatch.setattr(tp_measure, "time_method", _fake_timing(again, monkeypatch))
    assert tp_cli.main(["--spec", json.dumps(dict(spec, max_updates=5)), "--out", str(out)]) == 0
    assert len(again) == 4  # every run timed afresh


def test_a_run_under_way_stops_between_updates(monkeypatch):
    """The deadline falls inside a timed run: it stops at the next update, is not counted as a failed
    method, and the stage stops (the real time_method, smoke shapes on the CPU)."""
    import time as _time

    from lrattnres import deadline

    monkeypatch.setenv("LRATTNRES_DEADLINE", str(_time.time() + 3600))
    real = tp_measure.time_method

    def soon(*a, guard=None, **k):
        monkeypatch.setenv("LRATTNRES_DEADLINE", str(_time.time() + 1e-3))
        return real(*a, guard=guard, **k)

    monkeypatch.setattr(tp_measure, "time_method", soon)
    with pytest.raises(deadline.DeadlineReached, match="the next update"):
        tp_measure.run(dict(SMALL, methods=["fused-rd"], repeats=1))


def test_a_malformed_deadline_is_a_user_error(capsys, monkeypatch, tmp_path):
    from lrattnres.cli import run_stage

    monkeypatch.setenv("LRATTNRES_DEADLINE", "tomorrow")
    assert run_stage("throughput", ["--spec", json.dumps(SMALL), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "LRATTNRES_DEADLINE" in err and "'tomorrow'" in err and "epoch seconds" in err


def test_aggregate_merges_one_result_per_size(tmp_path):
    a, s = _fake_gpu_result("NVIDIA H100 80GB HBM3")
    one = dict(a, spec=dict(s, presets=["1B"]), rows=[r for r in a["rows"] if r["preset"] == "1B"],
               gains={"1B": a["gains"]["1B"]}, runs=[], skipped=[], notes=["x"])
    four = dict(a, spec=dict(s, presets=["4B"]), rows=[r for r in a["rows"] if r["preset"] == "4B"],
                gains={"4B": a["gains"]["4B"]}, runs=[], skipped=[], notes=["x"], complete=False)
    paths = []
    for name, part in (("1B", one), ("4B", four)):
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(json.dumps(part))
    assert tp_cli.main(["--aggregate", *paths, "--out", str(tmp_path / "all.json")]) == 0
    r = json.loads((tmp_path / "all.json").read_text())
    assert r["spec"]["presets"] == ["1B", "4B"] and set(r["gains"]) == {"1B", "4B"} and len(r["rows"]) == 8
    assert r["complete"] is False and r["notes"] == ["x"] and r["parts"] == paths
    assert any(c.startswith("table3.tokens_per_s.h100.4b") for c in r["claims"])


# ------------------------------------------------------------------------------ compiled once, resolved, fits


@pytest.fixture
def eager_backend(monkeypatch):
    """torch.compile with Dynamo's own tracing and guards but no code generation (seconds on a CPU):
    whether a graph is compiled again is Dynamo's decision, the same under Inductor."""
    import functools

    import torch

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


def test_a_method_compiles_once_and_its_repeats_reuse_the_graph(eager_backend):
    spec = dict(SMALL, methods=["fused-rd", "fused-rd4"], repeats=2, compile=True, max_updates=3)
    r = tp_measure.run(spec)
    graphs = {(x["repeat"], x["name"]): x["graphs_compiled"] for x in r["runs"]}
    assert graphs[(0, "fused-rd")] >= 1 and graphs[(0, "fused-rd4")] >= 1  # compiled in the first warm-up update
    assert graphs[(1, "fused-rd")] == 0 and graphs[(1, "fused-rd4")] == 0  # the second repeat does not recompile
    assert all(x["compile_s"] > 0 for x in r["runs"] if x["repeat"] == 0)
    assert all(x["compile_s"] == 0 for x in r["runs"] if x["repeat"] == 1)
    assert len({x["process"] for x in r["runs"]}) == 1
    rep = next(row for row in r["protocol"] if row["aspect"] == "repeats")
    assert rep["same"] is False and "share its compiled graph" in rep["here"]
    comp = next(row for row in r["protocol"] if row["aspect"] == "compile")
    assert comp["same"] is True and "one graph per method" in comp["here"]


def test_a_repeat_reloads_the_weights_and_starts_a_fresh_optimiser(eager_backend):
    """The same shared weights give the same losses in a second timed run on the same compiled graph:
    no weights, gradients or optimiser state carry over; other weights give other losses."""
    import torch

    s = tp_spec.resolve_spec(dict(SMALL, compile=True, warmup=1, min_updates=2, max_updates=2))
    dev = torch.device("cpu")
    batches = tp_matched.synthetic_buffer(1, 2, 32, 97, 96, 16, 0)
    slot = tp_measure.MethodSlot("smoke", "fused-rd4", s, 97, dev, "fp32")
    first = tp_matched.shared_backbone("smoke", s, 97, 0, dev)
    assert all(v.device.type == "cpu" for v in first.values())  # the shared weights stay on the host
    recs, guarded = [], []
    for shared in (first, tp_matched.shared_backbone("smoke", s, 97, 0, dev), tp_matched.shared_backbone("smoke", s, 97, 1, dev)):
        slot.load(shared)
        guarded.append([])
        recs.append(tp_measure.time_method(slot.model, batches, s, dev, "fp32", fwd=slot.fwd, lm=slot.lm,
                                   guard=guarded[-1].append))
        slot.release()
        assert all(p.untyped_storage().nbytes() == 0 and p.grad is None for p in slot.model.parameters())
    assert recs[0]["graphs_compiled"] >= 1 and recs[1]["graphs_compiled"] == 0 == recs[2]["graphs_compiled"]
    # the deadline's guard is not told the compiling update's time, only the updates' after it
    assert guarded[0][0] == 0.0 and guarded[1][0] > 0 and len(guarded[0]) == 2
    assert recs[1]["final_ce"] == recs[0]["final_ce"]
    assert recs[2]["final_ce"] != recs[0]["final_ce"]


def _paced(calls: list, rates: dict):
    """A stand-in for time_method: update times from ``rates[cfg.method]``, a function of how many runs of
    that method came before; no model runs."""

    def timed(model, batches, s, device, precision, log=None, guard=None, **kw):
        t = rates[model.cfg.method](calls.count(model.cfg.method))
        calls.append(model.cfg.method)
        return {"times_s": [t] * 3, "warmup_s": 0.01, "stopped": "converged", "final_ce": 1.0, "peak_mem_gib": None,
                "weights_dtype": "float32", "first_update_s": t, "graphs_compiled": 0, "compile_s": 0.0}

    return timed


def test_more_repeats_of_the_pair_until_the_gain_is_resolved(monkeypatch):
    base = dict(SMALL, methods=["baseline", "fused-rd", "fused-rd4"], repeats=3, max_repeats=8)
    steady = {"baseline": lambda k: 1.0, "attnres": lambda k: 1.02, "lr": lambda k: 1.0}
    calls: list = []
    monkeypatch.setattr(tp_measure, "time_method", _paced(calls, steady))
    r = tp_measure.run(dict(base, target_half_width=0.3))
    assert r["resolution"]["smoke"]["stopped"] == "resolved" and len(calls) == 9  # the three repeats suffice
    assert "resolved: at most the target 0.3" in __import__(
        "lrattnres.report.sections.throughput", fromlist=["x"]).result_tables(r, "cpu")
    # a noisy rank gain: repeats of fused-rd and fused-rd4 alone are added up to max_repeats
    noisy = dict(steady, lr=lambda k: 1.0 + 0.02 * (k % 2))
    calls.clear()
    monkeypatch.setattr(tp_measure, "time_method", _paced(calls, noisy))
    r = tp_measure.run(dict(base, target_half_width=0.3))
    res = r["resolution"]["smoke"]
    assert res["stopped"] == "max_repeats" and res["n"] == 8 and res["half_width"] > 0.3
    extra = [x for x in r["runs"] if x["repeat"] >= 3]
    assert {x["name"] for x in extra} == {"fused-rd", "fused-rd4"} and len(extra) == 10
    g = r["gains"]["smoke"]
    assert g["rank"]["n"] == 8 and g["routing_rd4"]["n"] == 3 and g["routing_rd4"]["repeat_ids"] == [0, 1, 2]
    by = {row["name"]: row for row in r["rows"]}
    assert len(by["baseline"]["repeats"]) == 3 and len(by["fused-rd4"]["repeats"]) == 8
    assert [x["name"] for x in extra if x["repeat"] == 3] == ["fused-rd4", "fused-rd"]  # rotation goes on
    from lrattnres.report.sections import throughput as sec

    html = sec.result_tables(r, "cpu")
    assert "95% half-width" in html and "over 8 paired repeats; not resolved (target 0.3) within 8 repeats" in html
    assert "the measurement protocol, the paper&#x27;s and this result&#x27;s" in html and "differs" in html
    # the budget: no extra repeat that would take the size past it
    calls.clear()
    r = tp_measure.run(dict(base, target_half_width=0.3, budget_s=1e-6))
    assert r["resolution"]["smoke"]["stopped"] == "budget" and len(calls) == 9
    # no target: the protocol's repeats only
    calls.clear()
    r = tp_measure.run(base)
    assert r["resolution"]["smoke"]["stopped"] == "not asked" and len(calls) == 9


def test_more_repeats_rule():
    hw = lambda x: {"half_width": x, "n": 5}  # noqa: E731
    kw = dict(base=5, target=0.3, max_repeats=30)
    assert tp_protocol.more_repeats(hw(9.0), done=3, **kw) == (True, "")  # the protocol's five always run
    assert tp_protocol.more_repeats(hw(0.3), done=5, **kw) == (False, "resolved")
    assert tp_protocol.more_repeats(hw(0.31), done=5, **kw) == (True, "")
    assert tp_protocol.more_repeats(hw(0.5), done=30, **kw) == (False, "max_repeats")
    assert tp_protocol.more_repeats(hw(0.5), done=9, spent_s=800, next_s=90, budget_s=900, **kw) == (True, "")
    assert tp_protocol.more_repeats(hw(0.5), done=9, spent_s=800, next_s=120, budget_s=900, **kw) == (False, "budget")
    assert tp_protocol.more_repeats(hw(0.5), done=5, base=5, target=None, max_repeats=30) == (False, "not asked")
    assert tp_protocol.more_repeats(None, done=1, base=1, target=0.3, max_repeats=30) == (True, "")  # no interval yet


def test_run_estimate_counts_compilation_once():
    runs = [{"warmup_s": 100.0, "compile_s": 88.0, "times_s": [4.0] * 8},
            {"warmup_s": 12.0, "compile_s": 0.0, "times_s": [4.0] * 10}]
    assert tp_measure.run_estimate(runs, compiled_here=True) == pytest.approx(52.0)
    assert tp_measure.run_estimate(runs, compiled_here=False) == pytest.approx(140.0)
    assert tp_measure.run_estimate([], compiled_here=False) is None


def test_a_method_out_of_memory_fails_the_job_naming_it(tmp_path, monkeypatch, capsys):
    import torch

    errors = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")]

    def oom(model, *a, **k):
        if model.cfg.rank == 8:
            raise errors[0]
        return {"times_s": [0.01] * 3, "warmup_s": 0.0, "stopped": "converged", "final_ce": 1.0, "peak_mem_gib": None,
                "weights_dtype": "float32", "first_update_s": 0.01, "graphs_compiled": 0, "compile_s": 0.0}

    monkeypatch.delenv("LRATTNRES_DEADLINE", raising=False)
    monkeypatch.setattr(tp_measure, "time_method", oom)
    out = tmp_path / "smoke.json"
    spec = dict(SMALL, methods=["fused-rd", "fused-rd4"], repeats=2)
    assert tp_cli.main(["--spec", json.dumps(spec), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "smoke repeat 0 method fused-rd4 ran out of GPU memory" in err and "Tried to allocate" in err
    assert not out.exists()  # no result with an empty row
    state = json.loads(tp_partial.partial_path(out).read_text())
    assert [x["name"] for x in state["runs"]] == ["fused-rd"] and not state["dropped"]
    errors[0] = RuntimeError("CUDA error: out of memory")  # raised by a library, not the allocator
    with pytest.raises(tp_measure.MethodFailed, match="fused-rd4 ran out of GPU memory"):
        tp_measure.run(spec)
    errors[0] = RuntimeError("shape not supported")  # any other failure: dropped, and listed
    r = tp_measure.run(spec)
    assert [row["name"] for row in r["rows"]] == ["fused-rd"] and "shape not supported" in r["skipped"][-1]["why"]


def test_a_plan_that_does_not_fit_the_gpu_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    from lrattnres.config import load_and_resolve

    paper = load_and_resolve(ROOT / "config.yaml", {"scale": "paper"})["cluster"]

    def nothing(*a, **k):
        raise AssertionError("built a model")

    monkeypatch.setattr(tp_measure, "MethodSlot", nothing)
    monkeypatch.setattr(tp_measure, "shared_backbone", nothing)
    tiny_gpu = dict(paper, gpu_memory_gib=0.5)
    out = tmp_path / "smoke.json"
    from lrattnres.throughput.cli import cluster_arg

    arg = cluster_arg(tiny_gpu)  # as the workflow passes it: a resource printed without ", "
    assert ", " not in arg and json.loads(arg)["memory_anchors"][0] == {"preset": "4B", "micro_batch": 2,
                                                                        "peak_gib": 76.0, "method": "lr"}
    assert tp_cli.main(["--spec", json.dumps(SMALL), "--cluster", arg, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "timing baseline at smoke needs an estimated" in err and "cluster.gpu_memory_gib 0.5 less the 10% margin" in err
    assert not out.exists() and not tp_partial.partial_path(out).exists()
    # the 4B timing of the paper's protocol: 76 GiB of training step and the overhead, no copy of the weights
    plan = [{"preset": "4B", "methods": ["fused-rd", "fused-rd4"], "vocab": 100277}]
    s = tp_spec.resolve_spec({"presets": ["4B"], "micro_batch": 2, "seq_len": 2048, "grad_accum": 64})
    gpu = load_and_resolve(ROOT / "config.yaml", {"scale": "gpu"})["cluster"]
    fits = tp_measure.memory_plan(plan, s, gpu, __import__("torch").device("cpu"))
    peaks = {row["method"]: row["peak_gib"] for row in fits["rows"]}
    assert fits["checked"] and fits["shared_weights"] == "host" and 78.5 < peaks["fused-rd4"] < 79.5
    from lrattnres import memory
    from lrattnres.presets import get_preset

    shape = dict(get_preset("4B"), vocab_size=100277)
    copy = memory.throughput_estimate(shape, micro_batch=2, seq_len=2048, cluster=gpu, rank=640, shared_on_gpu=True)
    assert copy["shared_weights_gib"] == pytest.approx(15.1, abs=0.1)  # the fp32 copy the stage no longer keeps
    # an 80 GB GPU (74.5 GiB) with the 10% margin cannot hold micro-batch 2; micro-batch 1 fits it
    with pytest.raises(memory.FitError, match=r"timing fused-rd at 4B needs an estimated 79.0 GiB .*at most 67.0 GiB"):
        tp_measure.memory_plan(plan, s, paper, __import__("torch").device("cpu"))
    one = tp_spec.resolve_spec({"presets": ["4B"], "micro_batch": 1, "seq_len": 2048, "grad_accum": 128})
    assert tp_measure.memory_plan(plan, one, paper, __import__("torch").device("cpu"))["checked"]
    assert tp_measure.memory_plan(plan, s, None, __import__("torch").device("cpu")) == {
        "checked": False, "why": "no cluster.gpu_memory_gib and cluster.memory_anchors given"}


def test_recorded_patterns_name_the_newest_recording(tmp_path):
    from lrattnres import recorded

    d = tmp_path / "benchmarks" / "results"
    d.mkdir(parents=True)
    for name in ("throughput_1b_h200_2026-11-29.json", "throughput_1b_h200_2026-12-11.json",
                 "throughput_1b_h100_2026-12-02.json", "throughput_1b_h200_2026-12-12.partial.json"):
        (d / name).write_text("{}")
    pat = "benchmarks/results/throughput_1b_*_????-??-??.json"
    assert recorded.resolve_path(pat, tmp_path) == "benchmarks/results/throughput_1b_h200_2026-12-11.json"
    assert recorded.resolve_path("benchmarks/results/throughput_4b_*_????-??-??.json", tmp_path) is None
    assert recorded.resolve_path("a/b.json", tmp_path) == "a/b.json"
    listed = recorded.read_list(ROOT / recorded.RECORDED)
    assert recorded.resolve_path(listed["throughput_gpu_1b"], ROOT).startswith("benchmarks/results/throughput_1b_")


def test_a_resolving_size_continues_across_commands_and_counts_its_time(tmp_path, monkeypatch):
    import time as _time

    out = tmp_path / "smoke.json"
    spec = json.dumps(dict(SMALL, methods=["fused-rd", "fused-rd4"], repeats=2, max_repeats=5, target_half_width=0.3))
    noisy = {"attnres": lambda k: 1.0, "lr": lambda k: 1.0 + 0.02 * (k % 2)}  # never resolved
    monkeypatch.delenv("LRATTNRES_DEADLINE", raising=False)
    calls: list = []
    paced = _paced(calls, noisy)

    def stops(*a, **k):
        rec = paced(*a, **k)
        if len(calls) == 6:  # inside the extra repeats: the command's time is up
            monkeypatch.setenv("LRATTNRES_DEADLINE", str(_time.time() - 1))
        return rec

    monkeypatch.setattr(tp_measure, "time_method", stops)
    assert tp_cli.main(["--spec", spec, "--out", str(out)]) == 75
    state = json.loads(tp_partial.partial_path(out).read_text())
    assert len(state["runs"]) == 6 and state["spent_s"]["smoke"] > 0
    monkeypatch.delenv("LRATTNRES_DEADLINE")
    calls.clear()
    monkeypatch.setattr(tp_measure, "time_method", _paced(calls, {"attnres": noisy["attnres"],
                                                                  "lr": lambda k: noisy["lr"](k + 3)}))
    assert tp_cli.main(["--spec", spec, "--out", str(out)]) == 0 and len(calls) == 4
    r = json.loads(out.read_text())
    assert sorted({x["repeat"] for x in r["runs"]}) == [0, 1, 2, 3, 4] and r["runs"][:6] == state["runs"]
    res = r["resolution"]["smoke"]
    assert res["stopped"] == "max_repeats" and res["n"] == 5 and res["spent_s"] >= state["spent_s"]["smoke"]
