"""A piece's archive: small outputs of a scale with their Snakemake metadata, data only.

Recorded pieces are committed files that people share, and restoring one writes into the working
tree that Snakemake runs next. So an archive is read and checked whole before anything is written:
every member must be a plain file under the scale's results folder of a kind that a piece brings back
(:data:`KEEP`), or the Snakemake metadata record (``.snakemake/metadata/<name>``) of such a file in
the same archive; no absolute path, no ``..``, no link, device, folder or unusual name, no name twice.
Anything else, or an archive that does not read to its end, is refused with one line naming the
archive and the member, and nothing of any archive is written. Files are written without execute
bits, atomically, with the modification time they were packed with. The results folder may be a
link (e.g. to scratch space): files are written through it.

Several archives may hold the same file (the data manifest, which every piece builds; an older
archive may hold an earlier state of a file that a later piece rewrote): the copy with the newest
modification time wins, with its own metadata, and a file already in the tree that is newer than
every copy is kept.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import lzma
import os
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrattnres.io import atomic_path

# Files of a scale's results that a piece brings back (relative to <results>/<scale>/); weights,
# checkpoints and token shards stay on the machine.
# throughput/ holds each size's timing and, while unfinished, its partial state (<preset>.partial.json),
# which the next piece continues.
KEEP = ("settings.json", "accounting.json", "kernel_check.json", "throughput.json", "throughput/*.json",
        "data/manifest.json", "data/build.json", "runs/*/result.json", "runs/*/metrics.jsonl", "runs/*/spec.json",
        "diagnostics/*.json", "convert/*.json", "evaluate/*.json", "kernel_check/*.json", "logs/**/*")
METADATA = ".snakemake/metadata"
# One path component of a member: run ids, presets, stage names, base64 of a metadata record.
_PART = re.compile(r"[A-Za-z0-9._=+@-]+")
_READ_ERRORS = (OSError, EOFError, tarfile.TarError, lzma.LZMAError, zlib.error)


class ArchiveError(ValueError):
    """An archive that is not a piece's data; the message is one line naming the archive."""


def metadata_name(path: str) -> str:
    """Snakemake's metadata file name for an output path (urlsafe base64 of the path)."""
    return base64.urlsafe_b64encode(path.encode()).decode()


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """``Path.glob`` semantics on split paths: ``**`` is any number of folders, ``*`` one name."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:])


def kept(rel: str) -> bool:
    """Whether ``rel`` (relative to a scale's results folder) is a kind of file a piece brings back."""
    parts = rel.split("/")
    return any(_glob_match(parts, p.split("/")) for p in KEEP)


def small_outputs(results: str) -> list[str]:
    """Existing files of ``results`` (a scale's folder) that a piece brings back, sorted."""
    root = Path(results)
    found: set[str] = set()
    for pattern in KEEP:
        found.update(p.as_posix() for p in root.glob(pattern) if p.is_file())
    return sorted(found)


def pack(out: str | os.PathLike, results: str, workdir: str = ".", files: list[str] | None = None) -> dict[str, Any]:
    """Write ``files`` (paths relative to ``workdir``; by default every small output of ``results``)
    and their Snakemake metadata into an xz tarball, each as a plain file."""
    cwd = Path(workdir)
    if files is None:
        rel = [Path(f).relative_to(cwd).as_posix() for f in small_outputs(str(cwd / results))]
    else:
        rel = sorted({Path(f).as_posix() for f in files})
    metas = [f"{METADATA}/{metadata_name(r)}" for r in rel]
    metas = [m for m in metas if (cwd / m).is_file()]
    with atomic_path(out) as tmp:
        with tarfile.open(tmp, "w:xz", dereference=True) as tar:
            for r in rel + metas:
                info = tar.gettarinfo(str(cwd / r), arcname=r)
                # a job's log and its attempt's copy are one file under two names (a hard link,
                # lrattnres/attempts.py): each goes in as the plain file it is
                info.type, info.linkname, info.size = tarfile.REGTYPE, "", (cwd / r).stat().st_size
                info.mode &= 0o644
                with open(cwd / r, "rb") as f:
                    tar.addfile(info, f)
    return {"files": len(rel), "metadata": len(metas), "bytes": os.path.getsize(out)}


@dataclass(frozen=True)
class Member:
    archive: str
    name: str
    mtime: float
    data: bytes


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _check_name(archive: str, name: str, results: str) -> str:
    """The kind of a member's name ("file" or "metadata"); raises when it is neither."""
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") or not _PART.fullmatch(p) for p in parts):
        raise ArchiveError(f"{archive}: member {name!r} is not a plain relative path (expected files under "
                           f"{results}/ and their records under {METADATA}/)")
    if name.startswith(results + "/") and kept(name[len(results) + 1:]):
        return "file"
    if name.startswith(METADATA + "/") and len(parts) == len(METADATA.split("/")) + 1:
        return "metadata"
    raise ArchiveError(f"{archive}: member {name!r} is not a result that a piece brings back (expected files "
                       f"under {results}/ matching {list(KEEP)}, and their records under {METADATA}/)")


def read_archive(archive: str, results: str) -> list[Member]:
    """Every member of ``archive``, checked (see the module docstring) and read to its end."""
    out: list[Member] = []
    kinds: dict[str, str] = {}
    try:
        with tarfile.open(archive, "r:xz") as tar:
            for m in tar.getmembers():
                kind = _check_name(archive, m.name, results)
                if not m.isreg() or m.issparse():
                    what = ("a link" if m.issym() or m.islnk() else "a folder" if m.isdir()
                            else "a device or pipe" if m.ischr() or m.isblk() or m.isfifo() else "not a plain file")
                    raise ArchiveError(f"{archive}: member {m.name!r} is {what}; a piece archive holds plain "
                                       "files only")
                if m.name in kinds:
                    raise ArchiveError(f"{archive}: member {m.name!r} appears twice")
                f = tar.extractfile(m)
                data = f.read() if f is not None else b""
                if len(data) != m.size:
                    raise ArchiveError(f"{archive}: member {m.name!r} ends after {len(data)} of {m.size} bytes")
                kinds[m.name] = kind
                out.append(Member(archive, m.name, float(m.mtime), data))
    except ArchiveError:
        raise
    except _READ_ERRORS as e:
        raise ArchiveError(f"{archive}: not a complete piece archive ({_one_line(e)})") from None
    for m in out:
        if kinds[m.name] != "metadata":
            continue
        b64 = m.name.rsplit("/", 1)[1]
        try:
            path = base64.urlsafe_b64decode(b64.encode()).decode()
        except (binascii.Error, UnicodeDecodeError):
            path = None
        if path is None or metadata_name(path) != b64 or kinds.get(path) != "file":
            raise ArchiveError(f"{archive}: member {m.name!r} is not the Snakemake record of a result in the archive")
        try:
            record = json.loads(m.data)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ArchiveError(f"{archive}: member {m.name!r} (the Snakemake record of {path}) is not a JSON object")
    return out


def read_archives(archives: list[str], results: str) -> list[Member]:
    """The members of every archive, all checked before any is used (raises :class:`ArchiveError`)."""
    return [m for a in archives for m in read_archive(a, results)]


@dataclass
class Restored:
    files: list[str]  # written (results and metadata)
    kept_local: list[str]  # present in the tree and newer than every archived copy
    superseded: list[dict]  # {"file", "from", "over"}: a newer copy won over an older one


def restore_members(members: list[Member], workdir: str = ".", *, skip: tuple[str, ...] = ()) -> Restored:
    """Write the newest copy of every result of ``members`` (read by :func:`read_archives`) with its
    metadata into ``workdir``; results under a ``skip`` prefix are left out."""
    cwd = Path(workdir)
    newest: dict[str, Member] = {}
    superseded = []
    for m in members:
        if m.name.startswith(METADATA + "/"):
            continue
        old = newest.get(m.name)
        if old is None or m.mtime >= old.mtime:  # a tie: the later archive
            if old is not None and old.data != m.data:
                superseded.append({"file": m.name, "from": m.archive, "over": old.archive})
            newest[m.name] = m
        elif old.data != m.data:
            superseded.append({"file": m.name, "from": old.archive, "over": m.archive})
    records = {(m.archive, m.name): m for m in members if m.name.startswith(METADATA + "/")}
    out = Restored([], [], superseded)
    for name, m in sorted(newest.items()):
        if any(name.startswith(s) for s in skip):
            continue
        dest = cwd / name
        if dest.is_file() and dest.stat().st_mtime > m.mtime:
            out.kept_local.append(name)
            continue
        record = records.get((m.archive, f"{METADATA}/{metadata_name(name)}"))
        for item in (m, record):
            if item is None:
                continue
            target = cwd / item.name
            if target.is_dir() and not target.is_symlink():
                raise ArchiveError(f"{item.archive}: member {item.name!r}: {target} is a folder in the working tree")
            with atomic_path(target) as tmp:
                Path(tmp).write_bytes(item.data)
            os.utime(target, (item.mtime, item.mtime))
            out.files.append(item.name)
    return out


def restore(archives: list[str], workdir: str = ".", *, results: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Check every archive whole, then restore them (:func:`restore_members`); returns what was written."""
    return restore_members(read_archives(archives, results), workdir, skip=skip).files
