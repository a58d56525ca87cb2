"""The published-numbers file and the claims engine (verdicts per kind)."""

from __future__ import annotations

import copy
import math
import statistics
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
        ({"kind": "direction", "published": "lr", "tolerance": None}, "published"),
        ({"kind": "shape", "published": True, "tolerance": None}, "published"),
        ({"tie": True}, "tie"),
        ({"kind": "direction", "tolerance": None, "tie": True, "every": True}, "every"),
        ({"kind": "direction", "tolerance": None, "threshold": 0.01}, "note"),
        ({"kind": "direction", "tolerance": None, "threshold": -1, "note": "why"}, "threshold"),
        ({"kind": "direction", "tolerance": None, "all_of": ["ok"]}, "all_of"),
        ({"origin": "hearsay"}, "origin"),
        ({"glance": " "}, "glance"),
        ({"quantity": "acc", "published": 100.5}, "published"),
        ({"quantity": "avg_acc", "published": -0.1}, "published"),
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


def test_all_of_names_known_plain_claims(tmp_path):
    d = {**GOOD, "kind": "direction", "published": True}
    d.pop("tolerance")
    both = {**d, "id": "both", "all_of": ["x.a", "nope"]}
    with pytest.raises(claims.PublishedError, match=r"'all_of': unknown claim id 'nope'"):
        claims.load_published(write(tmp_path, [{**d, "id": "x.a"}, both]))
    nested = {**d, "id": "nested", "all_of": ["x.a", "both"]}
    with pytest.raises(claims.PublishedError, match=r"'all_of': 'both' combines other claims"):
        claims.load_published(write(tmp_path, [{**d, "id": "x.a"}, {**d, "id": "y"}, {**both, "all_of": ["x.a", "y"]},
                                               nested]))


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
    assert claims.verdict(r, 48.4375, "paper", paper_runs=True)[0] == "match"  # a tie: half-up 48.44
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
    assert claims.verdict(r, -5e-4, "paper", paper_runs=True)[0] == "match"
    assert claims.verdict(r, -5e-3, "paper", paper_runs=True)[0] == "mismatch"
    assert claims.verdict(r, True, "paper", paper_runs=True)[0] == "match"
    assert claims.verdict(r, False, "paper", paper_runs=True)[0] == "mismatch"
    # equality with the published count when there is no bound
    r = rec(kind="invariant", published=48, op="==")
    assert claims.verdict(r, 48, "tiny")[0] == "match"
    assert claims.verdict(r, 47, "tiny")[0] == "mismatch"
    assert claims.verdict(r, float("inf"), "tiny")[0] == "mismatch"  # an infinite error fails its bound
    v, note = claims.verdict(r, float("nan"), "tiny")  # NaN is no value: not run, said so
    assert v == "not run" and "NaN" in note


def direction(**kw):
    return {k: v for k, v in rec(kind="direction", published=0.03, **kw).items() if k != "tolerance"}


def test_direction_needs_a_resolved_interval():
    r = direction()
    # paired samples over at least three replicates: the Student t interval of the mean
    out = claims.judge(r, {"reproduced": 0.03, "samples": [0.029, 0.031, 0.030]}, "tiny")
    assert out["verdict"] == "reproduced" and out["n"] == 3 and out["interval"][0] > 0
    assert "95% interval" in out["note"] and "n = 3" in out["note"]
    out = claims.judge(r, {"reproduced": -0.03, "samples": [-0.029, -0.031, -0.030]}, "tiny")
    assert out["verdict"] == "contradicted" and out["interval"][1] < 0
    out = claims.judge(r, {"reproduced": 0.0, "samples": [0.02, -0.02, 0.001]}, "tiny")
    assert out["verdict"] == "inconclusive" and out["interval"][0] < 0 < out["interval"][1]
    # two replicates are never enough, however clear the sign (an interval of [-4.5, +7.2] too)
    out = claims.judge(r, {"reproduced": 0.03, "samples": [0.0300, 0.0301]}, "tiny")
    assert out["verdict"] == "inconclusive" and "fewer than 3" in out["note"] and out["n"] == 2
    out = claims.judge(r, {"reproduced": 1.37, "samples": [-4.0, 6.5, 1.2, 3.0, 0.15]}, "tiny")
    assert out["verdict"] == "inconclusive"
    # a standard error (Student t with df, normal without)
    assert claims.judge(r, {"reproduced": 0.03, "se": 0.005, "df": 4}, "tiny")["verdict"] == "reproduced"
    assert claims.judge(r, {"reproduced": 0.03, "se": 0.02}, "tiny")["verdict"] == "inconclusive"
    assert claims.judge(r, {"reproduced": -0.03, "se": 0.005}, "tiny")["verdict"] == "contradicted"
    # a single run: the claim's own threshold, or the one the stage gives for its scale
    r = direction(threshold=10, note="why ten")
    assert claims.judge(r, {"reproduced": 12.0}, "tiny")["verdict"] == "reproduced"
    assert claims.judge(r, {"reproduced": 8.0}, "tiny")["verdict"] == "inconclusive"
    assert claims.judge(r, {"reproduced": -12.0}, "tiny")["verdict"] == "contradicted"
    assert claims.judge(r, {"reproduced": 12.0, "threshold": 15.0}, "tiny")["verdict"] == "inconclusive"
    # a bare sign or an effect without evidence resolves nothing
    assert claims.verdict(direction(), True, "tiny")[0] == "inconclusive"
    v, note = claims.verdict(direction(), 0.5, "tiny")
    assert v == "inconclusive" and "no interval" in note


def test_direction_claims_carry_their_minimum_detectable_difference():
    """What a claim could resolve at its noise: (t_{0.975} + t_{0.80}) times its standard error."""
    r = direction()
    samples = [0.018, 0.086, 0.072]  # the recorded gpu seeds piece's paired reductions (paper rates)
    sd = statistics.stdev(samples)
    out = claims.judge(r, {"reproduced": 0.0587, "samples": samples}, "gpu")
    assert out["mdd"] == pytest.approx((4.302653 + 1.060660) * sd / math.sqrt(3), rel=1e-5)
    assert out["mdd"] > 0.029  # the paper's paired reduction: not resolvable at that noise
    out = claims.judge(r, {"reproduced": 0.03, "se": 0.005, "df": 4}, "tiny")
    assert out["mdd"] == pytest.approx((2.776445 + 0.940965) * 0.005, rel=1e-5)
    assert claims.judge(direction(threshold=10, note="why ten"), {"reproduced": 12.0}, "tiny")["mdd"] == 10.0
    assert claims.judge(r, {"reproduced": 0.5}, "tiny")["mdd"] is None  # no interval, nothing resolvable
    assert claims.judge(r, {"reproduced": 0.03, "samples": [0.03]}, "tiny")["mdd"] is None
    assert claims.judge(r, None, "tiny")["mdd"] is None
    # other kinds carry none
    assert claims.judge(rec(kind="value", published=2.9), {"reproduced": 3.0}, "tiny")["mdd"] is None


def test_direction_every_item_and_near_tie():
    r = direction(every=True)
    ok = {"reproduced": 0.03, "samples": [0.03, 0.031, 0.029], "labels": ["a", "b", "c"], "item_se": 0.001, "df": 4}
    assert claims.judge(r, ok, "tiny")["verdict"] == "reproduced"
    one_bad = {**ok, "samples": [0.05, 0.05, -0.02]}  # the mean is fine, one item is resolved the other way
    out = claims.judge(r, {**one_bad, "reproduced": 0.027}, "tiny")
    assert out["verdict"] == "contradicted" and "at c" in out["note"]
    r = direction(tie=True)
    assert claims.judge(r, {"reproduced": 0.001, "se": 0.002, "df": 4, "margin": 0.015}, "tiny")["verdict"] == "reproduced"
    assert claims.judge(r, {"reproduced": 0.05, "se": 0.002, "df": 4, "margin": 0.015}, "tiny")["verdict"] == "contradicted"
    assert claims.judge(r, {"reproduced": 0.012, "se": 0.002, "df": 4, "margin": 0.015}, "tiny")["verdict"] == "inconclusive"
    assert claims.judge(r, {"reproduced": 0.001, "se": 0.002, "df": 4}, "tiny")["verdict"] == "inconclusive"  # no margin


def test_shape_change_and_rank_correlation():
    r = {k: v for k, v in rec(kind="shape", published=-1.77).items() if k != "tolerance"}
    assert claims.judge(r, {"reproduced": -2.5, "se": 0.3, "df": 4}, "tiny")["verdict"] == "reproduced"
    assert claims.judge(r, {"reproduced": 2.5, "se": 0.3, "df": 4}, "tiny")["verdict"] == "contradicted"
    assert claims.judge(r, {"reproduced": -0.1, "se": 0.3, "df": 4}, "tiny")["verdict"] == "inconclusive"
    rho = {k: v for k, v in rec(kind="shape", published=1.0, quantity="spearman_rho").items() if k != "tolerance"}
    same = {f"c{i}": [5.0 + i / 10, 2.9 + i / 100] for i in range(12)}
    out = claims.judge(rho, {"reproduced": None, "pairs": same}, "tiny")
    assert out["verdict"] == "reproduced" and out["reproduced"] == pytest.approx(1.0) and out["n"] == 12
    rev = {k: [v[0], -v[1]] for k, v in same.items()}
    assert claims.judge(rho, {"reproduced": -1.0, "pairs": rev}, "tiny")["verdict"] == "contradicted"
    four = dict(list(same.items())[:4])  # a perfect ordering of four: its permutation p-value is 0.083
    assert claims.judge(rho, {"reproduced": 1.0, "pairs": four}, "tiny")["verdict"] == "inconclusive"
    five = dict(list(same.items())[:5])  # of five: 0.017
    assert claims.judge(rho, {"reproduced": 1.0, "pairs": five}, "tiny")["verdict"] == "reproduced"
    noisy = {f"c{i}": [x, y] for i, (x, y) in enumerate(zip([1, 2, 3, 4, 5, 6], [3, 1, 2, 6, 4, 5]))}
    out = claims.judge(rho, {"reproduced": 0.66, "pairs": noisy}, "tiny")  # rho 0.66 over six: [-0.36, 0.96]
    assert out["verdict"] == "inconclusive" and out["interval"][0] < 0 < out["interval"][1]


def test_value_paper_scale_and_different_scale():
    r = rec(kind="value", published=2.944, tolerance=0.006)
    assert claims.verdict(r, 2.949, "paper", paper_runs=True)[0] == "match"
    assert claims.verdict(r, 2.951, "paper", paper_runs=True)[0] == "mismatch"
    v, note = claims.verdict(r, 4.1, "tiny")
    assert v == "different scale" and "tiny" in note
    # no tolerance: half a unit of the last printed digit
    r = rec(kind="value", published=602.6)
    assert claims.verdict(r, 602.64, "paper", paper_runs=True)[0] == "match"
    assert claims.verdict(r, 602.7, "paper", paper_runs=True)[0] == "mismatch"
    assert claims.verdict(rec(kind="value", published="lr.n8.r128"), "lr.n8.r128", "paper", paper_runs=True)[0] == "match"
    # the scale's setting (config.yaml paper_runs) decides, not its name
    assert claims.verdict(rec(kind="value", published=2.944), 2.944, "paper")[0] == "different scale"
    assert claims.verdict(rec(kind="value", published=2.944), 2.944, "my-cluster", paper_runs=True)[0] == "match"


def test_not_run_names_the_stage():
    v, note = claims.verdict(rec(stage="evaluate"), None, "tiny")
    assert v == "not run" and "evaluate" in note
    v, note = claims.verdict(rec(stage="none"), None, "paper", paper_runs=True)
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
    """Feeding the published numbers back (with a tight interval for the statistical kinds)
    reproduces every claim at the paper scale, so every direction record's published effect points
    the paper's way."""
    produced = {}
    for cid, r in published.items():
        pub = r["published"]
        if r.get("all_of"):
            continue
        if r["kind"] == "invariant":
            produced[cid] = {"reproduced": pub if isinstance(pub, (int, float)) and not isinstance(pub, bool) else True}
        elif r["kind"] == "shape" and r["quantity"] == "spearman_rho":
            produced[cid] = {"reproduced": 1.0, "pairs": {f"c{i}": [i, i] for i in range(30)}}
        elif r["kind"] in ("direction", "shape"):
            eff = 1.0 if pub is True else pub
            produced[cid] = {"reproduced": eff, "se": abs(eff) / 100 or 1e-9, "margin": abs(eff) * 10 or 1.0}
        else:
            produced[cid] = {"reproduced": pub}
    out = claims.evaluate_claims(published, produced, "paper", paper_runs=True)
    bad = [(c["id"], c["verdict"], c["note"]) for c in out if c["verdict"] not in ("match", "reproduced")]
    assert not bad
    plain = [r for r in published.values() if r["kind"] == "direction" and not r.get("tie") and r["published"] is not True]
    assert plain and all(r["published"] > 0 for r in plain)


def _rec(cid, kind, published, **kw):
    return {"id": cid, "source": "Section 4.2", "section": "4.2", "row": {}, "quantity": "q", "kind": kind,
            "published": published, "stage": "grid", "statement": "s", **kw}


def test_every_verdict_path_on_a_synthetic_result_set(tmp_path):
    """One small published file and the stage claims of one synthetic run: each verdict once, with
    the interval and n in the statistical ones and the JSON strict."""
    import json

    records = [
        _rec("a.exact", "exact", 0.09865, sig=4),
        _rec("a.exact_bad", "exact", 0.1754, sig=4),
        _rec("a.inv", "invariant", 8.3e-13, bound=2e-12, op="<="),
        _rec("a.value", "value", 2.944, tolerance=0.006),
        _rec("a.dir_up", "direction", 0.029),
        _rec("a.dir_down", "direction", 0.029),
        _rec("a.dir_unsure", "direction", 0.0195),
        _rec("a.shape", "shape", -1.77),
        _rec("a.rho", "shape", 1.0, quantity="spearman_rho"),
        _rec("a.both", "direction", True, all_of=["a.dir_up", "a.dir_unsure"]),
        _rec("a.unrun", "direction", 0.5, stage="evaluate"),
        _rec("a.malformed", "value", 2.78, tolerance=0.006),
    ]
    pub = claims.load_published(write(tmp_path, records))
    produced = {
        "a.exact": {"reproduced": 0.0986527},
        "a.exact_bad": {"reproduced": 0.1761},
        "a.inv": {"reproduced": 3.1e-14},
        "a.value": {"reproduced": 5.31, "note": "run tiny-lr-n4-r8-s0"},
        "a.dir_up": {"reproduced": 0.031, "samples": [0.03, 0.031, 0.032], "unit": "seeds"},
        "a.dir_down": {"reproduced": -0.02, "samples": [-0.019, -0.021, -0.02], "unit": "seeds"},
        "a.dir_unsure": {"reproduced": 0.004, "se": 0.01, "df": 4},
        "a.shape": {"reproduced": -2.0, "se": 0.2, "df": 4},
        "a.rho": {"reproduced": None, "pairs": {f"c{i}": [i, 2 * i] for i in range(10)}},
        "a.malformed": {"reproduced": "2.7x"},
    }
    problems = {}
    clean = {}
    for cid, p in produced.items():
        c, why = claims.check_produced(pub[cid], p, "results/tiny/grid.json")
        if why:
            problems[cid] = why
        else:
            clean[cid] = c
    out = {c["id"]: c for c in claims.evaluate_claims(pub, clean, "tiny", problems)}
    want = {"a.exact": "match", "a.exact_bad": "mismatch", "a.inv": "match", "a.value": "different scale",
            "a.dir_up": "reproduced", "a.dir_down": "contradicted", "a.dir_unsure": "inconclusive",
            "a.shape": "reproduced", "a.rho": "reproduced", "a.both": "inconclusive", "a.unrun": "not run",
            "a.malformed": "not run"}
    assert {k: out[k]["verdict"] for k in want} == want
    for cid in ("a.dir_up", "a.dir_down", "a.dir_unsure", "a.shape", "a.rho"):
        assert out[cid]["n"] and len(out[cid]["interval"]) == 2 and "95% interval" in out[cid]["note"]
    assert out["a.dir_up"]["n"] == 3 and "paired over 3 seeds" in out["a.dir_up"]["note"]
    assert "evaluate stage" in out["a.unrun"]["note"]
    assert "results/tiny/grid.json" in out["a.malformed"]["note"] and "reproduced" in out["a.malformed"]["note"]
    assert "a.dir_up: reproduced" in out["a.both"]["note"]
    assert out["a.rho"]["reproduced"] == pytest.approx(1.0)
    assert all(c["origin"] == "paper" for c in out.values())
    json.dumps(list(out.values()), allow_nan=False)  # strict JSON
    # at the paper scale the value is compared
    assert claims.evaluate_claims(pub, {"a.value": {"reproduced": 2.947}}, "paper", paper_runs=True)[3]["verdict"] == "match"
    assert claims.evaluate_claims(pub, {"a.value": {"reproduced": 2.951}}, "paper", paper_runs=True)[3]["verdict"] == "mismatch"


@pytest.mark.parametrize("bad,key", [
    ({"reproduced": float("nan")}, "reproduced"),
    ({"reproduced": "x"}, "reproduced"),
    ({"value": 1}, "reproduced"),
    ({"reproduced": 0.1, "samples": [0.1, None]}, "samples"),
    ({"reproduced": 0.1, "se": -1}, "se"),
    ({"reproduced": 0.1, "df": 0}, "df"),
    ({"reproduced": 0.1, "samples": [1, 2, 3], "labels": ["a"]}, "labels"),
    ({"reproduced": 0.1, "pairs": {"a": [1]}}, "pairs"),
    ("0.1", "claims"),
])
def test_malformed_stage_values_name_the_file_and_key(bad, key):
    r = direction()
    claim, why = claims.check_produced(r, bad, "results/x/grid.json")
    assert claim is None and "results/x/grid.json" in why and "x.a" in why and key in why


@pytest.mark.parametrize("value,ok", [(0, True), (42.27, True), (100, True), (-0.01, False), (100.01, False),
                                      (4227.0, False), (True, False)])
def test_accuracy_outside_0_to_100_is_refused(value, ok):
    """An accuracy is a percentage: a stage value outside 0-100 (a fraction scaled twice, a sign
    error) leaves its claim without a value, naming the file and the claim; 0 and 100 are accuracies."""
    for quantity in claims.ACCURACY_QUANTITIES:
        r = {**rec(published=42.27), "quantity": quantity}
        claim, why = claims.check_produced(r, {"reproduced": value}, "results/x/evaluate/run.json")
        if ok:
            assert claim == {"reproduced": value} and why == ""
        else:
            assert claim is None and "results/x/evaluate/run.json" in why and "x.a" in why
            assert "from 0 to 100" in why, why
    # another quantity takes any number
    assert claims.check_produced(rec(published=2.944), {"reproduced": 4227.0}, "f")[0] is not None


def test_non_finite_values_are_written_as_strings():
    assert claims.json_safe({"a": [float("nan"), float("inf"), -float("inf"), 1.0]}) == {"a": ["NaN", "Infinity", "-Infinity", 1.0]}


def test_origin_marks_numbers_not_printed_in_the_paper(published):
    assert published["explainer.four_number_example"]["origin"] == "explainer"
    assert published["facts.params.0.5b.attnres.full"]["origin"] == "repository"
    assert published["explainer.flops_reduction_pct.r_d8"]["origin"] == "derived"
    assert all(r.get("origin", "paper") in claims.ORIGINS for r in published.values())


def test_glance_names_about_twelve_conclusions(published):
    glance = [r for r in published.values() if "glance" in r]
    assert 10 <= len(glance) <= 14
    assert {"sec4.2.routed_beat_baseline", "sec4.4.paired_reduction_all_positive", "table5.loss_order_spearman"} <= {
        r["id"] for r in glance}


def test_mended_records(published):
    """The records held to the rule: no claim that cannot fail, no tolerance wider than its effect."""
    for size in ("0.5b", "1b", "4b"):
        assert published[f"appB.2.joint_rank.{size}"]["kind"] == "value"
    for cid in ("sec4.2.r64_minus_r128", "sec4.3.block_spread.r256", "appC.3.best_plr_minus_best_lr"):
        assert published[cid]["kind"] == "direction" and published[cid]["tie"] is True
    for cid, r in published.items():
        if r["kind"] == "value" and "tolerance" in r and isinstance(r["published"], (int, float)) and r["published"]:
            # a tolerance as wide as the value accepts anything from 0 to twice it: the record says why
            assert r["tolerance"] < abs(r["published"]) or "tolerance" in r.get("note", ""), cid
        if cid.startswith("table2.fp64_max_err."):
            assert r["bound"] <= 2e-12
        if cid.startswith("table2.delta_ce."):
            assert r["bound"] <= 2e-4
        if cid.startswith("table10."):
            assert r["kind"] == "invariant" and r["op"] == "<=" and r["bound"] == pytest.approx(2 * r["published"], rel=1e-3)
        if cid.startswith(("table9.", "appG.1.")) and r["kind"] == "value":
            assert r["tolerance"] <= 0.11 * r["published"], cid
    for g in ("h100", "b200"):
        for s in ("1b", "4b"):
            assert published[f"sec4.9.rank_gain_positive.{g}.{s}"]["kind"] == "direction"
            assert "0.5 pp" in published[f"sec4.9.combined_gain_pct.{g}.{s}"]["note"]
    assert "sec4.9.rank_gain_positive.1b" not in published
    added = ["sec4.2.best_rank_interior", "sec4.2.best_rank.nfull", "sec4.3.best_blocks.r16",
             "sec4.3.more_blocks_not_consistently_better", "sec4.3.r256_to_r512_depends_on_n",
             "appC.3.plr_beats_lr.full.r64", "appC.3.plr_full_improves_with_rank",
             "appC.5.grad_argmin_not_loss_argmin.nfull", "appC.5.plr_full_below_attnres",
             "appG.1.lr_lower_grad_norm_var.1b", "sec4.9.fast_beats_fla.h100.1b", "sec4.9.combined_gain_positive.b200.4b",
             "sec4.6.broader_routing_not_lower_loss", "appI.repeats_met_stopping_rule.1b"]
    for cid in added:
        assert cid in published and published[cid].get("page"), cid
