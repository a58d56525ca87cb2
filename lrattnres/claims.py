"""The claims engine: the published numbers of the paper and a verdict for each reproduced one.

``reports/published.yaml`` lists every published number and qualitative claim (its header explains the
fields).  A stage produces claims in its result JSON as ``{"<id>": {"reproduced": ..., "note": ...}}``;
:func:`evaluate_claims` turns the merged produced claims into the claim dicts of ``reports/paper.json``.

Verdicts (DESIGN.md, "Claims and verdicts"):

- exact      match | mismatch: the reproduced value, rounded the way the paper printed the published one
             (``sig`` significant figures or ``decimals`` places; inferred from the printed number if
             neither is given), equals the published value.  Any scale.
- invariant  match | mismatch: ``reproduced <op> bound`` (bound defaults to the published value); a bool
             reproduced value means "the invariant holds".  Any scale.
- direction  reproduced | not reproduced: a bool reproduced value; or a number compared as
             ``reproduced <op> bound`` (op defaults to "==", bound to the published value); or a string
             compared for equality.  Any scale.
- value      at scale "paper": match | mismatch within the absolute ``tolerance`` (default: half a unit
             of the last printed digit); strings and bools by equality.  At any other scale:
             "different scale" (the numbers are shown side by side).
- no reproduced value: "not run", with a note naming the stage that produces the claim.
"""

from __future__ import annotations

import math
import operator
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

KINDS = ("exact", "invariant", "direction", "value")
STAGES = ("accounting", "train", "grid", "convert", "evaluate", "throughput", "diagnostics", "kernel", "none")
VERDICTS = ("match", "mismatch", "reproduced", "not reproduced", "different scale", "not run")
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
OPTIONAL = ("page", "tolerance", "bound", "op", "decimals", "sig", "check", "derived", "note")
CLAIM_FIELDS = ("id", "source", "row", "quantity", "kind", "published", "reproduced", "verdict", "note")


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
        if kind not in ("invariant", "direction"):
            fail("op", f"only invariant and direction claims take an op (kind is {kind!r})")
        if rec["op"] not in OPS:
            fail("op", f"expected one of {list(OPS)}, got {rec['op']!r}")
    if "bound" in rec:
        if kind not in ("invariant", "direction"):
            fail("bound", f"only invariant and direction claims take a bound (kind is {kind!r})")
        if not (_is_number(rec["bound"]) or isinstance(rec["bound"], bool)):
            fail("bound", f"expected a number or bool, got {rec['bound']!r}")
    if kind == "invariant":
        if "op" not in rec:
            fail("op", f"an invariant claim needs an op (one of {list(OPS)})")
        if "bound" not in rec and not _is_number(pub) and not isinstance(pub, bool):
            fail("bound", "an invariant claim whose published value is not a number needs a bound")
    if kind == "direction" and "op" in rec and "bound" not in rec and not _is_number(pub):
        fail("bound", "a direction claim with an op needs a numeric bound or published value")


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


def verdict(record: dict, reproduced: Any, scale: str) -> tuple[str, str]:
    """(verdict, note) for one published record and the reproduced value at ``scale``."""
    stage = record.get("stage", "?")
    if reproduced is None:
        if stage == "none":
            return "not run", "not reproducible in this project (stage none: needs data outside the pipeline)"
        return "not run", f"the {stage} stage has not produced this claim"
    kind = record["kind"]
    pub = record["published"]
    if _is_number(reproduced) and math.isnan(reproduced):
        bad = "not reproduced" if kind == "direction" else "mismatch"
        if kind == "value" and scale != "paper":
            bad = "different scale"
        return bad, "reproduced value is NaN"

    if kind == "exact":
        if not _is_number(reproduced):
            return "mismatch", f"expected a number, got {reproduced!r}"
        places, how = _quantum(record, pub)
        want = round_as_printed(pub, places)
        got = {round_as_printed(reproduced, places, m) for m in (ROUND_HALF_UP, ROUND_HALF_EVEN)}
        ok = want in got
        shown = round_as_printed(reproduced, places)
        return ("match" if ok else "mismatch"), f"rounded to {how}: {shown} vs published {want}"

    if kind == "invariant":
        if isinstance(reproduced, bool):
            return ("match" if reproduced else "mismatch"), ("holds" if reproduced else "does not hold")
        op = record.get("op", "==")
        bound = record.get("bound", pub)
        try:
            ok = _compare(reproduced, op, bound)
        except TypeError:
            return "mismatch", f"cannot compare {reproduced!r} {op} {bound!r}"
        return ("match" if ok else "mismatch"), f"{_fmt(reproduced)} {op} {_fmt(bound)}: {'holds' if ok else 'fails'}"

    if kind == "direction":
        if isinstance(reproduced, bool):
            return ("reproduced" if reproduced else "not reproduced"), ("holds" if reproduced else "does not hold")
        if isinstance(reproduced, str) or isinstance(pub, str) and "op" not in record:
            ok = reproduced == pub
            return ("reproduced" if ok else "not reproduced"), f"{reproduced!r} vs published {pub!r}"
        op = record.get("op", "==")
        bound = record.get("bound", pub)
        try:
            ok = _compare(reproduced, op, bound)
        except TypeError:
            return "not reproduced", f"cannot compare {reproduced!r} {op} {bound!r}"
        return ("reproduced" if ok else "not reproduced"), f"{_fmt(reproduced)} {op} {_fmt(bound)}: {'holds' if ok else 'fails'}"

    if kind == "value":
        if scale != "paper":
            if _is_number(reproduced) and _is_number(pub):
                return "different scale", f"scale {scale!r}; difference {reproduced - pub:+.4g} (compared at the paper scale only)"
            return "different scale", f"scale {scale!r} (compared at the paper scale only)"
        if _is_number(pub) and _is_number(reproduced):
            tol = record.get("tolerance")
            if tol is None:
                tol = 0.5 * 10 ** (-_decimals_printed(pub))
                how = "half a printed unit"
            else:
                how = "tolerance"
            diff = reproduced - pub
            ok = abs(diff) <= tol * (1 + 1e-12)
            return ("match" if ok else "mismatch"), f"|{diff:+.4g}| {'<=' if ok else '>'} {tol:g} ({how})"
        ok = reproduced == pub
        return ("match" if ok else "mismatch"), f"{reproduced!r} vs published {pub!r}"

    raise ValueError(f"claim {record.get('id')!r}: unknown kind {kind!r}")


def evaluate_claims(published: dict[str, dict], produced: dict[str, dict], scale: str) -> list[dict]:
    """Claim dicts of paper.json for every published record, in the file's order.

    ``produced`` maps claim ids to ``{"reproduced": ..., "note": ...}`` (merged from the stages'
    result JSONs).  An id the published file does not know is an error naming the id.
    """
    unknown = [cid for cid in produced if cid not in published]
    if unknown:
        raise KeyError(
            f"produced claim id {unknown[0]!r} is not in the published-numbers file"
            + (f" (and {len(unknown) - 1} more: {unknown[1:6]})" if len(unknown) > 1 else "")
        )
    out = []
    for cid, rec in published.items():
        prod = produced.get(cid)
        if prod is not None and not isinstance(prod, dict):
            raise ValueError(f"produced claim {cid!r}: expected {{'reproduced': ..., 'note': ...}}, got {prod!r}")
        reproduced = prod.get("reproduced") if prod else None
        v, note = verdict(rec, reproduced, scale)
        extra = (prod or {}).get("note")
        if extra:
            note = f"{note}; {extra}" if note else str(extra)
        out.append(
            {
                "id": cid,
                "source": rec["source"],
                "row": rec["row"],
                "quantity": rec["quantity"],
                "kind": rec["kind"],
                "published": rec["published"],
                "reproduced": reproduced,
                "verdict": v,
                "note": note,
            }
        )
    return out
