"""The partial state of an unfinished throughput job: its finished timed runs, with what they were
made with, so that the next run of the same spec on the same device continues it."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from lrattnres.train.code import code_fingerprint


PARTIAL_FORMAT = "lrattnres.throughput.partial/1"


def partial_path(out: str | Path) -> Path:
    """The partial-state file beside a result: ``1B.json`` -> ``1B.partial.json``."""
    out = Path(out)
    return out.with_name(out.stem + ".partial.json")


def partial_key(s: dict, device_name: str, data_sha256: str | None) -> dict:
    """What a partial state must share with the run that continues it: the resolved spec (less the keys
    that bound how long it measures, not what a run measures), the device, the data and the code that
    is timed (the training stack and this package)."""
    here = sorted(Path(__file__).resolve().parent.glob("*.py"))
    code = hashlib.sha256((code_fingerprint() + "".join(f.read_text(encoding="utf-8") for f in here)).encode()).hexdigest()
    return {"spec": {k: v for k, v in s.items() if k not in ("deadline_s", "published", "budget_s", "target_half_width",
                                                           "max_repeats")}, "device": device_name,
            "data_sha256": data_sha256, "code_sha256": code}


def load_partial(path: Path, key: dict, log=None) -> dict | None:
    """The partial state at ``path`` when it continues a run of ``key``, else None (a state of another
    spec, device, data or code is left to be overwritten)."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not path.is_file():
        return None
    try:
        st = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        say(f"[throughput] {path}: not readable ({e}); starting afresh")
        return None
    if not isinstance(st, dict) or st.get("format") != PARTIAL_FORMAT or not isinstance(st.get("runs"), list):
        say(f"[throughput] {path}: not a partial state of format {PARTIAL_FORMAT}; starting afresh")
        return None
    if st.get("key") != key:
        differs = sorted(k for k in key if (st.get("key") or {}).get(k) != key[k])
        say(f"[throughput] {path}: made with another {', '.join(differs)}; starting afresh")
        return None
    say(f"[throughput] {path}: continuing after {len(st['runs'])} timed runs")
    return st
