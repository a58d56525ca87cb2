"""A scale in pieces (lrattnres.pieces): planning, packing, restoring, and a smoke-scale chain of two
pieces and a report on three fresh copies of the repository, none of which redoes another's work."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ONE_OF_EACH

from lrattnres import pieces, process_group
from lrattnres.config import load_and_resolve, science

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
    (meta / pieces.metadata_name("results/smoke/runs/a/result.json")).write_text("{}")


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
    got = pieces.restore([str(tmp_path / "p.tar.xz")], workdir=str(dst), results="results/smoke",
                         skip=("results/smoke/logs/",))
    assert (dst / "results/smoke/runs/a/result.json").is_file() and not (dst / "results/smoke/logs").exists()
    assert len(got) == len(names) - 2
    pieces.restore([str(tmp_path / "p.tar.xz")], workdir=str(dst), results="results/smoke")
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
    got = pieces.restore([str(tmp_path / "p.tar.xz")], workdir=str(tmp_path / "dst"), results="results/smoke")
    assert sorted(got) == ["results/smoke/logs/accounting.log", "results/smoke/logs/attempts/accounting.1.log"]
    assert (tmp_path / "dst" / "results/smoke/logs/attempts/accounting.1.log").read_text() == "log"


def _archive(path: Path, members: list[tuple]) -> Path:
    """A crafted xz tarball: (name, bytes, {type, mode, mtime, linkname, devmajor}) per member."""
    with tarfile.open(path, "w:xz") as tar:
        for name, data, kw in members:
            info = tarfile.TarInfo(name)
            info.type = kw.get("type", tarfile.REGTYPE)
            info.mode, info.mtime = kw.get("mode", 0o644), kw.get("mtime", 1_700_000_000)
            info.linkname = kw.get("linkname", "")
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return path


GOOD = ("results/smoke/runs/a/result.json", b"{}", {})
CRAFTED = {
    "code through ..": ("results/smoke/../../lrattnres/__init__.py", b"print('run')", {}),
    "config": ("config.yaml", b"scale: smoke\n", {}),
    "Snakefile": ("Snakefile", b"rule all:\n", {}),
    "git hook": (".git/hooks/pre-commit", b"#!/bin/sh\necho run\n", {"mode": 0o755}),
    "conda env": (".snakemake/conda/env.yaml", b"dependencies: []\n", {}),
    "absolute": ("/tmp/results/smoke/settings.json", b"{}", {}),
    "other scale": ("results/gpu/settings.json", b"{}", {}),
    "weights": ("results/smoke/runs/a/model.safetensors", b"w", {}),
    "symlink": ("results/smoke/runs/b/result.json", b"", {"type": tarfile.SYMTYPE, "linkname": "../../../../lrattnres/__init__.py"}),
    "hard link": ("results/smoke/runs/b/result.json", b"", {"type": tarfile.LNKTYPE, "linkname": "results/smoke/runs/a/result.json"}),
    "device": ("results/smoke/runs/b/result.json", b"", {"type": tarfile.CHRTYPE}),
    "pipe": ("results/smoke/runs/b/result.json", b"", {"type": tarfile.FIFOTYPE}),
    "folder": ("results/smoke/runs/b", b"", {"type": tarfile.DIRTYPE}),
    "odd name": ("results/smoke/logs/a\nb.log", b"", {}),
    "twice": GOOD,
    "orphan record": (f".snakemake/metadata/{pieces.metadata_name('results/smoke/settings.json')}", b"{}", {}),
    "record not JSON": (f".snakemake/metadata/{pieces.metadata_name(GOOD[0])}", b"exec", {}),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_an_archive_holds_data_only(tmp_path, case):
    """Every member must be a kept kind of result under the scale's folder, or its Snakemake record:
    anything else is refused naming the member, and nothing of the archive is written."""
    bad = CRAFTED[case]
    arc = _archive(tmp_path / "evil.tar.xz", [GOOD, bad])
    work = tmp_path / "w"
    work.mkdir()
    with pytest.raises(pieces.ArchiveError) as err:
        pieces.restore([str(arc)], workdir=str(work), results="results/smoke")
    assert repr(bad[0]) in str(err.value) and "\n" not in str(err.value).replace(repr(bad[0]), "")
    assert not any(work.rglob("*")), "nothing is extracted when any member is refused"


def test_every_archive_is_checked_before_any_is_written(tmp_path):
    good = _archive(tmp_path / "good.tar.xz", [GOOD])
    bad = _archive(tmp_path / "bad.tar.xz", [CRAFTED["Snakefile"]])
    (tmp_path / "w").mkdir()
    with pytest.raises(pieces.ArchiveError, match="Snakefile"):
        pieces.restore([str(good), str(bad)], workdir=str(tmp_path / "w"), results="results/smoke")
    assert not any((tmp_path / "w").rglob("*"))


def test_a_corrupt_or_truncated_archive_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Refused before the piece builds or writes anything (the command exits 2 with one line)."""
    whole = (REPO / "reports/recorded/gpu/pieces/seeds.tar.xz").read_bytes()
    cases = {"truncated": whole[: len(whole) - 5000], "cut short": whole[:300], "junk": b"junk",
             "empty": b""}
    monkeypatch.chdir(REPO)  # main reads config.yaml; the archive is refused before anything is written
    for name, data in cases.items():
        arc = tmp_path / f"{name.replace(' ', '_')}.tar.xz"
        arc.write_bytes(data)
        with pytest.raises(pieces.ArchiveError, match="not a complete piece archive"):
            pieces.read_archive(str(arc), "results/gpu")
        out = tmp_path / "out"
        rc = pieces.main(["run", "first", "--out", str(out), "--restore", str(arc), "--config", "scale=smoke"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and str(arc) in err, (name, err)
        assert not out.exists()


def test_restore_through_a_linked_results_folder(tmp_path):
    """results/ may be a link to scratch space: files land there (and keep their time)."""
    arc = _archive(tmp_path / "p.tar.xz", [GOOD, (f".snakemake/metadata/{pieces.metadata_name(GOOD[0])}", b"{}", {})])
    work, scratch = tmp_path / "w", tmp_path / "scratch"
    work.mkdir()
    scratch.mkdir()
    (work / "results").symlink_to(scratch)
    got = pieces.restore([str(arc)], workdir=str(work), results="results/smoke")
    assert sorted(got) == sorted([GOOD[0], f".snakemake/metadata/{pieces.metadata_name(GOOD[0])}"])
    assert (scratch / "smoke/runs/a/result.json").read_text() == "{}"
    assert (scratch / "smoke/runs/a/result.json").stat().st_mtime == 1_700_000_000


def test_restored_files_are_never_executable(tmp_path):
    arc = _archive(tmp_path / "p.tar.xz", [("results/smoke/logs/x.log", b"#!/bin/sh\n", {"mode": 0o777})])
    pieces.restore([str(arc)], workdir=str(tmp_path / "w"), results="results/smoke")
    assert (tmp_path / "w/results/smoke/logs/x.log").stat().st_mode & 0o111 == 0


def _partial(runs: int) -> bytes:
    return json.dumps({"format": "lrattnres.throughput.partial/1", "runs": [{"repeat": i} for i in range(runs)]}).encode()


def test_newest_state_wins_four_timed_runs_then_two(tmp_path):
    """The throughput pieces of the gpu scale, as the docs run them: table3-1b stops with 2 timed runs,
    table3-4b (restoring it) runs, table3-1b continues to 4, and everything is restored again in name
    order. A piece packs only its own outputs, and restore keeps the newest copy of a file."""
    S = settings("gpu")
    ps = {p.name: p for p in pieces.plan_pieces(S)}
    R = S["results"]
    part_1b = f"{R}/throughput/1B.partial.json"

    def run(tree: Path, piece: str, restore: list[Path], write: dict[str, bytes], when: float) -> Path:
        tree.mkdir()
        pieces.restore([str(a) for a in restore], workdir=str(tree), results=R)
        for rel, data in write.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(data)
            os.utime(tree / rel, (when, when))
        out = tmp_path / "out" / f"{piece}.tar.xz"
        pieces.pack(out, R, workdir=str(tree), files=pieces.own_files(S, ps[piece], workdir=str(tree)))
        return out

    a = run(tmp_path / "1", "table3-1b", [], {part_1b: _partial(2)}, 1000)
    b = run(tmp_path / "2", "table3-4b", [a], {f"{R}/throughput/4B.partial.json": _partial(1)}, 2000)
    with tarfile.open(b) as tar:
        assert part_1b not in tar.getnames() and f"{R}/throughput/4B.partial.json" in tar.getnames()
    a2 = run(tmp_path / "3", "table3-1b", [a, b], {part_1b: _partial(4)}, 3000)
    assert a2 == a
    final = tmp_path / "4"
    final.mkdir()
    pieces.restore([str(a), str(b)], workdir=str(final), results=R)
    assert len(json.loads((final / part_1b).read_text())["runs"]) == 4
    # an older copy in a later archive (packed by a piece before it packed only its own outputs)
    stale = _archive(tmp_path / "stale.tar.xz", [(part_1b, _partial(2), {"mtime": 1000})])
    got = pieces.restore_members(pieces.read_archives([str(a), str(stale)], R), str(tmp_path / "5"))
    assert len(json.loads((tmp_path / "5" / part_1b).read_text())["runs"]) == 4
    assert got.superseded == [{"file": part_1b, "from": str(a), "over": str(stale)}]
    # a file in the tree newer than every copy is kept
    os.utime(tmp_path / "5" / part_1b, (4000, 4000))
    (tmp_path / "5" / part_1b).write_bytes(_partial(5))
    got = pieces.restore_members(pieces.read_archives([str(a)], R), str(tmp_path / "5"))
    assert got.kept_local == [part_1b] and len(json.loads((tmp_path / "5" / part_1b).read_text())["runs"]) == 5


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
    # nor are the training's execution settings, which settings.json leaves out
    res["train"] = {**res["train"], "log_every_s": 5, "grad_guard": {"factor": 50, "window": 20, "min_history": 5}}
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
    """Three fresh trees: the first piece; the first piece again, restoring itself (nothing trained),
    then the second continuing it; the report from both (on a grid of one seed, rank and block count:
    every rule, fewer runs)."""
    out = tmp_path / "out"
    a = _copy_repo(tmp_path / "a")
    r = _piece(a, "run", "first", "--out", str(out), "--cores", "2", config=ONE_OF_EACH)
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads((out / "first.json").read_text())
    assert first["missing_targets"] == [] and first["planned_jobs"]["train"] == len(first["runs"])

    # the first piece again, restoring its archive (the "stopped, run it again" path): nothing is trained
    b = _copy_repo(tmp_path / "b")
    r = _piece(b, "run", "first", "--out", str(out), "--cores", "2", "--restore", str(out / "first.tar.xz"),
               config=ONE_OF_EACH)
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.loads((out / "first.json").read_text())
    assert again["planned_jobs"].get("train", 0) == 0 and again["skipped_runs"] == first["runs"]
    assert again["trained_tokens"] == 0 and again["aggregate_tokens_per_s"] is None
    assert f"not trained again: {', '.join(first['runs'])}" in r.stderr
    assert len(again["invocations"]) == 2 and again["total_trained_tokens"] == first["trained_tokens"] > 0
    with tarfile.open(out / "first.tar.xz") as tar:  # the second archive holds the first's results
        assert {f"results/smoke/runs/{run}/result.json" for run in first["runs"]} <= set(tar.getnames())

    r = _piece(b, "run", "rest", "--out", str(out), "--cores", "2", "--restore", str(out / "first.tar.xz"),
               config=ONE_OF_EACH)
    assert r.returncode == 0, r.stdout + r.stderr
    rest = json.loads((out / "rest.json").read_text())
    # the restored runs are not trained again: only the piece's own runs are planned
    assert rest["restored_runs"] == len(first["runs"])
    assert rest["planned_jobs"]["train"] == len(rest["runs"])
    assert not set(rest["runs"]) & set(first["runs"])
    with tarfile.open(out / "rest.tar.xz") as tar:  # its own outputs only, not the restored ones
        assert not [n for n in tar.getnames() if any(f"/{run}" in n for run in first["runs"])]

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
        R = tmp_path / arc.stem
        pieces.restore([str(arc)], workdir=str(R), results=S["results"])
        results = R / S["results"]
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


def _fake_snakemake(calls: list, make=()):
    """A stand-in for pieces._snakemake: records each call and makes the files ``make`` (relative to
    the working directory; {path: content}, or paths of {"tokens": 100}) when it runs the targets."""
    def fake(args, log, *, stop=None, stop_at=None, env=None):
        calls.append({"args": args, "stop_at": stop_at, "env": env})
        if not args[0].endswith("data/manifest.json"):
            for rel in make:
                Path(rel).parent.mkdir(parents=True, exist_ok=True)
                Path(rel).write_text(json.dumps(make[rel] if isinstance(make, dict) else {"tokens": 100}))
        return process_group.Outcome(0, None, [])
    return fake


def test_a_piece_with_a_deadline_passes_it_to_its_jobs(tmp_path, monkeypatch):
    """run_piece gives Snakemake LRATTNRES_DEADLINE (the piece's end less the packing time), stops it
    STOP_MARGIN_S before the end, and lets a throughput piece run the per-size timing and merge rules."""
    import time

    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pieces, "_snakemake", _fake_snakemake(calls))
    monkeypatch.setattr(pieces, "planned_jobs", lambda targets, config_args, extra: {"throughput_size": 1})
    S = settings("gpu")
    t0, m0 = time.time(), time.monotonic()
    rec = pieces.run_piece(S, "table3-4b", str(tmp_path / "out"), restore_from=[], config_args=["scale=gpu"],
                           cores="all", deadline_s=600, allow_rerun=False, extra=[])
    env = calls[-1]["env"]
    assert t0 + 600 - pieces.PACK_MARGIN_S - 5 <= int(env["LRATTNRES_DEADLINE"]) <= time.time() + 600 - pieces.PACK_MARGIN_S
    assert m0 + 600 - pieces.STOP_MARGIN_S <= calls[-1]["stop_at"] <= time.monotonic() + 600 - pieces.STOP_MARGIN_S
    assert calls[-1]["args"][0] == f"{S['results']}/throughput/4B.json"
    assert rec["missing_targets"] == [f"{S['results']}/throughput/4B.json"]
    assert rec["exit_code"] == 1 and rec["stopped"] is None  # a job failed: no stop asked, none at its deadline
    # the timing job stopped at its own deadline (exit 75, as lrattnres/attempts.py records it)
    status = f"{S['results']}/logs/throughput/attempts/4B.status.json"
    monkeypatch.setattr(pieces, "_snakemake", _fake_snakemake(calls, make={status: {"status": "exited", "code": 75}}))
    rec = pieces.run_piece(S, "table3-4b", str(tmp_path / "out"), restore_from=[], config_args=["scale=gpu"],
                           cores="all", deadline_s=600, allow_rerun=False, extra=[])
    assert rec["exit_code"] == 75 and rec["stopped"] == "deadline" and rec["partial"]
    monkeypatch.setattr(pieces, "planned_jobs", lambda targets, config_args, extra: {"throughput_size": 1, "report": 1})
    with pytest.raises(pieces.PieceError, match=r"would also run \['report'\]"):
        pieces.run_piece(S, "table3-4b", str(tmp_path / "out"), restore_from=[], config_args=["scale=gpu"],
                         cores="all", deadline_s=None, allow_rerun=False, extra=[])


def test_a_deadline_too_short_for_the_jobs_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    assert pieces.main(["run", "table3-1b", "--out", str(out), "--deadline", "30", "--config", "scale=gpu"]) == 2
    err = capsys.readouterr().err
    assert "--deadline 30: a piece needs at least 60 s" in err and not out.exists()


@pytest.mark.parametrize("section, key, value", [
    ("throughput", "repeats", 3), ("throughput", "seq_len", 1024), ("accounting", "ranks", ["d/4"]),
])
def test_the_timing_and_accounting_settings_are_compared(tmp_path, section, key, value):
    """Restored pieces made with other throughput (Table 3's protocol) or accounting (Appendix F's
    ranks) settings belong to another experiment: refused naming the key, unless accepted."""
    S = settings("gpu")
    R = tmp_path / "r"
    R.mkdir()
    (R / "settings.json").write_text(json.dumps(S))
    assert {"throughput", "accounting"} <= set(pieces.check_same_settings(S, str(R)))
    other = json.loads(json.dumps(S))
    other[section][key] = value
    with pytest.raises(pieces.PieceError, match=rf"settings.{section} differs .*'{key}'"):
        pieces.check_same_settings(other, str(R))
    pieces.check_same_settings(other, str(R), accept=(f"{section}.{key}",))


def _whole_run(S: dict, run: str, root: Path = Path(".")) -> None:
    for t in pieces.run_targets(S, run):
        (root / t).parent.mkdir(parents=True, exist_ok=True)
        (root / t).write_text(json.dumps({"tokens": 1000}))


def test_finished_runs_are_skipped_and_restored_results_never_trained_again(tmp_path, monkeypatch):
    """A run whose outputs all exist is left out of Snakemake's targets (and named); a run with a
    result but a missing later output would be trained again to make it: refused, and allowed only
    with --allow-rerun. Cost figures count this invocation's training only."""
    S = settings()
    piece = {p.name: p for p in pieces.plan_pieces(S)}["first"]
    done, half, new = piece.runs
    monkeypatch.chdir(tmp_path)
    _whole_run(S, done)
    result = f"{S['results']}/runs/{half}/result.json"
    Path(result).parent.mkdir(parents=True)
    Path(result).write_text("{}")
    calls = []
    monkeypatch.setattr(pieces, "_snakemake", _fake_snakemake(calls, make=pieces.run_targets(S, new)))
    monkeypatch.setattr(pieces, "planned_jobs", lambda targets, config_args, extra: {"train": 2, "diagnose_run": 2})
    run = lambda **kw: pieces.run_piece(S, "first", str(tmp_path / "out"), restore_from=[],  # noqa: E731
                                        config_args=["scale=smoke"], cores="1", deadline_s=None, extra=[], **kw)
    with pytest.raises(pieces.PieceError, match=rf"only 1 have no result: .*'{half}': \['diagnostics/{half}.json'"):
        run(allow_rerun=False)
    rec = run(allow_rerun=True)
    targets = calls[-1]["args"]
    assert rec["skipped_runs"] == [done] and not any(f"/{done}" in t for t in targets)
    assert f"{S['results']}/runs/{new}/result.json" in targets and f"{S['results']}/runs/{half}/result.json" in targets
    assert rec["trained_runs"] == [new] and rec["trained_tokens"] == 100  # not the restored run's 1000
    assert "not trained again: " + done in (tmp_path / "out" / "first.log").read_text()


def test_a_job_killed_after_its_work_is_not_done_again(tmp_path):
    """SIGKILL to Snakemake after a training job wrote its outputs leaves them marked incomplete, and
    Snakemake (rerun-incomplete) would train the run again; the piece marks whole outputs complete."""
    import signal
    import time

    S = settings()
    run = "smoke-baseline-s0"
    piece = pieces.Piece("p", (run,), ())
    (tmp_path / "Snakefile").write_text(
        "rule train:\n"
        "    output: r='results/smoke/runs/{run}/result.json', m='results/smoke/runs/{run}/model.safetensors',\n"
        "            s='results/smoke/runs/{run}/model.safetensors.sha256'\n"
        "    shell: 'echo w > {output.m}; echo s > {output.s}; echo {{}} > {output.r}.tmp; mv {output.r}.tmp {output.r}; "
        "sleep 600'\n")
    target = f"results/smoke/runs/{run}/result.json"
    smk = [sys.executable, "-m", "snakemake", target, "--cores", "1", "--rerun-incomplete"]
    proc = subprocess.Popen(smk, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        for _ in range(300):
            if (tmp_path / target).is_file():
                break
            time.sleep(0.1)
        assert (tmp_path / target).is_file()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    dry = lambda: subprocess.run([*smk, "-n"], cwd=tmp_path, capture_output=True, text=True).stdout  # noqa: E731
    assert "rule train" in dry()  # what Snakemake alone would do
    cleared = pieces.complete_finished(S, piece, workdir=str(tmp_path))
    assert cleared == [f"results/smoke/runs/{run}/{f}" for f in pieces.TRAIN_OUTPUTS]
    assert "rule train" not in dry()
    # outputs that are not whole keep their mark
    (tmp_path / target).unlink()
    marker = pieces._incomplete_marker(tmp_path, target)
    marker.write_text("{}")
    assert pieces.complete_finished(S, piece, workdir=str(tmp_path)) == [] and marker.is_file()


# A stand-in for Snakemake in a piece's own process: it builds a data manifest, answers dry runs with
# the training jobs of the result.json targets it is given, and runs the piece's targets by making them
# (FAKE_DONE: runs made whole; FAKE_HALF: runs trained but not diagnosed; every other run of the
# targets is left to a job that runs until SIGTERM, then takes a second to write its log and exit 75, as
# a training job writes its checkpoint). On SIGTERM it waits for its job, as Snakemake does.
FAKE_SNAKEMAKE = r'''
import hashlib, json, os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, os.environ["REPO"])
from lrattnres.gridplan import plan, train_spec
from lrattnres.train import spec as spec_mod

args = sys.argv[1:]
S = json.loads(Path(os.environ["FAKE_SETTINGS"]).read_text())
R = S["results"]
targets = [a for a in args if a.startswith(R + "/")]
with open("fake.calls", "a") as f:
    f.write(json.dumps({"targets": targets, "dry": "-n" in args, "deadline": os.environ.get("LRATTNRES_DEADLINE")}) + "\n")
runs_of = lambda ts: [t.split("/")[-2] for t in ts if t.endswith("/result.json")]
if "-n" in args:
    n = len([r for r in runs_of(targets) if not Path(f"{R}/runs/{r}/result.json").is_file()])
    print("job count\ntrain " + str(n) + "\ntotal " + str(n) if n else "")
    sys.exit(0)
manifest = Path(R) / "data" / "manifest.json"
if targets == [str(manifest)]:
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text('{"fake": 1}')
    sys.exit(0)
sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
grid = {r.run_id: r for r in plan(S)}

def write(rel, obj):
    Path(rel).parent.mkdir(parents=True, exist_ok=True)
    Path(rel).write_text(json.dumps(obj))

def train(run):
    d = f"{R}/runs/{run}"
    write(f"{d}/spec.json", {"manifest_sha256": sha, "spec": spec_mod.resolve(train_spec(S, grid[run]))})
    write(f"{d}/metrics.jsonl", {"kind": "train"})
    write(f"{d}/model.safetensors", {})
    write(f"{d}/result.json", {"stage": "train", "tokens": 100})
    write(f"{R}/logs/train/{run}.log", "trained")

whole = os.environ.get("FAKE_DONE", "").split(",")
half = os.environ.get("FAKE_HALF", "").split(",")
for t in targets:
    if "/runs/" not in t and not any(f"/{r}." in t for r in runs_of(targets)):
        write(t, {"stage": "stage"} if not t.endswith("settings.json") else S)
for run in runs_of(targets):
    if os.environ.get("FAKE_MODE") == "complete" or run in whole:
        train(run)
        for t in targets:
            if t.endswith(f"/{run}.json"):
                write(t, {"stage": "later"})
    elif run in half:
        train(run)
    else:
        log = f"{R}/logs/train/{run}.log"
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        job = subprocess.Popen([sys.executable, "-c", (
            "import signal, sys, time\n"
            "def stop(*a):\n"
            "    time.sleep(1)\n"
            f"    open({log!r}, 'a').write('stopped by SIGTERM\\n')\n"
            "    sys.exit(75)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "open('fake.job', 'w').write('ready')\n"
            "while True: time.sleep(0.1)\n")])
        while not Path("fake.job").is_file() or Path("fake.job").read_text() != "ready":
            time.sleep(0.02)
        Path("fake.job").write_text(str(job.pid))
        signal.signal(signal.SIGTERM, lambda *a: (job.wait(), sys.exit(1)))
        Path("fake.ready").write_text(str(os.getpid()))
        while True:
            time.sleep(0.1)
'''

RUN_PIECE = r'''
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
from lrattnres import pieces
pieces.SNAKEMAKE = (sys.executable, os.environ["FAKE"])
pieces.MIN_DEADLINE_S, pieces.PACK_MARGIN_S, pieces.STOP_MARGIN_S, pieces.STOP_GRACE_S = 1, 3, 1, 5
S = json.loads(open(os.environ["FAKE_SETTINGS"]).read())
deadline = float(sys.argv[2]) if sys.argv[2] != "-" else None
try:
    rec = pieces.run_piece(S, "first", sys.argv[1], restore_from=sys.argv[3:], config_args=["scale=smoke"],
                           cores="1", deadline_s=deadline, allow_rerun=False, extra=[])
except pieces.PieceError as e:
    print(f"piece: {e}", file=sys.stderr)
    sys.exit(2)
sys.exit(rec["exit_code"])
'''


@pytest.fixture
def piece_process(tmp_path):
    """Start ``first`` of the smoke scale with run_piece in a fresh tree (its own process), Snakemake
    played by FAKE_SNAKEMAKE; whatever a failing test leaves running is killed at its end."""
    started = []

    def start(tree: str, deadline: float | None = None, restore: tuple = (), **env):
        cwd, proc = _piece_process(tmp_path, tree, deadline, restore, **env)
        started.append((cwd, proc))
        return cwd, proc

    yield start
    import signal

    for cwd, proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ready = cwd / "fake.ready"
        if ready.is_file() and ready.read_text():
            try:
                os.killpg(int(ready.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _piece_process(tmp_path: Path, tree: str, deadline: float | None = None, restore: tuple = (), **env):
    (tmp_path / "fake.py").write_text(FAKE_SNAKEMAKE)
    (tmp_path / "run.py").write_text(RUN_PIECE)
    (tmp_path / "settings.json").write_text(json.dumps(settings()))
    cwd = tmp_path / tree
    cwd.mkdir()
    env = {**os.environ, "REPO": str(REPO), "FAKE": str(tmp_path / "fake.py"),
           "FAKE_SETTINGS": str(tmp_path / "settings.json"), **env}
    return cwd, subprocess.Popen([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "out"),
                                  "-" if deadline is None else str(deadline), *map(str, restore)],
                                 cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, seconds: float = 60) -> None:
    import time

    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def _check_stopped_piece(tmp_path: Path, cwd: Path, proc, why: str) -> None:
    """A stopped ``first``: exit 75, its job ended before the packing (its last log line is packed),
    the whole run and the stage outputs packed, the run trained but not diagnosed left out."""
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, out + err
    assert not _alive(int((cwd / "fake.job").read_text()))
    S = settings()
    R = S["results"]
    done, half, hung = {p.name: p for p in pieces.plan_pieces(S)}["first"].runs
    rec = json.loads((tmp_path / "out" / "first.json").read_text())
    assert rec["stopped"] == why and rec["partial"] and rec["exit_code"] == 75
    assert list(rec["runs_left_out"]) == [half]
    with tarfile.open(tmp_path / "out" / "first.tar.xz") as tar:
        names = set(tar.getnames())
        log = tar.extractfile(f"{R}/logs/train/{hung}.log").read().decode()
    assert "stopped by SIGTERM" in log
    assert {f"{R}/runs/{done}/result.json", f"{R}/runs/{done}/spec.json", f"{R}/diagnostics/{done}.json",
            f"{R}/settings.json", f"{R}/accounting.json", f"{R}/kernel_check.json"} <= names
    assert not [n for n in names if f"/runs/{half}/" in n or f"/runs/{hung}/" in n]


def test_sigterm_stops_the_whole_piece_packs_what_finished_and_a_rerun_continues(tmp_path, piece_process):
    """SIGTERM to the piece: Snakemake's group is stopped, its job waited for, what finished packed,
    exit 75. Run again, restoring the archive: the finished run is skipped, the others trained, and
    the cost counts only that invocation (both invocations are kept in the record)."""
    import signal

    S = settings()
    done, half, hung = {p.name: p for p in pieces.plan_pieces(S)}["first"].runs
    cwd, proc = piece_process("a", FAKE_DONE=done, FAKE_HALF=half)
    _wait_for(cwd / "fake.ready")
    proc.send_signal(signal.SIGTERM)
    _check_stopped_piece(tmp_path, cwd, proc, "SIGTERM")

    cwd, proc = piece_process("b", restore=(tmp_path / "out" / "first.tar.xz",), FAKE_MODE="complete")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    rec = json.loads((tmp_path / "out" / "first.json").read_text())
    assert rec["skipped_runs"] == [done] and rec["planned_jobs"] == {"train": 2}
    calls = [json.loads(x) for x in (cwd / "fake.calls").read_text().splitlines()]
    assert not any(done in t for c in calls for t in c["targets"])
    assert rec["trained_runs"] == sorted([half, hung]) and rec["trained_tokens"] == 200
    assert [i["stopped"] for i in rec["invocations"]] == ["SIGTERM", None]
    assert rec["total_wall_s"] == pytest.approx(sum(i["wall_s"] for i in rec["invocations"]), abs=0.2)
    cost = pieces.piece_summary([str(tmp_path / "out" / "first.tar.xz")])
    assert cost["piece_costs"][0]["invocations"] == 2
    assert cost["gpu_minutes"] == round(rec["total_wall_s"] / 60, 1)


def test_the_deadline_stops_the_whole_piece_and_packs_what_finished(tmp_path, piece_process):
    S = settings()
    done, half, hung = {p.name: p for p in pieces.plan_pieces(S)}["first"].runs
    cwd, proc = piece_process("a", deadline=8, FAKE_DONE=done, FAKE_HALF=half)
    _check_stopped_piece(tmp_path, cwd, proc, "deadline")
    calls = [json.loads(x) for x in (cwd / "fake.calls").read_text().splitlines()]
    assert calls[-1]["deadline"] is not None  # the jobs were given theirs (LRATTNRES_DEADLINE)


def test_results_left_by_an_earlier_command_are_checked_like_restored_ones(tmp_path, monkeypatch):
    """A machine that keeps its files between commands: a piece run without archives in a folder where
    an earlier piece wrote settings.json with other rates refuses, naming the folder to clear (its
    Snakemake reruns nothing for changed settings alone, so the stale file would travel as its own)."""
    import io

    monkeypatch.chdir(tmp_path)
    S = settings("gpu")
    piece = {p.name: p for p in pieces.plan_pieces(S)}["seeds"]
    job = pieces._PieceRun(S, piece, str(tmp_path / "out"), [], ["scale=gpu"], "1", None, [], io.StringIO(),
                           None, 0.0)
    job.restore([], ())  # nothing left: nothing to check
    assert "settings_compared" not in job.record
    R = tmp_path / S["results"]
    (R / "data").mkdir(parents=True)
    (R / "data" / "manifest.json").write_text('{"a": 1}')
    (R / "settings.json").write_text(json.dumps(science(S)))
    job.restore([], ())  # the same configuration: compared, accepted
    assert "train" in job.record["settings_compared"]
    earlier = science(S)
    earlier["recipe"]["optim"]["muon"]["lr"], earlier["recipe"]["optim"]["adam"]["lr"] = 0.001, 0.0003
    (R / "settings.json").write_text(json.dumps(earlier))
    with pytest.raises(pieces.PieceError, match=rf"left in {S['results']} by an earlier command .*optim\.muon\.lr.*remove"):
        job.restore([], ())
    job.restore([], ("recipe.optim.muon.lr", "recipe.optim.adam.lr"))  # accepted when asked
