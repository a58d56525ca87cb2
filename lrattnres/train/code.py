"""The source of the training stack: the files whose change makes a checkpoint one of "other training
code" (lrattnres/train/loop.py's resume), their fingerprint and their per-file hashes. It reads files
only, so that a stage that keys its own state to the training code (lrattnres/throughput/partial.py)
needs no torch."""

from __future__ import annotations

import hashlib
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent.parent
CODE_FILES = ("lrattnres/train/*.py", "lrattnres/model.py", "lrattnres/routing.py", "lrattnres/attention.py",
              "lrattnres/segments.py",
              "lrattnres/presets.py", "lrattnres/data/loader.py", "kernels/*.py")


def _code_sources():
    for pattern in CODE_FILES:
        for f in sorted(_REPO.glob(pattern)):
            yield f.relative_to(_REPO).as_posix(), f.read_bytes()


def code_fingerprint() -> str:
    """sha256 over the source of the training stack (a resumed run must not mix two versions)."""
    h = hashlib.sha256()
    for rel, data in _code_sources():
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def code_files() -> dict[str, str]:
    """The sha256 of each source file of the training stack, by its path in the repository: what a
    checkpoint records, so that a refusal can name the files that changed."""
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in _code_sources()}


def changed_code_files(old: dict | None, new: dict[str, str]) -> list[str] | None:
    """The files whose source differs between two :func:`code_files` records (added and removed ones
    too); None where the checkpoint records no per-file hashes."""
    if not isinstance(old, dict):
        return None
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
