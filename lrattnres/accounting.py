"""The accounting stage (Appendix F): added FLOPs, parameter deltas, activation memory.

``python -m lrattnres accounting --spec '<json>' --out results/<scale>/accounting.json``

Everything here is analytic, so it is computed for the paper's 0.5B, 1B and 4B architectures at every
scale (the "exact" claims of ``reports/published.yaml`` must match at any scale), and also for the
extra architectures named in the spec (the current scale's presets).

Conventions (Appendix F; the paper's equations):

- A model of L Transformer blocks makes 2L writes o_1..o_2L.  Read t (t = 1..2L) follows write t; the
  last one feeds the head.  The embedding-only first read is the identity and costs nothing.
- n_t = number of sources at read t: full routing t + 1; block routing with boundaries ceil(2L j / N):
  1 (embedding) + completed blocks + 1 if the current partial block is nonempty.
- Depth-kernel FLOPs (multiply-adds) of one read: scores n_t r + value mixing n_t d; standard AttnRes
  has r = d, i.e. 2 n_t d (F.1).  Normalisation and softmax are not counted.
- Projected keys add C_P,key-proj = r [L (d + m) + d] per token (F.2): an r-wide key from the input of
  every output projection (width d for attention, m for the MLP) and a d -> r map of the embedding.
- Percentages are of the non-embedding Transformer core C_base = L (4 d^2 + 3 d m) per token (F.6).
- Parameters (F.5): Delta P_S = 2 L r (the queries) for sliced keys, 2 L d for AttnRes, and
  Delta P_P = r [L (d + m) + d + 2L] for projected keys.  Percentages use P_base = L (4 d^2 + 3 d m),
  the non-embedding core parameter count (F.5 leaves P_base implicit; the core is the natural reading
  since the FLOP percentages use the same core).  Norms are weightless and there are no biases.
- Activation memory (F.4): A = b K_src d for AttnRes and sliced keys, b K_src (d + r) for projected
  keys; reported per token (b = 1) for the largest source set K_src = max_t n_t of each routing setting.

This module must not import torch: the stage starts in well under a second.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from fractions import Fraction
from typing import Any

from lrattnres.checks import is_int
from lrattnres.io import atomic_write_json, read_spec_arg
from lrattnres.presets import get_preset
from lrattnres.provenance import now, provenance
from lrattnres.ranks import resolve_rank

log = logging.getLogger("lrattnres.accounting")

PAPER_VOCAB = 100_277
BF16_BYTES = 2
METHODS = ("baseline", "attnres", "lr", "lr-fullrms", "plr")

# The paper's architectures (Sections 4.1 and 4.5): (n_layers L, d_model d, d_ff m).
PAPER_ARCHS: dict[str, dict[str, int]] = {
    "0.5B": {"n_layers": 24, "d_model": 1024, "d_ff": 2816, "vocab_size": PAPER_VOCAB},
    "1B": {"n_layers": 24, "d_model": 1536, "d_ff": 4224, "vocab_size": PAPER_VOCAB},
    "4B": {"n_layers": 44, "d_model": 2560, "d_ff": 7040, "vocab_size": PAPER_VOCAB},
}
SIZE_KEY = {"0.5B": "0.5b", "1B": "1b", "4B": "4b"}

# The paper's grids: the 0.5B sweep of Table 5 and the N = 8, r in {d/4, d} pairs at 1B and 4B.
TABLE5: list[tuple[str, Any, int | None]] = (
    [("baseline", None, None)]
    + [("attnres", N, 1024) for N in ("full", 4, 8, 16)]
    + [("plr", "full", r) for r in (16, 32, 64)]
    + [("plr", N, 32) for N in (4, 8, 16)]
    + [("lr", N, r) for N in ("full", 4, 8, 16) for r in (16, 32, 64, 128, 256, 512, 768)]
    + [("lr-fullrms", 8, 128)]
)
PAIR_BLOCKS = 8


# ------------------------------------------------------------------------------------ formulas


def source_counts(n_layers: int, blocks: int | str) -> list[int]:
    """n_t for the reads t = 1..2L (the read after write t): the number of routing sources."""
    writes = 2 * n_layers
    if blocks == "full":
        return [t + 1 for t in range(1, writes + 1)]
    if not is_int(blocks) or not 1 <= blocks <= writes:
        raise ValueError(f"blocks must be 'full' or an integer in [1, 2L={writes}], got {blocks!r}")
    ends = {math.ceil(writes * j / blocks) for j in range(1, blocks + 1)}
    counts, completed = [], 0
    for t in range(1, writes + 1):
        partial = t not in ends
        if not partial:
            completed += 1
        counts.append(1 + completed + (1 if partial else 0))
    return counts


def core_flops(L: int, d: int, m: int) -> int:
    """C_base = L (4 d^2 + 3 d m): non-embedding core multiply-adds per token (= core parameters)."""
    return L * (4 * d * d + 3 * d * m)


def key_proj_flops(L: int, d: int, m: int, r: int) -> int:
    """C_P,key-proj = r [L (d + m) + d] (F.2)."""
    return r * (L * (d + m) + d)


def kernel_flops(L: int, d: int, r: int, blocks: int | str) -> int:
    """Depth-kernel multiply-adds per token over all reads: sum_t n_t (d + r) (F.1, F.3)."""
    return (d + r) * sum(source_counts(L, blocks))


def effective_rank(method: str, d: int, r: int | None) -> int | None:
    if method == "baseline":
        return None
    if method == "attnres":
        if r not in (None, d):
            raise ValueError(f"attnres uses r = d = {d}, got r = {r}")
        return d
    if r is None or not 1 <= r <= d:
        raise ValueError(f"{method}: rank must be in [1, d={d}], got {r!r}")
    return r


def added_flops(L: int, d: int, m: int, method: str, blocks: int | str | None, r: int | None) -> dict[str, Any]:
    """Added FLOPs of one configuration per token, absolute and as % of C_base."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    base = core_flops(L, d, m)
    if method == "baseline":
        return {"kernel": 0, "key_proj": 0, "total": 0, "pct": 0.0, "kernel_pct": 0.0, "key_proj_pct": 0.0,
                "sources_total": 0, "max_sources": 1}
    r = effective_rank(method, d, r)
    counts = source_counts(L, blocks)
    kern = (d + r) * sum(counts)
    proj = key_proj_flops(L, d, m, r) if method == "plr" else 0
    total = kern + proj
    return {
        "kernel": kern,
        "key_proj": proj,
        "total": total,
        "pct": 100 * total / base,
        "kernel_pct": 100 * kern / base,
        "key_proj_pct": 100 * proj / base,
        "sources_total": sum(counts),
        "max_sources": max(counts),
    }


def param_delta(L: int, d: int, m: int, method: str, r: int | None) -> dict[str, Any]:
    """Added parameters vs the baseline and vs AttnRes (F.5), and their % of P_base (the core)."""
    base = core_flops(L, d, m)
    attn = 2 * L * d
    if method == "baseline":
        vs_base, queries, keys = 0, 0, 0
    else:
        r = effective_rank(method, d, r)
        queries = 2 * L * r
        keys = r * (L * (d + m) + d) if method == "plr" else 0
        vs_base = queries + keys
    return {
        "query_params": queries,
        "key_params": keys,
        "delta_vs_baseline": vs_base,
        "delta_vs_attnres": vs_base - attn,
        "pct_vs_baseline": 100 * vs_base / base,
        "pct_vs_attnres": 100 * (vs_base - attn) / base,
    }


def activation_memory(L: int, d: int, method: str, blocks: int | str | None, r: int | None) -> dict[str, Any]:
    """Per-token retained source memory for the largest source set (F.4), elements and bf16 bytes."""
    if method == "baseline":
        return {"max_sources": 1, "elements": d, "bytes_bf16": d * BF16_BYTES, "ratio_vs_attnres": None}
    r = effective_rank(method, d, r)
    k = max(source_counts(L, blocks))
    width = d + r if method == "plr" else d
    return {
        "max_sources": k,
        "elements": k * width,
        "bytes_bf16": k * width * BF16_BYTES,
        "ratio_vs_attnres": Fraction(width, d).__float__(),
    }


def total_params(L: int, d: int, m: int, vocab: int | None, method: str, r: int | None) -> int | None:
    """All parameters: untied embedding and head (V d each), core, queries, projected keys.

    The backbone has weightless norms (including QK-norm) and no biases, so nothing else is counted.
    """
    if vocab is None:
        return None
    return 2 * vocab * d + core_flops(L, d, m) + param_delta(L, d, m, method, r)["delta_vs_baseline"]


# ------------------------------------------------------------------------------------ spec


def _arch_from_spec(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        p = get_preset(value)
        return {"preset": value, "n_layers": p["n_layers"], "d_model": p["d_model"], "d_ff": p["d_ff"],
                "vocab_size": p.get("vocab_size")}
    if isinstance(value, dict):
        out = {}
        for key in ("n_layers", "d_model", "d_ff"):
            v = value.get(key)
            if not is_int(v) or v < 1:
                raise ValueError(f"spec: architectures.{name}.{key}: expected a positive integer, got {v!r}")
            out[key] = v
        vocab = value.get("vocab_size")
        if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
            raise ValueError(f"spec: architectures.{name}.vocab_size: expected a positive integer or null, got {vocab!r}")
        out["vocab_size"] = vocab
        return out
    raise ValueError(f"spec: architectures.{name}: expected a preset name or {{n_layers, d_model, d_ff}}, got {value!r}")


def parse_spec(spec: dict) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise ValueError(f"spec: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"architectures", "ranks", "blocks"})
    if unknown:
        raise ValueError(f"spec: unknown key {unknown[0]!r}; expected architectures, ranks, blocks")
    archs = spec.get("architectures", {})
    if not isinstance(archs, dict):
        raise ValueError(f"spec: architectures: expected a mapping name -> preset or shape, got {archs!r}")
    ranks = spec.get("ranks", ["d/8", "d/4", "d"])
    blocks = spec.get("blocks", ["full", 8])
    if not isinstance(ranks, list) or not ranks:
        raise ValueError(f"spec: ranks: expected a non-empty list (128, 'd', 'd/8', ...), got {ranks!r}")
    if not isinstance(blocks, list) or not blocks:
        raise ValueError(f"spec: blocks: expected a non-empty list ('full' or N >= 1), got {blocks!r}")
    for b in blocks:
        if b != "full" and (not is_int(b) or b < 1):
            raise ValueError(f"spec: blocks: expected 'full' or an integer >= 1, got {b!r}")
    return {"architectures": {n: _arch_from_spec(n, v) for n, v in archs.items()}, "ranks": ranks, "blocks": blocks}


# ------------------------------------------------------------------------------------ tables


def configurations(arch: dict, ranks: list, blocks: list) -> tuple[list[tuple[str, Any, int | None]], list[str]]:
    """(method, N, r) for the baseline, AttnRes per N, and LR / projected LR per N and r < d."""
    L, d = arch["n_layers"], arch["d_model"]
    skipped = []
    rs = []
    for rank in ranks:
        r = resolve_rank(rank, d, where="accounting spec: ranks")
        if r not in rs:
            rs.append(r)
    bs = []
    for b in blocks:
        if b != "full" and b > 2 * L:
            skipped.append(f"N={b} exceeds 2L={2 * L} writes")
            continue
        bs.append(b)
    out: list[tuple[str, Any, int | None]] = [("baseline", None, None)]
    out += [("attnres", b, d) for b in bs]
    out += [(m, b, r) for m in ("lr", "plr") for b in bs for r in sorted(rs) if r < d]
    return out, skipped


def arch_tables(name: str, arch: dict, configs: list[tuple[str, Any, int | None]]) -> dict[str, Any]:
    L, d, m, vocab = arch["n_layers"], arch["d_model"], arch["d_ff"], arch.get("vocab_size")
    rows = []
    for method, N, r in configs:
        fl = added_flops(L, d, m, method, N, r)
        pr = param_delta(L, d, m, method, r)
        mem = activation_memory(L, d, method, N, r)
        attn_fl = added_flops(L, d, m, "attnres", N, d) if method != "baseline" else None
        rows.append({
            "method": method, "N": N, "r": r,
            "sources_total": fl["sources_total"], "max_sources": fl["max_sources"],
            "kernel_flops": fl["kernel"], "key_proj_flops": fl["key_proj"], "added_flops": fl["total"],
            "added_flops_pct": fl["pct"], "kernel_pct": fl["kernel_pct"], "key_proj_pct": fl["key_proj_pct"],
            "flops_reduction_vs_attnres_pct": (100 * (1 - fl["total"] / attn_fl["total"]) if attn_fl else None),
            **{f"param_{k}": v for k, v in pr.items()},
            "act_mem_elements_per_token": mem["elements"], "act_mem_bytes_bf16_per_token": mem["bytes_bf16"],
            "act_mem_ratio_vs_attnres": mem["ratio_vs_attnres"],
            "total_params": total_params(L, d, m, vocab, method, r),
        })
    return {
        "name": name,
        "shape": {"n_layers": L, "d_model": d, "d_ff": m, "vocab_size": vocab, **({"preset": arch["preset"]} if "preset" in arch else {})},
        "core_flops": core_flops(L, d, m),
        "core_params": core_flops(L, d, m),
        "writes": 2 * L,
        "active_queries": 2 * L,
        "rows": rows,
    }


def _row(tables: dict, method: str, N: Any, r: int | None) -> dict:
    for row in tables["rows"]:
        if row["method"] == method and row["N"] == N and row["r"] == r:
            return row
    raise KeyError((method, N, r))


# ------------------------------------------------------------------------------------ claims


def paper_claims() -> tuple[dict[str, dict], dict[str, Any]]:
    """Every accounting claim of published.yaml, computed for the paper's architectures."""
    C: dict[str, dict] = {}

    def put(cid: str, value: Any, note: str) -> None:
        C[cid] = {"reproduced": value, "note": note}

    L, d, m = 24, 1024, 2816
    base = core_flops(L, d, m)

    # Table 5, added-FLOPs column (and the lr-fullrms control, whose kernel cost equals sliced LR).
    for method, N, r in TABLE5:
        fl = added_flops(L, d, m, method, N, r)
        key = method if method == "baseline" else f"{method}.n{N}.r{r}"
        how = "0: no routing" if method == "baseline" else (
            f"(d + r) x {fl['sources_total']} source reads"
            + (f" + key projection {fl['key_proj']:,}" if fl["key_proj"] else "")
            + f" = {fl['total']:,} / C_base {base:,}")
        put(f"table5.added_flops.{key}", fl["pct"], how)

    attn8 = added_flops(L, d, m, "attnres", 8, d)
    lr8 = added_flops(L, d, m, "lr", 8, 128)
    put("sec4.2.added_flops_reduction_pct.n8.r128", 100 * (1 - lr8["total"] / attn8["total"]),
        f"1 - {lr8['pct']:.5f}% / {attn8['pct']:.5f}%")
    cheaper = all(
        added_flops(L, d, m, "lr", N, r)["total"] < added_flops(L, d, m, "attnres", N, d)["total"]
        for meth, N, r in TABLE5 if meth == "lr"
    )
    put("sec4.2.lowrank_cheaper_than_endpoint", cheaper, "all 28 sliced 0.5B configurations vs AttnRes at the same N")
    r8 = d // 8
    put("explainer.flops_reduction_pct.r_d8", 100 * (1 - (d + r8) / (2 * d)), f"(d - r)/(2d) at r = d/8 = {r8}")
    plr8 = added_flops(L, d, m, "plr", 8, 32)
    put("appC.3.flops_ratio.plr_n8_r32_vs_lr_n8_r128", plr8["total"] / lr8["total"],
        f"{plr8['pct']:.5f}% / {lr8['pct']:.5f}%")

    # Appendix F.6 worked numbers (d = 1024, r = 32).
    put("appF.6.flops_reduction_pct.r32", 100 * (d - 32) / (2 * d), "100 (d - r)/(2d)")
    put("appF.6.key_proj_flops.r32", key_proj_flops(L, d, m, 32), "r [L (d + m) + d]")
    put("appF.6.param_delta.plr.r32", param_delta(L, d, m, "plr", 32)["delta_vs_baseline"], "r [L (d + m) + d + 2L]")
    ratio = activation_memory(L, d, "plr", 8, 32)["ratio_vs_attnres"]
    put("appF.6.payload_increase_pct.plr.r32", 100 * (ratio - 1), "100 r / d (payload d + r vs d)")
    put("appC.2.payload_increase_pct.plr.r32", 100 * (ratio - 1), "100 r / d (payload d + r vs d)")
    put("appF.6.key_proj_flops_pct.r32", 100 * key_proj_flops(L, d, m, 32) / base, "C_P,key-proj / C_base")
    put("appF.6.core_flops.0.5b", base, "L (4 d^2 + 3 d m)")
    put("appF.6.total_added_flops.plr.nfull.r32", added_flops(L, d, m, "plr", "full", 32)["pct"],
        "kernel + key projection, full routing")
    put("appF.6.total_added_flops.plr.n8.r32", plr8["pct"], "kernel + key projection, N = 8")
    put("appF.4.activation_memory_equal.lr", activation_memory(L, d, "lr", 8, 128)["ratio_vs_attnres"],
        "A_S / A_AttnRes (b K_src d both)")

    # F.5 parameters and the active-query counts, per paper size.
    for name, size in SIZE_KEY.items():
        a = PAPER_ARCHS[name]
        La, da, ma = a["n_layers"], a["d_model"], a["d_ff"]
        rr = 128 if name == "0.5B" else da // 4
        put(f"appF.5.query_params.attnres.{size}", param_delta(La, da, ma, "attnres", da)["query_params"], "2 L d")
        put(f"appF.5.query_params.lr.r{rr}.{size}", param_delta(La, da, ma, "lr", rr)["query_params"], "2 L r")
        put(f"appF.5.param_delta_vs_attnres.lr.r{rr}.{size}", param_delta(La, da, ma, "lr", rr)["delta_vs_attnres"],
            "-2 L (d - r)")
        put(f"sec4.8.active_queries.{size}", 2 * La, "T = 2L (the embedding-only read needs no query)")

    n = total_params(L, d, m, PAPER_VOCAB, "attnres", d)
    put("facts.params.0.5b.attnres.full", n,
        f"2 V d ({2 * PAPER_VOCAB * d:,}) + core L(4d^2 + 3dm) ({base:,}) + queries 2Ld ({2 * L * d:,}); "
        "weightless norms and QK-norm, no biases")

    worked = {
        "d": d, "r": 32, "L": L, "m": m,
        "flops_reduction_pct": 100 * (d - 32) / (2 * d),
        "key_proj_flops": key_proj_flops(L, d, m, 32),
        "param_delta_plr": param_delta(L, d, m, "plr", 32)["delta_vs_baseline"],
        "payload_increase_pct": 100 * 32 / d,
        "core_flops": base,
        "key_proj_flops_pct": 100 * key_proj_flops(L, d, m, 32) / base,
        "total_plr_full_r32_pct": added_flops(L, d, m, "plr", "full", 32)["pct"],
        "total_plr_n8_r32_pct": plr8["pct"],
        "reduction_r_d8_pct": 100 * (1 - (d + r8) / (2 * d)),
        "reduction_n8_r128_pct": 100 * (1 - lr8["total"] / attn8["total"]),
        "flops_ratio_plr_n8_r32_vs_lr_n8_r128": plr8["total"] / lr8["total"],
        "params_0.5b_attnres_full": n,
    }
    return C, worked


def run(spec: dict) -> dict[str, Any]:
    parsed = parse_spec(spec)
    paper = {}
    for name, arch in PAPER_ARCHS.items():
        if name == "0.5B":
            configs = list(TABLE5)
        else:
            d = arch["d_model"]
            configs = [("baseline", None, None), ("attnres", PAIR_BLOCKS, d), ("lr", PAIR_BLOCKS, d // 4),
                       ("plr", PAIR_BLOCKS, d // 4)]
        paper[name] = arch_tables(name, arch, configs)
    extra, notes = {}, {}
    for name, arch in parsed["architectures"].items():
        configs, skipped = configurations(arch, parsed["ranks"], parsed["blocks"])
        extra[name] = arch_tables(name, arch, configs)
        if skipped:
            notes[name] = skipped
            log.warning("architecture %s: skipped %s", name, "; ".join(skipped))
    claims, worked = paper_claims()
    return {
        "tables": {"paper": paper, "extra": extra, "skipped": notes, "worked": worked,
                   "ranks": parsed["ranks"], "blocks": parsed["blocks"]},
        "claims": claims,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres accounting", description=__doc__.split("\n")[0])
    p.add_argument("--spec", default="{}", help='JSON: {"architectures": {name: preset | {n_layers, d_model, d_ff}}, '
                                               '"ranks": [...], "blocks": [...]}')
    p.add_argument("--out", required=True, help="result JSON to write")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    started = now()
    try:
        spec = read_spec_arg(args.spec)
    except ValueError as e:
        print(f"accounting: {e}", file=sys.stderr)
        return 2
    try:
        result = run(spec)
    except ValueError as e:
        print(f"accounting: {e}", file=sys.stderr)
        return 2
    out = {"stage": "accounting", "provenance": provenance(spec, started=started), **result}
    atomic_write_json(args.out, out)
    log.info("wrote %s: %d claims, %d paper and %d extra architectures", args.out, len(result["claims"]),
             len(result["tables"]["paper"]), len(result["tables"]["extra"]))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
