"""The launch-configuration candidates, as data, and the column layout.

A candidate is one line: (n, elements per thread, PREFETCH, options, where the tuner chose it).  n
is the tokens per program (BLOCK_T) of the forward and of the token-tile backward, or the sources per
step (SB) of the persistent backward; it grows for narrow chunks so that a tile [n, BLOCK_D] has at
least 512 elements; num_warps = n * BLOCK_D / (32 * elements per thread), 1 to 16.  Options: KEYCH
(build with KEY0, the key's first chunk), EVICT (evict-first source reads), STAGES (Triton's software
pipelining), TILE (the token-tile backward), PAIR (two sources per step; the pair forward at S = 2),
DEFER (the deferred backward), PERSIST (token blocks looped over by that many programs per
multiprocessor), ARGS (the configuration of the per-argument kernels, which Inductor launches
untuned).  The counts say at how many of the 90 measured shapes the tuner chose a line
(kernel_bench_h200_2026-12-01: tokens 4096 and 8192, d 1024/1536/2560, r = d, d/4, d/8, S 2 to 49).
On CUDA the tuner times every distinct candidate of a shape class; without tuning the first runs.
"""

from __future__ import annotations

KEYED = {"KEYCH": True}
EVICT = {"EVICT": True}
TILE = {"BLOCK_T": True}
ARGS = {"ARGS": True}


def _opts(*parts: dict, **more) -> dict:
    out = {}
    for p in parts:
        out.update(p)
    return {**out, **more}


FAMILIES = {
    # the forward's source loop, several chunks (d = 1536 as 3 x 512, 2560 as 5 x 512, 1024 with r < d as 2 x 512)
    "FWD_CHUNKS": (
        (4, 16, 1, _opts(KEYED, EVICT, ARGS), "4 tokens, 4 warps per chunk: 20 shapes (r < d at d = 1024 and 1536)"),
        (1, 4, 1, _opts(KEYED, EVICT), "1 token, 4 warps: 6 shapes (d = 2560, r < d, S >= 9)"),
        (4, 16, 0, _opts(KEYED, STAGES=3), "4 tokens, pipelined: 3 shapes (d = 2560, r = d/4, S 5 and 9)"),
        (1, 4, 1, {}, "1 token, 4 warps, no hint: 2 shapes (r = d, S = 5, 8192 tokens)"),
        (1, 8, 1, _opts(KEYED, EVICT), "1 token, 2 warps: 12 shapes (r = d at d = 1536 and 2560)"),
        (1, 16, 1, _opts(KEYED, EVICT), "1 token, 1 warp: 21 shapes (S = 5; d = 1024 with r < d)"),
        (1, 8, 0, _opts(KEYED, EVICT, STAGES=3), "1 token, 2 warps, pipelined: 7 shapes (r = d, S 9 to 25)"),
    ),
    # the forward's source loop, one chunk (d = 1024 with r = d, and d <= 512)
    "FWD_ONE": (
        (2, 32, 1, ARGS, "2 tokens: 1 shape (d = 1024, r = d, S = 5, 8192 tokens)"),
        (1, 16, 1, {}, "for unmeasured one-chunk widths"),
        (1, 16, 0, {}, "for unmeasured one-chunk widths"),
        (1, 8, 1, {}, "for unmeasured one-chunk widths"),
        (2, 16, 1, {}, "for unmeasured one-chunk widths"),
        (1, 32, 1, EVICT, "1 warp per 1024 columns (no cross-warp sums): 7 shapes (d = 1024, r = d)"),
    ),
    # the pair forward (exactly two sources, both at once; no next source to prefetch)
    "FWD_PAIR": (
        (1, 8, 0, _opts(KEYED, ARGS, PAIR=True), "1 token, 2 warps per 512 columns: 3 shapes (d = 2560, 8192 tokens)"),
        (1, 16, 0, _opts(KEYED, EVICT, PAIR=True), "1 token, 1 warp: 10 shapes"),
        (2, 32, 0, _opts(KEYED, EVICT, PAIR=True), "2 tokens, 1 warp: 1 shape (d = 1024, r = d/8, 8192 tokens)"),
        (1, 8, 0, _opts(KEYED, EVICT, PAIR=True), "1 token, 2 warps, hint: 2 shapes"),
        (1, 4, 0, _opts(KEYED, EVICT, PAIR=True), "1 token, 4 warps: 2 shapes (d = 2560, 4096 tokens)"),
    ),
    # the backward with the rounding residual, several chunks
    "BWD_CHUNKS": (
        (1, 4, 1, _opts(TILE, KEYED), "token tile, 4 warps: 10 shapes (r < d, S >= 25)"),
        (1, 8, 0, _opts(TILE, KEYED, ARGS, STAGES=3), "token tile, 2 warps, pipelined: the per-argument backward"),
        (1, 8, 1, _opts(TILE, KEYED), "token tile, 2 warps: 13 shapes (d = 1024, r < d)"),
        (1, 4, 0, KEYED, "persistent, 4 warps: 2 shapes (d = 2560, r = d/4, S = 9)"),
        (1, 8, 1, {}, "persistent, 2 warps: 1 shape (d = 2560, r = d, S = 9, 8192 tokens)"),
        (1, 16, 1, {}, "persistent, 1 warp: 8 shapes (d = 1536, r = d)"),
        (1, 4, 1, _opts(TILE, KEYED, PAIR=True), "two sources per step, 4 warps: 5 shapes (d = 2560, S >= 25)"),
        (1, 8, 1, _opts(TILE, KEYED, PAIR=True), "two sources per step, 2 warps: 11 shapes (d = 1536, r < d)"),
        (1, 8, 1, _opts(TILE, KEYED, PERSIST=8), "token tile looped by 8 per SM: 3 shapes (d = 2560, r = d, S <= 9)"),
    ),
    # the backward with the rounding residual, one chunk
    "BWD_ONE": (
        (1, 8, 1, {}, "persistent, 4 warps per 1024 columns: 12 shapes (d = 1024, r = d)"),
        (2, 32, 0, ARGS, "persistent, two sources per step: the per-argument backward"),
        (2, 16, 0, {}, "for unmeasured one-chunk widths"),
        (1, 16, 1, {}, "for unmeasured one-chunk widths"),
        (2, 16, 1, {}, "for unmeasured one-chunk widths"),
    ),
    # the resident pair (DEFER with PAIR: at most two sources, any key position)
    "BWD_RESIDENT_PAIR": (
        (1, 8, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True, PERSIST=16), "2 warps by 16 per SM: 4 shapes (d = 1024)"),
        (1, 4, 0, _opts(TILE, KEYED, ARGS, PAIR=True, DEFER=True, PERSIST=8), "4 warps by 8 per SM: 8 shapes"),
        (1, 16, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True, PERSIST=32), "1 warp by 32 per SM: 1 shape"),
        (1, 8, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True), "2 warps, a program per token: 3 shapes"),
        (1, 4, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True), "4 warps, a program per token: 1 shape"),
        (1, 4, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True, STAGES=2, PERSIST=4), "4 by 4 per SM, the block loop "
                                                                                  "pipelined: 3 shapes (r = d)"),
    ),
    # the two-pass deferred backward ("slice", the key past the first chunk, at most defer_max_s sources)
    "BWD_DEFERRED": (
        (1, 4, 1, _opts(TILE, KEYED, DEFER=True), "4 warps: 1 shape (d = 2560, r = d/4, S = 5, 8192 tokens)"),
        (1, 8, 1, _opts(TILE, KEYED, ARGS, DEFER=True), "2 warps: 6 shapes"),
        (1, 16, 1, _opts(TILE, KEYED, DEFER=True), "1 warp: 5 shapes (4096 tokens)"),
        (1, 8, 1, _opts(TILE, KEYED, DEFER=True, PERSIST=16), "2 warps by 16 per SM: 1 shape (d = 2560, r = d/8)"),
    ),
}

MIN_CHUNK = 128  # narrower chunks gain little from splitting a row
MAX_CHUNKS = 5  # the widest layout timed (d = 2560 as 5 x 512)
PREFERRED_CHUNK = 512  # the chunk width timed fastest at d = 1536
PAIR_MAX_S = 2  # the sources one PAIR step holds


def next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


def chunks_of(d: int, nch: int) -> tuple[int, int]:
    """(BLOCK_D, nch): nch equal power-of-two chunks covering d columns."""
    return next_pow2(-(-d // nch)), nch


def key_pos(d: int, r: int, block_d: int, nch: int) -> int:
    """The first chunk holding a key column (0 with one chunk: nothing to skip)."""
    return 0 if nch == 1 else min(nch - 1, (d - r) // block_d)


def col_layout(d: int, split: bool | int | None = None, r: int | None = None) -> tuple[int, int]:
    """(BLOCK_D, NCH): how a row of d columns is read.  The fewest columns (padding included) among
    1 to MAX_CHUNKS chunks of at least MIN_CHUNK columns; among equals the chunk width nearest
    PREFERRED_CHUNK, then fewer chunks: 1536 as 3 x 512, 2560 as 5 x 512, 1024 as 2 x 512, 513 as
    5 x 128.  With the key width r: where the key starts in the first chunk of every such layout
    (r = d), the fewest chunks (1024 as one).  ``split`` (a configuration's SPLIT) forces a layout:
    False one chunk, an int that many."""
    if split is False or split == 0:
        return chunks_of(d, 1)
    if split is not None and split is not True:
        if not 1 <= int(split) <= MAX_CHUNKS:
            raise ValueError(f"SPLIT: expected a chunk count from 1 to {MAX_CHUNKS} or a bool, got {split!r}")
        return chunks_of(d, int(split))
    layouts = [chunks_of(d, n) for n in range(1, MAX_CHUNKS + 1)]
    layouts = [(b, n) for b, n in layouts if n == 1 or b >= MIN_CHUNK]
    fewest = min(b * n for b, n in layouts)
    layouts = [(b, n) for b, n in layouts if b * n == fewest]
    if r is not None and all(key_pos(d, r, b, n) == 0 for b, n in layouts):
        return min(layouts, key=lambda x: x[1])
    pref = PREFERRED_CHUNK.bit_length()
    return min(layouts, key=lambda x: (abs(x[0].bit_length() - pref), x[1]))


def build(block_d: int, key: str, table) -> list[dict]:
    """The launch configurations of ``table``'s lines at chunk width ``block_d`` (``key``: "BLOCK_T"
    for the forward, "SB" for the backward; TILE lines use BLOCK_T), each once."""
    out = []
    for n, per_thread, prefetch, options, _why in table:
        extra = {k: v for k, v in options.items() if k != "ARGS"}
        n = max(n, 512 // block_d)
        k = "BLOCK_T" if extra.pop("BLOCK_T", False) else key
        cfg = {k: n, "num_warps": max(1, min(16, n * block_d // (32 * per_thread))), "PREFETCH": prefetch, **extra}
        if cfg not in out:
            out.append(cfg)
    return out


def family(kind: str, nch: int, form: str | None = None) -> str:
    """The family a call tunes among: the forward's loop or pair ("pair"), the residual backward, the
    resident pair ("pair") or the two-pass form ("passes")."""
    if kind == "fwd":
        return "FWD_PAIR" if form == "pair" else ("FWD_CHUNKS" if nch > 1 else "FWD_ONE")
    return {"pair": "BWD_RESIDENT_PAIR", "passes": "BWD_DEFERRED"}.get(form, "BWD_CHUNKS" if nch > 1 else "BWD_ONE")


def configs(name: str, block_d: int) -> list[dict]:
    """Family ``name``'s candidates at chunk width ``block_d``."""
    return build(block_d, "BLOCK_T" if name.startswith("FWD") else "SB", FAMILIES[name])


def candidates(kind: str, block_d: int, nch: int, forms: tuple = ()) -> list[dict]:
    """``kind``'s candidates.  ``forms``: for the forward, "pair" puts the pair forward's first (the
    default without tuning at S = 2); for a backward whose forward kept no residual, the deferred
    forms' ("pair": the resident pair, "passes": two passes), in that order."""
    if kind == "fwd":
        return (configs("FWD_PAIR", block_d) if "pair" in forms else []) + configs(family("fwd", nch), block_d)
    if not forms:
        return configs(family("bwd", nch), block_d)
    return [c for form in ("pair", "passes") if form in forms for c in configs(family("bwd", nch, form), block_d)]


def args_config(kind: str, block_d: int, nch: int, forms: tuple = ()) -> dict:
    """The per-argument kernels' configuration: the ARGS line of the family a call of these forms
    runs (the forward's pair at S = 2; the first deferred form of a residual-free backward)."""
    name = family(kind, nch, forms[0] if forms else None)
    table = FAMILIES[name]
    line = next(i for i, row in enumerate(table) if row[3].get("ARGS"))
    cfgs = configs(name, block_d)
    return cfgs[min(line, len(cfgs) - 1)]  # narrow chunks may merge lines
