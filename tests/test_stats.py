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


def test_sd_interval_is_the_chi_square_interval():
    # textbook factors for n = 3 (2 degrees of freedom): chi2_{0.025} = 0.05064, chi2_{0.975} = 7.3778,
    # so the 95% interval of sigma is [0.5206 s, 6.2847 s]
    lo, hi = stats.sd_interval(1.0, 3)
    assert lo == pytest.approx(0.52060, abs=1e-4) and hi == pytest.approx(6.2847, abs=1e-3)
    # n = 10: chi2_{0.025, 9} = 2.7004, chi2_{0.975, 9} = 19.023 -> [0.6878 s, 1.8256 s]
    lo, hi = stats.sd_interval(0.02, 10)
    assert lo == pytest.approx(0.02 * 0.68783, rel=1e-4) and hi == pytest.approx(0.02 * 1.82562, rel=1e-4)
    assert stats.sd_interval(0.0, 5) == [0.0, 0.0] and stats.sd_interval(1.0, 1) is None
    with pytest.raises(ValueError, match="sd"):
        stats.sd_interval(-1.0, 3)


def test_min_detectable_difference():
    # normal: (1.959964 + 0.841621) se = 2.801585 se, the textbook "2.8 standard errors"
    assert stats.min_detectable(1.0) == pytest.approx(2.801585, abs=1e-6)
    # Student t, 2 degrees of freedom: t_{0.975} = 4.302653, t_{0.80} = 1.060660
    assert stats.min_detectable(0.01, 2) == pytest.approx(0.01 * (4.302653 + 1.060660), rel=1e-6)
    assert stats.min_detectable(1.0, power=0.5) == pytest.approx(1.959964, abs=1e-6)  # power 50%: the half-width
    for bad in ({"se": -1.0}, {"se": 1.0, "power": 1.0}, {"se": 1.0, "df": 0}):
        with pytest.raises(ValueError):
            stats.min_detectable(**bad)
