"""The token-shard manifest: loading and validation (every error names the file).

Layout of a prepared data folder::

    manifest.json               this module's FORMAT (see below)
    val_00000.bin ...           raw little-endian uint32 token ids (model ids: compacted if vocab=compact)
    val_00000.idx.npy ...       int64 exclusive end offsets of the shard's documents (each ends in EOT)
    train_00000.bin ...
    vocab.npy                   only with vocab=compact: sorted original cl100k ids (int64)

Shards hold whole documents; every document ends with the end-of-text id ``manifest["eot_id"]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..io import read_json, sha256_file
from . import tokenizer as _tok

FORMAT = "lrattnres-tokens/1"
SPLITS = ("val", "train")

_VERIFIED: dict[tuple, bool] = {}


class ManifestError(UserError, ValueError):
    pass


def root_of(manifest: dict) -> Path:
    try:
        return Path(manifest["_root"])
    except KeyError:
        raise ManifestError("manifest dict has no '_root': load it with lrattnres.data.load_manifest(path)") from None


def manifest_sha256(manifest: dict) -> str:
    """sha256 of the manifest file as loaded (identifies the data a model was trained on)."""
    return manifest["_sha256"]


def _check_file(root: Path, rec: dict, key: str, verify: bool | str, mpath: Path, *, tokens: int | None = None) -> Path:
    name = rec[key]
    if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
        raise ManifestError(f"{mpath}: bad file name {name!r} in field {key!r}")
    path = root / name
    if not path.is_file():
        raise ManifestError(f"{path}: file listed in {mpath} is missing")
    size = path.stat().st_size
    if tokens is not None:
        if size % 4:
            raise ManifestError(
                f"{path}: size {size} bytes is not a multiple of 4 (a truncated uint32 shard)"
            )
        if size // 4 != tokens:
            raise ManifestError(
                f"{path}: holds {size // 4} tokens, manifest {mpath} says {tokens} (truncated or altered shard)"
            )
    if verify is True:
        st = path.stat()
        cache_key = (str(path.resolve()), st.st_size, st.st_mtime_ns, rec[key + "_sha256" if key != "file" else "sha256"])
        if not _VERIFIED.get(cache_key):
            want = cache_key[3]
            got = sha256_file(path)
            if got != want:
                raise ManifestError(
                    f"{path}: sha256 {got} differs from {want} recorded in {mpath} (altered or corrupt file)"
                )
            _VERIFIED[cache_key] = True
    return path


def validate_manifest(m: Any, mpath: Path, verify: bool | str = True) -> dict:
    """Check a manifest dict and its files. ``verify``: True (sizes and sha256), "size" (sizes only,
    for huge data), False (structure only)."""
    if not isinstance(m, dict):
        raise ManifestError(f"{mpath}: expected a JSON object")
    if m.get("format") != FORMAT:
        raise ManifestError(f"{mpath}: field 'format' is {m.get('format')!r}, expected {FORMAT!r}")
    tok = m.get("tokenizer")
    if not isinstance(tok, dict) or tok.get("name") != _tok.NAME or tok.get("sha256") != _tok.EXPECTED_SHA256:
        got = (tok or {}).get("name") if isinstance(tok, dict) else tok
        got_sha = (tok or {}).get("sha256") if isinstance(tok, dict) else None
        raise ManifestError(
            f"{mpath}: field 'tokenizer' names {got!r} (sha256 {got_sha}), expected {_tok.NAME!r} "
            f"(sha256 {_tok.EXPECTED_SHA256}): the shards come from another tokenizer"
        )
    for key in ("vocab", "vocab_size", "eot_id", "splits", "dtype"):
        if key not in m:
            raise ManifestError(f"{mpath}: field {key!r} missing")
    if m["dtype"] != "uint32" or m.get("byteorder", "little") != "little":
        raise ManifestError(f"{mpath}: field 'dtype' is {m['dtype']!r}, expected 'uint32' little-endian")
    if m["vocab"] not in ("full", "compact"):
        raise ManifestError(f"{mpath}: field 'vocab' is {m['vocab']!r}, expected 'full' or 'compact'")
    vs = m["vocab_size"]
    if not isinstance(vs, int) or vs < 2:
        raise ManifestError(f"{mpath}: field 'vocab_size' is {vs!r}, expected an integer >= 2")
    if m["vocab"] == "full" and vs != _tok.N_VOCAB:
        raise ManifestError(f"{mpath}: field 'vocab_size' is {vs}, expected {_tok.N_VOCAB} for vocab 'full'")
    root = mpath.parent
    if m["vocab"] == "compact":
        vm = m.get("vocab_map")
        if not isinstance(vm, dict) or "file" not in vm or "sha256" not in vm:
            raise ManifestError(f"{mpath}: field 'vocab_map' (file, sha256) missing for vocab 'compact'")
        _check_file(root, vm, "file", True if verify else False, mpath)
    splits = m["splits"]
    if not isinstance(splits, dict) or set(splits) != set(SPLITS):
        raise ManifestError(f"{mpath}: field 'splits' must have exactly {SPLITS}")
    for split in SPLITS:
        s = splits[split]
        total = 0
        for i, rec in enumerate(s.get("shards", [])):
            for key in ("file", "tokens", "documents", "sha256", "index", "index_sha256"):
                if key not in rec:
                    raise ManifestError(f"{mpath}: field 'splits.{split}.shards[{i}].{key}' missing")
            _check_file(root, rec, "file", verify, mpath, tokens=rec["tokens"])
            _check_file(root, rec, "index", verify, mpath)
            total += rec["tokens"]
        if total != s.get("tokens"):
            raise ManifestError(
                f"{mpath}: field 'splits.{split}.tokens' is {s.get('tokens')}, its shards hold {total}"
            )
    if splits["train"]["tokens"] == 0:
        raise ManifestError(f"{mpath}: the train split is empty")
    return m


def load_manifest(path: str | os.PathLike, verify: bool | str = True) -> dict:
    """Load and validate a manifest (a ``manifest.json`` or the folder holding it).

    Shard sizes are always checked; ``verify=True`` (default) also checks every file's sha256
    (cached per process by path, size and mtime); ``verify="size"`` skips hashing for huge data.
    The returned dict carries ``_root`` (the folder) and ``_sha256`` (of the manifest file).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    try:
        m = read_json(p)
    except ValueError as e:  # not JSON, not text: the message names the file
        raise ManifestError(f"{e}; expected the manifest.json of prepare-data") from None
    validate_manifest(m, p, verify)
    m["_root"] = str(p.parent.resolve())
    m["_path"] = str(p.resolve())
    m["_sha256"] = sha256_file(p)
    return m


def load_tokenizer(manifest: dict | str | os.PathLike) -> _tok.Tokenizer:
    """The tokenizer of a loaded manifest (or of a manifest path): cl100k, with the manifest's
    compaction where it has one."""
    if not isinstance(manifest, dict):
        manifest = load_manifest(manifest, verify=False)
    return _tok.Tokenizer(load_vocab_ids(manifest))


def load_vocab_ids(manifest: dict) -> np.ndarray | None:
    """The compaction map (sorted original ids) or None for the full vocabulary."""
    if manifest.get("vocab") != "compact":
        return None
    vm = manifest["vocab_map"]
    path = root_of(manifest) / vm["file"]
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: cannot read the compaction map ({e})") from None
    if ids.ndim != 1 or ids.size + 1 != manifest["vocab_size"]:
        raise ManifestError(
            f"{path}: compaction map has {ids.size} ids, manifest vocab_size {manifest['vocab_size']} needs "
            f"{manifest['vocab_size'] - 1} (plus the UNK id)"
        )
    return ids.astype(np.int64)


def shard_paths(manifest: dict, split: str) -> list[tuple[Path, int]]:
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {SPLITS}")
    root = root_of(manifest)
    return [(root / r["file"], int(r["tokens"])) for r in manifest["splits"][split]["shards"]]


def open_shard(path: Path, tokens: int) -> np.ndarray:
    size = path.stat().st_size
    if size % 4 or size // 4 != tokens:
        raise ManifestError(f"{path}: size {size} bytes, expected {tokens * 4} ({tokens} uint32 tokens)")
    return np.memmap(path, dtype="<u4", mode="r", shape=(tokens,))


def doc_ends(manifest: dict, split: str) -> np.ndarray:
    """Exclusive end offsets of every document of a split, over the split's concatenated shards."""
    root = root_of(manifest)
    out, base = [], 0
    for r in manifest["splits"][split]["shards"]:
        ends = np.load(root / r["index"], allow_pickle=False).astype(np.int64)
        out.append(ends + base)
        base += int(r["tokens"])
    return np.concatenate(out) if out else np.zeros(0, np.int64)
