"""Gradient-norm outliers of runs for the report (lrattnres/run_health.py)."""

from __future__ import annotations

from lrattnres import run_health


def test_runs_of_reads_every_way_a_stage_names_its_runs():
    assert run_health.runs_of({"run_id": "a"}) == {"a"}  # one run's result (evaluate, convert, diagnose)
    assert run_health.runs_of({"runs": {"a": {}, "b": {}}}) == {"a", "b"}  # diagnostics
    assert run_health.runs_of({"runs": [{"run_id": "a"}, "b", 3]}) == {"a", "b"}  # kernel_reads, evaluate_pairs
    assert run_health.runs_of({"conversions": [{"run_id": "c"}, {}]}) == {"c"}  # convert_all
    assert run_health.runs_of({"stage": "throughput"}) == set()


def test_outliers_come_from_the_result_or_a_replay_of_the_norms():
    ev = {"update": 3, "norm": 9.0e9, "median": 1.0}
    assert run_health.run_outliers({"grad_norm": {"outliers": [ev]}}, [1.0] * 20) == ([ev], run_health.FROM_RESULT)
    assert run_health.run_outliers({"grad_norm": {"outliers": []}}, [1.0] * 12 + [1e6]) == ([], run_health.FROM_RESULT)
    out, src = run_health.run_outliers({"grad_norm": {"mean": 1.0}}, [1.0] * 12 + ["inf", 1e6])
    assert src == run_health.FROM_REPLAY and [e["update"] for e in out] == [12, 13]
    assert run_health.run_outliers(None, []) == ([], None)


def test_the_worst_outlier_is_a_non_finite_one_else_the_largest():
    out = [{"update": 1, "norm": 5e3, "median": 1.0}, {"update": 2, "norm": 7e9, "median": 1.0},
           {"update": 9, "norm": "inf", "median": 2.0}]
    assert run_health.worst(out)["update"] == 9
    assert run_health.describe(out[:2]) == "2 gradient-norm outliers, the largest 7e+09 at update 2 (running median 1)"
    assert run_health.note("r", out[:1]).startswith("rests on r, whose training had 1 gradient-norm outlier, the largest")


def test_annotate_names_flagged_runs_in_other_stages_claims_only():
    flagged = {"a": [{"update": 1, "norm": 1e9, "median": 1.0}]}
    produced = {"x": {"reproduced": 1, "note": "n"}, "y": {"reproduced": 2}, "g": {"reproduced": 3}}
    results = [{"stage": "diagnostics", "runs": {"a": {}, "b": {}}, "claims": {"x": {}, "y": {}}},
               {"stage": "grid", "runs": [{"run_id": "a"}], "claims": {"g": {}}},  # names its own
               {"stage": "convert", "conversions": [{"run_id": "b"}], "claims": {"y": {}}}]
    assert run_health.annotate_claims(produced, results, flagged) == ["x", "y"]
    assert produced["x"]["note"].startswith("n; computed from runs that include a (1 gradient-norm outlier")
    assert produced["y"]["note"].startswith("computed from runs that include a")
    assert "note" not in produced["g"]
    assert run_health.flagged_runs([{"runs": [{"run_id": "a", "grad_outliers": flagged["a"]},
                                              {"run_id": "b", "grad_outliers": []}]}]) == flagged
