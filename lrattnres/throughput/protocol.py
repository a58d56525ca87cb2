"""Appendix I's rules as pure functions: when to stop timing a run (two quiet windows), the 95%
interval of a mean and of paired gains over repeats, and when a gain is resolved (its interval narrow
enough) or the measuring has to end without it."""

from __future__ import annotations

import math
import statistics
from typing import Any


def window_stats(times: list[float]) -> tuple[float, float]:
    """(coefficient of variation, drift) of one window of update times, as fractions.

    CV = sample SD / mean; drift = |mean(second half) - mean(first half)| / mean (for an odd window
    the middle update belongs to neither half)."""
    n = len(times)
    if n < 2:
        raise ValueError("a window needs at least 2 updates")
    mean = sum(times) / n
    cv = statistics.stdev(times) / mean
    h = n // 2
    first, second = times[:h], times[n - h:]
    drift = abs(sum(second) / h - sum(first) / h) / mean
    return cv, drift


def window_ok(times: list[float], cv: float, drift: float) -> bool:
    c, d = window_stats(times)
    return c <= cv and d <= drift


def should_stop(times: list[float], *, min_updates: int = 8, max_updates: int = 30, window: int = 6,
                stride: int = 2, cv: float = 0.01, drift: float = 0.005) -> tuple[bool, str]:
    """Whether to stop after the measured update times ``times`` (seconds), and why.

    Appendix I: 8 to 30 measured updates; stop when two consecutive six-update windows each have a
    coefficient of variation of at most 1% and a drift between their halves of at most 0.5%.  The
    two windows are the last ``window`` updates and the ``window`` updates ending ``stride`` updates
    earlier.  With the paper's numbers (window 6, stride 2) they span the last 8 updates, so the
    rule can first fire at the paper's minimum of eight; ``stride = window`` gives disjoint windows.
    Returns ``(True, "converged")``, ``(True, "max_updates")`` or ``(False, "")``.
    """
    n = len(times)
    if n >= max_updates:
        return True, "max_updates"
    if n < max(min_updates, window + stride):
        return False, ""
    late = times[n - window:]
    early = times[n - window - stride:n - stride]
    if window_ok(early, cv, drift) and window_ok(late, cv, drift):
        return True, "converged"
    return False, ""


# two-sided 95% Student t quantiles t_{0.975, df}, df = 1..30 (scipy.stats.t.ppf(0.975, df), 3 decimals)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}


def t975(df: int, use_scipy: bool = True) -> float:
    """t_{0.975, df}: from scipy where installed, else the table (df <= 30) or a Cornish-Fisher expansion."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if use_scipy:
        try:
            from scipy.stats import t as student_t

            return float(student_t.ppf(0.975, df))
        except ImportError:
            pass
    if df in T975:
        return T975[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(values: list[float], use_scipy: bool = True) -> dict[str, Any]:
    """Mean, sample SD and the 95% interval mean +- t_{0.975, n-1} s / sqrt(n).

    (The paper's formula prints s_g / 5 for n = 5; the standard error of a mean is s / sqrt(n).)"""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "t": None, "half_width": None, "ci95": [None, None]}
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "t": None, "half_width": None, "ci95": [None, None]}
    sd = statistics.stdev(values)
    t = t975(n - 1, use_scipy)
    hw = t * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "t": t, "half_width": hw, "ci95": [mean - hw, mean + hw]}


def paired_gains(numerator: list[float], denominator: list[float]) -> list[float]:
    """g_j = 100 (v_j^num / v_j^den - 1) for paired repeats j."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired gains need equal repeat counts, got {len(numerator)} and {len(denominator)}")
    return [100.0 * (a / b - 1.0) for a, b in zip(numerator, denominator)]


def paired_gain(numerator: list[float], denominator: list[float], use_scipy: bool = True) -> dict[str, Any]:
    g = paired_gains(numerator, denominator)
    out = mean_ci95(g, use_scipy)
    out["per_repeat"] = g
    return out


def more_repeats(gain: dict | None, *, done: int, base: int, target: float | None, max_repeats: int,
                 spent_s: float = 0.0, next_s: float | None = None, budget_s: float | None = None) -> tuple[bool, str]:
    """Whether to time another repeat, after ``done`` repeats, and why not.

    The protocol's ``base`` repeats always run. After them, with a ``target`` half-width (percentage
    points) of the 95% interval of ``gain`` (a :func:`paired_gain`), another repeat runs until the
    half-width is at most the target (``"resolved"``), ``max_repeats`` repeats are done
    (``"max_repeats"``), or the next repeat (``next_s`` seconds) would take the time spent (``spent_s``)
    past ``budget_s`` (``"budget"``). Without a target: ``"not asked"``. Returns ``(True, "")`` to go on.
    """
    if done < base:
        return True, ""
    if target is None:
        return False, "not asked"
    hw = (gain or {}).get("half_width")
    if hw is not None and hw <= target:
        return False, "resolved"
    if done >= max(max_repeats, base):
        return False, "max_repeats"
    if budget_s is not None and spent_s + (next_s or 0.0) > budget_s:
        return False, "budget"
    return True, ""
