"""The claims engine: the published numbers of the paper and a verdict for each reproduced one.

``reports/published.yaml`` lists every published number and qualitative claim (its header explains the
fields).  A stage produces claims in its result JSON as ``{"<id>": {"reproduced": ..., "note": ...}}``,
with the evidence a statistical verdict needs (below); :func:`evaluate_claims` turns the merged
produced claims into the claim dicts of ``reports/paper.json``.

Verdicts (docs/report.md, "Verdicts"):

- exact      match | mismatch: the reproduced value, rounded the way the paper printed the published one
             (``sig`` significant figures or ``decimals`` places; inferred from the printed number if
             neither is given), equals the published value.  Any scale.
- invariant  match | mismatch: ``reproduced <op> bound`` (bound defaults to the published value); a bool
             reproduced value means "the invariant holds".  Any scale.
- direction  reproduced | contradicted | inconclusive, at every scale.  The reproduced value is the effect,
             signed so that a positive effect is the paper's direction; the published value is the
             paper's effect (or true where the paper prints no number).  The effect's interval [lo, hi]
             comes from the produced evidence:
               ``samples``  paired differences over seeds, repeats or configurations: the Student t
                            interval of their mean (:func:`lrattnres.stats.mean_interval`); n >= 3 is
                            needed for a resolved verdict;
               ``se``       a standard error of the effect (``df`` degrees of freedom, normal if absent);
               threshold    a single-run design: effect +- the claim's threshold (the produced
                            ``threshold``, else the record's).
             reproduced when lo > 0, contradicted when hi < 0, inconclusive otherwise (or without an
             interval).  Each direction claim also carries ``mdd``, the smallest true effect its test
             resolves at this noise with 80% power (:func:`lrattnres.stats.min_detectable` of the
             evidence's standard error: ``sd / sqrt(n)`` over n - 1 degrees of freedom for samples;
             the threshold itself for a single-run design), to set beside the paper's effect.
             ``every`` records also name the items (``labels`` beside ``samples``, each with
             the single-run half-width from ``item_se`` and ``df``): one item resolved below 0 makes
             the claim contradicted.  ``tie`` records claim a near-tie: reproduced when the interval
             lies inside +-``margin`` (produced), contradicted when it lies wholly outside, else
             inconclusive.  ``all_of`` records combine other claims: reproduced when all are,
             contradicted when one is, not run when one is not run, inconclusive otherwise.
- shape      reproduced | contradicted | inconclusive: the pattern of the sweep below the paper's scale.
             A configuration's change relative to the same scale's baseline (%) is judged like a
             direction claim in the published change's sign; the rank correlation of the sweep
             (produced ``pairs``: label -> [reproduced, published]) by its Spearman interval
             (:func:`lrattnres.stats.spearman_interval`): reproduced when lo > 0, contradicted when hi < 0.
- value      where the scale trains the paper's own runs (config.yaml ``paper_runs``): match | mismatch
             within the absolute ``tolerance`` (default: half a unit of the last printed digit);
             strings and bools by equality.  At any other scale: "different scale" (the numbers are
             shown side by side).
- no reproduced value: "not run", with a note naming the stage that produces the claim, or the file
             and key of a malformed stage value (:func:`check_produced`).
"""

from __future__ import annotations

import math
import operator
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

from lrattnres import stats

KINDS = ("exact", "invariant", "direction", "shape", "value")
STAGES = ("accounting", "train", "grid", "convert", "evaluate", "throughput", "diagnostics", "kernel", "none")
VERDICTS = ("match", "mismatch", "reproduced", "contradicted", "inconclusive", "different scale", "not run")
ORIGINS = ("paper", "explainer", "repository", "derived")
OPS = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "abs<": lambda a, b: abs(a) < b,
    "abs<=": lambda a, b: abs(a) <= b,
}
REQUIRED = ("id", "source", "section", "row", "quantity", "kind", "published", "stage", "statement")
OPTIONAL = ("page", "tolerance", "bound", "op", "decimals", "sig", "check", "origin", "note", "glance",
            "threshold", "tie", "every", "all_of")
CLAIM_FIELDS = ("id", "source", "section", "origin", "row", "quantity", "kind", "published", "reproduced",
                "verdict", "interval", "interval_kind", "n", "unresolved", "mdd", "note")
# evidence a stage may give beside "reproduced" and "note" (see the module doc)
EVIDENCE = ("samples", "unit", "labels", "item_se", "se", "df", "n", "threshold", "margin", "pairs")
MIN_REPLICATES = 3
# Quantities that are the percentage of items answered correctly (Tables 1 and 8): a number outside
# 0-100 is refused, published or reproduced.
ACCURACY_QUANTITIES = ("acc", "avg_acc")


class PublishedError(ValueError):
    """A malformed published-numbers file; the message names the file, the record and the field."""


# --------------------------------------------------------------------------------------- loading


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate_record(rec: Any, where: str) -> None:
    """Raise PublishedError (message starting with ``where``) if ``rec`` is not a valid record."""

    def fail(field: str, problem: str) -> None:
        raise PublishedError(f"{where}: field {field!r}: {problem}")

    if not isinstance(rec, dict):
        raise PublishedError(f"{where}: expected a mapping with fields {list(REQUIRED)}, got {type(rec).__name__}")
    for f in REQUIRED:
        if f not in rec:
            fail(f, "missing (required)")
    unknown = sorted(set(rec) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        fail(unknown[0], f"unknown field; expected only {list(REQUIRED) + list(OPTIONAL)}")
    for f in ("id", "source", "section", "quantity", "statement"):
        if not isinstance(rec[f], str) or not rec[f].strip():
            fail(f, f"expected a non-empty string, got {rec[f]!r}")
    if not isinstance(rec["row"], dict):
        fail("row", f"expected a mapping (method, N, r, size, ...), got {rec['row']!r}")
    if rec["kind"] not in KINDS:
        fail("kind", f"expected one of {list(KINDS)}, got {rec['kind']!r}")
    if rec["stage"] not in STAGES:
        fail("stage", f"expected one of {list(STAGES)}, got {rec['stage']!r}")
    pub = rec["published"]
    if not (_is_number(pub) or isinstance(pub, (bool, str))):
        fail("published", f"expected a number, bool or string, got {pub!r}")
    if _is_number(pub) and math.isnan(pub):
        fail("published", "is NaN")
    if rec["quantity"] in ACCURACY_QUANTITIES and not (_is_number(pub) and 0 <= pub <= 100):
        fail("published", f"an accuracy ({rec['quantity']}) is a percentage from 0 to 100, got {pub!r}")
    if "page" in rec and not (
        (isinstance(rec["page"], int) and not isinstance(rec["page"], bool) and rec["page"] > 0)
        or (isinstance(rec["page"], str) and rec["page"].strip())
    ):
        fail("page", f"expected a positive integer or a range such as '5-6', got {rec['page']!r}")
    kind = rec["kind"]
    if kind == "exact" and not _is_number(pub):
        fail("published", f"an exact claim needs a number, got {pub!r}")
    if "decimals" in rec and "sig" in rec:
        fail("sig", "give either 'decimals' or 'sig', not both")
    if "decimals" in rec and not (isinstance(rec["decimals"], int) and not isinstance(rec["decimals"], bool)
                                  and rec["decimals"] >= 0):
        fail("decimals", f"expected an integer >= 0, got {rec['decimals']!r}")
    if "sig" in rec and not (isinstance(rec["sig"], int) and not isinstance(rec["sig"], bool) and rec["sig"] >= 1):
        fail("sig", f"expected an integer >= 1, got {rec['sig']!r}")
    if "tolerance" in rec:
        if kind != "value":
            fail("tolerance", f"only value claims take a tolerance (kind is {kind!r})")
        if not _is_number(rec["tolerance"]) or rec["tolerance"] < 0:
            fail("tolerance", f"expected a number >= 0, got {rec['tolerance']!r}")
    if "op" in rec:
        if kind != "invariant":
            fail("op", f"only invariant claims take an op (kind is {kind!r})")
        if rec["op"] not in OPS:
            fail("op", f"expected one of {list(OPS)}, got {rec['op']!r}")
    if "bound" in rec:
        if kind != "invariant":
            fail("bound", f"only invariant claims take a bound (kind is {kind!r})")
        if not (_is_number(rec["bound"]) or isinstance(rec["bound"], bool)):
            fail("bound", f"expected a number or bool, got {rec['bound']!r}")
    if kind == "invariant":
        if "op" not in rec:
            fail("op", f"an invariant claim needs an op (one of {list(OPS)})")
        if "bound" not in rec and not _is_number(pub) and not isinstance(pub, bool):
            fail("bound", "an invariant claim whose published value is not a number needs a bound")
    if kind == "direction" and not (_is_number(pub) or pub is True):
        fail("published", f"a direction claim needs the paper's effect (a number) or true, got {pub!r}")
    if kind == "shape" and not _is_number(pub):
        fail("published", f"a shape claim needs a number, got {pub!r}")
    for flag in ("tie", "every"):
        if flag in rec:
            if kind != "direction":
                fail(flag, f"only direction claims take {flag!r} (kind is {kind!r})")
            if not isinstance(rec[flag], bool):
                fail(flag, f"expected true or false, got {rec[flag]!r}")
    if rec.get("tie") and rec.get("every"):
        fail("every", "a claim is either a near-tie or holds for every item, not both")
    if "threshold" in rec:
        if kind not in ("direction", "shape"):
            fail("threshold", f"only direction and shape claims take a threshold (kind is {kind!r})")
        if not _is_number(rec["threshold"]) or not rec["threshold"] > 0:
            fail("threshold", f"expected a number > 0, got {rec['threshold']!r}")
        if not isinstance(rec.get("note"), str) or not rec["note"].strip():
            fail("note", "a record with a threshold says in its note why the threshold is what it is")
    if "all_of" in rec:
        if kind != "direction":
            fail("all_of", f"only direction claims combine others (kind is {kind!r})")
        parts = rec["all_of"]
        if not (isinstance(parts, list) and len(parts) >= 2 and all(isinstance(x, str) and x for x in parts)):
            fail("all_of", f"expected a list of at least two claim ids, got {parts!r}")
        if rec["id"] in parts:
            fail("all_of", "a claim cannot include itself")
    if "origin" in rec and rec["origin"] not in ORIGINS:
        fail("origin", f"expected one of {list(ORIGINS)}, got {rec['origin']!r}")
    if "glance" in rec and not (isinstance(rec["glance"], str) and rec["glance"].strip()):
        fail("glance", f"expected a short conclusion (non-empty string), got {rec['glance']!r}")


def load_published(path: str | Path) -> dict[str, dict]:
    """Records of the published-numbers file by id, in the file's order; every record validated."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PublishedError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise PublishedError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, list):
        raise PublishedError(f"{path}: expected a YAML list of records, got {type(data).__name__}")
    out: dict[str, dict] = {}
    first: dict[str, int] = {}
    for i, rec in enumerate(data):
        rid = rec.get("id") if isinstance(rec, dict) else None
        where = f"{path}: record {i}" + (f" (id {rid!r})" if rid is not None else "")
        validate_record(rec, where)
        if rid in out:
            raise PublishedError(f"{where}: field 'id': duplicate id, first used by record {first[rid]}")
        out[rid] = rec
        first[rid] = i
    for rid, rec in out.items():
        where = f"{path}: record {first[rid]} (id {rid!r}): field 'all_of'"
        unknown = [x for x in rec.get("all_of", []) if x not in out]
        if unknown:
            raise PublishedError(f"{where}: unknown claim id {unknown[0]!r}")
        nested = [x for x in rec.get("all_of", []) if out[x].get("all_of")]
        if nested:
            raise PublishedError(f"{where}: {nested[0]!r} combines other claims itself; list its parts instead")
    return out


# --------------------------------------------------------------------------------------- verdicts


def _decimals_printed(x: float | int) -> int:
    """Decimal places of a number as printed (its shortest repr), e.g. 0.09865 -> 5, 2981888 -> 0."""
    d = Decimal(repr(x)) if isinstance(x, float) else Decimal(x)
    return max(0, -d.normalize().as_tuple().exponent) if d != 0 else 0


def _quantum(rec: dict, published: float | int) -> tuple[int, str]:
    """(decimal places, description) with which the paper printed ``published``."""
    if "decimals" in rec:
        return rec["decimals"], f"{rec['decimals']} decimal places"
    if "sig" in rec:
        if published == 0:
            return 0, f"{rec['sig']} significant figures"
        exp = Decimal(repr(float(published))).adjusted()
        return rec["sig"] - 1 - exp, f"{rec['sig']} significant figures"
    n = _decimals_printed(published)
    return n, f"{n} decimal places (as printed)"


def round_as_printed(value: float, places: int, mode=ROUND_HALF_UP) -> Decimal:
    q = Decimal(1).scaleb(-places)
    return Decimal(repr(float(value))).quantize(q, rounding=mode)


def _fmt(v: Any) -> str:
    if _is_number(v):
        return f"{v:.6g}"
    return repr(v)


def _compare(reproduced: Any, op: str, bound: Any) -> bool:
    return bool(OPS[op](reproduced, bound))


def _interval_text(iv: list[float] | None, n: int | None, how: str, kind: str | None = "95%") -> str:
    if iv is None:
        return f"no interval ({how})" if how else "no interval"
    what = "threshold band" if kind == "threshold" else "95% interval"
    return f"{what} [{iv[0]:+.4g}, {iv[1]:+.4g}], n = {n}" + (f" ({how})" if how else "")


def _evidence_interval(record: dict, prod: dict,
                       effect: float) -> tuple[list[float] | None, int | None, str, str, str | None]:
    """(interval, n, how, problem, kind) of a direction or shape effect from the produced evidence.

    ``problem`` is non-empty when the evidence cannot resolve the effect whatever its value (fewer than
    three replicates, no threshold). ``kind``: "95%" (a 95% interval of the effect, over replicates or
    from a standard error), "threshold" (a single run: the effect plus and minus the claim's
    threshold, which an effect must clear) or None."""
    if prod.get("samples") is not None:
        st = stats.mean_interval(prod["samples"])
        unit = prod.get("unit") or "replicates"
        how = f"paired over {st['n']} {unit}"
        if st["n"] < MIN_REPLICATES:
            return (st["interval"], st["n"], how, f"{st['n']} {unit}: fewer than {MIN_REPLICATES} to resolve an effect",
                    "95%")
        return st["interval"], st["n"], how, "", "95%"
    if prod.get("se") is not None:
        df = prod.get("df")
        iv = stats.effect_interval(effect, prod["se"], df)
        how = f"standard error {prod['se']:.3g}" + (f", {df:g} degrees of freedom" if df is not None else ", normal")
        return iv, prod.get("n", 1), how, "", "95%"
    thr = prod.get("threshold", record.get("threshold"))
    if thr is not None:
        src = "this scale's" if "threshold" in prod else "the claim's"
        return [effect - thr, effect + thr], prod.get("n", 1), f"single run, {src} threshold {thr:.3g}", "", "threshold"
    return None, prod.get("n"), "", "no interval: a single comparison with no threshold or replicates", None


def min_detectable(record: dict, prod: dict) -> float | None:
    """The smallest true effect a direction claim's evidence resolves with 80% power (None without an
    interval): from the samples' SD over n - 1 degrees of freedom, a produced standard error, or the
    single-run threshold (an effect beyond it is resolved whatever the noise)."""
    if prod.get("samples") is not None:
        st = stats.mean_interval(prod["samples"])
        if st["sd"] is None:
            return None
        return stats.min_detectable(st["sd"] / math.sqrt(st["n"]), st["n"] - 1)
    if prod.get("se") is not None:
        return stats.min_detectable(prod["se"], prod.get("df"))
    thr = prod.get("threshold", record.get("threshold"))
    return None if thr is None else float(thr)


def _judge_direction(record: dict, prod: dict) -> dict:
    effect = prod["reproduced"]
    if isinstance(effect, bool) or not _is_number(effect):
        return {"verdict": "inconclusive", "note": f"expected an effect size, got {effect!r}: a bare sign is not resolved",
                "interval": None, "n": prod.get("n")}
    iv, n, how, problem, ivk = _evidence_interval(record, prod, effect)
    if problem and iv is None:
        return {"verdict": "inconclusive", "note": f"effect {effect:+.4g}; {problem}", "interval": None, "n": n,
                "unresolved": problem}
    text = f"effect {effect:+.4g}; {_interval_text(iv, n, how, ivk)}"
    lo, hi = iv
    shown = {"interval": iv, "n": n, "interval_kind": ivk, "unresolved": problem or None}
    if record.get("tie"):
        m = prod.get("margin")
        if m is None:
            return {"verdict": "inconclusive", "note": f"{text}; no tie margin given", **shown,
                    "unresolved": "no tie margin given"}
        text += f"; tie margin +-{m:.3g}"
        if problem:
            v = "inconclusive"
        elif -m < lo and hi < m:
            v = "reproduced"
        elif lo >= m or hi <= -m:
            v = "contradicted"
        else:
            v = "inconclusive"
        return {"verdict": v, "note": text + (f"; {problem}" if problem else ""), **shown}
    against = []
    if record.get("every") and prod.get("labels") and prod.get("item_se") is not None:
        q = stats.quantile(df=prod.get("df"))
        hw = q * prod["item_se"]
        against = [lab for lab, x in zip(prod["labels"], prod["samples"]) if x + hw < 0]
        text += f"; each item +-{hw:.3g}"
    if against:
        return {"verdict": "contradicted", "note": f"{text}; resolved the other way at {', '.join(against)}",
                **shown, "unresolved": None}
    if problem:
        v = "inconclusive"
    elif hi < 0:
        v = "contradicted"
    elif lo > 0:
        v = "reproduced"
    else:
        v = "inconclusive"
    return {"verdict": v, "note": text + (f"; {problem}" if problem else ""), **shown}


def _judge_shape(record: dict, prod: dict) -> dict:
    if prod.get("pairs") is not None:
        pairs = prod["pairs"]
        labels = list(pairs)
        if len(labels) < 3:
            why = f"{len(labels)} configurations in common with the paper: too few for a rank correlation"
            return {"verdict": "inconclusive", "reproduced": None, "interval": None, "n": len(labels), "note": why,
                    "unresolved": why}
        st = stats.spearman_interval([pairs[k][0] for k in labels], [pairs[k][1] for k in labels])
        rho, iv, n = st["rho"], st["interval"], st["n"]
        text = (f"Spearman rho {'n/a' if rho is None else f'{rho:+.3f}'} over {n} configurations; "
                + _interval_text(iv, n, "Fisher z, SE sqrt(1.06/(n-3))"))
        if iv is None:
            v = "inconclusive"
        elif iv[0] > 0:
            v = "reproduced"
        elif iv[1] < 0:
            v = "contradicted"
        else:
            v = "inconclusive"
        return {"verdict": v, "reproduced": rho, "interval": iv, "n": n, "note": text,
                "interval_kind": None if iv is None else "95%"}
    pub = record["published"]
    sign = 1.0 if pub > 0 else -1.0
    change = prod["reproduced"]
    if isinstance(change, bool) or not _is_number(change):
        return {"verdict": "inconclusive", "note": f"expected a number, got {change!r}", "interval": None, "n": None}
    iv, n, how, problem, ivk = _evidence_interval(record, prod, change)
    text = f"{change:+.4g} (paper {pub:+.4g}); {_interval_text(iv, n, how, ivk)}"
    if iv is None:
        return {"verdict": "inconclusive", "note": f"{text}; {problem}", "interval": None, "n": n,
                "unresolved": problem}
    lo, hi = sorted((iv[0] * sign, iv[1] * sign))
    v = "inconclusive" if problem else ("contradicted" if hi < 0 else ("reproduced" if lo > 0 else "inconclusive"))
    return {"verdict": v, "note": text + (f"; {problem}" if problem else ""), "interval": iv, "n": n,
            "interval_kind": ivk, "unresolved": problem or None}


def verdict(record: dict, reproduced: Any, scale: str, *, paper_runs: bool = False) -> tuple[str, str]:
    """(verdict, note) for one published record and a bare reproduced value at ``scale``."""
    out = judge(record, None if reproduced is None else {"reproduced": reproduced}, scale, paper_runs=paper_runs)
    return out["verdict"], out["note"]


def judge(record: dict, prod: dict | None, scale: str, *, paper_runs: bool = False) -> dict:
    """``{"verdict", "note", "interval", "n", "reproduced"}`` for one record and its produced claim
    (``{"reproduced": ..., evidence ...}``, or None when no stage produced it). ``paper_runs``: the
    scale trains the paper's own runs (config.yaml), so a value claim is compared with the published
    number; otherwise it is "different scale"."""
    stage = record.get("stage", "?")
    reproduced = None if prod is None else prod.get("reproduced")
    out = {"verdict": "not run", "note": "", "interval": None, "n": None, "mdd": None, "reproduced": reproduced,
           "interval_kind": None, "unresolved": None}
    if reproduced is None and not (record["kind"] == "shape" and prod and prod.get("pairs") is not None):
        if stage == "none":
            out["note"] = "not reproducible in this project (stage none: needs data outside the pipeline)"
        else:
            out["note"] = f"the {stage} stage has not produced this claim"
        return out
    kind = record["kind"]
    pub = record["published"]
    if _is_number(reproduced) and math.isnan(reproduced):
        out["note"] = f"the {stage} stage gave NaN"
        return out

    if kind == "direction":
        out.update(_judge_direction(record, prod))
        if _is_number(reproduced) and not isinstance(reproduced, bool):
            out["mdd"] = min_detectable(record, prod)
        return out
    if kind == "shape":
        out.update(_judge_shape(record, prod))
        return out

    if kind == "exact":
        if not _is_number(reproduced):
            out.update(verdict="mismatch", note=f"expected a number, got {reproduced!r}")
            return out
        places, how = _quantum(record, pub)
        want = round_as_printed(pub, places)
        if not math.isfinite(reproduced):
            out.update(verdict="mismatch", note=f"{reproduced} vs published {want}")
            return out
        got = {round_as_printed(reproduced, places, m) for m in (ROUND_HALF_UP, ROUND_HALF_EVEN)}
        shown = round_as_printed(reproduced, places)
        out.update(verdict="match" if want in got else "mismatch", note=f"rounded to {how}: {shown} vs published {want}")
        return out

    if kind == "invariant":
        if isinstance(reproduced, bool):
            out.update(verdict="match" if reproduced else "mismatch", note="holds" if reproduced else "does not hold")
            return out
        op = record.get("op", "==")
        bound = record.get("bound", pub)
        try:
            ok = _compare(reproduced, op, bound)
        except TypeError:
            out.update(verdict="mismatch", note=f"cannot compare {reproduced!r} {op} {bound!r}")
            return out
        out.update(verdict="match" if ok else "mismatch",
                   note=f"{_fmt(reproduced)} {op} {_fmt(bound)}: {'holds' if ok else 'fails'}")
        return out

    if kind == "value":
        if not paper_runs:
            if _is_number(reproduced) and _is_number(pub):
                note = f"scale {scale!r}; difference {reproduced - pub:+.4g} (compared at the paper scale only)"
            else:
                note = f"scale {scale!r} (compared at the paper scale only)"
            out.update(verdict="different scale", note=note)
            return out
        if _is_number(pub) and _is_number(reproduced):
            tol = record.get("tolerance")
            if tol is None:
                tol = 0.5 * 10 ** (-_decimals_printed(pub))
                how = "half a printed unit"
            else:
                how = "tolerance"
            diff = reproduced - pub
            ok = abs(diff) <= tol * (1 + 1e-12)
            out.update(verdict="match" if ok else "mismatch", note=f"|{diff:+.4g}| {'<=' if ok else '>'} {tol:g} ({how})")
            return out
        ok = reproduced == pub
        out.update(verdict="match" if ok else "mismatch", note=f"{reproduced!r} vs published {pub!r}")
        return out

    raise ValueError(f"claim {record.get('id')!r}: unknown kind {kind!r}")


def _judge_all_of(record: dict, parts: list[dict]) -> dict:
    got = {p["id"]: p["verdict"] for p in parts}
    text = "; ".join(f"{cid}: {v}" for cid, v in got.items())
    vs = set(got.values())
    if "contradicted" in vs or "mismatch" in vs:
        v = "contradicted"
    elif "not run" in vs:
        v = "not run"
    elif vs <= {"reproduced", "match"}:
        v = "reproduced"
    else:
        v = "inconclusive"
    n = min((p["n"] for p in parts if p.get("n") is not None), default=None)
    return {"verdict": v, "note": f"all of: {text}", "interval": None, "n": n, "reproduced": v == "reproduced" if v != "not run" else None}


# --------------------------------------------------------------------------------------- stage values


def _num_ok(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


def check_produced(record: dict, prod: Any, where: str) -> tuple[dict | None, str]:
    """(the produced claim, "") when it is well formed for ``record``; else (None, a problem naming
    ``where``, the key and what was expected).  A malformed stage value makes its claim "not run"."""
    cid = record["id"]
    key = f"{where}: claims[{cid!r}]"
    if not isinstance(prod, dict):
        return None, f"{key}: expected {{'reproduced': ..., 'note': ...}}, got {prod!r:.80}"
    if "reproduced" not in prod:
        return None, f"{key}: key 'reproduced' is missing"
    v = prod["reproduced"]
    kind, pub = record["kind"], record["published"]
    if v is not None:
        if _is_number(v) and math.isnan(v):
            return None, f"{key}.reproduced: expected a finite number, got NaN"
        if kind == "exact" and not _is_number(v):
            return None, f"{key}.reproduced: expected a number, got {v!r:.80}"
        if kind in ("direction", "shape") and not (_is_number(v) or isinstance(v, bool)):
            return None, f"{key}.reproduced: expected a number (the effect), got {v!r:.80}"
        if kind == "invariant" and not (_is_number(v) or isinstance(v, bool)):
            return None, f"{key}.reproduced: expected a number or bool, got {v!r:.80}"
        if record["quantity"] in ACCURACY_QUANTITIES and not (_is_number(v) and 0 <= v <= 100):
            return None, f"{key}.reproduced: expected an accuracy ({record['quantity']}) from 0 to 100 percent, got {v!r:.80}"
        if kind == "value":
            if isinstance(pub, str) and not isinstance(v, str):
                return None, f"{key}.reproduced: expected a string, got {v!r:.80}"
            if _is_number(pub) and not _is_number(v):
                return None, f"{key}.reproduced: expected a number, got {v!r:.80}"
    if "samples" in prod:
        s = prod["samples"]
        if not (isinstance(s, list) and s and all(_num_ok(x) for x in s)):
            return None, f"{key}.samples: expected a non-empty list of finite numbers, got {s!r:.80}"
        if "labels" in prod and not (isinstance(prod["labels"], list) and len(prod["labels"]) == len(s)):
            return None, f"{key}.labels: expected one label per sample ({len(s)}), got {prod['labels']!r:.80}"
    for f in ("se", "item_se", "threshold", "margin"):
        if f in prod and prod[f] is not None and not (_num_ok(prod[f]) and prod[f] >= 0):
            return None, f"{key}.{f}: expected a finite number >= 0, got {prod[f]!r:.80}"
    if prod.get("df") is not None and not (_num_ok(prod["df"]) and prod["df"] >= 1):
        return None, f"{key}.df: expected a number >= 1, got {prod['df']!r:.80}"
    if "pairs" in prod:
        p = prod["pairs"]
        if not (isinstance(p, dict) and all(isinstance(x, list) and len(x) == 2 and all(_num_ok(y) for y in x)
                                            for x in p.values())):
            return None, f"{key}.pairs: expected {{label: [reproduced, published]}} of finite numbers, got {p!r:.80}"
    if "note" in prod and prod["note"] is not None and not isinstance(prod["note"], str):
        return None, f"{key}.note: expected a string, got {prod['note']!r:.80}"
    return prod, ""


def json_safe(v: Any) -> Any:
    """A value for strict JSON: non-finite floats as the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, list):
        return [json_safe(x) for x in v]
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    return v


def evaluate_claims(published: dict[str, dict], produced: dict[str, dict], scale: str,
                    problems: dict[str, str] | None = None, *, paper_runs: bool = False) -> list[dict]:
    """Claim dicts of paper.json for every published record, in the file's order.

    ``produced`` maps claim ids to ``{"reproduced": ..., "note": ..., evidence}`` (merged from the
    stages' result JSONs, checked by :func:`check_produced`); ``problems`` maps claim ids to the
    malformed stage value that left them "not run".  An id the published file does not know is an
    error naming the id.
    """
    problems = problems or {}
    unknown = [cid for cid in produced if cid not in published]
    if unknown:
        raise KeyError(
            f"produced claim id {unknown[0]!r} is not in the published-numbers file"
            + (f" (and {len(unknown) - 1} more: {unknown[1:6]})" if len(unknown) > 1 else "")
        )
    out: dict[str, dict] = {}
    for cid, rec in published.items():
        if rec.get("all_of"):
            continue
        prod = produced.get(cid)
        if prod is not None:
            prod, problem = check_produced(rec, prod, "stage result")
            if problem:
                problems.setdefault(cid, problem)
        res = judge(rec, prod, scale, paper_runs=paper_runs)
        note = res["note"]
        if cid in problems:
            note = f"{problems[cid]} (the stage value is malformed)"
        extra = (prod or {}).get("note")
        if extra:
            note = f"{note}; {extra}" if note else str(extra)
        out[cid] = _claim(rec, res, note)
    for cid, rec in published.items():
        if rec.get("all_of"):
            res = _judge_all_of(rec, [out[p] for p in rec["all_of"] if p in out])
            out[cid] = _claim(rec, res, res["note"])
    return [out[cid] for cid in published]


def _claim(rec: dict, res: dict, note: str) -> dict:
    return {
        "id": rec["id"],
        "source": rec["source"],
        "section": rec["section"],
        "origin": rec.get("origin", "paper"),
        "row": rec["row"],
        "quantity": rec["quantity"],
        "kind": rec["kind"],
        "published": rec["published"],
        "reproduced": json_safe(res["reproduced"]),
        "verdict": res["verdict"],
        "interval": json_safe(res["interval"]),
        "interval_kind": res.get("interval_kind"),
        "n": res["n"],
        "unresolved": res.get("unresolved"),
        "mdd": json_safe(res.get("mdd")),
        "note": note,
    }
