"""The Snakemake workflow: plans at every scale, lint and format, bad config, the smoke DAG end to end,
and reruns that follow real code changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, copy_repo, snakemake

from lrattnres.config import load_and_resolve
from lrattnres.grid import conversions, evaluations, plan

SCALES = ("smoke", "tiny", "gpu", "paper")


def job_counts(stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run as {rule: count}."""
    counts: dict[str, int] = {}
    lines = stdout.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().startswith("Job stats"))
    except StopIteration:
        return counts
    for line in lines[start + 3 :]:
        m = re.match(r"^(\S+)\s+(\d+)$", line.strip())
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    counts.pop("total", None)
    return counts


@pytest.fixture(scope="module")
def shared_copy(tmp_path_factory) -> Path:
    return copy_repo(tmp_path_factory.mktemp("wf") / "repo")


@pytest.mark.parametrize("scale", SCALES)
def test_dry_run_every_scale(shared_copy, scale):
    proc = snakemake(shared_copy, "-n", "--config", f"scale={scale}")
    counts = job_counts(proc.stdout)
    settings = load_and_resolve(REPO / "config.yaml", {"scale": scale})
    assert counts.get("train") == len(plan(settings))
    assert counts.get("convert") == len(conversions(settings))
    assert counts.get("evaluate") == len(evaluations(settings))
    for rule in ("accounting", "prepare_data", "report", "grid_summary", "convert_all", "diagnostics"):
        assert counts.get(rule) == 1, (rule, counts)


def test_paper_scale_plans_exactly_the_papers_runs(shared_copy):
    proc = snakemake(shared_copy, "-n", "--config", "scale=paper")
    # 32 rank/grouping configurations + baseline, 2 extra seeds of each headline run, the control,
    # 6 projected configurations, the 1B and 4B pairs.
    counts = job_counts(proc.stdout)
    assert counts["train"] == 33 + 4 + 1 + 6 + 4
    # Table 2: the four 0.5B AttnRes runs, the 1B and the 4B; Table 8: the two pairs
    assert counts["convert"] == 6 and counts["evaluate"] == 4
    settings = load_and_resolve(REPO / "config.yaml", {"scale": "paper"})
    ids = {r.run_id for r in plan(settings)}
    assert "0.5B-lr-n8-r128-s2" in ids and "0.5B-attnres-n8-r1024-s2" in ids
    assert "0.5B-lr-fullrms-n8-r128-s0" in ids and "0.5B-plr-n16-r32-s0" in ids
    assert {"1B-attnres-n8-r1536-s0", "1B-lr-n8-r384-s0", "4B-attnres-n8-r2560-s0", "4B-lr-n8-r640-s0"} <= ids
    sweep = [r for r in plan(settings) if "sweep" in r.roles]
    assert len(sweep) == 32 and sum(r.method == "attnres" for r in sweep) == 4


def test_malformed_config_stops_before_any_job(shared_copy):
    proc = snakemake(shared_copy, "-n", "--config", "scale=huge", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "scale" in out and "'huge'" in out and "expected one of" in out
    proc = snakemake(shared_copy, "-n", "--config", 'train={"stepz": 3}', check=False)
    assert proc.returncode != 0 and "'stepz'" in proc.stdout + proc.stderr


def test_lint_clean(shared_copy):
    proc = snakemake(shared_copy, "--lint")
    assert "Congratulations" in proc.stdout + proc.stderr


def test_snakefmt_clean():
    files = ["Snakefile", *sorted(str(p.relative_to(REPO)) for p in (REPO / "workflow" / "rules").glob("*.smk"))]
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", *files], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _planned(workdir: Path) -> dict[str, int]:
    return job_counts(snakemake(workdir, "-n", "--config", "scale=smoke").stdout)


@pytest.mark.slow
def test_smoke_dag_end_to_end_and_reruns_follow_code(tmp_path):
    work = copy_repo(tmp_path / "repo")
    t0 = time.time()
    snakemake(work, "reports/paper.html", "--cores", "2", "--config", "scale=smoke")
    elapsed = time.time() - t0
    paper = json.loads((work / "reports" / "paper.json").read_text())
    assert paper["scale"] == "smoke"
    assert {"commit", "config_sha256", "versions", "device", "started", "finished"} <= set(paper["provenance"])
    claims = paper["claims"]
    assert len(claims) >= 300
    verdicts = {"match", "mismatch", "reproduced", "contradicted", "inconclusive", "different scale", "not run"}
    assert all(c["verdict"] in verdicts for c in claims)
    assert paper["problems"] == [], paper["problems"]  # every stage output of the DAG is well formed
    tsv = (work / "reports" / "claims.tsv").read_text().splitlines()
    assert tsv[0].startswith("id\tsource\t") and len(tsv) == len(claims) + 1
    exact = [c for c in claims if c["kind"] == "exact"]
    assert exact and all(c["verdict"] == "match" for c in exact), [c for c in exact if c["verdict"] != "match"]
    for c in claims:
        if c["verdict"] == "not run":
            assert c["note"], c
    html = (work / "reports" / "paper.html").read_text()
    assert not re.search(r"<script[^>]*\ssrc=", html, re.I)  # the filter script is inline: the page works from disk
    print(f"smoke DAG: {elapsed:.1f} s")

    # nothing to do after a complete run
    assert _planned(work) == {}

    # a bare touch of a source file reruns nothing (content checksums, not mtimes)
    os.utime(work / "lrattnres" / "accounting.py")
    assert _planned(work) == {}

    # a real change of one report section reruns the report only
    sec = work / "lrattnres" / "report" / "sections" / "kernel.py"
    sec.write_text(sec.read_text() + "\n# a change\n")
    assert set(_planned(work)) == {"report", "all"}

    # a real change of the accounting module reruns the accounting, the stages that import it (the
    # grid summary uses its FLOP counts, the diagnostics the grid's run list) and the report
    acc = work / "lrattnres" / "accounting.py"
    acc.write_text(acc.read_text() + "\n# a change\n")
    assert set(_planned(work)) == {"accounting", "grid_summary", "diagnostics", "report", "all"}
    snakemake(work, "reports/paper.html", "--cores", "2", "--config", "scale=smoke")

    # a change of the model reruns the training runs and what reads them, not data or accounting
    model = work / "lrattnres" / "model.py"
    model.write_text(model.read_text() + "\n# a change\n")
    planned = _planned(work)
    assert "train" in planned and "accounting" not in planned and "prepare_data" not in planned


def test_shell_scripts_clean():
    """The install script and the conda post-deploy scripts parse and are shfmt-formatted (2 spaces)."""
    import shutil

    files = [REPO / "scripts" / "install.sh", *sorted((REPO / "envs").glob("*.sh"))]
    assert len(files) >= 2
    for f in files:
        proc = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{f}: {proc.stderr}"
    shfmt = shutil.which("shfmt") or shutil.which("shfmt", path=str(Path(sys.executable).parent))
    if shfmt is None:
        pytest.skip("shfmt (installed with snakefmt) not found")
    proc = subprocess.run([shfmt, "-i", "2", "-d", *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
