"""Provenance recorded in every result file: what code, config and machine made it.

Stages that run a model add the attention backend its forward used and that backend's version
(``attention=lrattnres.attention.describe(...)``): ``auto`` stands for different kernels on
different devices, so the requested name alone does not say what ran.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGES = ("torch", "triton", "flash_attn", "numpy", "snakemake", "lm_eval", "tiktoken", "datasets")
_REPO = Path(__file__).resolve().parent.parent


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def config_sha256(config: Any) -> str:
    """Hash of a JSON-serialisable config, independent of key order."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it.  LRATTNRES_COMMIT, when set, names the commit
    instead: a working tree copied to another machine (a GPU host) may carry a stale .git.  Where that
    .git holds the named commit, "dirty" says whether the tracked files differ from it (so a name read
    from the stale .git itself, not the tree's own, shows as dirty); else it is unknown (None)."""
    given = os.environ.get("LRATTNRES_COMMIT")
    if given:
        diff = _git("diff", "--name-only", given, "--")  # fails (None) where the .git lacks that commit
        return {"commit": given, "dirty": bool(diff) if diff is not None else None}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return out


def device() -> str:
    """The accelerator a stage ran on.  Asks torch only if the stage already imported it, so that
    cheap stages (accounting, report) do not pay torch's import for their provenance."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"cpu: {platform.processor() or platform.machine()}"


def provenance(config: Any = None, started: str | None = None, attention: dict | None = None) -> dict[str, Any]:
    """The provenance block of every result file: commit, dirty, config hash, versions, device, times; and
    ``attention`` for a stage that runs a model: ``{"requested", "backend", "version"}``
    (``lrattnres.attention.describe``), or one such record per model name where a stage runs
    several models with different attention."""
    rec = git_state()
    rec["config_sha256"] = config_sha256(config) if config is not None else None
    rec["versions"] = versions()
    rec["device"] = device()
    rec["host"] = platform.node()
    rec["started"] = started or now()
    rec["finished"] = now()
    if attention is not None:
        rec["attention"] = dict(attention)
    return rec
