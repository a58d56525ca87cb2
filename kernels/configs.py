"""Launch-configuration candidates of the fused kernels, as data, and the column-layout rules.

A candidate is one line: (n, elements per thread, PREFETCH, options, why).  n is the tokens per
program (BLOCK_T) of the forward and of the token-tile backward, or the sources per step (SB) of the
persistent backward; it grows for narrow chunks so that a tile [n, BLOCK_D] has at least 512
elements; num_warps follows from the tile: n * BLOCK_D / (32 * elements per thread), 1 to 16.
Options: KEYCH (the key-chunk specialisation where the key starts past the first chunk), EVICT (the
evict-first hint on source reads), STAGES (Triton's software pipelining of the source loop), TILE
(the token-tile backward grid instead of the persistent one), PAIR (two sources per step; the pair
forward at S = 2), DEFER (the deferred backward, no residual), PERSIST (token blocks looped over by
that many programs per multiprocessor).  ARGS marks the configuration the per-argument kernels use
under torch.compile (Inductor launches them with no tuning).  "why" says where the tuner chose it in
the measured grid (benchmarks/results/kernel_bench_h200_2026-12-01.json: 90 shapes, 4096 and 8192
tokens, d 1024/1536/2560, r = d, d/4, d/8, S 2/5/9/25/49; the tuned choices are its runs'
tuned_configs records) or why it is kept.

On CUDA the tuner (kernels.tuner, called from kernels.op._config) times every distinct candidate of
a shape class and keeps the fastest; without tuning the first one runs.
"""

from __future__ import annotations

KEYED = {"KEYCH": True}
EVICT = {"EVICT": True}
TILE = {"BLOCK_T": True}  # the token-tile backward grid (n is then its tokens per program)
ARGS = {"ARGS": True}  # the per-argument kernels' configuration (not a launch option)


def _opts(*parts: dict, **more) -> dict:
    out = {}
    for p in parts:
        out.update(p)
    out.update(more)
    return out


# ---------------------------------------------------------------------------------------------- candidates

# The forward's source loop, several column chunks (d = 1536 as 3 x 512, 2560 as 5 x 512, 1024 with
# r < d as 2 x 512).
FWD_CHUNKS = (
    (4, 16, 1, _opts(KEYED, EVICT, ARGS), "4 tokens, 4 warps per chunk: 20 shapes (r < d at d = 1024 and 1536)"),
    (1, 4, 1, _opts(KEYED, EVICT), "1 token, 4 warps: 6 shapes (d = 2560, r = d/8 and d/4, S >= 9)"),
    (4, 16, 0, _opts(KEYED, STAGES=3), "4 tokens, pipelined: 3 shapes (d = 2560, r = d/4, S = 5 and 9)"),
    (1, 4, 1, {}, "1 token, 4 warps, no hint: 2 shapes (r = d, S = 5, 8192 tokens)"),
    (1, 8, 1, _opts(KEYED, EVICT), "1 token, 2 warps: 12 shapes (r = d at d = 1536 and 2560)"),
    (1, 16, 1, _opts(KEYED, EVICT), "1 token, 1 warp: 21 shapes (S = 5 and d = 1024 with r < d)"),
    (1, 8, 0, _opts(KEYED, EVICT, STAGES=3), "1 token, 2 warps, pipelined: 7 shapes (r = d at S 9 to 25)"),
)

# The forward's source loop, one chunk (d = 1024 with r = d; every width whose least-padded layout is one
# chunk, d <= 512 among them).  Only d = 1024 is measured; the others are kept for the unmeasured widths.
FWD_ONE = (
    (2, 32, 1, ARGS, "2 tokens: 1 shape (d = 1024, r = d, S = 5, 8192 tokens)"),
    (1, 16, 1, {}, "kept for unmeasured one-chunk widths"),
    (1, 16, 0, {}, "kept for unmeasured one-chunk widths"),
    (1, 8, 1, {}, "kept for unmeasured one-chunk widths"),
    (2, 16, 1, {}, "kept for unmeasured one-chunk widths"),
    (1, 32, 1, EVICT, "1 token, 1 warp per 1024 columns (no cross-warp sums): 7 shapes (d = 1024, r = d)"),
)

# The pair forward (exactly two sources, both loaded at once; no prefetch: there is no next source).
FWD_PAIR = (
    (1, 8, 0, _opts(KEYED, ARGS, PAIR=True), "1 token, 2 warps per 512 columns: 3 shapes (d = 2560, 8192 tokens)"),
    (1, 16, 0, _opts(KEYED, EVICT, PAIR=True), "1 token, 1 warp: 10 shapes"),
    (2, 32, 0, _opts(KEYED, EVICT, PAIR=True), "2 tokens, 1 warp: 1 shape (d = 1024, r = d/8, 8192 tokens)"),
    (1, 8, 0, _opts(KEYED, EVICT, PAIR=True), "1 token, 2 warps, hint: 2 shapes"),
    (1, 4, 0, _opts(KEYED, EVICT, PAIR=True), "1 token, 4 warps: 2 shapes (d = 2560, 4096 tokens)"),
)

# The backward with the rounding residual, several chunks.
BWD_CHUNKS = (
    (1, 4, 1, _opts(TILE, KEYED), "token tile, 4 warps: 10 shapes (r < d, S >= 25)"),
    (1, 8, 0, _opts(TILE, KEYED, ARGS, STAGES=3), "token tile, 2 warps, pipelined: the per-argument backward "
                                                  "(the 1B and 4B steps' shapes)"),
    (1, 8, 1, _opts(TILE, KEYED), "token tile, 2 warps: 13 shapes (d = 1024, r < d)"),
    (1, 4, 0, KEYED, "persistent, 4 warps: 2 shapes (d = 2560, r = d/4, S = 9)"),
    (1, 8, 1, {}, "persistent, 2 warps: 1 shape (d = 2560, r = d, S = 9, 8192 tokens)"),
    (1, 16, 1, {}, "persistent, 1 warp: 8 shapes (d = 1536, r = d)"),
    (1, 4, 1, _opts(TILE, KEYED, PAIR=True), "token tile, two sources per step, 4 warps: 5 shapes (d = 2560, S >= 25)"),
    (1, 8, 1, _opts(TILE, KEYED, PAIR=True), "token tile, two sources per step, 2 warps: 11 shapes (d = 1536, r < d)"),
    (1, 8, 1, _opts(TILE, KEYED, PERSIST=8), "token tile looped by 8 per SM: 3 shapes (d = 2560, r = d, S <= 9)"),
)

# The backward with the rounding residual, one chunk.
BWD_ONE = (
    (1, 8, 1, {}, "persistent, 4 warps per 1024 columns: 12 shapes (d = 1024, r = d)"),
    (2, 32, 0, ARGS, "persistent, two sources per step: the per-argument backward at one chunk"),
    (2, 16, 0, {}, "kept for unmeasured one-chunk widths"),
    (1, 16, 1, {}, "kept for unmeasured one-chunk widths"),
    (2, 16, 1, {}, "kept for unmeasured one-chunk widths"),
)

# The resident pair (DEFER with PAIR, at most two sources, any key position; no prefetch).
BWD_RESIDENT_PAIR = (
    (1, 8, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True, PERSIST=16), "2 warps by 16 per SM: 4 shapes (d = 1024)"),
    (1, 4, 0, _opts(TILE, KEYED, ARGS, PAIR=True, DEFER=True, PERSIST=8), "4 warps by 8 per SM: 8 shapes"),
    (1, 16, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True, PERSIST=32), "1 warp by 32 per SM: 1 shape "
                                                                      "(d = 2560, r = d/8, 8192 tokens)"),
    (1, 8, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True), "2 warps, a program per token: 3 shapes"),
    (1, 4, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True), "4 warps, a program per token: 1 shape"),
    (1, 4, 0, _opts(TILE, KEYED, PAIR=True, DEFER=True, STAGES=2, PERSIST=4), "4 warps by 4 per SM, the block loop "
                                                                              "pipelined: 3 shapes (r = d)"),
)

# The two-pass deferred backward ("slice", the key past the first chunk, at most DEFER_MAX_S sources).
BWD_DEFERRED = (
    (1, 4, 1, _opts(TILE, KEYED, DEFER=True), "4 warps: 1 shape (d = 2560, r = d/4, S = 5, 8192 tokens)"),
    (1, 8, 1, _opts(TILE, KEYED, ARGS, DEFER=True), "2 warps: 6 shapes"),
    (1, 16, 1, _opts(TILE, KEYED, DEFER=True), "1 warp: 5 shapes (4096 tokens)"),
    (1, 8, 1, _opts(TILE, KEYED, DEFER=True, PERSIST=16), "2 warps by 16 per SM: 1 shape (d = 2560, r = d/8, S = 5)"),
)


# ---------------------------------------------------------------------------------------------- column layout

MIN_CHUNK = 128  # narrower chunks gain little from splitting a row
MAX_CHUNKS = 5  # the kernel bodies name five chunks (kernels/tiles.py)
PREFERRED_CHUNK = 512  # the chunk width timed fastest at d = 1536


def next_pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


def chunks_of(d: int, nch: int) -> tuple[int, int]:
    """(BLOCK_D, nch): nch equal power-of-two chunks covering d columns."""
    return next_pow2(-(-d // nch)), nch


def key_pos(d: int, r: int, block_d: int, nch: int) -> int:
    """The first column chunk holding a key column (0 with one chunk: nothing to skip)."""
    return 0 if nch == 1 else min(nch - 1, (d - r) // block_d)


def col_layout(d: int, split: bool | int | None = None, r: int | None = None) -> tuple[int, int]:
    """(BLOCK_D, NCH): the chunk width and count (1 to MAX_CHUNKS) a row of d columns is read as.

    The layout with the fewest columns (NCH * BLOCK_D, padding included) among 1 to MAX_CHUNKS chunks of at least
    MIN_CHUNK columns; among equals, the chunk width nearest PREFERRED_CHUNK, then the fewer chunks:
    d = 1536 as 3 x 512 (one chunk would pad it to 2048 columns), 2560 as 5 x 512, 1024 as 2 x 512, 513
    as 5 x 128.  With the key width r: where the key starts in the first chunk of every such layout
    (r = d), the fewest chunks (1024 as one chunk: there is nothing to specialise, and one chunk is
    faster: kernel_sweep_h200_2026-11-30_chunks2).  ``split`` (a configuration's SPLIT) forces a
    layout: False one chunk, an int that many chunks."""
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


# ---------------------------------------------------------------------------------------------- building

PAIR_MAX_S = 2  # the sources one PAIR step holds (the kernel's pair, not a setting)


def build(block_d: int, key: str, table) -> list[dict]:
    """The launch configurations of ``table``'s lines at chunk width ``block_d`` (``key``: "BLOCK_T"
    for the forward, "SB" for the backward; TILE lines use BLOCK_T), each once, ARGS and why left out."""
    out = []
    for n, per_thread, prefetch, options, _why in table:
        extra = {k: v for k, v in options.items() if k != "ARGS"}
        n = max(n, 512 // block_d)
        k = "BLOCK_T" if extra.pop("BLOCK_T", False) else key
        cfg = {k: n, "num_warps": max(1, min(16, n * block_d // (32 * per_thread))), "PREFETCH": prefetch, **extra}
        if cfg not in out:
            out.append(cfg)
    return out


def _args_line(table) -> int:
    return next(i for i, line in enumerate(table) if line[3].get("ARGS"))


def fwd_configs(block_d: int, nch: int = 1) -> list[dict]:
    """The forward's source-loop candidates (the first is the default without tuning)."""
    return build(block_d, "BLOCK_T", FWD_CHUNKS if nch > 1 else FWD_ONE)


def fwd_pair_configs(block_d: int, nch: int = 1) -> list[dict]:
    """The pair forward's candidates (exactly two sources)."""
    return build(block_d, "BLOCK_T", FWD_PAIR)


def bwd_configs(block_d: int, nch: int = 1) -> list[dict]:
    """The residual backward's candidates."""
    return build(block_d, "SB", BWD_CHUNKS if nch > 1 else BWD_ONE)


def pair_configs(block_d: int, nch: int = 1) -> list[dict]:
    """The resident pair's candidates (DEFER with PAIR, at most two sources)."""
    return build(block_d, "SB", BWD_RESIDENT_PAIR)


def defer_configs(block_d: int, nch: int = 1) -> list[dict]:
    """The two-pass deferred backward's candidates."""
    return build(block_d, "SB", BWD_DEFERRED)


def candidates(kind: str, block_d: int, nch: int, forms: tuple = ()) -> list[dict]:
    """``kind``'s candidates.  ``forms``: for the forward, "pair" puts the pair forward's first (two
    sources; the first is then the default without tuning); for a backward whose forward kept no
    residual, those of the deferred forms named ("pair": the resident pair, "passes": two passes)."""
    if kind == "fwd":
        return (fwd_pair_configs(block_d, nch) if "pair" in forms else []) + fwd_configs(block_d, nch)
    if not forms:
        return bwd_configs(block_d, nch)
    return ((pair_configs(block_d, nch) if "pair" in forms else [])
            + (defer_configs(block_d, nch) if "passes" in forms else []))


def args_config(kind: str, block_d: int, nch: int, forms: tuple = ()) -> dict:
    """The per-argument kernels' configuration (ARGS line): the forward's or the pair forward's
    ("pair" in ``forms``); the residual backward's, or the resident pair's or the two-pass form's where
    the forward kept no residual (``forms`` as for :func:`candidates`)."""
    if kind == "fwd":
        table = FWD_PAIR if "pair" in forms else (FWD_CHUNKS if nch > 1 else FWD_ONE)
        key = "BLOCK_T"
    else:
        table = (BWD_RESIDENT_PAIR if "pair" in forms else BWD_DEFERRED if forms
                 else BWD_CHUNKS if nch > 1 else BWD_ONE)
        key = "SB"
    cfgs = build(block_d, key, table)
    return cfgs[min(_args_line(table), len(cfgs) - 1)]  # its line's place (narrow chunks may merge lines)
