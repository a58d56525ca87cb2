"""Metrics: one JSON line per optimiser step and per validation; progress for a person.

``metrics.jsonl`` is appended to as the run goes (flushed every ``flush_every`` records and at
every checkpoint).  On resume the file is cut back to the records of steps the checkpoint covers,
so a resumed run's file equals an uninterrupted run's (apart from timings).

Progress: a live tqdm bar on a terminal (``progress_bar``); where none is drawn (a log file under
Snakemake or Slurm, or ``--no-progress``), :class:`StatusLines` prints a plain line after the first
update and then every ``log_every_s`` seconds: step, mean loss since the last line, tokens/s since
the last line, elapsed time and ETA.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lrattnres.progress import duration, interactive


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN/inf; keep the fact visible
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class MetricsWriter:
    def __init__(self, path: str | os.PathLike, enabled: bool = True, flush_every: int = 20):
        self.path = Path(path)
        self.enabled = enabled
        self.flush_every = flush_every
        self._pending = 0
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")

    def truncate_after(self, step: int) -> None:
        """Keep only the records with ``step <= step`` (used on resume)."""
        if not self.enabled:
            return
        self._f.close()
        kept = []
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if rec.get("step", 0) <= step:
                    kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        if not self.enabled:
            return
        self._f.write(json.dumps(_clean(rec), separators=(",", ":")) + "\n")
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.enabled and self._f is not None:
            self._f.flush()
            self._pending = 0

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            self._f.close()
            self._f = None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in MiB: CUDA allocator peak on a GPU, process max RSS on the CPU."""
    if device.type == "cuda":
        return {
            "cuda_max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "cuda_max_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"max_rss_mib": rss_kib / 1024}


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "train"):
    """A live tqdm bar on stderr where ``enabled`` and stderr is a terminal; else a silent object."""
    if enabled and interactive(sys.stderr):
        try:
            from tqdm import tqdm

            return tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr,
                        dynamic_ncols=True, mininterval=1.0, smoothing=0.1)
        except ImportError:  # pragma: no cover
            pass
    return _NoBar()


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def write(self, s):
        print(s, file=sys.stderr, flush=True)

    def close(self):
        pass


class StatusLines:
    """Plain training status lines: after the first update of this process, then every ``every_s``
    seconds, and at the end (if an update came after the last line).

    ``[train] <run>: step 120/1500 (8.0%), loss 4.1234, 38,211 tokens/s, elapsed 0:05:12, eta 0:59:40``

    The loss is the mean training loss (CE + z-loss) of the updates since the last line; tokens/s
    their tokens over the wall time since the last line (validation and checkpoints included); the
    ETA the remaining updates at this process's mean time per update so far.
    """

    def __init__(self, desc: str, total_steps: int, start_step: int, every_s: float,
                 say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.desc, self.total, self.start_step = desc, total_steps, start_step
        self.every_s, self.say, self.clock = every_s, say, clock
        self.start = self.last = clock()
        self.loss_sum, self.count, self.tokens = 0.0, 0, 0
        self.step = start_step
        self.lines = 0

    def update(self, step: int, loss: float, tokens: int) -> None:
        """After an update: its step number (1-based), training loss and tokens."""
        self.step = step
        self.loss_sum += loss
        self.count += 1
        self.tokens += tokens
        if self.lines == 0 or self.clock() - self.last >= self.every_s:
            self.emit()

    def emit(self) -> None:
        now = self.clock()
        elapsed, since = now - self.start, now - self.last
        done = self.step - self.start_step
        eta = elapsed / done * (self.total - self.step) if done > 0 else None
        loss = self.loss_sum / self.count if self.count else float("nan")
        rate = f"{self.tokens / since:,.0f}" if since > 0 else "?"
        self.say(f"[train] {self.desc}: step {self.step}/{self.total} ({100.0 * self.step / max(self.total, 1):.1f}%), "
                 f"loss {loss:.4f}, {rate} tokens/s, elapsed {duration(elapsed)}, eta {duration(eta)}")
        self.last = now
        self.loss_sum, self.count, self.tokens = 0.0, 0, 0
        self.lines += 1

    def close(self) -> None:
        if self.count:
            self.emit()


def grad_norm_summary(norms: list[float], clip: float | None, guard=None) -> dict[str, Any]:
    """Mean, population variance, maximum and percentage above the clip threshold of pre-clip norms;
    with ``guard`` (lrattnres.train.guard.GradGuard) also its outliers (``{"update", "norm",
    "median"}`` each) and its settings."""
    vals = [x for x in norms if math.isfinite(x)]
    out: dict[str, Any] = {"mean": None, "var": None, "max": None, "above_clip_pct": None, "count": 0}
    if vals:
        n = len(vals)
        mean = math.fsum(vals) / n
        out.update(mean=mean, var=math.fsum((x - mean) ** 2 for x in vals) / n, max=max(vals),
                   above_clip_pct=None if clip is None else 100.0 * sum(x > clip for x in vals) / n, count=n)
    if guard is not None:
        out["outliers"] = [dict(e) for e in guard.outliers]
        out["guard"] = guard.settings()
    return out


# The end-of-run training loss is the mean cross-entropy of this many last updates (all when fewer):
# a window wide enough to average out batch noise, narrow enough to sit at the end of the schedule.
FINAL_TRAIN_WINDOW = 50
# Throughput "in steady state" leaves out this fraction of the first updates (compilation, warm-up).
STEADY_SKIP_FRAC = 0.1


def end_of_run_summary(path: str | Path) -> dict[str, float | None]:
    """From a run's metrics.jsonl: the mean training CE of the last :data:`FINAL_TRAIN_WINDOW` updates
    (to set beside the final validation CE: a gap says the run memorised its data) and the median
    tokens/s of the updates after the first :data:`STEADY_SKIP_FRAC` (compilation excluded)."""
    ces, rates = [], []
    p = Path(path)
    if p.is_file():
        for line in p.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("kind") == "train":
                ces.append(rec.get("ce"))
                rates.append(rec.get("tokens_per_s"))
    last = [c for c in ces[-FINAL_TRAIN_WINDOW:] if isinstance(c, (int, float)) and math.isfinite(c)]
    steady = [r for r in rates[int(len(rates) * STEADY_SKIP_FRAC):] if isinstance(r, (int, float))]
    return {
        "final_train_ce": sum(last) / len(last) if last else None,
        "final_train_window": len(last),
        "steady_tokens_per_s": statistics.median(steady) if steady else None,
    }
