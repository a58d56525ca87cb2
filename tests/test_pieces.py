"""A scale in pieces (lrattnres.pieces): planning, packing, restoring, and a smoke-scale chain of two
pieces and a report on three fresh copies of the repository, none of which redoes another's work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ONE_OF_EACH

from lrattnres import pieces
from lrattnres.config import load_and_resolve

REPO = Path(__file__).resolve().parent.parent


def settings(scale="smoke"):
    return load_and_resolve(REPO / "config.yaml", {"scale": scale})


def test_plan_every_run_once_first_match_wins():
    for scale in ("smoke", "gpu"):
        S = settings(scale)
        from lrattnres.grid import plan

        got = [r for p in pieces.plan_pieces(S) for r in p.runs]
        assert sorted(got) == sorted(r.run_id for r in plan(S)) and len(got) == len(set(got))
    gpu = {p.name: p for p in pieces.plan_pieces(settings("gpu"))}
    assert len(gpu["seeds"].runs) == 7 and "kernel_check" in gpu["seeds"].stages
    assert max(len(p.runs) for p in gpu.values()) <= 7  # one wave of side-by-side trainings each


def test_unmatched_runs_and_duplicate_names_refused():
    S = settings()
    with pytest.raises(pieces.PieceError, match="match no piece"):
        pieces.plan_pieces({**S, "pieces": [{"name": "a", "runs": ["smoke-baseline-*"]}]})
    with pytest.raises(pieces.PieceError, match="duplicate piece names"):
        pieces.plan_pieces({**S, "pieces": [{"name": "a", "runs": ["x"]}, {"name": "a", "runs": ["*"]}]})


def test_targets_include_the_stages_that_need_weights():
    S = settings("gpu")
    first = next(p for p in pieces.plan_pieces(S) if p.name == "seeds")
    t = pieces.piece_targets(S, first)
    R = S["results"]
    assert f"{R}/kernel_check.json" in t
    assert f"{R}/evaluate/gpu-small-attnres-n8-r384-s0.json" in t and f"{R}/convert/gpu-small-attnres-n8-r384-s0.json" in t
    assert all(f"{R}/diagnostics/{r}.json" in t for r in first.runs)
    # Appendix I's reads of the size pair's runs, beside their models; no other run's
    assert f"{R}/kernel_check/gpu-small-attnres-n8-r384-s0.json" in t
    assert [x for x in t if "/kernel_check/" in x] == [f"{R}/kernel_check/gpu-small-attnres-n8-r384-s0.json"]


def _fake_results(root: Path) -> None:
    R = root / "results" / "smoke"
    (R / "runs" / "a").mkdir(parents=True)
    (R / "runs" / "a" / "result.json").write_text("{}")
    (R / "runs" / "a" / "model.pt").write_bytes(b"weights stay behind")
    (R / "logs" / "train").mkdir(parents=True)
    (R / "logs" / "train" / "a.log").write_text("log")
    (R / "logs" / "attempts").mkdir()
    os.link(R / "logs" / "train" / "a.log", R / "logs" / "attempts" / "a.1.log")  # kept attempt logs
    (R / "data").mkdir()
    (R / "data" / "train_00000.bin").write_bytes(b"\0" * 8)
    meta = root / ".snakemake" / "metadata"
    meta.mkdir(parents=True)
    (meta / pieces._metadata_name("results/smoke/runs/a/result.json")).write_text("{}")


def test_pack_keeps_small_outputs_and_metadata_only(tmp_path):
    src = tmp_path / "src"
    _fake_results(src)
    info = pieces.pack(tmp_path / "p.tar.xz", "results/smoke", workdir=str(src))
    with tarfile.open(tmp_path / "p.tar.xz") as tar:
        names = set(tar.getnames())
    assert "results/smoke/runs/a/result.json" in names and "results/smoke/logs/train/a.log" in names
    assert "results/smoke/logs/attempts/a.1.log" in names
    assert not any(n.endswith((".pt", ".bin")) for n in names)
    assert info["metadata"] == 1
    dst = tmp_path / "dst"
    dst.mkdir()
    got = pieces.restore([str(tmp_path / "p.tar.xz")], workdir=str(dst), skip=("results/smoke/logs/",))
    assert (dst / "results/smoke/runs/a/result.json").is_file() and not (dst / "results/smoke/logs").exists()
    assert len(got) == len(names) - 2
    pieces.restore([str(tmp_path / "p.tar.xz")], workdir=str(dst))
    assert (dst / "results/smoke/logs/attempts/a.1.log").read_text() == "log"


def test_hard_linked_logs_are_packed_as_plain_files(tmp_path):
    """A job's log and its attempt's copy (one file, two names) come back as two plain files."""
    import os

    src = tmp_path / "src"
    logs = src / "results" / "smoke" / "logs"
    (logs / "attempts").mkdir(parents=True)
    (logs / "accounting.log").write_text("log")
    os.link(logs / "accounting.log", logs / "attempts" / "accounting.1.log")
    pieces.pack(tmp_path / "p.tar.xz", "results/smoke", workdir=str(src))
    with tarfile.open(tmp_path / "p.tar.xz") as tar:
        assert all(m.isfile() for m in tar.getmembers())
    got = pieces.restore([str(tmp_path / "p.tar.xz")], workdir=str(tmp_path / "dst"))
    assert sorted(got) == ["results/smoke/logs/accounting.log", "results/smoke/logs/attempts/accounting.1.log"]
    assert (tmp_path / "dst" / "results/smoke/logs/attempts/accounting.1.log").read_text() == "log"


def test_restore_refuses_members_outside_the_tree(tmp_path):
    evil = tmp_path / "evil.tar.xz"
    (tmp_path / "x").write_text("x")
    with tarfile.open(evil, "w:xz") as tar:
        tar.add(tmp_path / "x", arcname="../outside.txt")
    (tmp_path / "w").mkdir()
    with pytest.raises(pieces.PieceError, match="not a plain file inside"):
        pieces.restore([str(evil)], workdir=str(tmp_path / "w"))
    (tmp_path / "junk.tar.xz").write_bytes(b"junk")
    with pytest.raises(pieces.PieceError, match="not a piece archive"):
        pieces.restore([str(tmp_path / "junk.tar.xz")], workdir=str(tmp_path / "w"))


def test_restored_results_must_match_data_and_settings(tmp_path):
    S = settings()
    R = tmp_path / "r"
    (R / "data").mkdir(parents=True)
    (R / "data" / "manifest.json").write_text('{"a": 1}')
    from lrattnres.data.manifest import sha256_file
    from lrattnres.grid import plan, train_spec
    from lrattnres.train import spec as spec_mod

    run = plan(S)[0]
    (R / "runs" / run.run_id).mkdir(parents=True)
    spec = spec_mod.resolve(train_spec(S, run))
    record = {"manifest_sha256": sha256_file(R / "data" / "manifest.json"), "spec": spec}
    (R / "runs" / run.run_id / "spec.json").write_text(json.dumps(record))
    (R / "settings.json").write_text(json.dumps(S))
    assert pieces.check_same_data(str(R)) == 1
    assert "train" in pieces.check_same_settings(S, str(R))
    # other data
    (R / "data" / "manifest.json").write_text('{"a": 2}')
    with pytest.raises(pieces.PieceError, match="trained on data manifest"):
        pieces.check_same_data(str(R))
    # another experiment: a science setting differs, named; accepted only when asked
    other = json.loads(json.dumps(S))
    other["train"]["steps"] += 1
    with pytest.raises(pieces.PieceError, match=r"settings.train differs .*'steps'"):
        pieces.check_same_settings(other, str(R))
    (R / "settings.json").write_text(json.dumps(other))  # the scale's block as now, the run as before
    with pytest.raises(pieces.PieceError, match=r"training spec differs .*'steps'"):
        pieces.check_same_settings(other, str(R))
    pieces.check_same_settings(other, str(R), accept=("steps",))
    (R / "settings.json").write_text(json.dumps(S))
    # resources are not science: no difference
    res = json.loads(json.dumps(S))
    res["resources"] = {"default": {"mem_mb": 1}}
    pieces.check_same_settings(res, str(R))


def _copy_repo(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".venv", "results", ".snakemake", ".git", ".pytest_cache", "__pycache__",
                                    ".whl*", ".carry", "paper.html", "paper.json", "claims.tsv")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def _piece(cwd: Path, *args: str, config: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lrattnres", "piece", *args, "--config", "scale=smoke", *config],
                          cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_smoke_scale_in_two_pieces_and_a_report(tmp_path):
    """Three fresh trees: the first piece, the second continuing it, the report from both (on a grid
    of one seed, rank and block count: every rule, fewer runs)."""
    out = tmp_path / "out"
    a = _copy_repo(tmp_path / "a")
    r = _piece(a, "run", "first", "--out", str(out), "--cores", "2", config=ONE_OF_EACH)
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads((out / "first.json").read_text())
    assert first["missing_targets"] == [] and first["planned_jobs"]["train"] == len(first["runs"])

    b = _copy_repo(tmp_path / "b")
    r = _piece(b, "run", "rest", "--out", str(out), "--cores", "2", "--restore", str(out / "first.tar.xz"),
               config=ONE_OF_EACH)
    assert r.returncode == 0, r.stdout + r.stderr
    rest = json.loads((out / "rest.json").read_text())
    # the restored runs are not trained again: only the piece's own runs are planned
    assert rest["restored_runs"] == len(first["runs"])
    assert rest["planned_jobs"]["train"] == len(rest["runs"])
    assert not set(rest["runs"]) & set(first["runs"])

    c = _copy_repo(tmp_path / "c")
    into = tmp_path / "recorded"
    r = _piece(c, "report", "--restore", str(out / "first.tar.xz"), str(out / "rest.tar.xz"), "--into", str(into),
               config=ONE_OF_EACH)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (into / "snakemake.log").read_text()
    assert "rule train:" not in log and "rule diagnose_run:" not in log  # nothing remade
    paper = json.loads((into / "paper.json").read_text())
    assert paper["scale"] == "smoke" and paper["claims"]
    run_ids = {x["run_id"] for x in (first["run_results"] + rest["run_results"])}
    grid = json.loads((c / "results" / "smoke" / "grid.json").read_text())
    check = grid["lr_check"]  # the learning-rate check's runs: its own table, not the grid's
    assert {row["run_id"] for row in grid["runs"]} | {row["run_id"] for row in check["runs"]} == run_ids
    assert check["state"] == "done" and paper["recipe"]["lr_check"] == check


def test_piece_summary_totals_the_gpu_minutes(tmp_path):
    for name, wall in (("a", 90.0), ("b", 150.0)):
        (tmp_path / f"{name}.tar.xz").write_bytes(b"")
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "piece": name, "runs": ["r1", "r2"], "wall_s": wall, "trained_tokens": 10,
            "train_jobs_per_gpu": 7, "provenance": {"device": "cuda: X", "commit": "c"}}))
    (tmp_path / "orphan.tar.xz").write_bytes(b"")  # no record beside it: not counted
    got = pieces.piece_summary([str(tmp_path / f"{n}.tar.xz") for n in ("a", "b", "orphan")])
    assert got["gpu_minutes"] == 4.0 and [r["piece"] for r in got["piece_costs"]] == ["a", "b"]
    assert got["piece_costs"][0]["runs"] == 2 and got["piece_costs"][1]["device"] == "cuda: X"
    assert pieces.piece_summary([]) == {"piece_costs": [], "gpu_minutes": None}


def test_the_recorded_gpu_pieces_belong_to_the_gpu_scale_or_are_refused(tmp_path):
    """A committed piece of the gpu scale made from the configured pack (data.pack.sha256) was made with
    today's gpu-scale settings: every run's spec is today's (a change of the gpu scale's science fails
    here first). Only the scale's rates may differ in its settings.json: the recipe piece runs before
    they are set to its winner, and its runs do not depend on them. A piece made from another pack
    (the seeds piece of 2026-12-01, manifest 24388f66...) is superseded: continuing from it is
    refused, naming the data."""
    archives = sorted((REPO / "reports" / "recorded" / "gpu" / "pieces").glob("*.tar.xz"))
    assert archives
    S = settings("gpu")
    for arc in archives:
        with tarfile.open(arc) as tar:
            tar.extractall(tmp_path / arc.stem, filter="data")
        results = tmp_path / arc.stem / S["results"]
        made_from = json.loads((results / "data" / "manifest.json").read_text())["source"]["sha256"]
        if made_from == S["data"]["pack"]["sha256"]:
            saved = json.loads((results / "settings.json").read_text())
            for group in ("muon", "adam"):  # the recipe piece's settings.json holds the rates before its winner
                saved["recipe"]["optim"][group]["lr"] = S["recipe"]["optim"][group]["lr"]
            (results / "settings.json").write_text(json.dumps(saved))
            assert "train" in pieces.check_same_settings(S, str(results))
        else:
            with pytest.raises(pieces.PieceError, match=r"settings\.data differs"):
                pieces.check_same_settings(S, str(results))


def test_a_piece_of_stages_only_times_its_sizes():
    S = settings("gpu")
    ps = {p.name: p for p in pieces.plan_pieces(S)}
    R = S["results"]
    for name, preset in (("table3-1b", "1B"), ("table3-4b", "4B")):
        p = ps[name]
        assert p.runs == () and p.stages == ("throughput",) and p.presets == (preset,)
        assert pieces.piece_targets(S, p) == [f"{R}/throughput/{preset}.json"]
    assert list(ps)[-2:] == ["table3-1b", "table3-4b"]  # after the pieces of runs
    assert S["throughput"]["grad_accum"] == 64 and S["throughput"]["compile"] is True
    assert S["throughput"]["presets"] == ["1B", "4B"] and S["throughput"]["repeats"] == 5
    whole = pieces.Piece("t", (), ("throughput",))
    assert pieces.piece_targets(S, whole) == [f"{R}/throughput.json"]
    with pytest.raises(pieces.PieceError, match=r"times presets \['0.5B'\]"):
        pieces.plan_pieces({**S, "pieces": [{"name": "a", "runs": ["*"]}, {"name": "t", "stages": ["throughput"],
                                                                         "presets": ["0.5B"]}]})
    with pytest.raises(pieces.PieceError, match="neither runs nor stages"):
        pieces.plan_pieces({**S, "pieces": [{"name": "a", "runs": ["*"]}, {"name": "e"}]})


def test_partial_throughput_state_comes_back_with_a_piece(tmp_path):
    R = tmp_path / "results" / "gpu"
    (R / "throughput").mkdir(parents=True)
    (R / "throughput" / "4B.partial.json").write_text("{}")
    got = [Path(f).relative_to(R).as_posix() for f in pieces.small_outputs(str(R))]
    assert "throughput/4B.partial.json" in got


def test_a_piece_with_a_deadline_passes_it_to_its_jobs(tmp_path, monkeypatch):
    """run_piece gives Snakemake LRATTNRES_DEADLINE (the piece's end less the packing time), and lets a
    throughput piece run the per-size timing and merge rules."""
    import time

    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pieces, "_snakemake", lambda args, log, timeout=None, env=None: calls.append((args, env)) or 0)
    monkeypatch.setattr(pieces, "planned_jobs", lambda targets, config_args, extra: {"throughput_size": 1})
    S = settings("gpu")
    t0 = time.time()
    rec = pieces.run_piece(S, "table3-4b", str(tmp_path / "out"), restore_from=[], config_args=["scale=gpu"],
                           cores="all", deadline_s=600, allow_rerun=False, extra=[])
    env = calls[-1][1]
    assert t0 + 600 - pieces.PACK_MARGIN_S - 5 <= int(env["LRATTNRES_DEADLINE"]) <= time.time() + 600 - pieces.PACK_MARGIN_S
    assert calls[-1][0][0] == f"{S['results']}/throughput/4B.json"
    assert rec["missing_targets"] == [f"{S['results']}/throughput/4B.json"]
    monkeypatch.setattr(pieces, "planned_jobs", lambda targets, config_args, extra: {"throughput_size": 1, "report": 1})
    with pytest.raises(pieces.PieceError, match=r"would also run \['report'\]"):
        pieces.run_piece(S, "table3-4b", str(tmp_path / "out"), restore_from=[], config_args=["scale=gpu"],
                         cores="all", deadline_s=None, allow_rerun=False, extra=[])
