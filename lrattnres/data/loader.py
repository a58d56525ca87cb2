"""Fixed-length training windows and evaluation batches over memory-mapped token shards.

A split is the concatenation of its shards. Window ``i`` is the ``seq_len + 1`` tokens starting at
``i * seq_len``: ``inputs = w[:-1]``, ``targets = w[1:]``, so consecutive windows predict disjoint
targets and a split of N tokens has ``(N - 1) // seq_len`` windows (a final partial window is
dropped). ``doc_ids[b, t]`` counts the end-of-text tokens among ``inputs[b, :t]``: the EOT itself
belongs to the document it ends; the token after it starts the next document. Ids are local to
the row (only equality matters for masking).

Training order: epoch ``e`` visits the windows in ``numpy.random.default_rng([seed, e]).permutation``
order, in global batches of ``batch_size * world_size`` windows (the remainder of an epoch is
dropped). Rank ``r`` takes the windows at positions ``r, r + world_size, ...`` of each global batch,
so the union over ranks of one step is exactly the batch a single rank with
``batch_size * world_size`` rows would get. ``batch_size`` is per rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .manifest import ManifestError, load_manifest, open_shard, shard_paths


@dataclass
class Batch:
    inputs: Any  # torch.LongTensor [B, T]
    targets: Any  # torch.LongTensor [B, T]
    doc_ids: Any  # torch.IntTensor [B, T]
    segments: Any = None  # lrattnres.segments.Segments of doc_ids (built with the batch, on the host)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        moved = (x.to(device, non_blocking=non_blocking) for x in (self.inputs, self.targets, self.doc_ids))
        segments = None if self.segments is None else self.segments.to(device, non_blocking=non_blocking)
        return Batch(*moved, segments)

    def head(self, rows: int) -> "Batch":
        """The first ``rows`` rows (host tensors), with their own segments."""
        return batch_from_arrays(self.inputs[:rows], self.targets[:rows], self.doc_ids[:rows])

    def __iter__(self):  # allows `inputs, targets, doc_ids = batch`
        return iter((self.inputs, self.targets, self.doc_ids))


def batch_from_arrays(inputs, targets, doc_ids) -> Batch:
    """A Batch of host arrays or tensors [B, T], with the segments of ``doc_ids``."""
    import torch

    from lrattnres.segments import document_segments

    inputs, targets, doc_ids = (
        x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)) for x in (inputs, targets, doc_ids)
    )
    return Batch(inputs, targets, doc_ids, document_segments(doc_ids))


def batch_from_rows(rows: np.ndarray, eot_id: int) -> Batch:
    """The Batch of windows ``rows`` [B, T + 1]: inputs, shifted targets, document ids, segments."""
    inputs = rows[:, :-1]
    targets = rows[:, 1:]
    is_eot = (inputs == eot_id).astype(np.int32)
    doc_ids = np.cumsum(is_eot, axis=1, dtype=np.int32) - is_eot  # exclusive prefix count
    return batch_from_arrays(inputs, targets, doc_ids)


def _as_manifest(manifest, verify=True) -> dict:
    if isinstance(manifest, (str, os.PathLike, Path)):
        return load_manifest(manifest, verify=verify)
    if not isinstance(manifest, dict) or "_root" not in manifest:
        raise ManifestError("expected a manifest loaded with lrattnres.data.load_manifest(path), or its path")
    return manifest


class SplitTokens:
    """The memory-mapped tokens of one split, read as one array."""

    def __init__(self, manifest: dict, split: str):
        self.split = split
        self.eot_id = int(manifest["eot_id"])
        self.shards = [open_shard(p, n) for p, n in shard_paths(manifest, split) if n > 0]
        sizes = np.array([s.size for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.size = int(self.starts[-1])
        self.source = manifest.get("_path", manifest.get("_root"))

    def read(self, start: int, n: int) -> np.ndarray:
        if start < 0 or start + n > self.size:
            raise IndexError(f"tokens [{start}, {start + n}) outside split {self.split!r} of {self.size} tokens")
        out = np.empty(n, dtype=np.int64)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos, done = start, 0
        while done < n:
            shard = self.shards[k]
            off = pos - int(self.starts[k])
            take = min(n - done, shard.size - off)
            out[done:done + take] = shard[off:off + take]
            done += take
            pos += take
            k += 1
        return out


def _make_batch(data: SplitTokens, windows: np.ndarray, seq_len: int) -> Batch:
    rows = np.stack([data.read(int(w) * seq_len, seq_len + 1) for w in windows]) if len(windows) else \
        np.zeros((0, seq_len + 1), dtype=np.int64)
    return batch_from_rows(rows, data.eot_id)


class TokenLoader:
    """Infinite, deterministic, restartable, rank-aware stream of training batches (see module doc)."""

    def __init__(self, manifest, split: str, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, *, verify: bool | str = True):
        m = _as_manifest(manifest, verify)
        for name, v, lo in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("world_size", world_size, 1),
                            ("rank", rank, 0), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"TokenLoader: {name} must be an integer >= {lo}, got {v!r}")
        if rank >= world_size:
            raise ValueError(f"TokenLoader: rank {rank} must be < world_size {world_size}")
        self.manifest_sha256 = m.get("_sha256")
        self.split = split
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.global_batch = self.batch_size * self.world_size
        self.data = SplitTokens(m, split)
        self.n_windows = max(0, (self.data.size - 1) // self.seq_len)
        self.batches_per_epoch = self.n_windows // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{self.data.source}: split {split!r} has {self.data.size} tokens = {self.n_windows} windows of "
                f"{self.seq_len}+1 tokens, fewer than one global batch of {self.global_batch}"
            )
        self.epoch = 0
        self.index = 0
        self._perm_epoch = None
        self._perm = None

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def windows_for(self, epoch: int, index: int) -> np.ndarray:
        """Window indices of this rank for global batch ``index`` of ``epoch``."""
        perm = self._permutation(epoch)
        g = self.global_batch
        return perm[index * g + self.rank:(index + 1) * g:self.world_size]

    def next_batch(self) -> Batch:
        if self.index >= self.batches_per_epoch:
            self.epoch += 1
            self.index = 0
        wins = self.windows_for(self.epoch, self.index)
        self.index += 1
        return _make_batch(self.data, wins, self.seq_len)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "split": self.split,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "n_windows": self.n_windows,
            "manifest_sha256": self.manifest_sha256,
        }

    def load_state_dict(self, state: dict[str, Any], reshard: bool = False) -> None:
        """Continue where ``state`` stopped. ``reshard``: the state may come from a loader of another
        global batch (another world size or micro-batch, the same tokens per update): its position,
        counted in windows, is converted to this loader's batches; it must fall on a batch boundary."""
        keys = ("seed", "split", "seq_len", "n_windows") if reshard else ("seed", "split", "seq_len", "global_batch",
                                                                          "n_windows")
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"TokenLoader.load_state_dict: field {key!r} is {state[key]!r} in the stored state, "
                    f"{getattr(self, key)!r} in this loader"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if reshard and int(state.get("global_batch", self.global_batch)) != self.global_batch:
            windows = index * int(state["global_batch"])
            if windows % self.global_batch or windows // self.global_batch > self.batches_per_epoch:
                raise ValueError(
                    f"TokenLoader.load_state_dict: the stored position ({index} batches of {state['global_batch']} "
                    f"windows in epoch {epoch}) is not a whole number of this loader's batches of {self.global_batch} "
                    "windows within the epoch; expected a split of the same tokens per update")
            index = windows // self.global_batch
        if epoch < 0 or not 0 <= index <= self.batches_per_epoch:
            raise ValueError(f"TokenLoader.load_state_dict: bad position epoch={epoch} index={index}")
        self.epoch, self.index = epoch, index


class EvalBatches:
    """Every window of a split once, in order (see module doc).

    With ``world_size > 1`` rank ``r`` takes batches ``r, r + world_size, ...``; the ranks together
    cover the split once. ``tokens_covered`` counts the targets this rank predicts (each once);
    ``tokens_covered_all`` those of all ranks together.
    """

    def __init__(self, manifest, split: str, batch_size: int, seq_len: int, *,
                 max_batches: int | None = None, rank: int = 0, world_size: int = 1,
                 verify: bool | str = True):
        m = _as_manifest(manifest, verify)
        if batch_size < 1 or seq_len < 1:
            raise ValueError("iter_eval_batches: batch_size and seq_len must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"iter_eval_batches: rank {rank} must be in [0, world_size={world_size})")
        self.data = SplitTokens(m, split)
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.rank, self.world_size = int(rank), int(world_size)
        self.n_windows = max(0, (self.data.size - 1) // self.seq_len)
        if max_batches is not None:
            self.n_windows = min(self.n_windows, int(max_batches) * self.batch_size)
        self.tokens_total = self.data.size
        self.tokens_covered_all = self.n_windows * self.seq_len
        self._starts = list(range(0, self.n_windows, self.batch_size))[self.rank::self.world_size]
        self.tokens_covered = sum(min(self.batch_size, self.n_windows - a) for a in self._starts) * self.seq_len

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[Batch]:
        for a in self._starts:
            wins = np.arange(a, min(a + self.batch_size, self.n_windows))
            yield _make_batch(self.data, wins, self.seq_len)


def iter_eval_batches(manifest, split: str, batch_size: int, seq_len: int, *,
                      max_batches: int | None = None, rank: int = 0, world_size: int = 1,
                      verify: bool | str = True) -> EvalBatches:
    """Cover ``split`` once with non-overlapping windows, in order (the last batch may be smaller;
    the final partial window is dropped). The result is iterable, has ``len()``, and reports
    ``tokens_covered`` (targets predicted) and ``tokens_total`` (tokens in the split)."""
    return EvalBatches(manifest, split, batch_size, seq_len, max_batches=max_batches, rank=rank,
                       world_size=world_size, verify=verify)
