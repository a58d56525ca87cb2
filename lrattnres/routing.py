"""Depth routing: the reference math of (LR-)AttnRes.

This module is the specification every faster implementation is held to
(``kernels.attnres`` among them).  It follows the paper's equations:

* a read mixes full-width sources ``o_i`` with softmax weights over
  ``q . RMSNorm(key_i)``;
* ``key_i`` is the last ``r`` coordinates of ``o_i`` (``r = len(query)``);
* ``norm="slice"`` takes the RMS over those ``r`` coordinates (LR-AttnRes),
  ``norm="full"`` takes it over all ``d`` coordinates and then slices (the
  full-width-RMS control, and the form the conversion theorem covers);
* block routing sums writes first, then slices and normalises
  (``block_ends`` gives the block boundaries, ``SourceBank`` keeps the
  embedding, the completed block sums and the current partial sum);
* projected keys (Appendix C) are separate r-wide vectors, summed over a
  block like the values and RMS-normalised over r (``route_keys``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NORMS = ("slice", "full")


def block_ends(num_writes: int, num_blocks: int | str | None) -> list[int]:
    """Write indices (1-based) that close a routing block.

    Boundaries are ``ceil(num_writes * j / N)`` for ``j = 1..N``.  ``None`` or
    ``"full"`` means full routing: every write is its own source.
    """
    if num_writes < 1:
        raise ValueError(f"num_writes must be >= 1, got {num_writes}")
    if num_blocks is None or num_blocks == "full":
        return list(range(1, num_writes + 1))
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"num_blocks must be 'full' or a positive int, got {num_blocks!r}")
    if num_blocks > num_writes:
        raise ValueError(
            f"num_blocks={num_blocks} exceeds the number of writes {num_writes} (2L); "
            "expected 1 <= N <= 2L"
        )
    return sorted({math.ceil(num_writes * j / num_blocks) for j in range(1, num_blocks + 1)})


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def routing_scores(
    sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice", eps: float = 1e-6
) -> torch.Tensor:
    """Scores ``q . RMSNorm(key_i)`` stacked on a leading source axis, in fp32 (or fp64 for fp64
    sources): [S, ...]."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if len(sources) == 0:
        raise ValueError("route needs at least one source")
    r = query.shape[-1]
    d = sources[0].shape[-1]
    if query.dim() != 1:
        raise ValueError(f"query must be 1-D [r], got shape {tuple(query.shape)}")
    if not 1 <= r <= d:
        raise ValueError(f"query width r={r} must satisfy 1 <= r <= d={d}")
    wide = _compute_dtype(sources[0])
    q = query.to(wide)
    scores = []
    for o in sources:
        if o.shape != sources[0].shape:
            raise ValueError(f"all sources must share one shape; got {tuple(o.shape)} and {tuple(sources[0].shape)}")
        o32 = o.to(wide)
        if norm == "slice":
            k = rms_norm(o32[..., d - r :], eps)
        else:
            k = rms_norm(o32, eps)[..., d - r :]
        scores.append(k @ q)
    return torch.stack(scores)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _mix(weights: torch.Tensor, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_i weights[i] * values[i], in the weights' dtype."""
    mixed = weights[0].unsqueeze(-1) * values[0].to(weights.dtype)
    for w, o in zip(weights[1:], values[1:]):
        mixed = mixed + w.unsqueeze(-1) * o.to(weights.dtype)
    return mixed


def route(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    *,
    norm: str = "slice",
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """Mix ``sources`` (each [..., d]) with routing weights from ``query`` ([r]).

    Computes in fp32 (fp64 for fp64 sources, so conversion checks can run in fp64) and returns the
    mixed value in the sources' dtype; with ``return_weights`` also returns the weights [S, ...] in
    that compute dtype.
    """
    weights = routing_scores(sources, query, norm=norm, eps=eps).softmax(dim=0)
    mixed = _mix(weights, sources)
    mixed = mixed.to(sources[0].dtype)
    return (mixed, weights) if return_weights else mixed


def route_keys(
    values: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    query: torch.Tensor,
    *,
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """Mix ``values`` ([..., d]) with weights from separate keys ([..., r]): Projected LR-AttnRes.

    Score i is ``q . RMSNorm(keys[i])`` (RMS over r); ``keys[i]`` belongs to ``values[i]``.
    Same precision rules as ``route``.
    """
    if len(values) != len(keys):
        raise ValueError(f"route_keys needs one key per value; got {len(values)} values and {len(keys)} keys")
    if query.dim() != 1 or any(k.shape[-1] != query.shape[-1] for k in keys):
        raise ValueError(f"keys must be [..., r] with r = len(query) = {query.shape[-1]}")
    wide = _compute_dtype(values[0])
    q = query.to(wide)
    weights = torch.stack([rms_norm(k.to(wide), eps) @ q for k in keys]).softmax(dim=0)
    mixed = _mix(weights, values)
    mixed = mixed.to(values[0].dtype)
    return (mixed, weights) if return_weights else mixed


class SourceBank:
    """The sources a read sees: embedding, completed block sums, current partial sum if nonempty.

    ``write(o)`` adds write t (1-based, in order) to the partial sum and closes the block when t is a
    block end; ``sources()`` lists what the read after the latest write mixes.  With full routing
    every write closes its own block, so every write is a source.
    """

    def __init__(self, first: torch.Tensor, num_writes: int, num_blocks: int | str | None):
        self._ends = set(block_ends(num_writes, num_blocks))
        self._num_writes = num_writes
        self._done = [first]
        self._partial: torch.Tensor | None = None
        self._t = 0

    def write(self, o: torch.Tensor) -> None:
        if self._t == self._num_writes:
            raise ValueError(f"SourceBank got more than num_writes={self._num_writes} writes")
        self._t += 1
        self._partial = o if self._partial is None else self._partial + o
        if self._t in self._ends:
            self._done.append(self._partial)
            self._partial = None

    def sources(self) -> list[torch.Tensor]:
        return self._done + ([] if self._partial is None else [self._partial])

    def state(self) -> tuple[list[torch.Tensor], torch.Tensor | None, int]:
        """(completed sources, partial sum or None, writes so far): what :meth:`resume` takes back, so
        that a function of tensors (an activation-checkpointed layer) can carry the bank."""
        return list(self._done), self._partial, self._t

    def resume(self, done: list[torch.Tensor], partial: torch.Tensor | None, t: int) -> "SourceBank":
        """Set the bank to a :meth:`state` (of a bank of the same writes and blocks); returns it."""
        self._done, self._partial, self._t = list(done), partial, t
        return self
