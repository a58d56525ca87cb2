"""The claims of a throughput result (Section 4.9, Table 3, Appendix I) and the one result merged
from the results of single sizes."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from lrattnres.errors import SpecError
from lrattnres.throughput.spec import PAPER_GPUS, PAPER_SIZES


def published_ids(path: str | None = None) -> set[str]:
    """Claim ids of the published-numbers file ({} if it is absent)."""
    p = Path(path) if path else Path(__file__).resolve().parents[2] / "reports" / "published.yaml"
    if not p.exists():
        return set()
    return set(_ids_of(str(p.resolve()), p.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _ids_of(path: str, mtime_ns: int) -> frozenset:
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or []
    return frozenset(r["id"] for r in data if isinstance(r, dict) and "id" in r)


def paper_gpu(device_name: str) -> str | None:
    """'h100' / 'b200' when the device is one of the paper's GPUs, else None."""
    for g in PAPER_GPUS:
        if g in device_name.upper():
            return g.lower()
    return None


# GPUs of the same architecture as one of the paper's: they stand in for it in the direction claims
# of Section 4.9 (never in Table 3's values, which are the paper's hardware's numbers).
GPU_STAND_INS = {"H200": "h100", "GH200": "h100"}


def direction_gpu(device_name: str) -> tuple[str | None, str]:
    """(the paper's GPU whose direction claims a measurement on ``device_name`` stands for, a note)."""
    gpu = paper_gpu(device_name)
    if gpu:
        return gpu, ""
    name = device_name.upper()
    for other, stands in sorted(GPU_STAND_INS.items(), key=lambda kv: -len(kv[0])):
        if other in name:
            return stands, f"measured on {device_name}, the same architecture as the {stands.upper()}"
    return None, ""


def claims_for(result: dict, s: dict, ids: set[str] | None = None) -> dict[str, dict]:
    """Claims of a (partial) result: only for the paper's shapes on a GPU (see the module docstring).

    Direction claims (Section 4.9's gains) carry the per-repeat paired gains as ``samples``: the claims
    engine judges them by the interval over repeats."""
    if result.get("device_type") != "cuda" or not s.get("claims", True):
        return {}
    ids = published_ids(s.get("published")) if ids is None else ids
    gpu = paper_gpu(result.get("device", ""))
    dgpu, stand_in = direction_gpu(result.get("device", ""))
    out: dict[str, dict] = {}
    setting = (f"{result.get('device')}, microbatch {s['micro_batch']} x {s['seq_len']}, "
               f"{'compiled' if s['compile'] else 'eager'}, {result.get('precision')}")

    def put(cid: str, value: Any, note: str, **evidence) -> None:
        if cid in ids and value is not None:
            out[cid] = {"reproduced": value, "note": note, **evidence}

    for preset, size in PAPER_SIZES.items():
        gains = result.get("gains", {}).get(preset, {})
        rows = {r["name"]: r for r in result.get("rows", []) if r["preset"] == preset}
        if not rows:
            continue
        accum = next(iter(rows.values()))["grad_accum"]
        where = f"{setting}, accumulation {accum} (paper: 64)"
        rank = gains.get("rank")
        if dgpu is not None:
            for cid, g, what in ((f"sec4.9.rank_gain_positive.{dgpu}.{size}", rank, "rank gain r = d/4 vs r = d"),
                                 (f"sec4.9.fast_beats_fla.{dgpu}.{size}", gains.get("kernel_vs_fla"),
                                  "kernel gain over FLA at r = d"),
                                 (f"sec4.9.combined_gain_positive.{dgpu}.{size}", gains.get("combined_vs_fla"),
                                  "combined gain over FLA")):
                if g and g.get("per_repeat"):
                    put(cid, g["mean"], "; ".join(x for x in (f"paired {what}, this project's kernel in place of "
                                                              f"Fast-AttnRes", stand_in, where) if x),
                        samples=list(g["per_repeat"]), unit="repeats")
        runs = [r for r in result.get("runs", []) if r.get("preset") == preset]
        if runs:
            missed = [f"repeat {r['repeat']} {r['name']} ({r.get('stopped')}, {r.get('updates')} updates)"
                      for r in runs if r.get("stopped") != "converged"]
            put(f"appI.repeats_met_stopping_rule.{size}", len(missed),
                f"{len(runs) - len(missed)} of {len(runs)} timed runs met the CV and drift limits"
                + (f"; not: {', '.join(missed)}" if missed else "") + f"; {where}")
        if gpu is None:
            continue
        for name, impl, rk in (("fla-rd", "fla", "rd"), ("fused-rd", "fast", "rd"), ("fused-rd4", "fast", "rd4")):
            r = rows.get(name)
            if r and r["repeats"]:
                note = f"{len(r['repeats'])} repeats; {where}" + ("; this project's kernel" if impl == "fast" else "")
                put(f"table3.tokens_per_s.{gpu}.{size}.{impl}.{rk}", r["mean"], note)
                put(f"table3.tokens_per_s_sd.{gpu}.{size}.{impl}.{rk}", r["sd"], note)
        if rank and rank["n"] >= 2:
            put(f"table3.rank_gain_pct.{gpu}.{size}", rank["mean"], where)
            put(f"table3.rank_gain_ci_low.{gpu}.{size}", rank["ci95"][0], where + "; t s/sqrt(n)")
            put(f"table3.rank_gain_ci_high.{gpu}.{size}", rank["ci95"][1], where + "; t s/sqrt(n)")
        comb = gains.get("combined_vs_fla")
        if comb:
            put(f"sec4.9.combined_gain_pct.{gpu}.{size}", comb["mean"], where)
    return out


def aggregate(parts: list[dict], paths: list[str]) -> dict:
    """One throughput result from the results of single sizes (one job per size)."""
    if not parts:
        raise SpecError("throughput --aggregate: no results given")
    spec = dict(parts[0]["spec"], presets=[p for part in parts for p in part["spec"]["presets"]])
    out = {k: parts[0][k] for k in ("stage", "device", "device_type", "precision", "compile", "threads", "tokens", "fla")
           if k in parts[0]}
    out.update(spec=spec, rows=[r for p in parts for r in p["rows"]], runs=[r for p in parts for r in p["runs"]],
               skipped=[r for p in parts for r in p["skipped"]], gains={k: v for p in parts for k, v in p["gains"].items()},
               complete=all(p.get("complete") for p in parts), parts=list(paths),
               notes=list(dict.fromkeys(n for p in parts for n in p.get("notes", []))),
               elapsed_s=sum(p.get("elapsed_s") or 0 for p in parts))
    devices = sorted({p.get("device") for p in parts})
    if len(devices) > 1:
        out["notes"].append(f"the sizes were timed on different devices: {', '.join(map(str, devices))}")
    out["claims"] = claims_for(out, spec)
    return out
