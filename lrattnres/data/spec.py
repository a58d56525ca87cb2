"""The prepare-data spec: defaults, validation (errors name the bad key).

Keys (all optional; the defaults are the paper's data setup except the source):

- ``source``: ``embedded`` (docstrings of installed packages, offline) | ``hf`` (a Hugging Face
  dataset, streamed; Ultra-FineWeb by default) | ``local`` (txt/jsonl/parquet files by glob) |
  ``pack`` (a pack of extracted documentation, :mod:`lrattnres.data.docs`).
- ``embedded``: ``packages`` (read in this order), ``max_documents``, ``max_tokens``, ``min_chars``,
  ``workers`` (ast-parsing processes), ``missing`` (skip | error for an uninstalled package).
- ``hf``: ``dataset``, ``name`` (config), ``split``, ``column``, ``revision``, ``max_tokens``,
  ``data_files`` (a local mirror or a stand-in: ``dataset: parquet, data_files: [...]``),
  ``local_dir`` (a pre-staged copy of the dataset's repository, read instead of the Hub: where the
  data stage runs without the network; docs/slurm.md). Without the network and without a copy the
  stage refuses in one line before reading anything. ``local_dir`` says where, not what: it is an
  execution setting (the shards' hashes decide whether the tokens are the same).
- ``local``: ``glob``, ``format`` (auto | txt | jsonl | parquet; txt = one document per file),
  ``field`` (jsonl key / parquet column), ``max_tokens``.
- ``pack``: ``path`` (the .jsonl.xz pack; the workflow builds it from the installed documentation
  when it is absent), ``collections`` (the collections to build and read, or null for all of
  :data:`lrattnres.data.docs.COLLECTIONS`), ``min_chars`` (shortest document), ``sha256`` (null, or
  the pack's expected sha256), ``max_tokens``.
- ``max_tokens`` (per source) caps the total (validation + training) tokens; whole documents are
  taken until the cap is reached (the document that reaches it is kept).
- ``shuffle``: ``auto`` | ``true`` | ``false``. A source without a split of its own (embedded, local,
  pack) is read in a fixed order that groups documents by origin (package, file, collection); with
  ``auto`` or ``true`` its documents are permuted with ``seed`` before the split, so that the
  validation and training splits sample one distribution. ``auto`` streams ``hf`` in its own order:
  the paper's validation split is the first 100M tokens of Ultra-FineWeb's stream; ``true`` with
  ``hf`` is refused (a stream cannot be permuted without reading it whole).
- ``val_tokens``: whole documents from the start of the (shuffled) document order go to the
  validation split until it holds at least this many tokens (the paper: the first 100M tokens).
- ``shard_tokens``: a shard is closed at the first document end at or after this many tokens.
- ``vocab``: ``full`` (cl100k ids) | ``compact`` (dense ids for the tokens the corpus uses, plus UNK).
- ``vocab_max``: with ``compact``, keep only the ``vocab_max - 1`` most frequent ids (EOT always); the
  rest map to UNK (the manifest records the fraction of tokens that became UNK).
- ``seed``: the seed of the document permutation (``shuffle``); the build is deterministic.
- ``num_threads``: threads of tiktoken's ``encode_ordinary_batch``: an execution setting, left out of
  the manifest (see :data:`EXECUTION_KEYS`).
"""

from __future__ import annotations

import copy
from typing import Any

from lrattnres.checks import is_int
from lrattnres.errors import SpecError

DEFAULT_PACKAGES = [
    "torch",
    "numpy",
    "sympy",
    "pandas",
    "networkx",
    "matplotlib",
    "datasets",
    "huggingface_hub",
]

DEFAULTS: dict[str, Any] = {
    "source": "embedded",
    "embedded": {
        "packages": DEFAULT_PACKAGES,
        "max_documents": None,
        "max_tokens": None,
        "min_chars": 200,  # a docstring must be longer than this to count as a document
        "workers": 2,  # processes parsing files with ast
        "missing": "skip",  # skip | error: what to do with a listed package that is not installed
    },
    "hf": {
        "dataset": "openbmb/Ultra-FineWeb",
        "name": None,
        "split": "en",
        "column": "content",
        "revision": None,
        "max_tokens": None,
        "data_files": None,  # e.g. a local mirror: dataset "parquet", data_files "mirror/*.parquet"
        "local_dir": None,  # a pre-staged copy of the dataset's repository, read instead of the Hub
    },
    "local": {"glob": None, "format": "auto", "field": "text", "max_tokens": None},
    "pack": {"path": None, "collections": None, "min_chars": 500, "sha256": None, "max_tokens": None},
    "shuffle": "auto",
    "val_tokens": 100_000_000,  # the paper: the first 100M tokens are the validation set
    "shard_tokens": 50_000_000,
    "vocab": "full",
    "vocab_max": None,  # compact only: keep the vocab_max - 1 most frequent ids (EOT always), the rest UNK
    "seed": 0,
    "num_threads": 2,  # tiktoken encode_ordinary_batch threads
}

_SOURCES = ("embedded", "hf", "local", "pack")
# Settings that change how fast the data are built, never which tokens: the manifest leaves them out,
# so changing them neither changes the data's hash nor reruns what depends on the data.
EXECUTION_KEYS = (("num_threads",), ("embedded", "workers"), ("hf", "local_dir"))
_FORMATS = ("auto", "txt", "jsonl", "parquet")


def _int(v, key, minimum=0, optional=False):
    if v is None and optional:
        return None
    if not is_int(v):
        raise SpecError(f"spec.{key}: expected an integer{' or null' if optional else ''}, got {v!r}")
    if v < minimum:
        raise SpecError(f"spec.{key}: expected >= {minimum}, got {v}")
    return v


def _str(v, key, optional=False, choices=None):
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v:
        raise SpecError(f"spec.{key}: expected a non-empty string{' or null' if optional else ''}, got {v!r}")
    if choices and v not in choices:
        raise SpecError(f"spec.{key}: expected one of {', '.join(choices)}, got {v!r}")
    return v


def validate_spec(spec: dict | None) -> dict:
    """Merge ``spec`` over the defaults and check every key; raise SpecError naming the bad one."""
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise SpecError(f"spec: expected a JSON object, got {type(spec).__name__}")
    out = copy.deepcopy(DEFAULTS)
    for k, v in spec.items():
        if k not in DEFAULTS:
            raise SpecError(f"spec.{k}: unknown key (expected one of {', '.join(DEFAULTS)})")
        if isinstance(DEFAULTS[k], dict):
            if v is None:
                continue
            if not isinstance(v, dict):
                raise SpecError(f"spec.{k}: expected an object, got {v!r}")
            for kk, vv in v.items():
                if kk not in DEFAULTS[k]:
                    raise SpecError(
                        f"spec.{k}.{kk}: unknown key (expected one of {', '.join(DEFAULTS[k])})"
                    )
                out[k][kk] = vv
        else:
            out[k] = v

    _str(out["source"], "source", choices=_SOURCES)
    _str(out["vocab"], "vocab", choices=("full", "compact"))
    out["vocab_max"] = _int(out["vocab_max"], "vocab_max", minimum=3, optional=True)
    if out["vocab_max"] is not None and out["vocab"] != "compact":
        raise SpecError("spec.vocab_max: only meaningful with vocab 'compact'")
    _int(out["val_tokens"], "val_tokens", 0)
    _int(out["shard_tokens"], "shard_tokens", 1)
    _int(out["seed"], "seed", 0)
    _int(out["num_threads"], "num_threads", 1)

    e = out["embedded"]
    if not isinstance(e["packages"], list) or not e["packages"] or not all(
        isinstance(p, str) and p.isidentifier() for p in e["packages"]
    ):
        raise SpecError(f"spec.embedded.packages: expected a non-empty list of importable package names, got {e['packages']!r}")
    if len(set(e["packages"])) != len(e["packages"]):
        raise SpecError(f"spec.embedded.packages: duplicate names in {e['packages']!r}")
    _int(e["max_documents"], "embedded.max_documents", 1, optional=True)
    _int(e["max_tokens"], "embedded.max_tokens", 1, optional=True)
    _int(e["min_chars"], "embedded.min_chars", 0)
    _int(e["workers"], "embedded.workers", 1)
    _str(e["missing"], "embedded.missing", choices=("skip", "error"))

    h = out["hf"]
    _str(h["dataset"], "hf.dataset")
    _str(h["name"], "hf.name", optional=True)
    _str(h["split"], "hf.split")
    _str(h["column"], "hf.column")
    _str(h["revision"], "hf.revision", optional=True)
    _int(h["max_tokens"], "hf.max_tokens", 1, optional=True)
    _str(h["local_dir"], "hf.local_dir", optional=True)
    df = h["data_files"]
    if df is not None and not (
        isinstance(df, str)
        or (isinstance(df, list) and all(isinstance(x, str) for x in df))
        or (isinstance(df, dict) and all(isinstance(x, (str, list)) for x in df.values()))
    ):
        raise SpecError(f"spec.hf.data_files: expected a path, a list of paths or a mapping, got {df!r}")

    sh = out["shuffle"]
    if sh not in ("auto", True, False):
        raise SpecError(f"spec.shuffle: expected auto, true or false, got {sh!r}")
    if sh is True and out["source"] == "hf":
        raise SpecError("spec.shuffle: true is not possible with source hf (a stream is read in its own "
                        "order; the paper's validation split is the first val_tokens of the stream): use auto")

    pk = out["pack"]
    if out["source"] == "pack":
        _str(pk["path"], "pack.path")
    else:
        _str(pk["path"], "pack.path", optional=True)
    cols = pk["collections"]
    if cols is not None and (not isinstance(cols, list) or not cols or not all(isinstance(c, str) and c for c in cols)):
        raise SpecError(f"spec.pack.collections: expected null or a non-empty list of collection names, got {cols!r}")
    sha = pk["sha256"]
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise SpecError(f"spec.pack.sha256: expected null or 64 lowercase hex digits, got {sha!r}")
    _int(pk["max_tokens"], "pack.max_tokens", 1, optional=True)
    _int(pk["min_chars"], "pack.min_chars", 0)

    lo = out["local"]
    if out["source"] == "local":
        _str(lo["glob"], "local.glob")
    else:
        _str(lo["glob"], "local.glob", optional=True)
    _str(lo["format"], "local.format", choices=_FORMATS)
    _str(lo["field"], "local.field")
    _int(lo["max_tokens"], "local.max_tokens", 1, optional=True)
    return out


def max_tokens(spec: dict) -> int | None:
    return spec[spec["source"]].get("max_tokens")


def shuffled(spec: dict) -> bool:
    """Whether the build permutes the documents before the split (``shuffle`` resolved)."""
    return spec["shuffle"] is True or (spec["shuffle"] == "auto" and spec["source"] != "hf")


def science(spec: dict) -> dict:
    """``spec`` without its execution settings (:data:`EXECUTION_KEYS`): what determines the tokens."""
    out = copy.deepcopy(spec)
    for path in EXECUTION_KEYS:
        node = out
        for key in path[:-1]:
            node = node.get(key, {})
        node.pop(path[-1], None)
    return out
