"""The experiment grid: run lists per scale, training specs, and the claims of the training sections."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from lrattnres.claims import load_published
from lrattnres.config import load_and_resolve
from lrattnres.grid import Run, conversions, evaluations, paper_row, plan, read_curve, summarize, train_spec
from lrattnres.train.spec import resolve as resolve_train_spec

PUBLISHED = load_published(REPO / "reports" / "published.yaml")


def settings(scale):
    return load_and_resolve(REPO / "config.yaml", {"scale": scale})


@pytest.mark.parametrize("scale", ["smoke", "tiny", "gpu", "paper"])
def test_plan_is_unique_and_specs_validate(scale):
    s = settings(scale)
    runs = plan(s)
    ids = [r.run_id for r in runs]
    assert len(ids) == len(set(ids))
    roles = {role for r in runs for role in r.roles}
    assert {"baseline", "sweep", "seeds", "control", "projected", "pair-small", "pair-large"} <= roles
    for run in runs:
        spec = resolve_train_spec(train_spec(s, run))  # the trainer accepts every spec the grid makes
        assert spec["model"]["method"] == run.method


def test_tiny_grid_holds_every_kind_of_run():
    runs = plan(settings("tiny"))
    methods = {r.method for r in runs}
    assert methods == {"baseline", "attnres", "lr", "lr-fullrms", "plr"}
    sweep = [r for r in runs if "sweep" in r.roles]
    assert {r.blocks for r in sweep if r.method == "attnres"} == {"full", 4}  # AttnRes full and N-block
    assert len({r.rank for r in sweep if r.method == "lr"}) >= 2  # two low ranks
    seeds = [r for r in runs if "seeds" in r.roles]
    assert sorted({r.seed for r in seeds}) == [0, 1, 2] and {r.method for r in seeds} == {"lr", "attnres"}
    presets = {r.preset for r in runs if any(x.startswith("pair") for x in r.roles)}
    assert len(presets) == 2  # a small/large size pair


def test_shared_grid_point_trains_once_with_both_roles():
    runs = {r.run_id: r for r in plan(settings("tiny"))}
    assert set(runs["tiny-attnres-n4-r64-s0"].roles) == {"sweep", "seeds", "pair-small"}


def test_pair_steps_override_the_scale_budget():
    s = settings("paper")
    pair = next(r for r in plan(s) if "pair-large" in r.roles)
    spec = train_spec(s, pair)
    assert spec["steps"] == 76294 and spec["model"]["preset"] == "4B"
    sweep = next(r for r in plan(s) if "sweep" in r.roles)
    assert train_spec(s, sweep)["steps"] == 38146


def test_paper_row_by_ratio():
    assert paper_row({"method": "lr", "blocks": 4, "rank": 8}, 64) == "lr.n4.r128"
    assert paper_row({"method": "attnres", "blocks": "full", "rank": 64}, 64) == "attnres.nfull.r1024"
    assert paper_row({"method": "lr", "blocks": 2, "rank": 8}, 64) is None  # the paper has no N = 2
    assert paper_row({"method": "lr", "blocks": 4, "rank": 5}, 64) is None  # r/d off the paper's ranks
    assert paper_row({"method": "baseline", "blocks": None, "rank": None}, 64) == "baseline"


def test_paper_scale_conversions_and_evaluations_are_tables_2_and_8():
    s = settings("paper")
    conv = conversions(s)
    assert [c["claim_row"] for c in conv] == ["0.5b.nfull", "0.5b.n4", "0.5b.n8", "0.5b.n16", "1b.n8", "4b.n8"]
    assert [c["rank"] for c in conv] == [64, 64, 64, 64, 64, 128]
    assert sorted(e["claim_size"] for e in evaluations(s)) == ["1b", "1b", "4b", "4b"]


def _fake_runs(tmp_path, s, loss_of):
    dirs = {}
    for run in plan(s):
        d = tmp_path / run.run_id
        d.mkdir(parents=True)
        loss = loss_of(run)
        (d / "result.json").write_text(json.dumps({"stage": "train", "final_val_ce": loss, "steps": 4, "tokens": 100,
                                                     "data_epochs": 0.25}))
        lines = [{"kind": "train", "step": i, "tokens": 10 * i, "grad_norm": 0.5 + i, "ce": 9.0} for i in range(1, 5)]
        lines += [{"kind": "val", "step": 2, "tokens": 20, "val_ce": loss + 0.1}, {"kind": "final_val", "step": 4, "tokens": 40, "val_ce": loss}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        dirs[run.run_id] = d
    return dirs


def _loss(run: Run) -> float:
    """A synthetic outcome shaped like the paper's: routing helps, low rank helps more."""
    if run.method == "baseline":
        return 3.0
    base = {"attnres": 2.97, "lr": 2.95, "lr-fullrms": 2.949, "plr": 2.955}[run.method]
    return base + 0.001 * run.seed - (0.01 if run.preset == "tiny-large" else 0.0)


def test_summary_claims_on_a_synthetic_grid(tmp_path):
    s = settings("tiny")
    out = summarize(s, _fake_runs(tmp_path, s, _loss), set(PUBLISHED))
    c = out["claims"]
    assert set(c) <= set(PUBLISHED)
    assert c["sec4.2.routed_beat_baseline"]["reproduced"] is True
    assert c["sec4.2.lowrank_beat_endpoint"]["reproduced"] == 4  # 2 ranks x 2 routings, all below r = d
    assert c["sec4.2.best_is_lowrank"]["reproduced"] is True
    assert c["sec4.4.paired_reduction_all_positive"]["reproduced"] is True
    assert c["sec4.4.paired_reduction_mean"]["reproduced"] == pytest.approx(0.02)
    assert c["sec4.4.val_loss_sd.lr.n8.r128"]["reproduced"] == pytest.approx(0.001)
    assert c["sec4.4.fullrms_close_to_slice"]["reproduced"] is True
    assert c["sec4.5.lr_lower_loss.1b"]["reproduced"] is True and c["sec4.5.lr_lower_loss.4b"]["reproduced"] is True
    assert c["table5.val_loss.baseline"]["reproduced"] == 3.0
    assert c["table5.val_loss.lr.n4.r128"]["reproduced"] == pytest.approx(2.95)
    assert all("tiny scale" in v["note"] for v in c.values())
    run = next(r for r in out["runs"] if r["run_id"] == "tiny-lr-n4-r8-s0")
    assert run["added_flops_pct"] > 0 and run["grad_norm_trace"] == [1.5, 2.5, 3.5, 4.5]
    assert run["data_epochs"] == 0.25  # carried for the report's over-one-epoch warning
    assert [p["ce"] for p in run["val_curve"]] == [pytest.approx(3.05), pytest.approx(2.95)]


def test_summary_reports_a_failed_direction_honestly(tmp_path):
    s = settings("tiny")
    out = summarize(s, _fake_runs(tmp_path, s, lambda r: 2.9 if r.method == "baseline" else _loss(r)), set(PUBLISHED))
    assert out["claims"]["sec4.2.routed_beat_baseline"]["reproduced"] is False


def test_read_curve_missing_file(tmp_path):
    assert read_curve(tmp_path / "none.jsonl") == ([], [])
