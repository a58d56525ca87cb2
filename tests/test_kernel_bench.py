"""benchmarks/kernel_bench.py without a GPU: the grid's order and --merge of runs that each measured
part of it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import kernel_bench as kb  # noqa: E402


def test_full_grid_is_the_90_shape_grid_goals_first():
    grid = kb.full_grid([8192, 4096])
    want = {(N, d, S, r) for N in (8192, 4096) for d in (1024, 1536, 2560) for S in (2, 5, 9, 25, 49)
            for r in (d, d // 4, d // 8)}
    assert len(grid) == len(want) == 90 and set(grid) == want
    assert grid[0] == (8192, 1536, 9, 384) and grid[1] == (8192, 1536, 9, 1536)
    assert grid[90 // 2] == (4096, 1536, 9, 384)  # each token count starts with the goals' shapes


_CHECK = {"d": 1536, "r": 384, "S": 9, "norm": "slice", "pass": True, "out_rel_l2": 1e-5, "src_grad_rel_l2": 2e-3,
          "query_grad_rel_l2": 3e-5}


def _run(env_date, commit, rows, bw=4.25, check=None, device="GPU X"):
    return {"env": {"device": device, "torch": "2.11", "triton": "3.6", "date": env_date, "git": {"commit": commit}},
            "copy_bw_TBps": bw, "rows": rows, "check": check or [], "truncated": True}


def _row(N, d, S, r, impl="ours", **more):
    return {"tokens": N, "d": d, "S": S, "r": r, "impl": impl, "fwd_us": 1.0, "fwdbwd_us": 2.0, "fwd_pct": 50.0,
            "fwdbwd_pct": 50.0, "fwd_graph_us": 1.0, "fwdbwd_graph_us": 2.0, "fwd_graph_pct": 50.0, "fwdbwd_graph_pct": 50.0,
            **more}


def test_merge_orders_rows_and_keeps_each_runs_provenance(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run("d1", "abc", [_row(4096, 1536, 9, 384)], check=[_CHECK])))
    b.write_text(json.dumps(_run("d2", "def", [_row(8192, 1536, 2, 384), _row(8192, 1536, 9, 384)], bw=4.0)))
    doc = kb.merge([str(a), str(b)], str(tmp_path / "out"), "merged", "two calls")
    assert [(r["tokens"], r["S"]) for r in doc["rows"]] == [(8192, 9), (8192, 2), (4096, 9)]
    assert doc["check"] == [_CHECK] and doc["shapes_measured"] == 3 and doc["truncated"]
    assert [m["env"]["git"]["commit"] for m in doc["merged_from"]] == ["abc", "def"]
    assert doc["env"]["date"] == "d2"  # the newest run's: the table's date is its latest measurement
    assert doc["copy_bw_TBps"] == pytest.approx(4.125)
    md = (tmp_path / "out" / "merged.md").read_text()
    assert "3 of the grid's 90 shapes" in md and "tree def" in md
    assert json.loads((tmp_path / "out" / "merged.json").read_text())["note"] == "two calls"


def test_merge_refuses_runs_of_different_devices(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run("d1", "abc", [_row(4096, 1536, 9, 384)])))
    b.write_text(json.dumps(_run("d2", "abc", [_row(8192, 1536, 9, 384)], device="GPU Y")))
    with pytest.raises(SystemExit, match="differ in device"):
        kb.merge([str(a), str(b)], str(tmp_path), "m", "")


def test_merge_keeps_the_last_run_of_a_shape(tmp_path):
    """A shape measured again after a kernel change: the later run's rows replace the earlier ones
    (all of that shape's implementations), other shapes stay."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    old = [_row(8192, 2560, 9, 640), _row(8192, 2560, 9, 640, "fast-attnres"), _row(8192, 1536, 9, 384)]
    a.write_text(json.dumps(_run("d1", "abc", old)))
    new = _row(8192, 2560, 9, 640)
    new["fwd_graph_us"] = 0.5
    b.write_text(json.dumps(_run("d2", "def", [new])))
    doc = kb.merge([str(a), str(b)], str(tmp_path / "out"), "merged", "")
    rows = [(r["d"], r["impl"], r["fwd_graph_us"]) for r in doc["rows"]]
    assert rows == [(1536, "ours", 1.0), (2560, "ours", 0.5)] and doc["shapes_measured"] == 2


def test_merge_carries_reference_rows_a_later_run_did_not_time(tmp_path):
    """The eager and compiled references (timed at a few shapes only, independent of our kernels) stay
    from an earlier run where the shape's latest run did not time them: named by their run, their
    speedups taken against the latest row of ours; a reference the latest run timed is its own."""
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    shape = (8192, 1536, 9, 384)
    a.write_text(json.dumps(_run("d1", "abc", [_row(*shape), _row(*shape, "compiled", fwdbwd_graph_us=8.0,
                                                                      ours_speedup_fwdbwd_graph=4.0),
                                               _row(*shape, "eager", fwdbwd_graph_us=20.0)])))
    b.write_text(json.dumps(_run("d2", "def", [_row(*shape, fwdbwd_graph_us=1.0),
                                               _row(*shape, "eager", fwdbwd_graph_us=10.0)])))
    doc = kb.merge([str(a), str(b)], str(tmp_path / "out"), "merged", "")
    by = {r["impl"]: r for r in doc["rows"]}
    assert set(by) == {"ours", "eager", "compiled"} and doc["shapes_measured"] == 1
    assert by["compiled"]["from_run"] == "a.json" and by["compiled"]["ours_speedup_fwdbwd_graph"] == 8.0
    assert by["eager"]["fwdbwd_graph_us"] == 10.0 and "from_run" not in by["eager"]
    assert "compiled (from a.json)" in (tmp_path / "out" / "merged.md").read_text()
    c.write_text(json.dumps(_run("d3", "ghi", [_row(*shape, fwdbwd_graph_us=2.0)])))  # merged again: origin kept
    again = kb.merge([str(tmp_path / "out" / "merged.json"), str(c)], str(tmp_path / "out2"), "m2", "")
    by = {r["impl"]: r for r in again["rows"]}
    assert by["compiled"]["from_run"] == "a.json" and by["compiled"]["ours_speedup_fwdbwd_graph"] == 4.0
    assert by["eager"]["from_run"] == "merged.json"


def test_measured_shapes_reads_several_files_and_names_a_bad_one(tmp_path):
    a, b, bad = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "bad.json"
    a.write_text(json.dumps(_run("d1", "abc", [_row(4096, 1536, 9, 384), _row(4096, 1536, 9, 384, "fla")])))
    b.write_text(json.dumps(_run("d2", "def", [_row(8192, 1024, 2, 128)])))
    assert kb.measured_shapes(f"{a},{b}") == {(4096, 1536, 9, 384), (8192, 1024, 2, 128)}
    bad.write_text(json.dumps({"rows": [{"tokens": 1}]}))
    with pytest.raises(SystemExit, match="bad.json"):
        kb.measured_shapes(str(bad))


def test_sweep_compares_the_widths_layout_with_one_and_three_chunks():
    import kernel_sweep as ks

    assert ks._layouts(2560) == [(512, 5), (4096, 1), (1024, 3)]
    assert ks._layouts(1536) == [(512, 3), (2048, 1)]
    assert ks._layouts(1024) == [(512, 2), (1024, 1)] == ks._layouts(1024, 256)
    assert ks._layouts(1024, 1024) == [(1024, 1), (512, 2)]  # the key spans the row: one chunk is its own
    shipped = ks._quick("bwd", 512, 5, default=False)
    assert shipped and all(c["SPLIT"] == 5 for c in shipped)
    assert len(ks._quick("bwd", 512, 5)) > len(shipped)  # the width's own layout gets more candidates


def test_sweep_times_the_deferred_forms_that_serve_a_shape():
    """The sweep's deferred candidates: the resident pair at S <= 2 in every layout, the two passes in
    the layouts whose key starts past the first chunk; neither where they cannot run."""
    import kernel_sweep as ks
    from kernels import configs

    two = ks._deferred_candidates(2560, 640, 2, [(512, 5), (4096, 1)])
    pairs = [c for c in two if c.get("PAIR")]
    assert pairs and all(c["DEFER"] for c in two)
    assert {c["SPLIT"] for c in pairs} == {5, 1} and {c["SPLIT"] for c in two if not c.get("PAIR")} == {5}
    assert len(pairs) == len(configs.configs("BWD_RESIDENT_PAIR", 512)) + len(configs.configs("BWD_RESIDENT_PAIR", 4096))
    nine = ks._deferred_candidates(2560, 640, 9, [(512, 5), (4096, 1)])
    assert nine and not any(c.get("PAIR") for c in nine)
    assert ks._deferred_candidates(1536, 1536, 9, [(512, 3)]) == []  # the key in every chunk: no deferral


def test_sweep_times_the_pair_forward_at_two_sources(monkeypatch):
    """The sweep's pair-forward candidates: at S = 2 only, in every layout, the shipped ones first, each
    once, never a prefetch; none where the default settings leave the pair forward out."""
    import kernel_sweep as ks
    from kernels import configs

    pairs = {bd: configs.configs("FWD_PAIR", bd) for bd in (512, 4096)}
    two = ks._fwd_pair_candidates(2, [(512, 5), (4096, 1)])
    shipped = len(pairs[512]) + len(pairs[4096])
    assert two[:shipped] == [dict(c, SPLIT=5) for c in pairs[512]] + [dict(c, SPLIT=1) for c in pairs[4096]]
    assert len(two) > shipped and all(c["PAIR"] and not c["PREFETCH"] for c in two)
    assert {c["SPLIT"] for c in two} == {5, 1} and len({str(c) for c in two}) == len(two)
    assert {"BLOCK_T": 1, "num_warps": 16, "PREFETCH": 0, "KEYCH": True, "PAIR": True, "EVICT": True, "SPLIT": 1} in two
    assert ks._fwd_pair_candidates(3, [(512, 5)]) == [] == ks._fwd_pair_candidates(1, [(512, 5)])
    monkeypatch.setattr(ks, "DEFAULT", ks.DEFAULT.replace(pair_fwd=False))
    assert ks._fwd_pair_candidates(2, [(512, 5)]) == []


def test_sweep_extra_configurations_parse_and_name_a_bad_one():
    """--extra KIND=JSON: configurations the sweep times beside the candidates (PREFETCH 0 unless named);
    a bad kind, bad JSON or an object naming no grid is refused with the option's text."""
    import kernel_sweep as ks

    got = ks._parse_extra(['bwd={"BLOCK_T":1,"num_warps":4,"STAGES":2}', 'fwd={"BLOCK_T":2,"num_warps":1,"PREFETCH":1}'])
    assert got == {"bwd": [{"PREFETCH": 0, "BLOCK_T": 1, "num_warps": 4, "STAGES": 2}],
                   "fwd": [{"PREFETCH": 1, "BLOCK_T": 2, "num_warps": 1}]}
    for bad, why in (('mid={"SB":1,"num_warps":4}', "KIND"), ("bwd={SB:1}", "not JSON"), ('bwd={"num_warps":4}', "BLOCK_T or SB")):
        with pytest.raises(SystemExit, match=why):
            ks._parse_extra([bad])


def test_shapes_option_parses_and_names_a_bad_shape():
    assert kb._shape_list("8192x1536x9x384,4096x2560x2x640") == [(8192, 1536, 9, 384), (4096, 2560, 2, 640)]
    with pytest.raises(argparse.ArgumentTypeError, match="'8192x1536x9'"):
        kb._shape_list("8192x1536x9")
    with pytest.raises(argparse.ArgumentTypeError, match="r <= d"):
        kb._shape_list("8192x512x9x1024")


def test_variant_option_names_settings_fields():
    """--variant LABEL:FIELD=VALUE;...: JSON values on kernels.Settings fields, which the variant's row
    passes to kernels.attnres; a bad spec names what is wrong."""
    label, settings = kb._variant("defer9:defer_max_s=9;res_bits=false")
    assert label == "defer9" and settings == {"defer_max_s": 9, "res_bits": False}
    assert kb.DEFAULT.replace(**settings).defer_max_s == 9 and kb.DEFAULT.defer_max_s == 8
    for bad, named in (("nolabel", "LABEL:FIELD=VALUE"), ("x:not_a_setting=1", "not_a_setting"),
                       ("x:key=1", "'key'"), ("x:defer_max_s=nine", "nine"), ("x:dq_sum=\"atomic\"", "dq_sum")):
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            kb._variant(bad)


def test_markdown_lists_each_rows_kernel_times():
    """Rows that carry per-kernel GPU times (torch.profiler) get a table of their own, kernels as
    measured, with their sum; rows without them are left out of it."""
    rows = [_row(8192, 1536, 2, 384, "ours", kernels_fwdbwd_us={"_attnres_bwd_kernel": 40.0, "_sum_rows_kernel": 2.5}),
            _row(8192, 1536, 2, 384, "eager")]
    md = kb._md({"env": {"device": "GPU X", "torch": "t", "triton": "tr", "date": "now"}, "copy_bw_TBps": 4.2,
                 "rows": rows, "check": []})
    section = md.split("## GPU time per kernel")[1]
    assert "| 8192 | 1536 | 2 | 384 | ours | 42.5 | _attnres_bwd_kernel 40.0; _sum_rows_kernel 2.5 |" in section
    assert "| eager |" not in section


def test_a_shape_starts_only_if_the_longest_so_far_still_fits():
    assert kb.fits(0.0, 0.0, 10.0) and kb.fits(100.0, 60.0, 160.0)
    assert not kb.fits(100.0, 61.0, 160.0) and not kb.fits(11.0, 0.0, 10.0)
