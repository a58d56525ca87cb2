"""The published-numbers file and the claims engine (verdicts per kind)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from lrattnres import claims

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "reports" / "published.yaml"


@pytest.fixture(scope="module")
def published():
    return claims.load_published(PUBLISHED)


# ------------------------------------------------------------------ the file


def test_published_loads_and_every_record_validates(published):
    raw = yaml.safe_load(PUBLISHED.read_text())
    assert len(raw) == len(published) > 300  # ids unique (a duplicate would have raised)
    for rec in published.values():
        claims.validate_record(rec, rec["id"])
        assert rec["kind"] in claims.KINDS and rec["stage"] in claims.STAGES


def test_table5_complete(published):
    for q in ("added_flops", "val_loss"):
        rows = [r for k, r in published.items() if k.startswith(f"table5.{q}.")]
        assert len(rows) == 40  # baseline + 38 routed rows of the sweep + the full-RMS control
        assert {r["row"]["method"] for r in rows} == {"baseline", "attnres", "lr", "plr", "lr-fullrms"}
    assert published["table5.added_flops.lr.n8.r128"]["published"] == 0.09865
    assert published["table5.val_loss.baseline"]["published"] == 2.997
    assert all(r["kind"] == "exact" for k, r in published.items() if k.startswith("table5.added_flops."))


def test_table8_and_table1_complete(published):
    tasks = ["arc_challenge", "arc_easy", "boolq", "commonsense_qa", "hellaswag", "openbookqa", "piqa", "social_iqa"]
    for size in ("1b", "4b"):
        for m in ("attnres", "lr"):
            vals = [published[f"table8.acc.{size}.{m}.{t}"]["published"] for t in tasks]
            mean = published[f"table8.acc.{size}.{m}.mean"]["published"]
            # the paper averaged unrounded accuracies: the mean of the printed ones may differ by <= 0.005 + rounding
            assert mean == pytest.approx(sum(vals) / 8, abs=0.0101)
            assert published[f"table1.avg_acc.{size}.{m}"]["published"] == mean
            assert f"table1.val_loss.{size}.{m}" in published


def test_other_tables_present(published):
    assert sum(k.startswith("table2.") for k in published) == 24
    assert sum(k.startswith("table3.") for k in published) == 36
    assert sum(k.startswith("table6.") for k in published) == 20
    assert sum(k.startswith("table9.") for k in published) == 12
    assert sum(k.startswith("table10.") for k in published) == 18
    assert all(r["stage"] == "none" for k, r in published.items() if k.startswith("table6."))
    for cid in ("sec4.2.routed_beat_baseline", "sec4.4.paired_reduction_mean", "appF.6.param_delta.plr.r32",
                "explainer.flops_reduction_pct.r_d8", "facts.params.0.5b.attnres.full", "appB.2.joint_rank.4b"):
        assert cid in published


# ------------------------------------------------------------------ malformed files


def write(tmp_path, records):
    p = tmp_path / "pub.yaml"
    p.write_text(yaml.safe_dump(records))
    return p


GOOD = {"id": "x.a", "source": "Table 5", "section": "C.3", "row": {"method": "lr"}, "quantity": "val_loss",
        "kind": "value", "published": 2.944, "stage": "grid", "statement": "s", "tolerance": 0.006}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"kind": "vibes"}, "kind"),
        ({"stage": "magic"}, "stage"),
        ({"published": [1]}, "published"),
        ({"row": "lr"}, "row"),
        ({"tolerance": -1}, "tolerance"),
        ({"page": 0}, "page"),
        ({"colour": "red"}, "colour"),
        ({"kind": "invariant", "tolerance": None}, "op"),
        ({"kind": "exact", "published": "yes", "tolerance": None}, "published"),
        ({"kind": "direction", "op": "~", "tolerance": None}, "op"),
    ],
)
def test_malformed_record_names_file_record_and_field(tmp_path, change, field):
    rec = {**GOOD, **change}
    rec = {k: v for k, v in rec.items() if v is not None}
    p = write(tmp_path, [GOOD | {"id": "ok"}, rec])
    with pytest.raises(claims.PublishedError) as e:
        claims.load_published(p)
    msg = str(e.value)
    assert str(p) in msg and "record 1" in msg and "x.a" in msg and f"'{field}'" in msg


def test_missing_field_and_duplicate_id(tmp_path):
    rec = dict(GOOD)
    del rec["statement"]
    with pytest.raises(claims.PublishedError, match=r"record 0 \(id 'x.a'\): field 'statement': missing"):
        claims.load_published(write(tmp_path, [rec]))
    with pytest.raises(claims.PublishedError, match=r"record 1 .*'id': duplicate id, first used by record 0"):
        claims.load_published(write(tmp_path, [GOOD, GOOD]))
    with pytest.raises(claims.PublishedError, match="expected a YAML list"):
        claims.load_published(write(tmp_path, {"a": 1}))


# ------------------------------------------------------------------ verdicts


def rec(**kw):
    return {**{k: v for k, v in GOOD.items() if k != "tolerance"}, **kw}


def test_exact_rounds_like_the_paper():
    r = rec(kind="exact", published=0.09865, sig=4)
    assert claims.verdict(r, 0.0986527, "tiny")[0] == "match"
    assert claims.verdict(r, 0.09867, "tiny")[0] == "mismatch"
    r = rec(kind="exact", published=48.44, decimals=2)
    assert claims.verdict(r, 48.4375, "paper")[0] == "match"  # a tie: half-up 48.44
    assert claims.verdict(rec(kind="exact", published=2983424, decimals=0), 2983424, "smoke")[0] == "match"
    assert claims.verdict(rec(kind="exact", published=2983424, decimals=0), 2983425, "smoke")[0] == "mismatch"
    # precision inferred from the printed number when neither decimals nor sig is given
    assert claims.verdict(rec(kind="exact", published=3.125), 3.1249999, "smoke")[0] == "match"
    assert claims.verdict(rec(kind="exact", published=0, decimals=0), 0.0, "smoke")[0] == "match"
    assert claims.verdict(rec(kind="exact", published=1.0), "x", "smoke")[0] == "mismatch"


def test_invariant():
    r = rec(kind="invariant", published=7.4e-13, bound=1e-9, op="<=")
    assert claims.verdict(r, 3e-12, "tiny")[0] == "match"
    assert claims.verdict(r, 2e-9, "tiny")[0] == "mismatch"
    r = rec(kind="invariant", published=6e-5, bound=1e-3, op="abs<=")
    assert claims.verdict(r, -5e-4, "paper")[0] == "match"
    assert claims.verdict(r, -5e-3, "paper")[0] == "mismatch"
    assert claims.verdict(r, True, "paper")[0] == "match"
    assert claims.verdict(r, False, "paper")[0] == "mismatch"
    # equality with the published count when there is no bound
    r = rec(kind="invariant", published=48, op="==")
    assert claims.verdict(r, 48, "tiny")[0] == "match"
    assert claims.verdict(r, 47, "tiny")[0] == "mismatch"
    assert claims.verdict(r, float("nan"), "tiny")[0] == "mismatch"


def test_direction():
    r = rec(kind="direction", published=True)
    assert claims.verdict(r, True, "tiny")[0] == "reproduced"
    assert claims.verdict(r, False, "tiny")[0] == "not reproduced"
    r = rec(kind="direction", published=27, op=">=", bound=27)
    assert claims.verdict(r, 28, "paper")[0] == "reproduced"
    assert claims.verdict(r, 20, "paper")[0] == "not reproduced"
    r = rec(kind="direction", published="lr.n8.r128")
    assert claims.verdict(r, "lr.n8.r128", "tiny")[0] == "reproduced"
    assert claims.verdict(r, "lr.n4.r64", "tiny")[0] == "not reproduced"


def test_value_paper_scale_and_different_scale():
    r = rec(kind="value", published=2.944, tolerance=0.006)
    assert claims.verdict(r, 2.949, "paper")[0] == "match"
    assert claims.verdict(r, 2.951, "paper")[0] == "mismatch"
    v, note = claims.verdict(r, 4.1, "tiny")
    assert v == "different scale" and "tiny" in note
    # no tolerance: half a unit of the last printed digit
    r = rec(kind="value", published=602.6)
    assert claims.verdict(r, 602.64, "paper")[0] == "match"
    assert claims.verdict(r, 602.7, "paper")[0] == "mismatch"
    assert claims.verdict(rec(kind="value", published="lr.n8.r128"), "lr.n8.r128", "paper")[0] == "match"


def test_not_run_names_the_stage():
    v, note = claims.verdict(rec(stage="evaluate"), None, "tiny")
    assert v == "not run" and "evaluate" in note
    v, note = claims.verdict(rec(stage="none"), None, "paper")
    assert v == "not run" and "none" in note


def test_evaluate_claims_shape_order_and_unknown_ids(published):
    produced = {"table5.added_flops.lr.n8.r128": {"reproduced": 0.0986527, "note": "from accounting"},
                "table5.val_loss.lr.n8.r128": {"reproduced": 3.9, "note": ""}}
    out = claims.evaluate_claims(published, produced, "tiny")
    assert [c["id"] for c in out] == list(published)
    assert all(set(c) == set(claims.CLAIM_FIELDS) for c in out)
    by = {c["id"]: c for c in out}
    assert by["table5.added_flops.lr.n8.r128"]["verdict"] == "match"
    assert "from accounting" in by["table5.added_flops.lr.n8.r128"]["note"]
    assert by["table5.val_loss.lr.n8.r128"]["verdict"] == "different scale"
    assert by["table1.avg_acc.1b.lr"]["verdict"] == "not run"
    assert "evaluate" in by["table1.avg_acc.1b.lr"]["note"]
    with pytest.raises(KeyError, match="no.such.claim"):
        claims.evaluate_claims(published, {"no.such.claim": {"reproduced": 1}}, "tiny")


def test_every_published_value_matches_itself(published):
    """Feeding the published numbers back reproduces every claim at the paper scale."""
    produced = {}
    for cid, r in published.items():
        if r["kind"] == "invariant":
            val = r["published"] if isinstance(r["published"], (int, float)) and not isinstance(r["published"], bool) else True
        elif r["kind"] == "direction":
            val = r["published"]
        else:
            val = r["published"]
        produced[cid] = {"reproduced": val}
    out = claims.evaluate_claims(published, produced, "paper")
    bad = [(c["id"], c["verdict"], c["note"]) for c in out if c["verdict"] not in ("match", "reproduced")]
    assert not bad
