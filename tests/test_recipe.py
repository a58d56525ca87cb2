"""The scale's recipe: the learning-rate check (its runs, specs, piece, rule and summary), the noise at
the chosen rates, the report's section on both, and the ``recipe`` command on piece archives."""

from __future__ import annotations

import html as html_lib
import json
import math
import tarfile
from pathlib import Path

import pytest
from conftest import REPO

from lrattnres import claims as engine
from lrattnres import grid, lrcheck, noise, pieces, recipe
from lrattnres.config import ConfigError, load_and_resolve
from lrattnres.gridplan import LR_CHECK, Run, lr_check_runs, paper_row, plan, train_spec
from lrattnres.report.context import ReportContext
from lrattnres.report.sections import recipe as section
from lrattnres.train.spec import resolve as resolve_train_spec

PUBLISHED = engine.load_published(REPO / "reports" / "published.yaml")
GPU_CHECK = ["gpu-small-baseline-lrx1-s0", "gpu-small-baseline-lrx2-s0", "gpu-small-baseline-lrx4-s0",
             "gpu-small-baseline-lrx8-s0", "gpu-small-baseline-lrx16-s0", "gpu-small-baseline-lrx32-s0"]

# The paper's rates (x1 of grid.lr_check.reference): the gpu scale's before its check set the winner.
PAPER_RATES = {"optim": {"muon": {"lr": 0.001}, "adam": {"lr": 0.0003}}}


def settings(scale: str, **over) -> dict:
    return load_and_resolve(REPO / "config.yaml", {"scale": scale, **over})


# ------------------------------------------------------------------------------- runs and specs


def test_the_gpu_check_runs_are_the_baseline_at_each_multiple_of_the_papers_rates():
    s = settings("gpu")
    runs = lr_check_runs(s)
    assert [r.run_id for r in runs] == GPU_CHECK
    assert [r.run_id for r in plan(s)][-6:] == GPU_CHECK  # planned last, after every run of the paper's
    assert all(r.method == "baseline" and r.seed == 0 and r.roles == (LR_CHECK,) for r in runs)
    base = train_spec(s, next(r for r in plan(s) if r.run_id == "gpu-small-baseline-s0"))
    for run in runs:
        spec = resolve_train_spec(train_spec(s, run))  # the trainer takes it
        m = run.lr_scale
        assert spec["optim"]["muon"]["lr"] == pytest.approx(0.001 * m) and spec["optim"]["adam"]["lr"] == pytest.approx(0.0003 * m)
        assert spec["record_nonfinite"] is True
        # the rest of the recipe is the scale's: schedule shape, warm-up, z-loss, clipping, batch, length
        for key in ("schedule", "z_loss", "grad_clip", "steps", "micro_batch", "seq_len", "precision", "model"):
            assert spec[key] == resolve_train_spec(base)[key], key
        for key in ("momentum", "weight_decay"):
            assert spec["optim"]["muon"][key] == base["optim"]["muon"][key]
    assert "record_nonfinite" not in base  # the scale's own runs fail on a non-finite loss, as before


def test_the_check_does_not_depend_on_the_rates_the_scale_chose():
    """Setting the scale's recipe to the winner changes no run id or spec of the check, and no run id
    of the rest: the recipe piece's archive stays valid, the seeds piece's runs keep their names."""
    s = settings("gpu")
    chosen = settings("gpu", recipe={"optim": {"muon": {"lr": 0.008}, "adam": {"lr": 0.0024}}})
    assert [r.run_id for r in plan(s)] == [r.run_id for r in plan(chosen)]
    for a, b in zip(lr_check_runs(s), lr_check_runs(chosen)):
        assert train_spec(s, a) == train_spec(chosen, b)
    run = next(r for r in plan(s) if r.run_id == "gpu-small-lr-n8-r48-s0")
    assert train_spec(chosen, run)["optim"]["muon"]["lr"] == 0.008


def with_rates(settings_json: Path, s: dict) -> None:
    """Set the learning rates of a restored settings.json to those of settings ``s``."""
    saved = json.loads(settings_json.read_text())
    for group in ("muon", "adam"):
        saved["recipe"]["optim"][group]["lr"] = s["recipe"]["optim"][group]["lr"]
    settings_json.write_text(json.dumps(saved))


def test_the_recipe_piece_belongs_to_the_scale_after_its_winner_is_set(tmp_path):
    """The recipe piece's settings.json holds the rates before the check; once the scale's rates are set
    to the winner, its runs' specs are still the scale's, and only those two rates differ."""
    from lrattnres.config import science
    from lrattnres.io import atomic_write_json

    before = settings("gpu", recipe=PAPER_RATES)  # the rates the recipe piece ran with
    after = settings("gpu")  # the check's winner, set in config.yaml
    assert (after["recipe"]["optim"]["muon"]["lr"], after["recipe"]["optim"]["adam"]["lr"]) == (0.008, 0.0024)
    res = tmp_path / before["results"]
    atomic_write_json(res / "settings.json", science(before))
    for run in lr_check_runs(before):
        atomic_write_json(res / "runs" / run.run_id / "spec.json", {"spec": resolve_train_spec(train_spec(before, run))})
    with pytest.raises(pieces.PieceError, match=r"settings\.recipe differs .*muon\.lr"):
        pieces.check_same_settings(after, str(res))
    with_rates(res / "settings.json", after)  # the later pieces' settings.json, restored after it
    assert "train" in pieces.check_same_settings(after, str(res))
    # a seeds run made before the winner was set is not the scale's any more
    seed_run = next(r for r in plan(before) if r.run_id == "gpu-small-lr-n8-r48-s0")
    atomic_write_json(res / "runs" / seed_run.run_id / "spec.json", {"spec": resolve_train_spec(train_spec(before, seed_run))})
    with pytest.raises(pieces.PieceError, match="training spec differs"):
        pieces.check_same_settings(after, str(res))


def test_five_seeds_add_the_headline_pair_only():
    s3, s5 = settings("gpu"), settings("gpu", grid={"seeds": 5})
    a, b = [r.run_id for r in plan(s3)], [r.run_id for r in plan(s5)]
    assert set(a) <= set(b)
    assert sorted(set(b) - set(a)) == ["gpu-small-attnres-n8-r384-s3", "gpu-small-attnres-n8-r384-s4",
                                       "gpu-small-lr-n8-r48-s3", "gpu-small-lr-n8-r48-s4"]
    for run in plan(s3):
        assert train_spec(s3, run) == train_spec(s5, next(r for r in plan(s5) if r.run_id == run.run_id))


def test_run_ids_of_other_multipliers_and_no_paper_row():
    assert Run("tiny", "baseline", None, None, 0, lr_scale=0.5).run_id == "tiny-baseline-lrx0.5-s0"
    assert Run("tiny", "baseline", None, None, 0, lr_scale=2.0).run_id == "tiny-baseline-lrx2-s0"
    assert paper_row({"method": "baseline", "roles": [LR_CHECK]}, 64) is None
    assert paper_row({"method": "baseline", "roles": ["baseline"]}, 64) == "baseline"


def test_the_recipe_piece_holds_the_check_alone_and_comes_first():
    s = settings("gpu")
    ps = pieces.plan_pieces(s)
    assert ps[0].name == "recipe" and list(ps[0].runs) == GPU_CHECK and ps[1].name == "seeds"
    assert not set(GPU_CHECK) & {r for p in ps[1:] for r in p.runs}
    targets = pieces.piece_targets(s, ps[0])
    assert all(f"{s['results']}/runs/{r}/result.json" in targets for r in GPU_CHECK)
    # the smoke scale's check runs in its last piece, through the same rules
    smoke = pieces.plan_pieces(settings("smoke"))
    assert {"smoke-baseline-lrx1-s0", "smoke-baseline-lrx2-s0"} <= set(smoke[-1].runs)


def test_a_check_without_reference_rates_is_refused():
    with pytest.raises(ConfigError, match="reference"):
        settings("gpu", grid={"lr_check": {"multipliers": [1, 2], "tie_margin": 0.01}})
    with pytest.raises(ConfigError, match="multipliers"):
        settings("gpu", grid={"lr_check": {"multipliers": [1, 1], "reference": {"muon": 1e-3, "adam": 3e-4},
                                           "tie_margin": 0.01}})


# ------------------------------------------------------------------------------------- the rule


def _row(m, ce, status="eligible"):
    return {"multiplier": m, "final_val_ce": ce, "status": status, "run_id": f"x{m}"}


def test_lowest_final_ce_wins():
    w = lrcheck.choose([_row(1, 4.0), _row(2, 3.9), _row(4, 3.7), _row(8, 3.75)], tie_margin=0.01)
    assert w["multiplier"] == 4 and w["near_ties"] == [4] and w["edge"] is False
    assert w["lowest"] == {"multiplier": 4, "final_val_ce": 3.7}


def test_a_near_tie_takes_the_smallest_multiplier_within_the_margin():
    rows = [_row(1, 4.0), _row(2, 3.795), _row(4, 3.79), _row(8, 3.785)]
    w = lrcheck.choose(rows, tie_margin=0.01)
    assert w["multiplier"] == 2 and w["near_ties"] == [2, 4, 8] and w["lowest"]["multiplier"] == 8
    assert lrcheck.choose(rows, tie_margin=0.0)["multiplier"] == 8
    # the margin is inclusive: 3.02 - 3.01 is 0.01 nats, though 0.010000000000000231 in binary
    assert lrcheck.choose([_row(1, 3.02), _row(2, 3.01)], tie_margin=0.01)["multiplier"] == 1
    assert lrcheck.choose([_row(1, 3.0201), _row(2, 3.01)], tie_margin=0.01)["multiplier"] == 2


def test_diverged_and_unstable_runs_cannot_win():
    rows = [_row(1, 4.0), _row(2, 3.9), _row(16, None, "diverged"), _row(8, 3.5, "outliers")]
    w = lrcheck.choose(rows, tie_margin=0.01)
    assert w["multiplier"] == 2 and w["edge"] is False
    assert lrcheck.choose([_row(1, None, "diverged")], 0.01) is None
    edge = lrcheck.choose([_row(1, 4.0), _row(2, 3.0)], 0.01)
    assert edge["multiplier"] == 2 and edge["edge"] is True


def _check_row(s, multiplier, ce, *, stopped=None, outliers=None, clipped=30.0, trace=(0.5, 2.0, 1.0)):
    run = next(r for r in lr_check_runs(s) if r.lr_scale == multiplier)
    g = {"mean": 1.0, "above_clip_pct": clipped}
    if outliers is not None:
        g.update(max=max(trace), outliers=outliers)
    return {"run_id": run.run_id, "lr_scale": multiplier, "roles": [LR_CHECK], "final_val_ce": ce,
            "grad_norm": g, "grad_norm_trace": list(trace), "stopped": stopped}


def test_summary_states_each_multiplier_and_checks_the_configured_rates():
    s = settings("gpu", recipe=PAPER_RATES)
    rows = [_check_row(s, 1.0, 4.30), _check_row(s, 2.0, 4.10), _check_row(s, 4.0, 3.95, outliers=[]),
            _check_row(s, 8.0, 3.90, outliers=[{"update": 700, "norm": 400.0, "median": 1.1}]),
            _check_row(s, 16.0, None, stopped={"update": 312, "reason": "non-finite gradient norm (inf)"}),
            _check_row(s, 32.0, None, stopped={"update": 40, "reason": "non-finite cross-entropy (nan)"})]
    out = lrcheck.summarize(s, rows)
    assert out["state"] == "done" and [r["status"] for r in out["runs"]] == [
        "eligible", "eligible", "eligible", "outliers", "diverged", "diverged"]
    assert out["winner"]["multiplier"] == 4.0 and out["winner"]["muon_lr"] == pytest.approx(0.004)
    by = {r["multiplier"]: r for r in out["runs"]}
    assert by[1.0]["max_grad_norm"] == 2.0 and by[1.0]["outliers_recorded"] is False
    assert by[4.0]["outliers_recorded"] is True and by[8.0]["why"].startswith("1 gradient-norm outlier")
    assert by[16.0]["why"] == "non-finite gradient norm (inf)" and by[1.0]["above_clip_pct"] == 30.0
    # rates at the paper's (x1): a mismatch, named
    c = out["configured"]
    assert c["multiplier"] == pytest.approx(1.0) and c["matches_winner"] is False
    assert "not the check's winner x4" in c["note"] and "scales.gpu.recipe.optim" in c["note"]
    chosen = settings("gpu", recipe={"optim": {"muon": {"lr": 0.004}, "adam": {"lr": 0.0012}}})
    c = lrcheck.summarize(chosen, rows)["configured"]
    assert c["matches_winner"] is True and c["multiplier"] == pytest.approx(4.0)
    # Muon and Adam not scaled together: no multiple of the reference, and no match
    odd = settings("gpu", recipe={"optim": {"muon": {"lr": 0.004}, "adam": {"lr": 0.003}}})
    c = lrcheck.summarize(odd, rows)["configured"]
    assert c["multiplier"] is None and c["matches_winner"] is False


def test_a_check_that_has_not_run_or_not_finished_has_no_winner():
    s = settings("gpu")
    out = lrcheck.summarize(s, [])
    assert out["state"] == "not run" and out["winner"] is None and out["configured"]["matches_winner"] is None
    part = lrcheck.summarize(s, [_check_row(s, 1.0, 4.3)])
    assert part["state"] == "incomplete" and part["winner"] is None
    assert [r["status"] for r in part["runs"]].count("not run") == 5
    assert lrcheck.summarize(settings("paper"), []) is None  # no check at this scale
    assert "no learning-rate check" in lrcheck.describe(None)[0]
    assert "(not run)" in lrcheck.describe(out)[0]


# ------------------------------------------------------------------------------------- the noise


def _grid_row(run: Run, ce, clipped=40.0, outliers=None, stopped=None):
    g = {"mean": 1.0, "above_clip_pct": clipped, **({"outliers": outliers, "max": 3.0} if outliers is not None else {})}
    return {"run_id": run.run_id, "preset": run.preset, "method": run.method, "seed": run.seed,
            "roles": list(run.roles), "final_val_ce": ce, "grad_norm": g, "grad_norm_trace": [1.0, 2.5],
            "stopped": stopped}


def test_noise_of_the_seed_pairs_and_the_seeds_rule():
    s = settings("gpu", recipe=PAPER_RATES)
    # the recorded seeds piece's losses (paper rates): LR 3.8128 3.7327 3.7742, AttnRes 3.8313 3.8188 3.8463
    lr = {0: 3.8128, 1: 3.7327, 2: 3.7742}
    at = {0: 3.8313, 1: 3.8188, 2: 3.8463}
    rows = []
    for run in plan(s):
        if LR_CHECK in run.roles:
            continue
        ce = {"lr": lr, "attnres": at}.get(run.method, {}).get(run.seed, 3.8957) if "seeds" in run.roles else 3.8957
        rows.append(_grid_row(run, ce, clipped=93.0 if run.method == "lr" else 20.0,
                              outliers=[{"update": 9, "norm": 500.0, "median": 1.0}] if run.run_id.endswith("r384-s2") else None))
    check = lrcheck.summarize(s, [_check_row(s, 1.0, 3.95)])
    out = noise.summarize(s, rows, check)
    diffs = [lr[i] - at[i] for i in range(3)]
    assert [p["difference"] for p in out["pairs"]] == pytest.approx(diffs)
    sd = math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2)
    p = out["paired"]
    assert p["n"] == 3 and p["sd"] == pytest.approx(sd) and p["mean"] == pytest.approx(sum(diffs) / 3)
    # chi-square with 2 degrees of freedom: [s sqrt(2 / 7.3778), s sqrt(2 / 0.050636)]
    assert p["sd_interval"] == pytest.approx([sd * math.sqrt(2 / 7.377759), sd * math.sqrt(2 / 0.0506356)], rel=1e-5)
    rule = out["rule"]
    assert rule["exceeded"] is True and rule["planned_seeds"] == 3 and "set grid.seeds: 5" in rule["text"]
    assert settings("gpu", grid={"seeds": 5})["grid"]["seeds"] == 5
    health = {r["run_id"]: r for r in out["runs"]}
    assert set(health) == {"gpu-small-baseline-s0", *(f"gpu-small-lr-n8-r48-s{i}" for i in range(3)),
                           *(f"gpu-small-attnres-n8-r384-s{i}" for i in range(3))}
    assert health["gpu-small-lr-n8-r48-s0"]["flags"] == ["93% of updates clipped"]
    assert health["gpu-small-attnres-n8-r384-s2"]["flags"] == ["1 gradient-norm outlier(s)"]
    assert health["gpu-small-attnres-n8-r384-s0"]["flags"] == [] and health["gpu-small-baseline-s0"]["max_grad_norm"] == 2.5
    ref = out["against_reference"]
    assert ref["difference"] == pytest.approx(3.8957 - 3.95) and ref["reference_run"] == "gpu-small-baseline-lrx1-s0"
    # the configured rates are x1: the baseline repeats the check's x1 run
    assert ref["repeat_run"] == "gpu-small-baseline-lrx1-s0" and ref["repeat_difference"] == pytest.approx(3.8957 - 3.95)
    other = noise.summarize(s, rows, lrcheck.summarize(settings("gpu", recipe={"optim": {"muon": {"lr": 0.002},
                                                                              "adam": {"lr": 0.0006}}}),
                                                   [_check_row(s, 1.0, 3.95), _check_row(s, 2.0, 3.90)]))
    assert other["against_reference"]["repeat_run"] == "gpu-small-baseline-lrx2-s0"
    assert other["against_reference"]["repeat_difference"] == pytest.approx(3.8957 - 3.90)
    # within the rule's SD: enough seeds
    calm = [dict(r, final_val_ce=3.80 + 0.001 * r["seed"]) if r["method"] == "lr" else r for r in rows]
    calm = [dict(r, final_val_ce=3.83 + 0.0012 * r["seed"]) if r["method"] == "attnres" else r for r in calm]
    assert noise.summarize(s, calm, check)["rule"]["exceeded"] is False
    one = [r for r in rows if r["seed"] == 0]
    assert noise.summarize(s, one, check)["rule"]["exceeded"] is None
    assert any("SD" in line for line in noise.describe(out))


# ------------------------------------------------------------------------- the grid and the report


def _fake_runs(tmp: Path, s: dict, loss, *, stopped=()):
    dirs = {}
    for run in plan(s):
        d = tmp / "runs" / run.run_id
        d.mkdir(parents=True)
        halt = run.run_id in stopped
        res = {"stage": "train", "final_val_ce": None if halt else loss(run), "steps": 4, "tokens": 100,
               "grad_norm": {"mean": 1.0, "var": 0.1, "above_clip_pct": 25.0, "count": 4},
               "stopped": {"update": 3, "reason": "non-finite gradient norm (inf)"} if halt else None}
        (d / "result.json").write_text(json.dumps(res))
        lines = [{"kind": "train", "step": i, "tokens": 10 * i, "grad_norm": 0.5 + i, "ce": 9.0} for i in range(1, 5)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        dirs[run.run_id] = d
    return dirs


def _loss(run: Run) -> float:
    if run.lr_scale is not None:
        return {1.0: 5.2, 2.0: 5.1}[run.lr_scale]
    base = {"baseline": 5.0, "attnres": 4.97, "lr": 4.95, "lr-fullrms": 4.949, "plr": 4.955}[run.method]
    return base + 0.003 * run.seed


def test_grid_summary_keeps_the_check_out_of_the_table_and_claims(tmp_path):
    s = settings("smoke")
    dirs = _fake_runs(tmp_path, s, _loss)
    out = grid.summarize(s, dirs, set(PUBLISHED), PUBLISHED)
    ids = {r["run_id"] for r in out["runs"]}
    assert not ids & {"smoke-baseline-lrx1-s0", "smoke-baseline-lrx2-s0"} and "smoke-baseline-s0" in ids
    assert out["claims"]["table5.val_loss.baseline"]["reproduced"] == 5.0  # the scale's baseline, not the check's
    assert out["lr_check"]["winner"]["multiplier"] == 2.0 and out["lr_check"]["configured"]["matches_winner"] is False
    assert out["noise"]["paired"]["n"] == 2 and out["noise"]["against_reference"]["difference"] == pytest.approx(-0.2)
    assert out["noise"]["against_reference"]["repeat_difference"] == pytest.approx(-0.2)  # smoke runs at x1
    # a diverged check run is an outcome of the check, not a problem of the grid's claims
    dirs = _fake_runs(tmp_path / "b", s, _loss, stopped={"smoke-baseline-lrx2-s0"})
    out = grid.summarize(s, dirs, set(PUBLISHED), PUBLISHED)
    assert out["lr_check"]["winner"]["multiplier"] == 1.0 and out["lr_check"]["configured"]["matches_winner"] is True
    assert all("problem" not in r for r in out["runs"])


def _context(s: dict, grid_result: dict | None, claims: dict | None = None) -> ReportContext:
    return ReportContext(scale=s["scale"], published=PUBLISHED, claims=claims or {}, settings=s,
                         by_stage={"grid": [grid_result]} if grid_result else {})


def test_report_section_shows_the_rule_the_winner_and_a_mismatch(tmp_path):
    s = settings("smoke")
    g = grid.summarize(s, _fake_runs(tmp_path, s, _loss), set(PUBLISHED), PUBLISHED)
    claims = {"sec4.4.paired_reduction_all_positive": {
        "id": "sec4.4.paired_reduction_all_positive", "kind": "direction", "source": "Section 4.4", "published": 0.029,
        "reproduced": 0.003, "n": 2, "mdd": 0.31, "verdict": "inconclusive"}}
    html = section.build(_context(s, g, claims))
    assert "Winner: <b>x2</b>" in html and "tie margin 0.01 nats" in html
    for line in lrcheck.RULE:
        assert html_lib.escape(line) in html
    assert 'badge bad">mismatch' in html and "not the check&#x27;s winner x2" in html
    assert "SD" in html and "chi-square" in html and "needs 5 seeds" in html and "enough seeds" in html  # SD 0
    assert "sec4.4.paired_reduction_all_positive" in html and "0.31" in html
    assert "run-to-run noise" in html and "smoke-baseline-lrx1-s0" in html
    # the configured rates set to the winner: no mismatch
    won = settings("smoke", recipe={"optim": {"muon": {"lr": 0.04}, "adam": {"lr": 0.006}}})
    g2 = grid.summarize(won, _fake_runs(tmp_path / "b", won, _loss), set(PUBLISHED), PUBLISHED)
    html = section.build(_context(won, g2))
    assert 'badge ok">match' in html and "mismatch" not in html


def test_report_section_before_the_check_and_without_one():
    html = section.build(_context(settings("gpu"), None))
    assert "The learning-rate check has not run at this scale." in html and "x32" in html
    html = section.build(_context(settings("paper"), None))
    assert "no learning-rate check" in html and "Muon 0.001, Adam 3.000e-04" in html


def test_report_section_flags_an_incomplete_check(tmp_path):
    s = settings("smoke")
    g = grid.summarize(s, _fake_runs(tmp_path, s, _loss), set(PUBLISHED), PUBLISHED)
    g["lr_check"] = lrcheck.summarize(s, [])
    assert "has not run at this scale" in section.build(_context(s, g))
    g["lr_check"] = lrcheck.summarize(s, [_check_row(s, 1.0, 4.0)])
    assert "incomplete" in section.build(_context(s, g))
    g["noise"]["rule"].update(exceeded=True, text="SD 0.03 > 0.015 nats")
    assert "more seeds needed" in section.build(_context(s, g))


def test_recipe_command_reads_piece_archives_without_extracting(tmp_path, monkeypatch, capsys):
    s = settings("gpu")
    dirs = _fake_runs(tmp_path / "w", s, lambda r: 4.0 - 0.05 * r.lr_scale if r.lr_scale else 3.9)
    arc = tmp_path / "recipe.tar.xz"
    with tarfile.open(arc, "w:xz") as tar:
        for run_id in GPU_CHECK:
            for name in ("result.json", "metrics.jsonl"):
                tar.add(dirs[run_id] / name, arcname=f"{s['results']}/runs/{run_id}/{name}")
    monkeypatch.chdir(REPO)
    assert recipe.main(["--config", "scale=gpu", "--restore", str(arc), "--json", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "winner: x32" in text and "at the grid's edge" in text and "not the check's winner" in text
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["lr_check"]["state"] == "done" and got["noise"]["paired"]["n"] == 0
