"""The gradient-norm guard (lrattnres/train/guard.py): what it flags, what it leaves, its replay."""

from __future__ import annotations

import math

import pytest

from lrattnres.train.guard import DEFAULTS, GradGuard, check_settings
from lrattnres.train.spec import RESUMABLE_CHANGES, SpecError, resolve


def _events(norms, **settings):
    g = GradGuard(**settings)
    return [g.observe(i, x) for i, x in enumerate(norms)], g


def test_a_norm_far_above_the_running_median_is_an_outlier():
    norms = [2.0, 1.0, 1.5, 1.2, 151.0, 1.1, 149.0]
    events, g = _events(norms, factor=100, window=4, min_history=3)
    # update 4: 151 > 100 x median(2, 1, 1.5, 1.2) = 135; update 6: 149 > 100 x median(1, 1.5, 1.2, 1.1) = 115
    # (the outlier at 4 stays out of the history, so the median it is judged against stays sane)
    assert [e is not None for e in events] == [False, False, False, False, True, False, True]
    assert g.outliers == [{"update": 4, "norm": 151.0, "median": pytest.approx(1.35)},
                          {"update": 6, "norm": 149.0, "median": pytest.approx(1.15)}]
    # at the bound itself, and below it: no event
    events, _ = _events([1.0, 1.0, 1.0, 100.0, 99.0], factor=100, window=10, min_history=3)
    assert events == [None] * 5


def test_no_finite_norm_is_judged_before_min_history_but_a_non_finite_one_always_is():
    events, g = _events([1e9, float("inf"), 1.0, 1.0, 1e9], factor=100, window=10, min_history=3)
    # update 0 has no history; update 1 (inf) is flagged without one; update 4 is judged against
    # median(1e9, 1, 1) = 1
    assert [e is not None for e in events] == [False, True, False, False, True]
    assert g.outliers[0]["update"] == 1 and math.isinf(g.outliers[0]["norm"]) and g.outliers[0]["median"] == 1e9
    first = GradGuard().observe(0, float("nan"))
    assert first["median"] is None and math.isnan(first["norm"])
    assert "not finite" in GradGuard().line("run", first) and "no running median yet" in GradGuard().line("run", first)


def test_the_median_is_over_the_last_window_norms():
    # the norms rise slowly; the median of the last three follows them: 5000 is under 100 x median(50,
    # 90, 120) = 9000 (the median of every norm so far, 25.5, would flag it), 12001 is over 100 x 120
    events, g = _events([1.0, 1.0, 1.0, 50.0, 90.0, 120.0, 5000.0, 12001.0], factor=100, window=3, min_history=3)
    assert events[:7] == [None] * 7
    assert events[7] == {"update": 7, "norm": 12001.0, "median": 120.0} and g.outliers == [events[7]]


def test_replay_rebuilds_what_a_live_guard_saw():
    norms = [3.0, 1.0, 1.0, 500.0, 1.0, 1.2, float("nan"), 0.9, 300.0]
    _, live = _events(norms, factor=100, window=5, min_history=2)
    again = GradGuard(factor=100, window=5, min_history=2)
    again.replay(norms[:4])
    for i, x in enumerate(norms[4:], start=4):  # a run resumed after update 3
        again.observe(i, x)
    assert [e["update"] for e in live.outliers] == [3, 6, 8]
    assert again.outliers[:2] == live.outliers[:2] and list(again.history) == list(live.history)
    assert again.outliers[2]["update"] == 8


def test_the_line_says_update_norm_and_median():
    g = GradGuard(factor=100, window=4, min_history=1)
    g.observe(0, 2.0)
    e = g.observe(1, 5000.0)
    line = g.line("gpu-small-baseline-s0", e)
    assert line == ("[train] gpu-small-baseline-s0: gradient-norm outlier at update index 1 (step 2): norm 5000 is "
                    "2.5e+03x the running median 2 (bound 100x)")


@pytest.mark.parametrize("bad,match", [({"factor": 1.0}, "factor"), ({"factor": True}, "factor"),
                                       ({"window": 0}, "window"), ({"min_history": 2.5}, "min_history"),
                                       ({"window": 3, "min_history": 4}, "min_history"), ({"limit": 3}, "limit")])
def test_bad_settings_are_refused_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        check_settings(bad)
    spec = {"model": "smoke", "steps": 1, "micro_batch": 1, "seq_len": 8, "grad_guard": bad}
    with pytest.raises(SpecError, match=rf"'grad_guard\.{match}'"):
        resolve(spec)


def test_the_spec_default_is_the_guards_and_a_change_resumes():
    spec = {"model": "smoke", "steps": 1, "micro_batch": 1, "seq_len": 8}
    assert resolve(spec)["grad_guard"] == DEFAULTS
    assert resolve({**spec, "grad_guard": {"factor": 20}})["grad_guard"] == {**DEFAULTS, "factor": 20}
    assert "grad_guard" in RESUMABLE_CHANGES  # an execution setting: changing it never blocks a resume
