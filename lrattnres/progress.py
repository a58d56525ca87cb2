"""Progress a person reads: a live tqdm bar on a terminal, plain lines everywhere else.

A log file under Snakemake or a batch system (Slurm's ``--output``) is not a terminal: tqdm's
carriage-return updates there pile up into one unreadable line.  ``bar`` gives the stages one
object with tqdm's small interface (``update``, ``set_postfix``, ``write``, ``close``, iteration):

* on a terminal, and where the caller wants a live bar: tqdm itself;
* otherwise: :class:`PlainProgress`, which prints one complete line (count, share of the total,
  rate, elapsed, ETA, and the postfix fields) at most every ``every_s`` seconds
  (:data:`EVERY_S`, one minute) and one when it closes.  ``every_s=0`` leaves out the periodic lines.

``quiet_library_bars`` does the same for the libraries the stages call (lm-eval, datasets, the HF
hub client): where stderr is not a terminal it turns their tqdm bars off through their environment
switches, before they are imported (``python -m lrattnres`` calls it first thing).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

EVERY_S = 60.0  # seconds between two plain progress lines

# Environment switches that turn off the tqdm bars of the libraries the stages use.  tqdm reads
# TQDM_* when it is imported (tqdm >= 4.66), so they must be set before anything imports it.
LIBRARY_BAR_SWITCHES = {
    "TQDM_DISABLE": "1",  # every tqdm bar created without an explicit disable= (lm-eval's)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub
}


def interactive(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal that a live bar can redraw."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def quiet_library_bars(stream: TextIO | None = None) -> bool:
    """Turn off the libraries' tqdm bars where ``stream`` (default: stderr) is not a terminal.

    Sets the switches of :data:`LIBRARY_BAR_SWITCHES` (a value already set is kept).  Returns whether it
    did.  Call it before tqdm, datasets or lm-eval is imported: tqdm reads its switch on import."""
    if interactive(stream):
        return False
    for key, value in LIBRARY_BAR_SWITCHES.items():
        os.environ.setdefault(key, value)
    return True


def duration(seconds: float | None) -> str:
    """``H:MM:SS`` (or ``M:SS`` under an hour); ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


class PlainProgress:
    """A progress report in whole lines: at most one every ``every_s`` seconds, and one at the end.

    ``line`` is ``"<desc>: <n>/<total> <unit> (<pct>%), <rate> <unit>/s, elapsed <t>, eta <t>"``
    followed by the ``set_postfix`` fields; without a total, count, rate and elapsed only.  Rates,
    elapsed time and ETA count from the start of this object (a resumed loop's earlier part is not
    in them).  ``clock`` is injectable for tests.
    """

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
                 unit: str = "it", stream: TextIO | None = None, every_s: float = EVERY_S, initial: float = 0,
                 clock: Callable[[], float] = time.monotonic):
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable = iterable
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream
        self.every_s = every_s
        self.n = self.initial = initial
        self.clock = clock
        self.start = self.last = clock()
        self.postfix: dict[str, Any] = {}
        self.closed = False

    @property
    def _out(self) -> TextIO:
        return sys.stderr if self.stream is None else self.stream

    def line(self) -> str:
        now = self.clock()
        elapsed = now - self.start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else None
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            parts = [f"{head}{_number(self.n)}/{_number(self.total)} {self.unit} ({100.0 * self.n / self.total:.0f}%)"]
        else:
            parts = [f"{head}{_number(self.n)} {self.unit}"]
        parts.append(f"{_number(rate)} {self.unit}/s" if rate is not None else f"? {self.unit}/s")
        parts.append(f"elapsed {duration(elapsed)}")
        if self.total:
            left = max(self.total - self.n, 0)
            parts.append(f"eta {duration(left / rate) if rate else '?'}")
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def _emit(self) -> None:
        print(self.line(), file=self._out, flush=True)
        self.last = self.clock()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self.every_s and self.clock() - self.last >= self.every_s:
            self._emit()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs) -> None:
        self.postfix.update(ordered_dict or {}, **kwargs)

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def write(self, s: str) -> None:
        print(s, file=self._out, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._emit()

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable or ():
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
        live: bool = True, stream: TextIO | None = None, every_s: float = EVERY_S, initial: float = 0,
        **tqdm_kwargs):
    """A tqdm bar where ``live`` and ``stream`` (default stderr) is a terminal; else :class:`PlainProgress`.

    ``tqdm_kwargs`` (``mininterval``, ``unit_scale``, ``leave`` ...) go to tqdm only."""
    if live and interactive(stream):
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a pipeline dependency
            pass
        else:
            return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr if stream is None else stream,
                        initial=initial, **tqdm_kwargs)
    return PlainProgress(iterable, total=total, desc=desc, unit=unit, stream=stream, every_s=every_s, initial=initial)
