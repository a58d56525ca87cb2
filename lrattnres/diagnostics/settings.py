"""The scale's ``diagnostics`` block: every key, its default and its check."""

from __future__ import annotations

from typing import Any

from lrattnres.checks import is_int
from lrattnres.errors import UserError

# The scale's ``diagnostics`` block: every key and its default.
DEFAULTS: dict[str, Any] = {
    "tokens": 65536,  # held-out tokens for N_eff and heatmaps (the paper: 1,007,616 = 492 x 2048)
    "batch_size": 8,  # sequences per forward pass
    "seq_len": None,  # window length; None: the run's training seq_len
    "split": "val",  # the held-out split of the manifest
    "device": "auto",  # auto | cpu | cuda
    "trailing_window": 50,  # steps of the trailing mean of Figure 10 (the paper: 1,000)
    "trace_points": 2000,  # at most this many points of each gradient-norm trace kept for Figure 10
}
DEVICES = ("auto", "cpu", "cuda")


class DiagnosticsError(UserError, ValueError):
    """Bad settings or inputs; the message names the file or key and what was expected."""


def validate_settings(block: Any, where: str = "diagnostics") -> dict[str, Any]:
    """The scale's ``diagnostics`` block with defaults filled in; bad keys are named."""
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise DiagnosticsError(f"{where}: expected a mapping with keys {sorted(DEFAULTS)}, got {type(block).__name__}")
    unknown = sorted(set(block) - set(DEFAULTS))
    if unknown:
        raise DiagnosticsError(f"{where}: unknown key(s) {unknown}; expected only {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **block}

    def bad(key: str, expected: str) -> None:
        raise DiagnosticsError(f"{where}.{key}: expected {expected}, got {out[key]!r}")

    for key in ("tokens", "batch_size", "trailing_window", "trace_points"):
        if not is_int(out[key]) or out[key] < 1:
            bad(key, "an integer >= 1")
    if out["seq_len"] is not None and (not is_int(out["seq_len"]) or out["seq_len"] < 1):
        bad("seq_len", "null (the run's training seq_len) or an integer >= 1")
    if not isinstance(out["split"], str) or not out["split"]:
        bad("split", "a split name of the data manifest (e.g. 'val')")
    if out["device"] not in DEVICES:
        bad("device", f"one of {list(DEVICES)}")
    return out
