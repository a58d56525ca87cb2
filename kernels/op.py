"""``attnres``: fused depth routing as a torch.library custom op with autograd (the glue around the
Triton kernels: dispatch, launchers, the CPU fallback).

Semantics are those of :func:`lrattnres.routing.route` (the model's reference; ``kernels.naive``
writes the kernels' own math out in torch): sources ``o_i`` [..., d] (a list, never stacked), query
[r] with 1 <= r <= d, key = the last r coordinates of each source, RMS over those r ("slice") or over
all d then sliced ("full"), softmax over sources of q . key, output sum_i w_i o_i computed in fp32 and
returned in the sources' dtype.

Where the code is:

- ``fused_fwd.py``, ``fused_bwd.py``: the forward and backward kernels (``tiles.py``: their shared
  pieces; ``pair.py``: the two-source paths; ``sums.py``: the query-gradient partial sums);
- ``configs.py``: the candidate launch configurations, as data, and the column layout;
- ``tuner.py``: the eager autotuner;
- this module: the settings below, which configuration a call runs (``_config``), the launchers,
  the torch.library ops, autograd and the CPU fallback.

Dispatch: eager calls on CUDA take a plain autograd.Function over the table kernels
(``_AttnResTriton``; EAGER_FUNCTION); under torch.compile, CUDA calls with at most MAX_ARG_SOURCES
sources take the ``triton_op`` pair over the per-argument kernels, which Inductor traces
(COMPILED_PATH), and other calls the opaque custom op over the table kernels.  CPU tensors run the
torch fallback (the reference math, with the kernels' saved statistics), unless the Triton path is
forced (``TRITON_INTERPRET=1`` together with ``set_cpu_triton(True)`` or ``KERNELS_CPU_TRITON=1``),
which runs the same Triton kernels through Triton's interpreter (used by the tests).

Saved for backward: the sources (kept by autograd anyway), the query, the output h (the next
sub-layer's input, so kept anyway in a model), per-token fp32 statistics [1 + 2S, tokens] (the
logsumexp, each source's score and key 1/RMS: the backward then needs one row sum per source instead
of three), and for bf16/fp16 an int8 residual per element (the mantissa bits that rounding h dropped;
the backward's g.h needs them, see kernels/tiles.py), except where the backward is deferred
(_defers: g.h from the sources, no residual).  The backward never builds an [S, tokens, d] temporary.

Environment: KERNELS_AUTOTUNE=0 turns autotuning off (the first candidate configuration runs);
KERNELS_COMPILE_THREADS sets how many threads build a shape class's candidates (1: one after
another; kernels.tuner); KERNELS_CPU_TRITON=1 sends CPU tensors to the Triton interpreter.  The other
settings are module attributes (benchmarks/kernel_bench.py --variant sets them by name).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from . import configs, tuner

NORMS = ("slice", "full")

_CPU_TRITON = os.environ.get("KERNELS_CPU_TRITON", "0") == "1"
# Tests set this to fill every freshly allocated output with NaN before the kernels run, so that an
# unwritten element shows up.
POISON = False
# Launch configuration overrides: {"fwd": {BLOCK_T, num_warps, PREFETCH}, "bwd": {SB, num_warps,
# PREFETCH}}, either optionally with num_stages, EVICT (the evict-first hint on source reads), STAGES
# (Triton's software pipelining of the source loop, 1 = none), SPLIT (the column layout, see
# configs.col_layout) and KEYCH (see configs.key_pos); the host reads SPLIT and KEYCH, the kernel never
# sees them.  A "bwd" with BLOCK_T > 0 instead of SB runs the token-tile backward (BLOCK_T tokens per
# program, one query-gradient partial row each).  PREFETCH is 0 or 1.
CONFIG_OVERRIDE: dict = {}
# Call statistics for benchmarks: set to a collections.Counter and every Triton launch adds one
# count under (kind, S, tokens, d, r, align) with align the vector width the tables allowed (a
# benchmark reads it to see which shapes a model sends and whether they load 16-byte vectors).
STATS = None


def set_cpu_triton(flag: bool) -> None:
    """Run the Triton kernels (through the interpreter) for CPU tensors too."""
    global _CPU_TRITON
    _CPU_TRITON = bool(flag)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (_CPU_TRITON and t.device.type == "cpu")


def _empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        out.fill_(float("nan") if dtype.is_floating_point else -128)
    return out


def _check(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str) -> tuple[int, int]:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if len(sources) == 0:
        raise ValueError("attnres needs at least one source")
    if query.dim() != 1:
        raise ValueError(f"query must be 1-D [r], got shape {tuple(query.shape)}")
    shape = sources[0].shape
    if len(shape) == 0:
        raise ValueError("sources must have a last (feature) dimension")
    for o in sources:
        if o.shape != shape:
            raise ValueError(f"all sources must share one shape; got {tuple(o.shape)} and {tuple(shape)}")
        if o.device != sources[0].device:
            raise ValueError("all sources must be on one device")
    d = shape[-1]
    r = query.shape[0]
    if not 1 <= r <= d:
        raise ValueError(f"query width r={r} must satisfy 1 <= r <= d={d}")
    return d, r


def _rows(t: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """A [N, d] view with unit column stride (copies only when no such view exists)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.stride(-1) != 1:
        t = t.contiguous()
    t2 = t.reshape(-1, d)  # a view when the leading dims can be flattened
    if t2.shape[0] > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


_TABLE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLE_CACHE_SIZE = 256


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows), S] table on ``device``.

    Cached by content: a table holds only offsets (relative to the anchor) and strides, so a cached
    one is right for any tensors at the same relative addresses (the caching allocator hands the
    same addresses out step after step).  A miss costs one pinned host-to-device copy, off the
    host's critical path.  Under CUDA-graph capture the tables a graph uses are kept alive.
    """
    key = (device, tuple(tuple(r) for r in rows))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    t = _TABLE_CACHE.get(key)
    if t is not None:
        _TABLE_CACHE.move_to_end(key)
        if capturing:  # a captured graph reads this tensor on every replay: never free it
            _CAPTURED.append(t)
        return t
    cpu = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        t = cpu
    else:
        pinned = cpu.pin_memory()
        t = pinned.to(device, non_blocking=True)
        if capturing:  # the graph copies from this host buffer on every replay: keep it alive
            _CAPTURED.append((pinned, t))
    _TABLE_CACHE[key] = t
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return t


# Tables (and their pinned host copies) referenced by captured CUDA graphs.
_CAPTURED: list = []


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# ---------------------------------------------------------------------------------------------- settings

# Residual of the rounded output: bits of mantissa per dtype (see kernels.tiles._res_code).
_MANT = {torch.bfloat16: 7, torch.float16: 10}
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The residual's code (kernels.tiles._res_code): for bf16 the fp32 bits below bf16's, taken by integer
# arithmetic on the bit patterns (RES_STEP 0); for fp16 (not a prefix of fp32) an exponent-scaled step.
# The same 2^-16-relative h either way; the bit code has no division and no exponent test (offline
# sm_90, d = 1536, four tokens per program: the forward 2304 -> 1184 instructions; on the H200 at
# S = 9, 8192 tokens, the forward 79 -> 70 us at d = 1536, 139 -> 116 at d = 2560: kernel_bench
# variant "scaled" in kernel_bench_h200_2026-11-30_v14_8192_a, git history).  False: the scaled code for bf16 too.
RES_BITS = True

# The forward's lazy online softmax (kernels.fused_fwd._lazy_rescale): the running mix is rescaled only
# when a score passes the reference maximum by more than LAZY_TAU, not at every source.  0 off, 1 for
# one-token programs (the branch needs no cross-warp reduction there), 2 for every forward program.
LAZY_RESCALE = 1

# The deferred backward (kernels.fused_bwd._bwd_tile_deferred) takes g.h from the sources in a first
# pass instead of from h and its int8 rounding residual, so the forward writes no residual: DRAM bytes
# S + 1 forward and 2S + 1 backward (the roofline formula's) instead of S + 1.5 and 2S + 2.5.  It
# needs key-free leading chunks ("slice", the key past the first chunk of the backward's layout),
# and it must be decided before the forward runs, from the shape alone (a fake forward must give the
# residual's shape).  Its second pass re-reads S key chunks per token, which outgrows the L2 as S
# grows: on the H200 at 8192 tokens it wins forward+backward at S = 2 and 5 (94 -> 82 and 158 -> 145 us
# at d = 1536; variant nodefer in kernel_bench_h200_2026-11-30_v14_8192_b) and loses 11-31 us at S = 9
# (variant defer16 in _v14_8192_a), so it serves up to DEFER_MAX_S sources.  False turns it off.
DEFER = True
DEFER_MAX_S = 8

# The resident pair (DEFER with PAIR, kernels.pair._bwd_tile_pairs' GH_PAIR): at S <= 2 one step of the
# two-source token tile holds every source, so g.h = sum_i w_i g.o_i comes from the tiles in hand and
# nothing is read twice: DRAM bytes 2S + 1 units (g, the sources, their gradients), for any norm and
# key position, and the residual-free forward moves 3 units instead of 3.5 at S = 2.  False turns it off.
PAIR_DEFER = True
PAIR_MAX_S = configs.PAIR_MAX_S  # the sources one PAIR step holds (the kernel's pair, not a setting)

# The pair forward (kernels.fused_fwd._fwd_body's PAIR): at S = 2 both sources' tiles are loaded at once
# and mixed with the exact two-way softmax, no source loop, no online rescale.  On the H200 at 8192
# tokens (kernel_bench_h200_2026-11-30_v17_c1_8192, variant nopairfwd = this off) the forward goes
# 38 -> 32 us at d = 2560 (fast-attnres 31-32); its candidates are timed beside the loop's
# (configs.FWD_PAIR, listed first).  False leaves them out.
PAIR_FWD = True

# Tuning (CUDA only, kernels.tuner): the fastest candidate for each shape class (d, norm, residual and
# its code, dtypes, the forward's LAZY, S, tokens rounded up to a power of two), timed over the whole
# launch as CUDA-graph replays.  False: the first candidate (also during a CUDA graph capture).
AUTOTUNE = os.environ.get("KERNELS_AUTOTUNE", "1") == "1"
BWD_PROGRAMS_PER_SM = 8  # the persistent backward's grid
# The backward's grid constexprs a configuration may leave out: one source per step, persistent grid
# (PAIR: the token-tile grid's two sources per step, off).  Every constexpr is passed, none left to a
# default: torch's analysis of which arguments a kernel writes (Inductor, compiled path) counts every
# pointer as written when the kernel has a defaulted constexpr that the launch leaves out.
_BWD_DEFAULTS = {"SB": 1, "BLOCK_T": 0, "PAIR": False, "DEFER": False, "PERSIST": 0}
_FWD_DEFAULTS = {"PAIR": False}  # the source loop (the pair forward only where a configuration asks)

# Multi-operand row reductions: None = on CUDA only (the interpreter runs them slowly).
FUSED_REDUCTIONS = None


# ---------------------------------------------------------------------------------------------- layout and forms

# The candidate tables and the layout rules live in kernels.configs; these names stay here for the
# benchmarks and tests that read them through kernels.op.
MIN_CHUNK, MAX_CHUNKS, PREFERRED_CHUNK = configs.MIN_CHUNK, configs.MAX_CHUNKS, configs.PREFERRED_CHUNK
_next_pow2 = configs.next_pow2
_chunks_of = configs.chunks_of
_col_layout = configs.col_layout
_key_pos = configs.key_pos
_fwd_configs = configs.fwd_configs
_fwd_pair_configs = configs.fwd_pair_configs
_bwd_configs = configs.bwd_configs
_pair_configs = configs.pair_configs
_defer_configs = configs.defer_configs
_candidates = configs.candidates


def _res_step(dtype: torch.dtype) -> float:
    """The kernels' RES_STEP: 0 for the bf16 bit code, else 2^-(mantissa bits + 8)."""
    if dtype == torch.bfloat16 and RES_BITS:
        return 0.0
    return 2.0 ** -(_MANT[dtype] + 8) if dtype in _MANT else 1.0


def _layout(kind: str, d: int, r: int | None = None) -> tuple[int, int]:
    """The column layout of ``kind``'s kernel for width d and key width r (CONFIG_OVERRIDE's SPLIT may
    force one)."""
    return configs.col_layout(d, CONFIG_OVERRIDE.get(kind, {}).get("SPLIT"), r)


def _key0(cfg: dict, key_pos: int) -> int:
    """KEY0 for a configuration: the key's first chunk where it asks for KEYCH, else 0."""
    return key_pos if cfg.get("KEYCH") else 0


def _stats_shape(n_sources: int, lead: tuple) -> tuple:
    """The forward's per-token statistics: logsumexp, then S scores, then S key 1/RMS."""
    return (1 + 2 * n_sources,) + tuple(lead)


def _fwd_forms(n_sources: int) -> tuple[str, ...]:
    """The forward's special forms whose candidates a call of ``n_sources`` sources tunes among: "pair"
    at exactly two sources (PAIR_FWD)."""
    return ("pair",) if (PAIR_FWD and n_sources == 2) else ()


def _check_fwd_pair(cfg: dict, n_sources: int) -> None:
    """The pair forward reads exactly two sources (a CONFIG_OVERRIDE may ask for it anywhere)."""
    if cfg.get("PAIR") and n_sources != 2:
        raise ValueError(f"attnres forward: the configuration {cfg} asks for the pair forward (PAIR), which "
                         f"reads exactly two sources; this call has {n_sources}")


def _defer_kinds(dtype: torch.dtype, d: int, r: int, norm: str, n_sources: int) -> tuple[str, ...]:
    """The forms of the deferred backward (no residual kept) that serve calls of this dtype and shape,
    in the order their candidates are listed: "pair" (the resident pair: at most PAIR_MAX_S sources),
    "passes" (the two-pass form: "slice", at most DEFER_MAX_S sources, the key past the backward
    layout's first chunk).  Empty: the residual backward.  bf16/fp16 only (fp32 keeps no residual
    anyway).  Where CONFIG_OVERRIDE pins a backward configuration, its DEFER and PAIR decide (then S
    does not matter)."""
    if not (DEFER and dtype in _MANT):
        return ()
    passes_ok = norm == "slice"
    if "bwd" in CONFIG_OVERRIDE:
        pinned = CONFIG_OVERRIDE["bwd"]
        if not pinned.get("DEFER"):
            return ()
        return ("pair",) if pinned.get("PAIR") else (("passes",) if passes_ok else ())
    kinds = ("pair",) if (PAIR_DEFER and n_sources <= PAIR_MAX_S) else ()
    if passes_ok and n_sources <= DEFER_MAX_S:
        block_d, nch = _layout("bwd", d, r)
        if configs.key_pos(d, r, block_d, nch) > 0:
            kinds += ("passes",)
    return kinds


def _defers(dtype: torch.dtype, d: int, r: int, norm: str, n_sources: int) -> bool:
    """Whether calls of this dtype and shape run the deferred backward (and so keep no residual)."""
    return bool(_defer_kinds(dtype, d, r, norm, n_sources))


def _res_kept(dtype: torch.dtype, d: int, r: int, norm: str, n_sources: int) -> bool:
    """Whether the forward writes the int8 rounding residual: bf16/fp16 unless the backward defers."""
    return dtype in _MANT and not _defers(dtype, d, r, norm, n_sources)


def _fused(dev: torch.device) -> bool:
    return dev.type == "cuda" if FUSED_REDUCTIONS is None else bool(FUSED_REDUCTIONS)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _key_masked(norm: str, d: int, r: int) -> bool:
    """The kernels' SLICE: "slice" with r < d.  At r = d the key is the whole row, the same math as
    "full", whose build has no key-column masks (offline sm_90, d = 1536 as 3 x 512, one token, 4 warps:
    the forward's source loop 232 -> 182 instructions, the backward's 236 -> 197, its registers
    119 -> 92)."""
    return norm == "slice" and r < d


def _launch_kwargs(cfg: dict, kind: str, key_pos: int) -> dict:
    """A configuration's kernel keyword arguments: EVICT off, STAGES 1 and, for the backward, the
    persistent grid with one source per step unless it names them; KEY0 from its KEYCH (a choice
    already made names KEY0); SPLIT and KEYCH dropped (the host read them)."""
    out = {"EVICT": False, "STAGES": 1}
    out.update(_BWD_DEFAULTS if kind == "bwd" else _FWD_DEFAULTS)
    out.update({k: v for k, v in cfg.items() if k not in ("SPLIT", "KEYCH")})
    out.setdefault("KEY0", _key0(cfg, key_pos))
    return out


# ---------------------------------------------------------------------------------------------- which configuration runs

# The tuned choice per (kind, BLOCK_D, chunks, key chunk, forms) + shape class (d, norm, residual,
# dtypes, the residual's code, the forward's LAZY, S, tokens rounded up to a power of two): launch
# keyword arguments with num_warps.
_CHOSEN: dict = {}


def _tune_class(n_sources: int, n_tok: int) -> tuple:
    """The part of a tuning key that follows the call's size: S, and the tokens rounded up to a power
    of two (a model sends a few token counts; varying lengths should not each be tuned)."""
    return (n_sources, configs.next_pow2(n_tok))


def _distinct(cfgs: list[dict], kind: str, key_pos: int) -> list[dict]:
    """The candidates as launch keyword arguments with num_warps, each once (a keyed candidate is its
    plain twin where the key starts in chunk 0)."""
    out = []
    for c in cfgs:
        kw = _launch_kwargs(c, kind, key_pos)
        if kw not in out:
            out.append(kw)
    return out


def _run(kernel, grid, warm: bool, *args, **kwargs):
    """Launch ``kernel`` on ``grid``, or with ``warm`` only compile it for these arguments (Triton's
    warmup: the same specialisation and cache entry as the launch) and return the compiled kernel."""
    if warm:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def _class_name(kind: str, block_d: int, nch: int, key_pos: int, forms: tuple, n_src: int, n_tok: int) -> str:
    """A shape class's name in tuned_configs and in the tuner's messages."""
    return (f"{kind}/{block_d}x{nch}" + (f"/key{key_pos}" if key_pos else "")
            + (("/deferred-" if kind == "bwd" else "/") + "+".join(forms) if forms else "")
            + f"/S{n_src}/N{n_tok}")


def _config(kind: str, block_d: int, nch: int, key_pos: int, device: torch.device, key: tuple, launch,
            forms: tuple = ()) -> dict:
    """Launch keyword arguments for this call: CONFIG_OVERRIDE's; the first candidate on the CPU, with
    AUTOTUNE off, or while a CUDA graph is being captured (nothing can be timed then, and nothing is
    remembered); else the fastest candidate for ``key`` (kernels.tuner.fastest), timed once with
    ``launch(cfg)`` (which must run the whole launch, so that a grid's extra work is counted).
    ``forms``: see configs.candidates (the forward's pair; the deferred forms of a backward whose
    forward kept no residual)."""
    if kind in CONFIG_OVERRIDE:
        return _launch_kwargs(CONFIG_OVERRIDE[kind], kind, key_pos)
    tk = (kind, block_d, nch, key_pos, forms) + key
    chosen = _CHOSEN.get(tk)
    if chosen is not None:
        return chosen
    if device.type != "cuda" or not AUTOTUNE or torch.cuda.is_current_stream_capturing():
        return _first(kind, block_d, nch, key_pos, forms)
    cands = _distinct(configs.candidates(kind, block_d, nch, forms), kind, key_pos)
    tag = _class_name(kind, block_d, nch, key_pos, forms, *key[-2:])
    chosen = _CHOSEN[tk] = tuner.fastest(cands, launch, device, tag)
    return chosen


@functools.lru_cache(maxsize=None)
def _first(kind: str, block_d: int, nch: int, key_pos: int, forms: tuple = ()) -> dict:
    """The first candidate's launch keyword arguments (the default without tuning; not to be mutated)."""
    return _launch_kwargs(configs.candidates(kind, block_d, nch, forms)[0], kind, key_pos)


def tuned_configs() -> dict:
    """The configurations tuning chose so far: {"fwd/512x3/key2/S9/N8192": {...}, ...} (chunk width x
    chunks, the key's first chunk where it is not the first, the forms it chose among: "pair" for the
    forward, "deferred-" and the deferred forms for the deferred backward; sources, tokens rounded up),
    and the partial sum's method per shape: {"sum/4224x320/bfloat16": {"method": "once"}, ...}."""
    out = {}
    for (kind, block_d, nch, key_pos, forms, *key), cfg in _CHOSEN.items():
        out[_class_name(kind, block_d, nch, key_pos, forms, *key[-2:])] = dict(cfg)
    for (n_rows, r, dtype, _), method in _SUM_CHOSEN.items():
        out[f"sum/{n_rows}x{r}/{str(dtype).removeprefix('torch.')}"] = {"method": method}
    return out


def _anchor_table(tensors: list[torch.Tensor], strides: list[int] | None):
    """Element offsets of ``tensors`` from the first one, and the ALIGN hint (elements)."""
    esz = tensors[0].element_size()
    p0 = tensors[0].data_ptr()
    offs = [(t.data_ptr() - p0) // esz for t in tensors]
    vec = max(1, 16 // esz)
    ok = p0 % 16 == 0 and all(o % vec == 0 for o in offs) and all(s % vec == 0 for s in (strides or []))
    return offs, (vec if ok else 1)


# ----------------------------------------------------------------------------------------------
# Triton launchers (also run on CPU tensors under TRITON_INTERPRET=1)
#
# They run twice per routing read (768 times per update of the 1B step), and a compiled step whose
# GPU work is short waits for them: so no per-source views or copies where the tensors can be read
# in place, outputs allocated in their final shape, and a tuned choice looked up by one dictionary key.


def _row_stride(t: torch.Tensor, d: int) -> int | None:
    """Row stride of ``t`` read in place as [tokens, d], or None when that needs a copy (a feature
    stride other than 1, or leading dimensions that do not flatten into one)."""
    if t.is_contiguous():
        return d
    st = t.stride()
    if t.dim() == 0 or st[-1] != 1:
        return None
    rs = None
    span = 0
    for size, stride in zip(reversed(t.shape[:-1]), reversed(st[:-1])):
        if size == 1:
            continue
        if rs is None:
            rs = stride
        elif stride != span:
            return None
        span = stride * size
    return d if rs is None else rs


def _as_rows(ts: Sequence[torch.Tensor], d: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors to address as [tokens, d] rows of ``dtype``, and their row strides (a copy only
    for a tensor that cannot be read in place)."""
    out, strides = [], []
    for t in ts:
        rs = _row_stride(t, d) if t.dtype == dtype else None
        if rs is None:
            t = _rows(t, d, dtype)
            rs = t.stride(0) if t.shape[0] > 1 else d
        out.append(t)
        strides.append(rs)
    return out, strides


def _fwd_outputs(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str):
    """Checks, then (d, r, tokens, whether a rounding residual is kept, h, statistics, residual)."""
    d, r = _check(sources, query, norm)
    s0 = sources[0]
    dtype, dev, lead = s0.dtype, s0.device, tuple(s0.shape[:-1])
    has_res = _res_kept(dtype, d, r, norm, len(sources))
    out = _empty(lead + (d,), dtype, dev)
    stats = _empty(_stats_shape(len(sources), lead), torch.float32, dev)
    res = _empty(lead + (d,) if has_res else (0,), torch.int8, dev)
    return d, r, s0.numel() // d, has_res, out, stats, res


def _fwd_triton(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str, eps: float):
    from . import fused_fwd as K

    d, r, n_tok, has_res, out, stats, res = _fwd_outputs(sources, query, norm)
    dtype, dev = out.dtype, out.device
    if n_tok > 0:
        rows, strides = _as_rows(sources, d, dtype)
        offs, align = _anchor_table(rows, strides)
        table = _table([offs, strides], dev)
        block_d, nch = _layout("fwd", d, r)
        if STATS is not None:
            STATS[("fwd", len(rows), n_tok, d, r, align)] += 1
        key = (d, norm == "slice", has_res, dtype, query.dtype, _res_step(dtype), LAZY_RESCALE) + _tune_class(
            len(rows), n_tok)
        key_pos = _key_pos(d, r, block_d, nch)
        args = (rows[0], table[0], table[1], query.contiguous(), out, res if has_res else out, stats,
                n_tok, len(rows), d, r, 1.0 / (r if norm == "slice" else d), float(eps))
        consts = dict(SLICE=_key_masked(norm, d, r), HAS_RES=has_res, RES_STEP=_res_step(dtype), ALIGN=align,
                      BLOCK_D=block_d, NCH=nch, FUSED=_fused(dev), LAZY=LAZY_RESCALE)

        def launch(cfg, warm=False):  # with ``warm``: compile only, and return the compiled kernel
            return _run(K._attnres_fwd_kernel, (triton_cdiv(n_tok, cfg["BLOCK_T"]),), warm, *args, **consts, **cfg)

        cfg = _config("fwd", block_d, nch, key_pos, dev, key, launch, _fwd_forms(len(rows)))
        _check_fwd_pair(cfg, len(rows))
        launch(cfg)
    return out, stats, res


def _bwd_inputs(sources, query, h, res, g, norm: str):
    """Checks and the backward's operands: (d, r, tokens, residual kept, the deferred forms that can
    serve (_defer_kinds; empty where the forward kept the residual), source gradients, h and g as rows,
    g's row stride), or (None, gradients, query gradient) when no kernel needs to run (one source, no
    tokens)."""
    d, r = _check(sources, query, norm)
    s0 = sources[0]
    dtype, dev = s0.dtype, s0.device
    n_tok = s0.numel() // d
    if len(sources) == 1:
        # one source: w = 1, h = o, dz = 0 exactly; the query gets no gradient.  A copy, never g
        # itself: a custom op's output may not alias its input (torch.library refuses it)
        grad = g.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        return None, [grad.view(s0.shape)], torch.zeros_like(query)
    grads = [_empty(o.shape, dtype, dev) for o in sources]
    if n_tok == 0:
        return None, grads, torch.zeros_like(query)
    h2 = h if (h.dtype == dtype and h.is_contiguous()) else _rows(h, d, dtype).contiguous()
    (g,), (gs,) = _as_rows([g], d, g.dtype)
    has_res = dtype in _MANT and res.numel() > 0
    deferred = ()
    if dtype in _MANT and res.numel() == 0:  # the forward kept no residual: see _defers
        deferred = _defer_kinds(dtype, d, r, norm, len(sources))
        if not deferred:
            raise ValueError(f"attnres backward: the forward kept no rounding residual, but no deferred backward "
                             f"serves this shape now (S = {len(sources)}, d = {d}, r = {r}, norm {norm!r}): were "
                             "DEFER, PAIR_DEFER or CONFIG_OVERRIDE changed between the forward and the backward?")
    return (d, r, n_tok, has_res, deferred, grads, h2, g, gs), None, None


def _bwd_programs(cfg: dict, n_tok: int, dev: torch.device) -> int:
    """Programs of the backward's grid under ``cfg``: one per BLOCK_T tokens (token-tile kernel), or
    BWD_PROGRAMS_PER_SM per multiprocessor (persistent kernel).  Each writes one query-gradient
    partial row."""
    bt = cfg.get("BLOCK_T", 0)
    if bt and cfg.get("PERSIST"):  # token blocks looped over by PERSIST programs per multiprocessor
        return max(1, min(triton_cdiv(n_tok, bt), cfg["PERSIST"] * _num_sms(dev)))
    if bt:
        return triton_cdiv(n_tok, bt)
    return max(1, min(n_tok, BWD_PROGRAMS_PER_SM * _num_sms(dev)))


def _bwd_scratch(cfg: dict, n_tok: int, n_sources: int, r: int, dev: torch.device):
    """The backward's fp32 work buffers under launch keywords ``cfg``: the query-gradient partials
    (one row per program) and, for the two-pass deferred backward, its g.o scratch [S, tokens] (else
    None)."""
    part = _empty((_bwd_programs(cfg, n_tok, dev), r), torch.float32, dev)
    go = _empty((n_sources, n_tok), torch.float32, dev) if (cfg["DEFER"] and not cfg["PAIR"]) else None
    return part, go


# The sum of the query-gradient partials [programs, r] fp32 (one row per backward program):
# "triton" (kernels.sums._sum_rows_kernel, two launches over slabs of rows, deterministic),
# "once" (_sum_rows_once_kernel: the same slabs and order in one launch, the last program to finish a
# column block summing the slabs; needs a zeroed counter, _sum_counts), "torch" (part.sum(0), then a
# cast), or "auto": all three timed once per (rows, r, dtype) on CUDA and the fastest kept (the
# two-launch Triton sum where nothing can be timed: on the CPU, or during graph capture with no choice
# made yet).  Why: torch's reduction over [1056, 384] runs on 51 blocks, 10.8 us under ncu, a fifth of
# the backward at S = 2; with torch.profiler in kernel_bench at 8192 tokens torch's takes 7-21 us at
# [1056-8192 rows, 192-1024 columns], the two-launch sum 3.6-10 us at such sizes.
DQ_SUM = "auto"
SUM_BLOCK_P, SUM_BLOCK_R, SUM_WARPS = 64, 64, 4  # a slab step [rows, columns] and its warps
SUM_PROGRAMS_PER_SM = 4  # the first launch's programs per multiprocessor (rows split into that many slabs)
# "once": each call takes the next row of a ring of zeroed counters [SUM_COUNT_RING, column blocks]
# per device and width; the kernel sets its row back to 0.  Two sums share a row only when
# SUM_COUNT_RING calls apart, so sums on different streams (or graphs replayed on different streams)
# do not count into each other's row unless that many calls separate them.
SUM_COUNT_RING = 1024
_SUM_CHOSEN: dict = {}
_SUM_COUNTS: dict = {}  # (device, column blocks) -> [counters int32 [SUM_COUNT_RING, blocks], next row]


def _sum_splits(n_rows: int, r: int, device: torch.device) -> int:
    """How many slabs the partial rows are cut into: about SUM_PROGRAMS_PER_SM programs per
    multiprocessor over the column blocks, at least SUM_BLOCK_P rows per slab."""
    ncb = triton_cdiv(r, SUM_BLOCK_R)
    programs = SUM_PROGRAMS_PER_SM * _num_sms(device)
    return max(1, min(triton_cdiv(programs, ncb), triton_cdiv(n_rows, SUM_BLOCK_P)))


def _sum_rows_triton(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """part [P, r] fp32 summed over its rows with _sum_rows_kernel: P split into slabs (_sum_splits),
    then the slabs summed into ``dtype`` (one launch when a single slab would do)."""
    from . import sums as K

    n_rows, r = part.shape
    ncb = triton_cdiv(r, SUM_BLOCK_R)
    out = _empty((r,), dtype, part.device)
    splits = _sum_splits(n_rows, r, part.device)
    src = part
    if splits > 1:
        src = _empty((splits, r), torch.float32, part.device)
        K._sum_rows_kernel[(splits, ncb)](part, src, n_rows, r, triton_cdiv(n_rows, splits), BLOCK_P=SUM_BLOCK_P,
                                          BLOCK_R=SUM_BLOCK_R, num_warps=SUM_WARPS)
    K._sum_rows_kernel[(1, ncb)](src, out, src.shape[0], r, src.shape[0], BLOCK_P=SUM_BLOCK_P, BLOCK_R=SUM_BLOCK_R,
                                 num_warps=SUM_WARPS)
    return out


def _sum_counts(device: torch.device, ncb: int):
    """The next row of zeroed counters for a one-launch sum over ``ncb`` column blocks, or None during
    graph capture before this device and width have a ring (a ring made inside a capture would come from
    the graph's private memory).  Rings are never freed: a captured graph keeps their address."""
    key = (device, ncb)
    ring = _SUM_COUNTS.get(key)
    if ring is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ring = _SUM_COUNTS[key] = [torch.zeros((SUM_COUNT_RING, ncb), dtype=torch.int32, device=device), 0]
    row = ring[0][ring[1]]
    ring[1] = (ring[1] + 1) % ring[0].shape[0]
    return row


def _sum_rows_once(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """part [P, r] fp32 summed over its rows in one launch (_sum_rows_once_kernel), with the slabs and
    the order of _sum_rows_triton, so the same bits; the two-launch sum where a single slab would do or
    no counters can be had (_sum_counts)."""
    from . import sums as K

    n_rows, r = part.shape
    ncb = triton_cdiv(r, SUM_BLOCK_R)
    splits = _sum_splits(n_rows, r, part.device)
    counts = _sum_counts(part.device, ncb) if splits > 1 else None
    if counts is None:
        return _sum_rows_triton(part, dtype)
    out = _empty((r,), dtype, part.device)
    slabs = _empty((splits, r), torch.float32, part.device)
    K._sum_rows_once_kernel[(splits, ncb)](part, slabs, out, counts, n_rows, r, triton_cdiv(n_rows, splits), splits,
                                           BLOCK_P=SUM_BLOCK_P, BLOCK_R=SUM_BLOCK_R, BLOCK_S=SUM_BLOCK_P,
                                           num_warps=SUM_WARPS)
    return out


def _sum_rows_torch(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return part.sum(0).to(dtype)


_SUMS = {"triton": _sum_rows_triton, "once": _sum_rows_once, "torch": _sum_rows_torch}


def _sum_partials(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The query gradient from its partial rows, by DQ_SUM's method."""
    mode = DQ_SUM
    if mode not in ("auto", *_SUMS):
        raise ValueError("kernels.op.DQ_SUM: expected 'auto', 'triton', 'once' or 'torch', "
                         f"got {mode!r}")
    if mode == "auto":
        key = (part.shape[0], part.shape[1], dtype, part.device)
        mode = _SUM_CHOSEN.get(key)
        if mode is None:
            if part.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
                mode = "triton"
            else:  # timed as the launch configurations are (nothing to compile ahead)
                mode = _SUM_CHOSEN[key] = tuner.fastest(
                    list(_SUMS), lambda name, warm=False: None if warm else _SUMS[name](part, dtype), part.device,
                    f"sum/{part.shape[0]}x{part.shape[1]}")
    return _SUMS[mode](part, dtype)


def _bwd_triton(sources, query, h, stats, res, g, norm: str, eps: float):
    from . import fused_bwd as K

    ops, grads, dq = _bwd_inputs(sources, query, h, res, g, norm)
    if ops is None:
        return grads, dq
    d, r, n_tok, has_res, deferred, grads, h2, g, gs = ops
    dtype, dev = h2.dtype, h2.device
    res2 = res.contiguous() if has_res else h2
    stats2 = stats.contiguous()
    block_d, nch = _layout("bwd", d, r)
    rows, strides = _as_rows(sources, d, dtype)
    offs, align = _anchor_table(rows, strides)
    goffs, galign = _anchor_table(grads, [d])
    table = _table([offs, strides, goffs], dev)
    if STATS is not None:
        STATS[("bwd", len(rows), n_tok, d, r, min(align, galign))] += 1
    key = (d, norm == "slice", has_res, dtype, query.dtype, g.dtype, _res_step(dtype)) + _tune_class(len(rows), n_tok)
    key_pos = _key_pos(d, r, block_d, nch)
    args = (rows[0], table[0], table[1], grads[0], table[2], query.contiguous(), h2, res2, g, stats2)
    more = (n_tok, len(rows), d, r, gs, 1.0 / (r if norm == "slice" else d), float(eps))
    consts = dict(SLICE=_key_masked(norm, d, r), HAS_RES=has_res, RES_STEP=_res_step(dtype), ALIGN=align, GALIGN=galign,
                  BLOCK_D=block_d, NCH=nch)

    def launch(cfg, warm=False):  # the kernel and the sum of its query-gradient partials (one row per program)
        part, go = _bwd_scratch(cfg, n_tok, len(rows), r, dev)
        kernel = _run(K._attnres_bwd_kernel, (part.shape[0],), warm, *args, part, go, *more, **consts, **cfg)
        return kernel if warm else _sum_partials(part, query.dtype)  # warm: compile only

    cfg = _config("bwd", block_d, nch, key_pos, dev, key, launch, deferred)
    _check_deferred(cfg, deferred, key_pos, len(rows))
    return grads, launch(cfg)


def _check_deferred(cfg: dict, deferred: tuple, key_pos: int, n_sources: int) -> None:
    """A forward that kept no residual needs the deferred backward; the deferred backward needs the
    token-tile grid, and either the pair (PAIR) with at most PAIR_MAX_S sources or the key past the
    first chunk (two passes)."""
    if deferred and not cfg["DEFER"]:
        raise ValueError("attnres backward: the forward kept no rounding residual (the deferred backward was "
                         f"chosen for this shape), but the backward configuration {cfg} does not ask for DEFER")
    if not cfg["DEFER"]:
        return
    if not cfg["BLOCK_T"]:
        raise ValueError(f"attnres backward: DEFER needs the token-tile grid (BLOCK_T > 0); got {cfg}")
    if cfg["PAIR"] and n_sources > PAIR_MAX_S:
        raise ValueError(f"attnres backward: DEFER with PAIR (the resident pair) holds at most {PAIR_MAX_S} "
                         f"sources; got {n_sources} with {cfg}")
    if not cfg["PAIR"] and cfg["KEY0"] < 1:
        raise ValueError(f"attnres backward: the two-pass DEFER needs the key past the first column chunk "
                         f"(KEYCH, key chunk {key_pos}); got {cfg}")


# ----------------------------------------------------------------------------------------------
# Torch fallback (CPU): the reference forward, and the backward written out in fp32 torch


def _res_encode(h32: torch.Tensor, hb: torch.Tensor) -> torch.Tensor:
    """int8 residual of rounding ``h32`` to ``hb`` (same code as the kernels)."""
    if hb.dtype not in _MANT:
        return torch.empty(0, dtype=torch.int8, device=hb.device)
    hb32 = hb.float()
    if _res_step(hb.dtype) == 0:
        code = (h32.float().view(torch.int32) - hb32.view(torch.int32) + 128) >> 8
        return code.clamp(-127, 127).to(torch.int8)
    ebits = hb32.view(torch.int32) & 0x7F800000
    ok = (ebits > 0) & (ebits < 0x7F800000)
    step = torch.where(ok, ebits.view(torch.float32) * _res_step(hb.dtype), 1.0)
    code = torch.floor((h32 - hb32) / step + 0.5).clamp(-127, 127)
    return torch.where(ok, code, 0.0).to(torch.int8)


def _res_decode(hb: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """h at about 2^-16 relative accuracy from its rounded value and residual (h itself when no
    residual is kept)."""
    if hb.dtype not in _MANT or res.numel() == 0:
        return hb
    hb32 = hb.float()
    if _res_step(hb.dtype) == 0:
        return (hb32.view(torch.int32) + res.to(torch.int32) * 256).view(torch.float32)
    ebits = hb32.view(torch.int32) & 0x7F800000
    ok = (ebits > 0) & (ebits < 0x7F800000)
    return torch.where(ok, hb32 + res.float() * (ebits.view(torch.float32) * _res_step(hb.dtype)), hb32)


def _scores_torch(sources, query, norm: str, eps: float):
    """Each source's score z_i and key 1/RMS rinv_i, [S, ...] in fp32 (fp64 for fp64 sources)."""
    d, r = _check(sources, query, norm)
    wide = torch.promote_types(sources[0].dtype, torch.float32)
    q = query.to(wide)
    zs, rinvs = [], []
    for o in sources:
        x = o.to(wide)
        k = x[..., d - r :] if norm == "slice" else x
        rinv = torch.rsqrt(k.pow(2).mean(-1) + eps)
        zs.append((x[..., d - r :] @ q) * rinv)
        rinvs.append(rinv)
    return torch.stack(zs), torch.stack(rinvs)


def _fwd_torch(sources, query, norm: str, eps: float):
    z, rinv = _scores_torch(sources, query, norm, eps)
    lse = torch.logsumexp(z, dim=0)
    w = torch.exp(z - lse)
    h = w[0].unsqueeze(-1) * sources[0].to(w.dtype)
    for wi, o in zip(w[1:], sources[1:]):
        h = h + wi.unsqueeze(-1) * o.to(w.dtype)
    hb = h.to(sources[0].dtype)
    d, r = sources[0].shape[-1], query.shape[-1]
    kept = _res_kept(hb.dtype, d, r, norm, len(sources))
    res = _res_encode(h, hb) if kept else torch.empty(0, dtype=torch.int8, device=hb.device)
    return hb, torch.cat([lse.unsqueeze(0), z, rinv]), res


def _bwd_torch(sources, query, h, stats, res, g, norm: str, eps: float):
    """The backward in torch from the forward's statistics (the kernels' math, any device)."""
    d, r = _check(sources, query, norm)
    S = len(sources)
    wide = stats.dtype
    q = query.to(wide)
    g = g.to(wide)
    gos = None  # g.o_i, where g.h needs them first
    if h.dtype in _MANT and res.numel() == 0:  # no residual kept (_defers): g.h = sum_i w_i g.o_i
        gos = [(g * o.to(wide)).sum(-1) for o in sources]
        gh = sum(torch.exp(stats[1 + i] - stats[0]) * go for i, go in enumerate(gos))
    else:
        gh = (g * _res_decode(h, res).to(wide)).sum(-1)
    n = r if norm == "slice" else d
    dq = torch.zeros(r, dtype=wide, device=query.device)
    grads = []
    for i, o in enumerate(sources):
        x = o.to(wide)
        z, rinv = stats[1 + i], stats[1 + S + i]
        w = torch.exp(z - stats[0])
        go = gos[i] if gos is not None else (g * x).sum(-1)
        c = w * (go - gh) * rinv  # dL/dz_i * rinv_i
        coef = (c * z * rinv / n).unsqueeze(-1)
        grad = w.unsqueeze(-1) * g
        grad[..., d - r :] += c.unsqueeze(-1) * q
        if norm == "slice":
            grad[..., d - r :] -= coef * x[..., d - r :]
        else:
            grad -= coef * x
        grads.append(grad.to(o.dtype))
        dq += (c.unsqueeze(-1) * x[..., d - r :]).reshape(-1, r).sum(0)
    return grads, dq.to(query.dtype)


# ----------------------------------------------------------------------------------------------
# torch.library ops


def _triton_ok(t: torch.Tensor) -> bool:
    return _use_triton(t) and t.dtype in TRITON_DTYPES


@torch.library.custom_op("lrattnres_kernels::attnres_fwd", mutates_args=())
def attnres_fwd(sources: list[torch.Tensor], query: torch.Tensor, norm: str, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (h [..., d] in the sources' dtype, statistics [1 + 2S, ...] fp32 (the logsumexp of
    the scores, the S scores, the S key 1/RMS), int8 residual of rounding h to its dtype [..., d]
    (empty for fp32))."""
    if _triton_ok(sources[0]):
        return _fwd_triton(sources, query, norm, eps)
    return _fwd_torch(sources, query, norm, eps)


@attnres_fwd.register_fake
def _(sources, query, norm, eps):
    _check(sources, query, norm)
    s0 = sources[0]
    res_shape = s0.shape if _res_kept(s0.dtype, s0.shape[-1], query.shape[-1], norm, len(sources)) else (0,)
    stats = s0.new_empty(_stats_shape(len(sources), s0.shape[:-1]), dtype=torch.promote_types(s0.dtype, torch.float32))
    return s0.new_empty(s0.shape), stats, s0.new_empty(res_shape, dtype=torch.int8)


@torch.library.custom_op("lrattnres_kernels::attnres_bwd", mutates_args=())
def attnres_bwd(
    sources: list[torch.Tensor], query: torch.Tensor, h: torch.Tensor, stats: torch.Tensor, res: torch.Tensor,
    g: torch.Tensor, norm: str, eps: float,
) -> list[torch.Tensor]:
    """Returns the S source gradients followed by the query gradient."""
    if _triton_ok(sources[0]):
        grads, dq = _bwd_triton(sources, query, h, stats, res, g, norm, eps)
    else:
        grads, dq = _bwd_torch(sources, query, h, stats, res, g, norm, eps)
    return list(grads) + [dq]


@attnres_bwd.register_fake
def _(sources, query, h, stats, res, g, norm, eps):
    return [s.new_empty(s.shape) for s in sources] + [query.new_empty(query.shape)]


def _setup_context(ctx, inputs, output):
    sources, query, norm, eps = inputs
    h, stats, res = output
    ctx.save_for_backward(query, h, stats, res, *sources)
    ctx.norm = norm
    ctx.eps = eps


def _backward_through(bwd_op):
    """The registered backward of a forward op whose saved tensors _setup_context chose: calls
    ``bwd_op`` (the custom op or the triton_op backward)."""

    def backward(ctx, grad_h, grad_stats, grad_res):
        query, h, stats, res, *sources = ctx.saved_tensors
        if grad_h is None:
            grad_h = torch.zeros_like(h)
        out = bwd_op(list(sources), query, h, stats, res, grad_h, ctx.norm, ctx.eps)
        return list(out[:-1]), out[-1], None, None

    return backward


attnres_fwd.register_autograd(_backward_through(attnres_bwd), setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Compiled path: torch.library.triton_op over the per-argument kernels
#
# Inside torch.compile a custom op is opaque: every call goes back to Python, through the
# dispatcher and the launchers above (about 1.6 ms of host time per read on the H200's host,
# host_overhead_h200_2026-11-29.json in the git history of benchmarks/results), and the 1B step makes 384 reads per
# update, so the GPU waits for the host.  A triton_op instead lets Inductor trace the body (the
# allocations and the Triton launches) into its own generated code.  The body must be traceable:
# no data pointers, hence one pointer argument per source (at most MAX_ARG_SOURCES) and no
# tables.  Larger S keeps the custom op.  COMPILED_PATH "op" sends compiled calls to the custom op
# too (for comparison: benchmarks/train_step_bench.py's *-op configurations).

MAX_ARG_SOURCES = 16
COMPILED_PATH = "triton_op"
# The per-argument kernels' launch configurations (Inductor launches them with no autotuner): the
# ARGS lines of kernels.configs.  The forward's and the residual backward's are the per-argument
# kernels' fastest at the 1B step's shapes (4096 tokens, d 1536, r 384, S = 9: kernel_sweep_h200_
# 2026-11-30_key.md and, for the four-token forward, _chunks2.md); the deferred forms' and the pair
# forward's are the table kernels' most frequent tuned choices (the per-argument kernels' own are not
# timed).


def _args_config(kind: str, block_d: int, nch: int, forms: tuple = ()) -> dict:
    """The per-argument kernels' configuration: CONFIG_OVERRIDE's, else configs.args_config.  ``forms``
    as for configs.candidates: the forward's (_fwd_forms: "pair" at S = 2), the backward's deferred ones."""
    if kind in CONFIG_OVERRIDE:
        return dict(CONFIG_OVERRIDE[kind])
    return configs.args_config(kind, block_d, nch, forms)


def _slots(ts: Sequence, fill=None) -> list:
    """``ts`` padded with ``fill`` to MAX_ARG_SOURCES kernel arguments."""
    return list(ts) + [fill] * (MAX_ARG_SOURCES - len(ts))


def _launch(kernel, grid, *args, **kwargs) -> None:
    """Launch through torch.library.wrap_triton, so that a trace records the kernel."""
    torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


def _fwd_args(sources: Sequence[torch.Tensor], query: torch.Tensor, norm: str, eps: float):
    from . import fused_fwd as K

    d, r, n_tok, has_res, out, stats, res = _fwd_outputs(sources, query, norm)
    dtype, dev = out.dtype, out.device
    if n_tok > 0:
        rows, strides = _as_rows(sources, d, dtype)
        block_d, nch = _layout("fwd", d, r)
        cfg = _args_config("fwd", block_d, nch, _fwd_forms(len(rows)))
        _check_fwd_pair(cfg, len(rows))
        if STATS is not None:  # counted when traced, not per run, under torch.compile
            STATS[("fwd-args", len(rows), n_tok, d, r)] += 1
        _launch(
            K._attnres_fwd_args_kernel, (triton_cdiv(n_tok, cfg["BLOCK_T"]),),
            *_slots(rows), *_slots(strides), query.contiguous(), out, res if has_res else None, stats,
            n_tok, len(rows), d, r,
            NSLOT=len(rows), EPS=float(eps), SLICE=_key_masked(norm, d, r), HAS_RES=has_res, RES_STEP=_res_step(dtype),
            BLOCK_D=block_d, NCH=nch, FUSED=_fused(dev), LAZY=LAZY_RESCALE,
            **_launch_kwargs(cfg, "fwd", _key_pos(d, r, block_d, nch)),
        )
    return out, stats, res


def _bwd_args(sources, query, h, stats, res, g, norm: str, eps: float):
    from . import fused_bwd as K

    ops, grads, dq = _bwd_inputs(sources, query, h, res, g, norm)
    if ops is None:
        return grads, dq
    d, r, n_tok, has_res, deferred, grads, h2, g, gs = ops
    dtype = h2.dtype
    block_d, nch = _layout("bwd", d, r)
    rows, strides = _as_rows(sources, d, dtype)
    key_pos = _key_pos(d, r, block_d, nch)
    kw = _launch_kwargs(_args_config("bwd", block_d, nch, deferred), "bwd", key_pos)
    _check_deferred(kw, deferred, key_pos, len(rows))
    part, go = _bwd_scratch(kw, n_tok, len(rows), r, h2.device)
    if STATS is not None:  # counted when traced, not per run, under torch.compile
        STATS[("bwd-args", len(rows), n_tok, d, r)] += 1
    _launch(
        K._attnres_bwd_args_kernel, (part.shape[0],),
        *_slots(rows), *_slots(strides), *_slots(grads), query.contiguous(), h2,
        res.contiguous() if has_res else None, g, stats.contiguous(), part, go,
        n_tok, len(rows), d, r, gs,
        NSLOT=len(rows), EPS=float(eps), SLICE=_key_masked(norm, d, r), HAS_RES=has_res, RES_STEP=_res_step(dtype),
        BLOCK_D=block_d, NCH=nch, **kw,
    )
    return grads, _sum_rows_torch(part, query.dtype)  # torch's sum, which Inductor compiles (no tuning here)


@torch.library.triton_op("lrattnres_kernels::attnres_fwd_args", mutates_args=())
def attnres_fwd_args(sources: list[torch.Tensor], query: torch.Tensor, norm: str, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attnres_fwd for at most MAX_ARG_SOURCES sources, traceable into a compiled graph."""
    if _triton_ok(sources[0]) and len(sources) <= MAX_ARG_SOURCES:
        return _fwd_args(sources, query, norm, eps)
    return _fwd_torch(sources, query, norm, eps)


@torch.library.triton_op("lrattnres_kernels::attnres_bwd_args", mutates_args=())
def attnres_bwd_args(
    sources: list[torch.Tensor], query: torch.Tensor, h: torch.Tensor, stats: torch.Tensor, res: torch.Tensor,
    g: torch.Tensor, norm: str, eps: float,
) -> list[torch.Tensor]:
    """attnres_bwd for at most MAX_ARG_SOURCES sources, traceable into a compiled graph."""
    if _triton_ok(sources[0]) and len(sources) <= MAX_ARG_SOURCES:
        grads, dq = _bwd_args(sources, query, h, stats, res, g, norm, eps)
    else:
        grads, dq = _bwd_torch(sources, query, h, stats, res, g, norm, eps)
    return list(grads) + [dq]


attnres_fwd_args.register_autograd(_backward_through(attnres_bwd_args), setup_context=_setup_context)


def _compiled_args_path(sources: Sequence[torch.Tensor]) -> bool:
    return (COMPILED_PATH == "triton_op" and 0 < len(sources) <= MAX_ARG_SOURCES
            and sources[0].is_cuda and sources[0].dtype in TRITON_DTYPES)


# Eager calls on the Triton path go through a plain autograd.Function (same kernels, same saved
# tensors) instead of the custom op: the custom op's eager dispatch (schema checks, pytree
# flattening of the source list, redispatch, autograd wrapper, twice per forward+backward) cost more
# host time than the launchers themselves (benchmarks/host_overhead.py).  torch.compile traces the
# custom op, so compiled graphs keep an opaque, fake-tensor-checked node.  False: always the op.
EAGER_FUNCTION = True


def attnres(sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice", eps: float = 1e-6) -> torch.Tensor:
    """Fused depth routing: ``sum_i softmax_i(q . RMSNorm(key_i)) o_i`` (see module docstring)."""
    compiling = torch.compiler.is_compiling()
    if EAGER_FUNCTION and not compiling and len(sources) > 0 and _triton_ok(sources[0]):
        return _AttnResTriton.apply(query, norm, float(eps), *sources)
    if compiling and _compiled_args_path(sources):
        h, _, _ = attnres_fwd_args(list(sources), query, norm, float(eps))
        return h
    h, _, _ = attnres_fwd(list(sources), query, norm, float(eps))
    return h


# ----------------------------------------------------------------------------------------------
# Direct Triton path with autograd, bypassing dispatch (used by the tests under TRITON_INTERPRET=1)


class _AttnResTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, norm, eps, *sources):
        h, stats, res = _fwd_triton(sources, query, norm, eps)
        ctx.save_for_backward(query, h, stats, res, *sources)
        ctx.norm, ctx.eps = norm, eps
        return h

    @staticmethod
    def backward(ctx, grad_h):
        query, h, stats, res, *sources = ctx.saved_tensors
        grads, dq = _bwd_triton(sources, query, h, stats, res, grad_h, ctx.norm, ctx.eps)
        return (dq, None, None, *grads)


def attnres_triton(sources: Sequence[torch.Tensor], query: torch.Tensor, *, norm: str = "slice", eps: float = 1e-6) -> torch.Tensor:
    """The Triton kernels with autograd, on any device Triton can run on (CPU via the interpreter)."""
    return _AttnResTriton.apply(query, norm, float(eps), *sources)
