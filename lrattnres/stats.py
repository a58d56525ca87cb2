"""Intervals behind the statistical verdicts (docs/report.md, "Verdicts"), from scipy.stats.

Every function is pure and returns plain floats, so a claim can carry its interval into paper.json.

- :func:`mean_interval`: the Student t interval of the mean of paired differences (seeds, repeats,
  configurations, segments of a run pair): ``mean +- t_{(1+level)/2, n-1} s / sqrt(n)``.
- :func:`effect_interval`: an effect with its standard error: ``effect +- q se`` with q the Student t
  quantile for ``df`` degrees of freedom, or the normal quantile when ``df`` is None.
- :func:`pooled_sd`: the pooled sample SD of replicate groups (seed replicates of one configuration
  each) and its degrees of freedom; the run-to-run noise of a single training run at a scale.
- :func:`spearman_interval`: Spearman's rank correlation with the Fisher-z interval of Fieller,
  Hartley and Pearson (1957): ``tanh(atanh(rho) +- z sqrt(1.06 / (n - 3)))``; a perfect ordering is
  taken as the nearest imperfect one, where the transform is finite.
- :func:`sd_interval`: the chi-square interval of a normal sample's SD,
  ``[s sqrt((n-1) / chi2_{(1+level)/2, n-1}), s sqrt((n-1) / chi2_{(1-level)/2, n-1})]``.
- :func:`min_detectable`: the minimum detectable difference of a two-sided test whose effect has
  standard error ``se``: ``(q_{(1+level)/2} + q_{power}) se`` (Student t with ``df``, normal without):
  the true effect that the test resolves with probability ``power``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

LEVEL = 0.95
# The power at which a claim's minimum detectable difference is stated (the usual 80%).
POWER = 0.80


def _finite(values: Iterable[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: expected finite numbers, got {bad[0]!r}")
    return out


def mean_interval(samples: Sequence[float], level: float = LEVEL) -> dict:
    """``{"mean", "sd", "n", "interval": [lo, hi] | None}``; the interval needs n >= 2 (an SD)."""
    from scipy import stats

    xs = _finite(samples, "samples")
    n = len(xs)
    if n == 0:
        raise ValueError("samples: expected at least one value")
    mean = math.fsum(xs) / n
    if n < 2:
        return {"mean": mean, "sd": None, "n": n, "interval": None}
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    if sd == 0.0:
        return {"mean": mean, "sd": 0.0, "n": n, "interval": [mean, mean]}
    lo, hi = stats.t.interval(level, n - 1, loc=mean, scale=sd / math.sqrt(n))
    return {"mean": mean, "sd": sd, "n": n, "interval": [float(lo), float(hi)]}


def quantile(level: float = LEVEL, df: float | None = None) -> float:
    """The two-sided quantile: Student t with ``df`` degrees of freedom, normal when df is None."""
    from scipy import stats

    p = 0.5 + level / 2
    return float(stats.norm.ppf(p) if df is None else stats.t.ppf(p, df))


def effect_interval(effect: float, se: float, df: float | None = None, level: float = LEVEL) -> list[float]:
    """``[effect - q se, effect + q se]`` (see :func:`quantile`)."""
    effect, se = _finite([effect, se], "effect and standard error")
    if se < 0:
        raise ValueError(f"standard error: expected >= 0, got {se!r}")
    if df is not None and df < 1:
        raise ValueError(f"degrees of freedom: expected >= 1, got {df!r}")
    q = quantile(level, df)
    return [effect - q * se, effect + q * se]


def pooled_sd(groups: Iterable[Sequence[float]]) -> tuple[float, int] | None:
    """(pooled sample SD, degrees of freedom) over groups of replicates; None without any
    group of two or more.  Groups of one contribute nothing."""
    ss, df = 0.0, 0
    for g in groups:
        xs = _finite(g, "replicates")
        if len(xs) < 2:
            continue
        m = math.fsum(xs) / len(xs)
        ss += math.fsum((x - m) ** 2 for x in xs)
        df += len(xs) - 1
    if df == 0:
        return None
    return math.sqrt(ss / df), df


def spearman_interval(x: Sequence[float], y: Sequence[float], level: float = LEVEL) -> dict:
    """``{"rho", "n", "interval": [lo, hi] | None}``: Spearman's rho of paired values and its
    Fisher-z interval (None for n < 4, where the standard error 1.06 / (n - 3) is undefined)."""
    from scipy import stats

    xs, ys = _finite(x, "x"), _finite(y, "y")
    if len(xs) != len(ys):
        raise ValueError(f"spearman: x and y differ in length ({len(xs)} and {len(ys)})")
    n = len(xs)
    if n < 3:
        raise ValueError(f"spearman: expected at least 3 pairs, got {n}")
    if len(set(xs)) == 1 or len(set(ys)) == 1:  # a constant ordering has no rank correlation
        return {"rho": None, "n": n, "interval": None}
    rho = float(stats.spearmanr(xs, ys).statistic)
    if n < 4:
        return {"rho": rho, "n": n, "interval": None}
    # atanh(+-1) is infinite: a perfect ordering is judged as the nearest imperfect one (one adjacent
    # swap, rho = 1 - 12 / (n (n^2 - 1))); this keeps a perfect ordering of four unresolved, as is its
    # two-sided permutation p-value 2/4! = 0.083
    z = math.atanh(max(min(rho, _one_swap(n)), -_one_swap(n)))
    hw = quantile(level) * math.sqrt(1.06 / (n - 3))
    return {"rho": rho, "n": n, "interval": [math.tanh(z - hw), math.tanh(z + hw)]}


def _one_swap(n: int) -> float:
    """Spearman's rho of n ranks with one adjacent pair swapped."""
    return 1.0 - 12.0 / (n * (n * n - 1))


def segments(values: Sequence[float], k: int) -> list[list[float]]:
    """``values`` cut into ``k`` contiguous segments of near-equal length (batch means of a run's
    per-step series); fewer when there are fewer than ``k`` values."""
    n = len(values)
    k = max(1, min(k, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [list(values[bounds[i]:bounds[i + 1]]) for i in range(k)]


def sd_interval(sd: float, n: int, level: float = LEVEL) -> list[float] | None:
    """The ``level`` chi-square interval of the SD of a normal sample of ``n`` whose sample SD is
    ``sd``; None for n < 2 (no SD)."""
    from scipy import stats

    (sd,) = _finite([sd], "sd")
    if sd < 0:
        raise ValueError(f"sd: expected >= 0, got {sd!r}")
    if n < 2:
        return None
    df = n - 1
    hi_q, lo_q = stats.chi2.ppf(0.5 + level / 2, df), stats.chi2.ppf(0.5 - level / 2, df)
    return [sd * math.sqrt(df / hi_q), sd * math.sqrt(df / lo_q)]


def min_detectable(se: float, df: float | None = None, level: float = LEVEL, power: float = POWER) -> float:
    """The smallest true effect that a two-sided test at ``level`` resolves with probability ``power``
    when the effect's standard error is ``se`` (``df`` degrees of freedom; normal when None)."""
    from scipy import stats

    (se,) = _finite([se], "standard error")
    if se < 0:
        raise ValueError(f"standard error: expected >= 0, got {se!r}")
    if not 0 < power < 1:
        raise ValueError(f"power: expected between 0 and 1, got {power!r}")
    if df is not None and df < 1:
        raise ValueError(f"degrees of freedom: expected >= 1, got {df!r}")
    q_power = float(stats.norm.ppf(power) if df is None else stats.t.ppf(power, df))
    return (quantile(level, df) + q_power) * se
