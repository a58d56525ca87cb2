"""The intervals behind the statistical verdicts (lrattnres/stats.py), against values worked by hand."""

from __future__ import annotations

import math

import pytest

from lrattnres import stats


def test_mean_interval_is_the_student_t_interval():
    out = stats.mean_interval([0.030, 0.026, 0.030])  # the paper's three seed pairs (Appendix A)
    assert out["n"] == 3 and out["mean"] == pytest.approx(0.028667, abs=1e-6)
    hw = 4.302653 * out["sd"] / math.sqrt(3)  # t_{0.975, 2}
    assert out["interval"] == pytest.approx([out["mean"] - hw, out["mean"] + hw], rel=1e-6)
    assert stats.mean_interval([1.0])["interval"] is None
    assert stats.mean_interval([2.0, 2.0, 2.0])["interval"] == [2.0, 2.0]
    with pytest.raises(ValueError, match="finite"):
        stats.mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="at least one"):
        stats.mean_interval([])


def test_effect_interval_and_quantiles():
    assert stats.quantile() == pytest.approx(1.959964, abs=1e-6)
    assert stats.quantile(df=4) == pytest.approx(2.776445, abs=1e-6)
    assert stats.effect_interval(0.03, 0.01, 4) == pytest.approx([0.03 - 0.02776445, 0.03 + 0.02776445], rel=1e-6)
    with pytest.raises(ValueError, match="standard error"):
        stats.effect_interval(0.0, -1.0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        stats.effect_interval(0.0, 1.0, 0)


def test_pooled_sd_of_seed_replicates():
    # Section 4.4's SDs 0.0009852 and 0.001777 over three seeds each: pooled over 4 degrees of freedom
    sd, df = stats.pooled_sd([[2.974, 2.972, 2.973], [2.944, 2.946, 2.943]])
    assert df == 4 and sd == pytest.approx(math.sqrt((0.001**2 * 2 + 0.0015275**2 * 2) / 4), rel=1e-3)
    assert stats.pooled_sd([[1.0], [2.0]]) is None  # single runs carry no noise estimate
    assert stats.pooled_sd([[1.0, 3.0], [5.0]]) == (pytest.approx(math.sqrt(2)), 1)


def test_spearman_interval():
    out = stats.spearman_interval([1, 2, 3, 4, 5, 6], [3, 1, 2, 6, 4, 5])
    assert out["rho"] == pytest.approx(23 / 35) and out["n"] == 6
    z, hw = math.atanh(23 / 35), 1.959964 * math.sqrt(1.06 / 3)
    assert out["interval"] == pytest.approx([math.tanh(z - hw), math.tanh(z + hw)], rel=1e-5)
    assert stats.spearman_interval([1, 2, 3], [1, 2, 3])["interval"] is None  # n < 4
    assert stats.spearman_interval([1, 2, 3, 4], [5, 5, 5, 5])["rho"] is None  # a constant ordering
    perfect = stats.spearman_interval(range(4), range(4))
    assert perfect["rho"] == pytest.approx(1.0) and perfect["interval"][0] < 0 < perfect["interval"][1]
    with pytest.raises(ValueError, match="length"):
        stats.spearman_interval([1, 2, 3], [1, 2])


def test_segments_are_contiguous_and_cover_everything():
    segs = stats.segments(list(range(6)), 5)
    assert segs == [[0], [1], [2, 3], [4], [5]]
    assert stats.segments([1, 2], 5) == [[1], [2]]
    assert sum(stats.segments(list(range(103)), 5), []) == list(range(103))
