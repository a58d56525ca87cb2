"""The claims of one conversion result (Table 2, Appendix B.2) and the ``convert_all`` result that
combines every conversion of a scale."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from lrattnres.claims import load_published
from lrattnres.errors import SpecError
from lrattnres.provenance import provenance

log = logging.getLogger("lrattnres.convert")


DEFAULT_PUBLISHED = Path(__file__).resolve().parents[2] / "reports" / "published.yaml"


SIZES = ("0.5b", "1b", "4b")


def parse_claim_row(row: str | None) -> tuple[str, str] | None:
    """"0.5b.nfull" -> ("0.5b", "nfull"); None -> None."""
    if row is None:
        return None
    m = re.fullmatch(r"(0\.5b|1b|4b)\.(nfull|n\d+)", str(row).strip().lower())
    if not m:
        raise SpecError(f"spec.claim_row: expected '<size>.n<N>' with size in {SIZES} and N 'full' or an int "
                         f"(e.g. '0.5b.nfull', '1b.n8'), or null; got {row!r}")
    return m.group(1), m.group(2)


def published_records(path: str | Path | None = None) -> dict[str, dict] | None:
    """The published records by id, or None (with a warning) when the file does not exist."""
    path = Path(path) if path is not None else DEFAULT_PUBLISHED
    if not path.exists():
        log.warning("published claims file not found (%s); no claims emitted: pass --published "
                    "reports/published.yaml (as the workflow does) to emit them", path)
        return None
    return load_published(path)


def result_claims(result: dict, published: dict[str, dict] | None) -> dict[str, dict]:
    """The claims of one conversion result under its ``claim_row`` (only ids of the published file).

    ``table2.fp64_max_err.<row>``: the absolute FP64 max logit difference (Table 2's quantity; the
    note gives it relative to the logit scale); ``table2.delta_ce.<row>``: converted minus original;
    ``table2.orig_ce/conv_ce.<row>``: the CEs; ``appB.2.joint_rank.<size>``: the joint rank (a value
    claim: compared with the paper's at the paper scale; the note gives the model's active queries)."""
    parsed = parse_claim_row(result.get("claim_row"))
    if parsed is None or not published:
        return {}
    size, n = parsed
    row = f"{size}.{n}"
    blocks = result.get("blocks")
    who = (f"{result.get('run_id')} (L={result.get('n_layers')}, N={blocks}, d={result.get('d')} -> "
           f"r={result.get('rank')}) standing in for the paper's {size.upper()} N={n[1:]} row")
    ce_how = (f"{result.get('val_tokens_evaluated'):,} validation tokens, {result.get('precision')} on "
              f"{result.get('device')}")
    scale = result.get("logit_scale") or 0.0
    err = result.get("fp64_max_logit_err")
    out: dict[str, dict] = {}

    def put(cid, value, note):
        if cid in published and value is not None:
            out[cid] = {"reproduced": value, "note": note}

    rel = f"{err / scale:.3g}" if err is not None and scale > 0 else "n/a"
    put(f"table2.fp64_max_err.{row}", err,
        f"{who}; absolute max |logit difference| on one {result.get('fp64_seq_len')}-token sequence in FP64; "
        f"relative to the logit scale {scale:.4g}: {rel}"
        + (f"; float64 noise floor (one rounding of every weight) {result['fp64_noise_floor']:.3g}"
           if result.get("fp64_noise_floor") is not None else ""))
    put(f"table2.delta_ce.{row}", result.get("delta_ce"), f"{who}; converted minus original over {ce_how}")
    put(f"table2.orig_ce.{row}", result.get("original_ce"), f"{who}; {ce_how}")
    put(f"table2.conv_ce.{row}", result.get("converted_ce"), f"{who}; {ce_how}")
    rid = f"appB.2.joint_rank.{size}"
    if rid in published and result.get("joint_rank") is not None:
        k, t = result["joint_rank"], result["active_queries"]
        paper_t = published[rid].get("row", {}).get("active_queries")
        out[rid] = {"reproduced": k, "note": f"{who}; joint rank {k} of {t} active queries"
                    + ("" if paper_t == t else f" (the paper's model has {paper_t})")}
    return out


def _worst(cid: str, entries: list[tuple[Any, str, str]]) -> tuple[Any, str]:
    """Combine the values of one claim id over several checkpoints: the worst case for invariants,
    the mean for values.  ``entries``: (value, note, run_id)."""
    vals = [v for v, _, _ in entries]
    runs = [r for _, _, r in entries]
    if len(entries) == 1:
        return vals[0], entries[0][1]
    if all(isinstance(v, bool) for v in vals):
        bad = [r for v, _, r in entries if not v]
        note = f"holds for all {len(vals)} checkpoints ({', '.join(runs)})" if not bad else f"fails for {', '.join(bad)}"
        return all(vals), note
    nums = [float(v) for v in vals]
    if ".fp64_max_err." in cid or ".joint_rank." in cid:
        i = max(range(len(nums)), key=lambda j: nums[j])
        return vals[i], f"worst (largest) of {len(vals)} checkpoints, from {runs[i]}: {entries[i][1]}"
    if ".delta_ce." in cid:
        i = max(range(len(nums)), key=lambda j: abs(nums[j]))
        return vals[i], f"worst (largest |ΔCE|) of {len(vals)} checkpoints, from {runs[i]}: {entries[i][1]}"
    mean = sum(nums) / len(nums)
    return mean, f"mean of {len(vals)} checkpoints ({', '.join(f'{r}: {v:.6g}' for r, v in zip(runs, nums))})"


def aggregate(results: list[dict]) -> dict[str, dict]:
    """Claims of several conversion results combined: every id produced by one checkpoint as it is
    (the Table 2 rows), ids produced by several (the per-size joint rank, or a row two checkpoints
    stand for) as the worst case over them for invariants (largest FP64 error, largest |ΔCE|, largest
    rank, all bools) and the mean for values."""
    grouped: dict[str, list] = {}
    for res in results:
        for cid, c in (res.get("claims") or {}).items():
            grouped.setdefault(cid, []).append((c.get("reproduced"), c.get("note", ""), str(res.get("run_id"))))
    out = {}
    for cid, entries in grouped.items():
        v, note = _worst(cid, entries)
        out[cid] = {"reproduced": v, "note": note}
    return out


def invariant_summary(results: list[dict]) -> dict:
    """Worst case over every conversion (mapped to a paper row or not)."""
    def mx(key, f=lambda x: x):
        vals = [f(r[key]) for r in results if r.get(key) is not None]
        return max(vals) if vals else None

    rel = [r["fp64_max_logit_err"] / r["logit_scale"] for r in results
           if r.get("fp64_max_logit_err") is not None and r.get("logit_scale")]
    return {
        "checkpoints": len(results),
        "fp64_max_logit_err": mx("fp64_max_logit_err"),
        "fp64_rel_logit_err": max(rel) if rel else None,
        "fp64_rel_below_1e-9": all(x <= 1e-9 for x in rel) if rel else None,
        "max_abs_delta_ce": mx("delta_ce", abs),
        "abs_delta_ce_below_1e-3": (mx("delta_ce", abs) <= 1e-3) if mx("delta_ce", abs) is not None else None,
        "joint_rank_within_active_queries": all(r["joint_rank"] <= r["active_queries"] for r in results) if results else None,
        "max_slice_drift_logit_err": max((r.get("slice_drift", {}).get("max_logit_err") or 0.0) for r in results) if results else None,
    }


def aggregate_results(results: list[dict], provenance_block: dict | None = None) -> dict:
    """The ``convert_all`` result: every conversion, the union of their claims (aggregated)."""
    conversions = [{k: v for k, v in r.items() if k != "_path"} for r in results]
    return {
        "stage": "convert",
        "conversions": conversions,
        "invariants": invariant_summary(conversions),
        "claims": aggregate(conversions),
        "provenance": provenance_block or provenance({"aggregate": [r.get("run_id") for r in conversions]}),
    }
