"""Which kernel a call runs, and with which launch configuration: the column layout, the forms a
shape allows (the pair forward, the deferred backward and so whether the forward keeps its rounding
residual), the residual's code, and the tuned choice per shape class (kernels.tuner).
"""

from __future__ import annotations

import functools

import torch

from . import configs, tuner
from .settings import Settings

_MANT = {torch.bfloat16: 7, torch.float16: 10}  # mantissa bits of the dtypes that keep a residual
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ARG_SOURCES = 16  # the per-argument kernels' source arguments
# The backward's grid constexprs a configuration may leave out.  Every constexpr is passed: Inductor
# counts every pointer as written when a kernel has a defaulted constexpr that the launch leaves out.
_BWD_DEFAULTS = {"SB": 1, "BLOCK_T": 0, "PAIR": False, "DEFER": False, "PERSIST": 0}
_FWD_DEFAULTS = {"PAIR": False}


def keeps_residual_code(dtype: torch.dtype) -> bool:
    return dtype in _MANT


def res_step(dtype: torch.dtype, s: Settings) -> float:
    """The kernels' RES_STEP: 0 for bf16's bit code, else 2^-(mantissa bits + 8)."""
    if dtype == torch.bfloat16 and s.res_bits:
        return 0.0
    return 2.0 ** -(_MANT[dtype] + 8) if dtype in _MANT else 1.0


def layout(kind: str, d: int, r: int | None, s: Settings) -> tuple[int, int]:
    """(BLOCK_D, NCH) of ``kind``'s kernel (a pinned configuration's SPLIT may force one)."""
    return configs.col_layout(d, (s.pinned(kind) or {}).get("SPLIT"), r)


def key_masked(norm: str, d: int, r: int) -> bool:
    """The kernels' SLICE: "slice" with r < d.  At r = d the key is the whole row, the same math as
    "full", whose build has no key-column masks (about 20% fewer loop instructions)."""
    return norm == "slice" and r < d


def fwd_forms(n_sources: int, s: Settings) -> tuple[str, ...]:
    """The forward's forms at this S: "pair" at exactly two sources."""
    return ("pair",) if (s.pair_fwd and n_sources == 2) else ()


def defer_kinds(dtype: torch.dtype, d: int, r: int, norm: str, n_sources: int, s: Settings) -> tuple[str, ...]:
    """The deferred backward's forms (no residual kept) that serve this call: "pair" (the resident
    pair, at most PAIR_MAX_S sources), "passes" (two passes: "slice", at most defer_max_s sources, the
    key past the backward layout's first chunk).  Empty: the residual backward.  bf16/fp16 only.  A
    pinned backward decides by its DEFER and PAIR.  Decided from the shape alone, before the forward
    runs (a fake forward must give the residual's shape)."""
    if not (s.defer and dtype in _MANT):
        return ()
    passes_ok = norm == "slice"
    pinned = s.pinned("bwd")
    if pinned is not None:
        if not pinned.get("DEFER"):
            return ()
        return ("pair",) if pinned.get("PAIR") else (("passes",) if passes_ok else ())
    kinds = ("pair",) if (s.pair_defer and n_sources <= configs.PAIR_MAX_S) else ()
    if passes_ok and n_sources <= s.defer_max_s and configs.key_pos(d, r, *layout("bwd", d, r, s)) > 0:
        kinds += ("passes",)
    return kinds


def res_kept(dtype: torch.dtype, d: int, r: int, norm: str, n_sources: int, s: Settings) -> bool:
    """Whether the forward writes the int8 rounding residual: bf16/fp16 unless the backward defers."""
    return dtype in _MANT and not defer_kinds(dtype, d, r, norm, n_sources, s)


def launch_kwargs(cfg: dict, kind: str, key_pos: int) -> dict:
    """A configuration's kernel keywords: EVICT off, STAGES 1 and the backward's grid defaults unless
    it names them; KEY0 from its KEYCH (a choice already made names KEY0); SPLIT and KEYCH dropped."""
    out = {"EVICT": False, "STAGES": 1, **(_BWD_DEFAULTS if kind == "bwd" else _FWD_DEFAULTS)}
    out.update({k: v for k, v in cfg.items() if k not in ("SPLIT", "KEYCH")})
    out.setdefault("KEY0", key_pos if cfg.get("KEYCH") else 0)
    return out


def check_fwd_pair(cfg: dict, n_sources: int) -> None:
    if cfg.get("PAIR") and n_sources != 2:
        raise ValueError(f"attnres forward: the configuration {cfg} asks for the pair forward (PAIR), which "
                         f"reads exactly two sources; this call has {n_sources}")


def check_deferred(cfg: dict, deferred: tuple, key_pos: int, n_sources: int) -> None:
    """A residual-free forward needs the deferred backward, which needs the token tile and either
    the pair (at most PAIR_MAX_S sources) or the key past the first chunk (two passes)."""
    if deferred and not cfg["DEFER"]:
        raise ValueError("attnres backward: the forward kept no rounding residual (the deferred backward was "
                         f"chosen for this shape), but the backward configuration {cfg} does not ask for DEFER")
    if not cfg["DEFER"]:
        return
    if not cfg["BLOCK_T"]:
        raise ValueError(f"attnres backward: DEFER needs the token-tile grid (BLOCK_T > 0); got {cfg}")
    if cfg["PAIR"] and n_sources > configs.PAIR_MAX_S:
        raise ValueError(f"attnres backward: DEFER with PAIR (the resident pair) holds at most {configs.PAIR_MAX_S} "
                         f"sources; got {n_sources} with {cfg}")
    if not cfg["PAIR"] and cfg["KEY0"] < 1:
        raise ValueError(f"attnres backward: the two-pass DEFER needs the key past the first column chunk "
                         f"(KEYCH, key chunk {key_pos}); got {cfg}")


# ---------------------------------------------------------------------------------------------- tuned choices

# (kind, BLOCK_D, chunks, key chunk, forms) + shape class -> launch keywords with num_warps
_TUNED: dict = {}


def tune_class(n_sources: int, n_tok: int) -> tuple:
    """The part of a tuning key that follows the call's size: S, and the tokens rounded up to a power
    of two (a model sends a few token counts; varying lengths are not each tuned)."""
    return (n_sources, configs.next_pow2(n_tok))


def distinct(cfgs: list[dict], kind: str, key_pos: int) -> list[dict]:
    """The candidates as launch keywords, each once (a keyed one is its plain twin at key chunk 0)."""
    out = []
    for c in cfgs:
        kw = launch_kwargs(c, kind, key_pos)
        if kw not in out:
            out.append(kw)
    return out


def class_name(kind: str, block_d: int, nch: int, key_pos: int, forms: tuple, n_src: int, n_tok: int) -> str:
    return (f"{kind}/{block_d}x{nch}" + (f"/key{key_pos}" if key_pos else "")
            + (("/deferred-" if kind == "bwd" else "/") + "+".join(forms) if forms else "")
            + f"/S{n_src}/N{n_tok}")


@functools.lru_cache(maxsize=None)
def first(kind: str, block_d: int, nch: int, key_pos: int, forms: tuple = ()) -> dict:
    """The first candidate's launch keywords (the choice without tuning; not to be changed)."""
    return launch_kwargs(configs.candidates(kind, block_d, nch, forms)[0], kind, key_pos)


def choose(kind: str, block_d: int, nch: int, key_pos: int, device: torch.device, key: tuple, launch, forms: tuple,
           s: Settings) -> dict:
    """This call's launch keywords: the pinned configuration; the first candidate off CUDA, without
    autotune, or while a CUDA graph is captured (nothing can be timed, nothing is remembered); else
    the fastest candidate for ``key``, timed once through ``launch(cfg)`` (the whole launch, so that
    a grid's extra work counts)."""
    pinned = s.pinned(kind)
    if pinned is not None:
        return launch_kwargs(pinned, kind, key_pos)
    tk = (kind, block_d, nch, key_pos, forms) + key
    chosen = _TUNED.get(tk)
    if chosen is not None:
        return chosen
    if device.type != "cuda" or not s.autotune or torch.cuda.is_current_stream_capturing():
        return first(kind, block_d, nch, key_pos, forms)
    cands = distinct(configs.candidates(kind, block_d, nch, forms), kind, key_pos)
    tag = class_name(kind, block_d, nch, key_pos, forms, *key[-2:])
    chosen = _TUNED[tk] = tuner.fastest(cands, launch, device, tag, s.compile_threads)
    return chosen


def args_config(kind: str, block_d: int, nch: int, forms: tuple, s: Settings) -> dict:
    """The per-argument kernels' configuration: the pinned one, else the family's ARGS line."""
    pinned = s.pinned(kind)
    return pinned if pinned is not None else configs.args_config(kind, block_d, nch, forms)


# (rows, r, dtype, device) -> the partial sum's method that timed fastest
_SUM_CHOSEN: dict = {}
SUMS = ("triton", "once", "torch")


def sum_method(part: torch.Tensor, dtype: torch.dtype, run, s: Settings) -> str:
    """How the query-gradient partial rows ``part`` are summed: the settings' dq_sum, or with "auto"
    each method timed once per size on CUDA (``run(method)`` runs one) and the fastest kept; the
    two-launch Triton sum where nothing can be timed (CPU, graph capture)."""
    if s.dq_sum != "auto":
        return s.dq_sum
    key = (part.shape[0], part.shape[1], dtype, part.device)
    method = _SUM_CHOSEN.get(key)
    if method is None:
        if part.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return "triton"
        method = _SUM_CHOSEN[key] = tuner.fastest(list(SUMS), lambda m, warm=False: None if warm else run(m),
                                                  part.device, f"sum/{part.shape[0]}x{part.shape[1]}")
    return method


def tuned_configs() -> dict:
    """The choices tuning made so far, by shape class ("fwd/512x3/key2/S9/N8192": chunk width x
    chunks, the key's first chunk, the forms tuned among, S, tokens rounded up), and the partial sum's
    method per size ("sum/4224x320/bfloat16")."""
    out = {class_name(kind, bd, nch, kp, forms, *key[-2:]): dict(cfg)
           for (kind, bd, nch, kp, forms, *key), cfg in _TUNED.items()}
    for (n_rows, r, dtype, _), method in _SUM_CHOSEN.items():
        out[f"sum/{n_rows}x{r}/{str(dtype).removeprefix('torch.')}"] = {"method": method}
    return out
