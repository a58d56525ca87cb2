"""Atomic output: a file is either absent or complete, never half written.

A write that fails because the file system is full raises :class:`DiskFull`, whose message is the
one line ``no space left on device: <path>``, whatever library did the writing (torch reports a full
disk as ``unexpected pos``, safetensors as an I/O error).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lrattnres.errors import InputError

# A failed write with less than this much space left beside it is taken for a full disk.
_FULL_BELOW_BYTES = 1 << 20


class DiskFull(OSError):
    """No space left on the device a file is written to."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(errno.ENOSPC, "no space left on device", str(path))

    def __str__(self) -> str:
        return f"no space left on device: {self.filename}"


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_disk_full(exc: BaseException, folder: str | os.PathLike | None = None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) reports a full disk; with ``folder``, a
    failed write there with (almost) no space left counts as well."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "os error 28" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if folder is not None and isinstance(exc, (OSError, RuntimeError)):
        free = _free_bytes(Path(folder))
        return free is not None and free < _FULL_BELOW_BYTES
    return False


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; rename it onto ``path`` on success.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException as e:
        full = isinstance(e, Exception) and not isinstance(e, DiskFull) and is_disk_full(e, path.parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if full:
            raise DiskFull(path) from e
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    import torch

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # through a Python file, so that a write error keeps its errno
            torch.save(obj, f)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def read_json(path: str | os.PathLike) -> Any:
    """Read JSON, naming the file in any error (:class:`InputError` for a file that is not JSON)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not valid JSON (not UTF-8 text: byte {e.start} is "
                         f"{e.object[e.start:e.start + 1]!r})") from None


def read_spec_arg(text: str) -> Any:
    """A stage's ``--spec``: inline JSON, or ``@path`` to a JSON file. ValueError names what is wrong."""
    if text.startswith("@"):
        text = Path(text[1:]).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--spec is not valid JSON ({e})") from None


def _json_default(o: Any):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
