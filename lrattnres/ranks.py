"""The rank grammar: how a routing-key width r is written in config.yaml and in a stage's spec.

A rank is an integer (``128``), ``"d"`` (the model's width: standard AttnRes), or ``"d/<k>"`` (the
width divided by k, which must divide it). A conversion also takes ``"k"``: the joint rank of the
checkpoint's queries, which only the conversion knows (``joint_rank``). Every rank lies between 1 and
the width. Each stage resolves its ranks here, so that a rank means the same everywhere.
"""

from __future__ import annotations

import re

from lrattnres.checks import is_int

_FRACTION = re.compile(r"^d(?:/(\d+))?$")
GRAMMAR = "an integer, 'd' or 'd/<k>'"


def resolve_rank(rank: int | str, d_model: int, *, where: str, joint_rank: int | None = None,
                 error: type[Exception] = ValueError) -> int:
    """``128`` -> 128; ``"d/8"`` -> d_model // 8; ``"d"`` -> d_model; ``"k"`` -> ``joint_rank`` (at
    least 1), where it is given. Raises ``error`` naming ``where`` for anything else, a ``k`` that
    does not divide the width, or a rank outside 1..d_model."""
    if rank == "k" and joint_rank is not None:
        value = max(int(joint_rank), 1)
    elif isinstance(rank, str):
        m = _FRACTION.match(rank)
        if not m:
            also = " or 'k' (the joint query rank)" if joint_rank is not None else ""
            raise error(f"{where}: rank {rank!r} is not {GRAMMAR}{also}")
        k = int(m.group(1) or 1)
        if k < 1 or d_model % k:
            raise error(f"{where}: rank {rank!r} does not divide the width d={d_model}")
        value = d_model // k
    elif is_int(rank):
        value = int(rank)
    else:
        raise error(f"{where}: rank {rank!r} is not {GRAMMAR}")
    if not 1 <= value <= d_model:
        raise error(f"{where}: rank {rank!r} = {value} must be between 1 and the width d={d_model}")
    return value
