"""A stage's deadline: ``LRATTNRES_DEADLINE``, epoch seconds, set by whoever runs the job.

A stage that works in resumable steps (the throughput stage's timed runs, the trainer's updates)
checks it before each step: when the step would not end before the deadline, it keeps its partial
state and stops with exit code 75 (EX_TEMPFAIL), which a retry or the next machine continues
(lrattnres/attempts.py retries it). lrattnres/pieces.py sets the variable a margin before a piece's
own deadline, so that such a stage stops by itself; what still runs at the piece's deadline is
stopped with its whole process group, and the piece, too, exits 75. Unset, nothing stops early.
"""

from __future__ import annotations

import os
import time

from lrattnres.errors import UserError

ENV = "LRATTNRES_DEADLINE"
EXIT_DEADLINE = 75


class DeadlineError(UserError, ValueError):
    pass


class DeadlineReached(Exception):
    """The next step would not end before the deadline; the partial state is kept."""


def deadline() -> float | None:
    """The deadline in epoch seconds, or None when ``LRATTNRES_DEADLINE`` is unset or empty."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise DeadlineError(f"environment variable {ENV}: {raw!r} is not a time; expected epoch seconds "
                            "(e.g. $(( $(date +%s) + 600 )))") from None


def left(now: float | None = None) -> float | None:
    """Seconds until the deadline (negative once past), or None without one."""
    d = deadline()
    return None if d is None else d - (time.time() if now is None else now)


def check(step_s: float, what: str) -> None:
    """Raise :class:`DeadlineReached` when a step of ``step_s`` seconds started now would end after it."""
    rest = left()
    if rest is not None and step_s >= rest:
        raise DeadlineReached(f"{what} (about {step_s:.0f} s) would end after the deadline ({ENV}, {max(rest, 0):.0f} s "
                              "left); the finished work is kept, rerun to continue")
