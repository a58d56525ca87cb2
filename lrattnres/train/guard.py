"""The gradient-norm guard: a pre-clip norm far above its running median, or not finite, is an event.

A path that computes wrong gradients (a compiled kernel, a miscompiled graph) shows in the gradient
norm before it shows in the loss: clipping rescales a gradient whose direction is still mostly
right, and the loss keeps falling.  The guard watches the pre-clip norm of every update: it keeps
the last ``window`` norms that were not events, and once ``min_history`` of them are known, a norm
above ``factor`` times their median is an *outlier*; a non-finite norm always is.  An outlier stays
out of the history, so a path that goes wrong for good keeps being flagged instead of raising the
median it is measured against.

The guard only observes: it changes no update, and its settings (``grad_guard`` of the training
spec) are execution settings.  It is a function of the sequence of norms, so replaying a resumed
run's recorded norms (:meth:`GradGuard.replay`) rebuilds exactly the events of an uninterrupted run.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# factor: how far above the running median a norm is an outlier; window: how many earlier norms the
# median is over; min_history: how many it needs before any finite norm is judged.
DEFAULTS = {"factor": 100.0, "window": 100, "min_history": 10}


class GradGuard:
    """Running median of the pre-clip gradient norms, and the outliers found so far.

    ``outliers``: one ``{"update", "norm", "median"}`` per event, in order; ``update`` is the 0-based
    update index (the run's metrics.jsonl records that update as ``step`` = update + 1), ``median``
    the running median it was judged against (None for a non-finite norm before any history)."""

    def __init__(self, factor: float = DEFAULTS["factor"], window: int = DEFAULTS["window"],
                 min_history: int = DEFAULTS["min_history"]):
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1):
            raise ValueError(f"grad_guard.factor: expected a number > 1, got {factor!r}")
        for name, v in (("window", window), ("min_history", min_history)):
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"grad_guard.{name}: expected a positive int, got {v!r}")
        if min_history > window:
            raise ValueError(f"grad_guard.min_history: expected at most window = {window}, got {min_history}")
        self.factor, self.window, self.min_history = float(factor), window, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.outliers: list[dict] = []
        self.seen = 0

    def settings(self) -> dict:
        return {"factor": self.factor, "window": self.window, "min_history": self.min_history}

    def median(self) -> float | None:
        return statistics.median(self.history) if self.history else None

    def observe(self, update: int, norm: float) -> dict | None:
        """Judge the norm of update ``update`` (0-based); returns the event, or None."""
        self.seen += 1
        med = self.median()
        if math.isfinite(norm) and not (len(self.history) >= self.min_history and norm > self.factor * med):
            self.history.append(float(norm))
            return None
        event = {"update": int(update), "norm": float(norm), "median": med}
        self.outliers.append(event)
        return event

    def replay(self, norms) -> None:
        """Rebuild the history and the outliers from a run's norms so far (update 0 first), silently."""
        for i, norm in enumerate(norms):
            self.observe(i, norm)

    def line(self, run: str, event: dict) -> str:
        """The one plain line that reports an event."""
        med = event["median"]
        where = f"update index {event['update']} (step {event['update'] + 1})"
        if not math.isfinite(event["norm"]):
            base = "no running median yet" if med is None else f"running median {med:.4g}"
            return f"[train] {run}: gradient-norm outlier at {where}: norm {event['norm']} is not finite ({base})"
        return (f"[train] {run}: gradient-norm outlier at {where}: norm {event['norm']:.4g} is {event['norm'] / med:.3g}x "
                f"the running median {med:.4g} (bound {self.factor:g}x)")


def check_settings(value, key: str = "grad_guard") -> dict:
    """The guard settings of a spec with the defaults filled in; a bad value raises ValueError naming
    ``key`` and the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected an object with keys {sorted(DEFAULTS)}, got {value!r}")
    unknown = sorted(set(value) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: not a known key; expected one of {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **value}
    try:
        GradGuard(**out)
    except ValueError as e:
        raise ValueError(str(e).replace("grad_guard.", f"{key}.", 1)) from None
    return out
