"""The report stage: assembly, claims bookkeeping, and the page rendered in headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from lrattnres import accounting, report
from lrattnres.config import load_and_resolve
from lrattnres.io import atomic_write_json, read_json


@pytest.fixture(scope="module")
def built_report(tmp_path_factory) -> dict[str, Path]:
    """A report of the tiny scale's settings with the accounting stage done (as after a fresh install)."""
    tmp = tmp_path_factory.mktemp("report")
    settings = load_and_resolve(REPO / "config.yaml")
    atomic_write_json(tmp / "settings.json", settings)
    assert accounting.main(["--spec", json.dumps({"architectures": {"tiny": "tiny", "tiny-large": "tiny-large"},
                                                   "ranks": ["d/8", "d"], "blocks": ["full", 2]}),
                            "--out", str(tmp / "accounting.json")]) == 0
    html, js = tmp / "paper.html", tmp / "paper.json"
    rc = report.main(["--settings", str(tmp / "settings.json"), "--published", str(REPO / "reports" / "published.yaml"),
                      "--results", str(tmp / "accounting.json"), "--html", str(html), "--json", str(js), "--root", str(REPO)])
    assert rc == 0
    return {"html": html, "json": js, "dir": tmp}


def test_paper_json_shape_and_not_run_claims(built_report):
    paper = read_json(built_report["json"])
    assert paper["scale"] == "tiny"
    assert {"commit", "dirty", "config_sha256", "versions", "device", "started", "finished"} <= set(paper["provenance"])
    claims = paper["claims"]
    ids = [c["id"] for c in claims]
    assert len(ids) == len(set(ids)) >= 300
    for c in claims:
        assert set(c) >= {"id", "source", "row", "quantity", "kind", "published", "reproduced", "verdict", "note"}
    exact = [c for c in claims if c["kind"] == "exact"]
    assert exact and all(c["verdict"] == "match" for c in exact)
    table5 = [c for c in claims if c["id"].startswith("table5.added_flops.")]
    assert len(table5) >= 38 and all(c["verdict"] == "match" for c in table5)
    not_run = [c for c in claims if c["verdict"] == "not run"]
    assert not_run, "only the accounting ran, so most claims are not run"
    # the note names the stage that will produce the claim
    assert all(re.search(r"\b(grid|convert|evaluate|throughput|diagnostics|kernel|stage)\b", c["note"]) for c in not_run)


def test_duplicate_claims_are_an_error():
    a = {"_path": "a.json", "stage": "x", "claims": {"c1": {"reproduced": 1}}}
    b = {"_path": "b.json", "stage": "y", "claims": {"c1": {"reproduced": 2}}}
    with pytest.raises(ValueError, match="c1.*a.json.*b.json"):
        report.collect_produced({"x": [a], "y": [b]}, {})


def test_result_without_stage_is_rejected(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="r.json.*stage"):
        report.load_results([str(bad)])


def test_sections_are_discovered_in_order():
    mods = report.discover_sections()
    names = [report.section_id(m) for m in mods]
    assert names[0] == "accounting" and "grid" in names
    assert all(hasattr(m, "TITLE") for m in mods)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
]


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (scripts/install.sh test installs it)")
def test_page_renders_in_headless_chromium(built_report, tmp_path):
    html = built_report["html"]
    url = html.resolve().as_uri()
    common = [_chromium(), *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not [line for line in console if "error" in line.lower() or "Uncaught" in line], console
    page = dom.stdout
    assert "Low-Rank Attention Residuals: replication report" in page
    # every section the contents list names is on the page, and so are the claims and provenance
    for anchor in re.findall(r'<a href="#([^"]+)">', page):
        assert f'id="{anchor}"' in page, anchor
    assert page.count('<section id="') >= 3
    # every figure is an inline PNG that decodes
    for src in re.findall(r'<img[^>]+src="([^"]+)"', page):
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    # Table 5's added-FLOPs column is shown with its verdicts
    assert "Table 5" in page and "match" in page
    shot = tmp_path / "page.png"
    proc = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2000", url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.stat().st_size > 10_000


def test_recorded_train_step_table():
    """The training-step benchmark recorded on a GPU: rows, ratio to the baseline and the goal line."""
    from lrattnres.report.sections.throughput import train_step_table

    doc = {"benchmark": "train_step", "device": "GPU X", "date": "2026-01-01", "git": {"commit": "abc"},
           "settings": {"preset": "1B", "micro_batch": 2, "seq_len": 2048, "grad_accum": 8, "updates": 5, "warmup": 2},
           "rows": [{"config": "baseline", "router": None, "rank": None, "tokens_per_s": 1000.0, "vs_baseline": 1.0,
                     "update_s_mean": 1.0, "update_s_cv": 0.01, "peak_allocated_gib": 2.0},
                    {"config": "lr-fused", "router": "fused", "rank": 4, "tokens_per_s": 850.0, "vs_baseline": 0.85,
                     "update_s_mean": 1.2, "update_s_cv": 0.02, "peak_allocated_gib": 2.1},
                    {"config": "lr-ref", "error": "RuntimeError: boom"}],
           "goal": {"met": False, "lr_fused_vs_baseline": 0.85, "lr_fused_tokens_per_s": 850.0},
           "skipped": [{"config": "attnres-ref", "why": "budget"}]}
    html = train_step_table(doc)
    assert "85.0%" in html and "Goal missed" in html and "attnres-ref" in html and "boom" in html


def test_recorded_gpu_grid_runs():
    from types import SimpleNamespace

    from lrattnres.report.sections.grid import _recorded_runs

    run = {"steps": 10, "tokens": 1000, "final_val_ce": 5.25, "tokens_per_s": 123.0, "train_s": 4.0,
           "memory": {"cuda_max_allocated_mib": 2048}, "provenance": {"device": "cuda: GPU X", "finished": "t"}}
    html = _recorded_runs(SimpleNamespace(recorded={"gpu_grid": {"_path": "x.json", "runs": {"r0": run}}}))
    assert "r0" in html and "5.2500" in html and "2.0" in html and "x.json" in html
    assert "Read with care" not in html and "<img" not in html  # no epoch count, no curve: neither is shown
    assert _recorded_runs(SimpleNamespace(recorded={})) == ""

    # a baseline and a routed run past one epoch, with curves, and a run cut off by the deadline
    curve = [{"step": 5, "tokens": 500, "ce": 6.0}, {"step": 10, "tokens": 1000, "ce": 5.5}]
    base = dict(run, final_val_ce=5.5, method="baseline", data_epochs=3.2, train_split_tokens=312, val_curve=curve)
    routed = dict(run, final_val_ce=5.25, method="lr", data_epochs=3.2, val_curve=curve)
    rec = {"_path": "x.json", "runs": {"b": base, "l": routed},
           "incomplete": {"cut": {"last_step": 7, "steps_planned": 10}}}
    html = _recorded_runs(SimpleNamespace(recorded={"gpu_grid": rec}))
    assert "-0.2500" in html  # the routed run's distance from the baseline
    assert "Read with care" in html and "3.2 times" in html
    assert "cut" in html and "update 7 of 10" in html
    assert "<img" in html and "figure-gpu-recorded" in html


def test_kernel_section_shows_cold_graph_timings_only_when_recorded():
    """The recorded kernel table gains the flushed-L2 graph columns when the rows carry them (runs
    since the ninth session) and keeps its old columns for older files; rows with per-kernel GPU times
    (twelfth session) get a table of where the time goes."""
    from lrattnres.report.context import ReportContext
    from lrattnres.report.sections import kernel as section

    row = {"tokens": 8192, "d": 1536, "S": 2, "r": 384, "impl": "ours", "fwd_us": 54.0, "fwd_pct": 33.0,
           "fwdbwd_us": 627.0, "fwdbwd_pct": 8.0, "fwd_graph_us": 34.0, "fwd_graph_pct": 52.0,
           "fwdbwd_graph_us": 102.0, "fwdbwd_graph_pct": 46.0}
    bench = {"env": {"device": "GPU X"}, "copy_bw_TBps": 4.27, "rows": [row], "_path": "k.json"}
    ctx = ReportContext(scale="smoke", published={}, claims={}, recorded={"kernel": bench})
    assert "cold graph" not in section.build(ctx)
    bench["rows"] = [dict(row, fwd_graph_cold_us=29.5, fwdbwd_graph_cold_us=97.25, fwdbwd_graph_cold_pct=48.5)]
    html = section.build(ctx)
    assert "cold graph fwd+bwd µs" in html and "97.25" in html and "flushed before each" in html
    assert "Where the time goes" not in html
    bench["rows"] = [dict(row, kernels_fwdbwd_us={"_attnres_bwd_kernel": 41.73, "_sum_rows_kernel": 3.82})]
    html = section.build(ctx)
    assert "Where the time goes" in html and "_attnres_bwd_kernel 41.7; _sum_rows_kernel 3.8" in html
    bench["rows"] = [row, dict(row, impl="compiled", from_run="k_v14.json")]  # a reference kept from an earlier run
    assert "compiled (from k_v14.json)" in section.build(ctx)

