"""Build token shards from a source: tokenise, split val/train by whole documents, shard, compact.

The build works in ``<out>/../.<name>.partial/`` and renames it onto ``<out>`` when complete, so an
interrupted build never leaves a folder that looks complete. It is resumable: every shard holds whole
documents, and after each shard is written ``progress.json`` records the number of source documents
consumed; a restart with the same spec keeps the written shards and skips that many documents.

A source without a split of its own is permuted with the spec's seed before the split (``shuffle``).
``manifest.json`` records only what determines the tokens, so rebuilding the same data gives the same
bytes (and the same hash, which training runs record); the build's timings, execution settings and
provenance go to ``build.json`` beside it.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from lrattnres.progress import bar as progress_bar

from ..io import atomic_path, atomic_write_json, read_json
from ..provenance import config_sha256, now, provenance
from . import tokenizer as tok
from .manifest import FORMAT, SPLITS, load_manifest, sha256_file
from .sources import make_source
from .spec import max_tokens, science, shuffled, validate_spec

CHUNK_DOCS = 2048  # at most this many documents per encode_ordinary_batch call
CHUNK_CHARS = 1 << 20  # ... or about this many characters
VAL_DEFINITION = (
    "the first whole documents of the document order (the source's order, permuted with the seed when "
    "shuffled) until the split holds at least val_tokens tokens (the document that reaches the budget is "
    "included); every later document is training data"
)


class _Buffer:
    def __init__(self):
        self.arrays: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.groups: list[int] = []  # per document: index into state["groups"]
        self.tokens = 0
        self.text = hashlib.sha256()

    def add(self, text: str, ids: list[int], group: int) -> None:
        a = np.asarray(ids, dtype=np.uint32)
        self.arrays.append(a)
        self.lengths.append(a.size)
        self.groups.append(group)
        self.tokens += a.size
        self.text.update(text.encode("utf-8", "surrogatepass"))
        self.text.update(b"\0")


def _fresh_state(spec_sha: str) -> dict[str, Any]:
    return {
        "spec_sha256": spec_sha,
        "started": now(),
        "docs_consumed": 0,
        "documents": 0,
        "empty_skipped": 0,
        "tokens": 0,
        "split": "val",
        "splits": {s: {"tokens": 0, "documents": 0, "shards": []} for s in SPLITS},
        "encode_seconds": 0.0,
        "seconds": 0.0,
        "done": False,
        "source": None,
        "groups": [],  # the documents' origins (package, file, collection), in order of first appearance
        "resume": None,  # where a restart continues: {"state": source state or None, "offset": documents}
    }


class _Shuffled:
    """A finite source read whole, then its documents permuted with ``seed`` (numpy's PCG64)."""

    def __init__(self, source, seed: int):
        self.source = source
        self.seed = seed
        self._docs: list[tuple[str, str]] | None = None

    def fingerprint(self):
        return self.source.fingerprint()

    def describe(self) -> dict[str, Any]:
        d = dict(self.source.describe())
        d["order"] = (f"documents permuted with numpy.random.default_rng({self.seed}).permutation "
                      f"(source order before: {d.get('order')})")
        return d

    def iter_docs(self, skip: int = 0):
        if self._docs is None:
            docs = list(self.source.iter_docs())
            perm = np.random.default_rng(self.seed).permutation(len(docs))
            self._docs = [docs[i] for i in perm]
        yield from self._docs[skip:]


def _take(it) -> list[tuple[str, str]]:
    out, chars = [], 0
    for group, text in it:
        out.append((group, text))
        chars += len(text)
        if len(out) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            break
    return out


class _Prefetch:
    """Pull chunks of texts from a source in a background thread (overlaps reading and encoding)."""

    def __init__(self, source, skip: int, resume, max_chunks: int = 3):
        self._q: queue.Queue = queue.Queue(max_chunks)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(source, skip, resume), daemon=True,
                                   name="prepare-data-read")
        self._t.start()

    def _run(self, source, skip, resume) -> None:
        it = source.iter_docs(skip=skip, resume=resume) if resume is not None else source.iter_docs(skip=skip)
        base, off = resume, skip  # where each chunk starts: a source state (or None) plus documents
        state_of = getattr(source, "state", lambda: None)
        try:
            while not self._stop.is_set():
                st = state_of()
                if st is not None:
                    base, off = st, 0
                chunk = _take(it)
                self._put(("data", (base, off, chunk)))
                off += len(chunk)
                if not chunk:
                    break
        except BaseException as e:  # handed to the consumer
            self._put(("error", e))
        finally:
            close = getattr(it, "close", None)
            if close:
                close()

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self) -> tuple[Any, int, list[str]]:
        kind, val = self._q.get()
        if kind == "error":
            raise val
        return val

    def close(self) -> None:
        self._stop.set()
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._t.join(timeout=30)


def _flush(work: Path, state: dict, split: str, buf: _Buffer) -> None:
    if not buf.tokens:
        return
    s = state["splits"][split]
    i = len(s["shards"])
    name = f"{split}_{i:05d}"
    data = np.concatenate(buf.arrays).astype("<u4", copy=False)
    raw = work / "raw" / f"{name}.bin"
    with atomic_path(raw) as tmp:
        data.tofile(tmp)
    ends = np.cumsum(np.asarray(buf.lengths, dtype=np.int64))
    idx = work / f"{name}.idx.npy"
    with atomic_path(idx) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, ends, allow_pickle=False)
    with atomic_path(work / "raw" / f"{name}.groups.npy") as tmp:  # per document: its origin
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(buf.groups, dtype=np.int32), allow_pickle=False)
    s["shards"].append({
        "file": f"{name}.bin",
        "tokens": int(buf.tokens),
        "documents": len(buf.lengths),
        "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
        "index": idx.name,
        "index_sha256": sha256_file(idx),
        "text_sha256": buf.text.hexdigest(),
    })
    s["tokens"] += int(buf.tokens)
    s["documents"] += len(buf.lengths)
    atomic_write_json(work / "progress.json", state)


def _tokenize(spec: dict, work: Path, state: dict, progress: bool) -> None:
    t_start = time.perf_counter()
    source = make_source(spec)
    if hasattr(source, "preflight"):  # a source that cannot be read says so before any work is shown
        source.preflight()
    if shuffled(spec):
        source = _Shuffled(source, spec["seed"])
    group_ids = {g: i for i, g in enumerate(state["groups"])}
    cap = max_tokens(spec)
    val_tokens = spec["val_tokens"]
    shard_tokens = spec["shard_tokens"]
    enc = tok.get_encoding()
    if state["split"] == "val" and val_tokens == 0:
        state["split"] = "train"
    res = state.get("resume") or {"state": None, "offset": state["docs_consumed"]}
    reader = _Prefetch(source, res["offset"], res["state"])
    buf = _Buffer()
    pending = {s: state["splits"][s]["tokens"] for s in SPLITS}
    bar = progress_bar(total=cap, initial=state["tokens"], unit="tok", desc=f"prepare-data ({spec['source']})",
                       live=progress, unit_scale=True, mininterval=1.0)
    stop = cap is not None and state["tokens"] >= cap
    encode_s = 0.0
    try:
        while not stop:
            base, off, docs = reader.get()
            if not docs:
                break
            texts = [t for _, t in docs]
            t0 = time.perf_counter()
            encoded = enc.encode_ordinary_batch(texts, num_threads=spec["num_threads"])
            encode_s += time.perf_counter() - t0
            for j, ((group, text), ids) in enumerate(zip(docs, encoded)):
                state["docs_consumed"] += 1
                state["resume"] = {"state": base, "offset": off + j + 1}
                if not ids or not text.strip():
                    state["empty_skipped"] += 1
                    continue
                ids.append(tok.EOT)
                split = state["split"]
                if group not in group_ids:
                    group_ids[group] = len(state["groups"])
                    state["groups"].append(group)
                buf.add(text, ids, group_ids[group])
                n = len(ids)
                state["tokens"] += n
                state["documents"] += 1
                pending[split] += n
                bar.update(n)
                if split == "val" and pending["val"] >= val_tokens:
                    _flush(work, state, "val", buf)
                    buf = _Buffer()
                    state["split"] = "train"
                    atomic_write_json(work / "progress.json", state)
                elif buf.tokens >= shard_tokens:
                    _flush(work, state, split, buf)
                    buf = _Buffer()
                if cap is not None and state["tokens"] >= cap:
                    stop = True
                    break
        _flush(work, state, state["split"], buf)
    finally:
        bar.close()
        reader.close()
    state["encode_seconds"] += encode_s
    state["seconds"] += time.perf_counter() - t_start
    state["source"] = source.describe()
    if state["documents"] == 0:
        raise ValueError(
            f"empty corpus: source {spec['source']!r} gave no non-empty documents "
            f"({state['docs_consumed']} consumed, {state['empty_skipped']} empty) -- "
            f"settings {spec[spec['source']]}"
        )
    if state["splits"]["train"]["tokens"] == 0:
        raise ValueError(
            f"corpus too small: all {state['tokens']} tokens ({state['documents']} documents) went to the "
            f"validation split (val_tokens={val_tokens}); lower val_tokens or give more data"
        )
    state["done"] = True
    atomic_write_json(work / "progress.json", state)


def _all_shards(state: dict):
    for split in SPLITS:
        for rec in state["splits"][split]["shards"]:
            yield split, rec


def _group_stats(work: Path, state: dict, fwd: np.ndarray | None, unk_id: int | None) -> list[dict[str, Any]]:
    """Per origin (package, file, collection): documents and tokens per split, and UNK tokens.

    Reads each shard's per-document origins (``raw/<shard>.groups.npy``) and, with a compacted
    vocabulary, counts the tokens that became UNK (``fwd`` maps cl100k ids to model ids)."""
    names = state["groups"]
    g = len(names)
    docs = {s: np.zeros(g, np.int64) for s in SPLITS}
    toks = {s: np.zeros(g, np.int64) for s in SPLITS}
    unk = np.zeros(g, np.int64)
    for split, rec in _all_shards(state):
        stem = rec["file"][: -len(".bin")]
        groups = np.load(work / "raw" / f"{stem}.groups.npy", allow_pickle=False).astype(np.int64)
        ends = np.load(work / rec["index"], allow_pickle=False).astype(np.int64)
        lengths = np.diff(ends, prepend=0)
        docs[split] += np.bincount(groups, minlength=g)
        toks[split] += np.bincount(groups, weights=lengths, minlength=g).astype(np.int64)
        if fwd is not None:
            mm = np.memmap(work / "raw" / rec["file"], dtype="<u4", mode="r")
            per_token = np.repeat(groups, lengths)
            is_unk = fwd[mm] == unk_id
            unk += np.bincount(per_token[is_unk], minlength=g)
    out = []
    for i, name in enumerate(names):
        total = int(toks["val"][i] + toks["train"][i])
        out.append({
            "name": name,
            "documents": int(docs["val"][i] + docs["train"][i]),
            "tokens": total,
            "val": {"documents": int(docs["val"][i]), "tokens": int(toks["val"][i])},
            "train": {"documents": int(docs["train"][i]), "tokens": int(toks["train"][i])},
            "unk_tokens": int(unk[i]) if fwd is not None else 0,
            "unk_fraction": float(unk[i] / max(total, 1)) if fwd is not None else 0.0,
        })
    return out


def _finalize(spec: dict, work: Path, state: dict, progress: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, build record): compact the vocabulary if asked, count per origin, describe."""
    bar = dict(live=progress, unit="shard", mininterval=5.0)
    shards = list(_all_shards(state))
    vocab = {"vocab_map": None, "vocab_size": tok.N_VOCAB, "eot_id": tok.EOT, "unk_id": None}
    fwd = None
    if spec["vocab"] == "compact":
        fwd, vocab = _compact_vocabulary(spec, work, shards, bar)
    groups = _group_stats(work, state, fwd, vocab["unk_id"])
    _write_shards(work, shards, fwd, bar)
    return _manifest(spec, state, shards, vocab, groups), _build_record(spec, state)


def _compact_vocabulary(spec: dict, work: Path, shards: list, bar: dict) -> tuple[np.ndarray, dict[str, Any]]:
    """The compact vocabulary (``vocab.npy``: the cl100k ids the corpus uses, at most ``vocab_max``,
    made once and kept): (the map from cl100k ids to model ids, the manifest's vocabulary keys)."""
    vpath = work / "vocab.npy"
    counts = np.zeros(tok.N_VOCAB, dtype=np.int64)
    for _, rec in progress_bar(shards, desc="compaction: scan", **bar):
        mm = np.memmap(work / "raw" / rec["file"], dtype="<u4", mode="r")
        for a in range(0, mm.size, 1 << 24):
            counts += np.bincount(mm[a:a + (1 << 24)], minlength=tok.N_VOCAB)
    if not vpath.exists():
        used = counts > 0
        used[tok.EOT] = True
        if spec["vocab_max"] is not None and used.sum() > spec["vocab_max"] - 1:
            # keep the vocab_max - 1 most frequent ids (EOT always); the rest become UNK
            ranked = np.argsort(-counts, kind="stable")
            keep = [i for i in ranked[: spec["vocab_max"] - 1] if i != tok.EOT][: spec["vocab_max"] - 2]
            used = np.zeros(tok.N_VOCAB, dtype=bool)
            used[keep] = True
            used[tok.EOT] = True
        ids = np.flatnonzero(used).astype(np.int64)
        with atomic_path(vpath) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, ids, allow_pickle=False)
    ids = np.load(vpath)
    fwd = np.full(tok.N_VOCAB, ids.size, dtype=np.uint32)
    fwd[ids] = np.arange(ids.size, dtype=np.uint32)
    kept = np.zeros(tok.N_VOCAB, dtype=bool)
    kept[ids] = True
    vocab_map = {"file": vpath.name, "sha256": sha256_file(vpath), "size": int(ids.size),
                 "meaning": "model id i < size stands for cl100k id ids[i] (sorted); id `size` is UNK "
                            "(any cl100k id the corpus never used, or beyond vocab_max)",
                 "vocab_max": spec["vocab_max"],
                 "unk_token_fraction": float(counts[~kept].sum() / max(int(counts.sum()), 1))}
    return fwd, {"vocab_map": vocab_map, "vocab_size": int(ids.size) + 1, "eot_id": int(fwd[tok.EOT]),
                 "unk_id": int(ids.size)}


def _write_shards(work: Path, shards: list, fwd: np.ndarray | None, bar: dict) -> None:
    """The final shards beside the manifest: rewritten through the compact vocabulary (their sha256
    recomputed), or moved as they are; the raw folder removed."""
    if fwd is not None:
        for _, rec in progress_bar(shards, desc="compaction: rewrite", **bar):
            mm = np.memmap(work / "raw" / rec["file"], dtype="<u4", mode="r")
            h = hashlib.sha256()
            with atomic_path(work / rec["file"]) as tmp:
                with open(tmp, "wb") as f:
                    for a in range(0, mm.size, 1 << 24):
                        block = fwd[mm[a:a + (1 << 24)]].astype("<u4", copy=False)
                        h.update(block.tobytes())
                        block.tofile(f)
            rec["sha256"] = h.hexdigest()
    else:
        for _, rec in shards:
            raw = work / "raw" / rec["file"]
            if raw.exists():
                os.replace(raw, work / rec["file"])
    shutil.rmtree(work / "raw", ignore_errors=True)


def _manifest(spec: dict, state: dict, shards: list, vocab: dict, groups: list[dict]) -> dict[str, Any]:
    """The manifest: the tokenizer, vocabulary, source (with its content hash), counts and splits."""
    content = hashlib.sha256("\n".join(rec.pop("text_sha256") for _, rec in shards).encode()).hexdigest()
    source = dict(state["source"] or {})
    source["content_sha256"] = content
    source["content_sha256_definition"] = (
        "sha256 of the newline-joined per-shard sha256 of the documents' UTF-8 text, each followed by NUL"
    )
    return {
        "format": FORMAT,
        "stage": "data",
        "tokenizer": tok.tokenizer_info(),
        "dtype": "uint32",
        "byteorder": "little",
        "vocab": spec["vocab"],
        "vocab_size": vocab["vocab_size"],
        "eot_id": vocab["eot_id"],
        "unk_id": vocab["unk_id"],
        "vocab_map": vocab["vocab_map"],
        "source": source,
        "shuffled": shuffled(spec),
        "sources": groups,
        "counts": {
            "documents_consumed": state["docs_consumed"],
            "documents": state["documents"],
            "empty_skipped": state["empty_skipped"],
            "duplicates_skipped": source.get("duplicates_skipped", 0),
            "tokens": state["tokens"],
        },
        "val_split": {
            "definition": VAL_DEFINITION,
            "val_tokens_requested": spec["val_tokens"],
            "tokens": state["splits"]["val"]["tokens"],
            "documents": state["splits"]["val"]["documents"],
        },
        "splits": state["splits"],
        "shard_tokens": spec["shard_tokens"],
        "spec": science(spec),
    }


def _build_record(spec: dict, state: dict) -> dict[str, Any]:
    """How the build went: its times (wall clock, shared with other processes) and provenance."""
    enc_s = max(state["encode_seconds"], 1e-9)
    return {
        "stage": "data",
        "manifest": "manifest.json",
        "timing": {
            "seconds": round(state["seconds"], 3),
            "encode_seconds": round(state["encode_seconds"], 3),
            "encode_tokens_per_s": round(state["tokens"] / enc_s),
            "note": "wall-clock times of this build, shared with source reading and other processes "
                    "(see load_avg_1min); python -m lrattnres.data.bench measures tokenisation alone",
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "end_to_end_tokens_per_s": round(state["tokens"] / max(state["seconds"], 1e-9)),
            "num_threads": spec["num_threads"],
            "cpu_count": os.cpu_count(),
        },
        "spec": spec,
        "provenance": provenance(science(spec), started=state["started"]),
    }


def _make_readable(folder: Path) -> None:
    """mkstemp creates 0600 files; give the outputs the usual umask-based mode."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def prepare(spec: dict | None, out: str | os.PathLike, *, progress: bool = True) -> dict:
    """Build the token shards and manifest for ``spec`` in ``out``; return the loaded manifest."""
    spec = validate_spec(spec)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.partial"
    try:
        fingerprint = make_source(spec).fingerprint()
    except FileNotFoundError:
        fingerprint = None  # reported by the build itself
    spec_sha = config_sha256({"spec": science(spec), "source": fingerprint, "format": FORMAT})  # resume key
    state = None
    prog = work / "progress.json"
    if prog.exists():
        try:
            old = read_json(prog)
            if old.get("spec_sha256") == spec_sha:
                state = old
                print(f"[data] resuming {work}: {old['docs_consumed']} documents consumed, "
                      f"{old['tokens']} tokens written", file=sys.stderr)
        except ValueError:
            state = None
    if state is None:
        shutil.rmtree(work, ignore_errors=True)
        (work / "raw").mkdir(parents=True)
        state = _fresh_state(spec_sha)
    try:
        if not state["done"]:
            _tokenize(spec, work, state, progress)
    except (ValueError, FileNotFoundError):
        shutil.rmtree(work, ignore_errors=True)  # a definitive error (empty corpus ...): nothing to resume
        raise
    m, build = _finalize(spec, work, state, progress)
    atomic_write_json(work / "manifest.json", m)
    atomic_write_json(work / "build.json", build)
    prog.unlink(missing_ok=True)
    _make_readable(work)
    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(work, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)
    return load_manifest(out)
