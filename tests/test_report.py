"""The report stage: assembly, claims bookkeeping, resilience to bad stage data, the recorded report
beside this one, and the page (glance section, claims filter) rendered in headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from markupsafe import escape

from lrattnres import accounting, claims as engine, grid, recorded, report
from lrattnres.config import load_and_resolve
from lrattnres.errors import InputError
from lrattnres.io import atomic_write_json, read_json

PUBLISHED = REPO / "reports" / "published.yaml"


def _loss(run: grid.Run) -> float:
    """Synthetic outcomes with every kind of verdict: low rank helps, AttnRes does worse than the baseline."""
    if run.method == "baseline":
        return 5.0
    base = {"attnres": 5.05, "lr": 4.9, "lr-fullrms": 4.91, "plr": 4.93}[run.method]
    return base + 0.002 * run.seed - (0.1 if run.preset == "tiny-large" else 0.0)


def grid_result(settings: dict, folder: Path, loss=_loss) -> Path:
    """grid.json of synthetic run folders of the scale's plan (result.json and metrics.jsonl each)."""
    dirs = {}
    for run in grid.plan(settings):
        d = folder / "runs" / run.run_id
        d.mkdir(parents=True)
        value = loss(run)
        (d / "result.json").write_text(json.dumps({"stage": "train", "final_val_ce": value, "steps": 4, "tokens": 100}))
        lines = [{"kind": "train", "step": i, "tokens": 10 * i, "grad_norm": 0.5 + i / 10, "ce": 6.0} for i in range(1, 11)]
        lines.append({"kind": "final_val", "step": 10, "tokens": 100, "val_ce": value})
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        dirs[run.run_id] = d
    pub = engine.load_published(PUBLISHED)
    out = folder / "grid.json"
    atomic_write_json(out, {**grid.summarize(settings, dirs, set(pub), pub), "provenance": {"started": "2026-12-01T10:00:00"}})
    return out


def render(tmp: Path, results: list[Path], settings: dict | None = None, root: Path = REPO, extra: tuple = ()) -> int:
    settings = settings or load_and_resolve(REPO / "config.yaml")
    atomic_write_json(tmp / "settings.json", settings)
    return report.main(["--settings", str(tmp / "settings.json"), "--published", str(PUBLISHED),
                        "--recorded", str(REPO / recorded.RECORDED), "--results", *map(str, results), "--html", str(tmp / "paper.html"), "--json",
                        str(tmp / "paper.json"), "--tsv", str(tmp / "claims.tsv"), "--root", str(root), *extra])


@pytest.fixture(scope="module")
def built_report(tmp_path_factory) -> dict[str, Path]:
    """A report of the tiny scale's settings with the accounting stage done and a synthetic training grid."""
    tmp = tmp_path_factory.mktemp("report")
    settings = load_and_resolve(REPO / "config.yaml")
    assert accounting.main(["--spec", json.dumps({"architectures": {"tiny": "tiny", "tiny-large": "tiny-large"},
                                                   "ranks": ["d/8", "d"], "blocks": ["full", 2]}),
                            "--out", str(tmp / "accounting.json")]) == 0
    g = grid_result(settings, tmp)
    assert render(tmp, [tmp / "accounting.json", g], settings) == 0
    return {"html": tmp / "paper.html", "json": tmp / "paper.json", "tsv": tmp / "claims.tsv", "dir": tmp}


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_paper_json_shape_and_not_run_claims(built_report):
    paper = _strict(built_report["json"].read_text())
    assert paper["scale"] == "tiny"
    assert {"commit", "dirty", "config_sha256", "versions", "device", "started", "finished"} <= set(paper["provenance"])
    claims = paper["claims"]
    ids = [c["id"] for c in claims]
    assert len(ids) == len(set(ids)) >= 300
    for c in claims:
        assert set(c) == set(engine.CLAIM_FIELDS)
        assert c["verdict"] in engine.VERDICTS
        if c["kind"] in ("direction", "shape") and c["verdict"] in ("reproduced", "contradicted"):
            assert c["n"] and len(c["interval"]) == 2 and c["interval_kind"] in ("95%", "threshold"), c
            assert ("threshold band" if c["interval_kind"] == "threshold" else "95% interval") in c["note"], c
    exact = [c for c in claims if c["kind"] == "exact"]
    assert exact and all(c["verdict"] == "match" for c in exact)
    table5 = [c for c in claims if c["id"].startswith("table5.added_flops.")]
    assert len(table5) >= 38 and all(c["verdict"] == "match" for c in table5)
    not_run = [c for c in claims if c["verdict"] == "not run"]
    assert not_run, "only the accounting and the grid ran, so most claims are not run"
    # the note names the stage that will produce the claim, why it could not, or the parts not run
    assert all(re.search(r"\b(grid|convert|evaluate|throughput|diagnostics|kernel|stage|scale|all of)\b", c["note"]) for c in not_run)
    verdicts = {c["verdict"] for c in claims}
    assert {"match", "reproduced", "contradicted", "inconclusive", "different scale", "not run"} <= verdicts
    assert paper["problems"] == []
    # the verdict counts, the paper's claims apart from the supplementary ones, as the page's summary counts them
    from collections import Counter

    want = {o: Counter(c["verdict"] for c in claims if (c["origin"] == "paper") == (o == "paper"))
            for o in ("paper", "supplementary")}
    assert paper["verdict_counts"] == {o: dict(v) for o, v in want.items()}
    page = built_report["html"].read_text()
    summary = page[page.index('id="verdict-summary"'):]
    assert f"claims of the paper<b>{sum(want['paper'].values())}</b>" in summary[: summary.index("</div>\n  </div>")]


def test_claims_tsv_is_the_claims_table(built_report):
    import pandas as pd

    frame = pd.read_csv(built_report["tsv"], sep="\t", keep_default_na=False)
    paper = read_json(built_report["json"])
    assert list(frame.columns) == list(report.TSV_COLUMNS)
    assert list(frame["id"]) == [c["id"] for c in paper["claims"]]
    assert list(frame["verdict"]) == [c["verdict"] for c in paper["claims"]]
    row = frame.set_index("id").loc["sec4.2.routed_beat_baseline"]
    claim = next(c for c in paper["claims"] if c["id"] == "sec4.2.routed_beat_baseline")
    assert float(row["interval_lo"]) == pytest.approx(claim["interval"][0]) and int(row["n"]) == claim["n"]


def test_duplicate_claims_are_an_error_or_a_named_problem():
    a = {"_path": "a.json", "stage": "x", "claims": {"c1": {"reproduced": 1}}}
    b = {"_path": "b.json", "stage": "y", "claims": {"c1": {"reproduced": 2}}}
    with pytest.raises(ValueError, match="c1.*a.json.*b.json"):
        report.collect_produced({"x": [a], "y": [b]}, {})
    problems: dict[str, str] = {}
    rec = {"id": "c1", "source": "Table 5", "section": "C.3", "row": {}, "quantity": "q", "kind": "value",
           "published": 1.0, "stage": "grid", "statement": "s"}
    assert report.collect_produced({"x": [a], "y": [b]}, {}, {"c1": rec}, problems) == {}
    assert "a.json" in problems["c1"] and "b.json" in problems["c1"]


def test_result_without_stage_is_rejected_or_listed(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="r.json.*stage"):
        report.load_results([str(bad)])
    junk = tmp_path / "j.json"
    junk.write_text("{not json")
    problems: list[str] = []
    assert report.load_results([str(bad), str(junk)], problems) == {}
    assert "r.json" in problems[0] and "stage" in problems[0] and "j.json" in problems[1] and "not valid JSON" in problems[1]


def test_sections_are_discovered_in_order():
    mods = report.discover_sections()
    names = [report.section_id(m) for m in mods]
    assert names[0] == "glance" and "grid" in names
    # the training results come before the accounting tables
    assert names.index("grid") < names.index("accounting") and names[-1] == "accounting"
    assert all(hasattr(m, "TITLE") for m in mods)


def test_accounting_tables_are_collapsed(built_report):
    page = built_report["html"].read_text()
    sec = page[page.index('<section id="accounting">'):]
    sec = sec[: sec.index("</section>")]
    assert '<details class="collapsed" id="accounting-tables">' in sec and "<details open" not in sec
    assert sec.index("<details") < sec.index("<table")  # every table inside the closed details


def test_malformed_stage_values_leave_their_claims_not_run(tmp_path):
    """One malformed value per kind of fault: the page renders, the claims are "not run" naming the
    file and key, the page lists the problems, paper.json stays strict."""
    settings = load_and_resolve(REPO / "config.yaml")
    g = grid_result(settings, tmp_path)
    data = read_json(g)
    data["claims"]["table5.val_loss.baseline"]["reproduced"] = "5.0x"  # a string
    data["claims"]["sec4.2.routed_beat_baseline"]["samples"] = [0.1, None]  # a null in the evidence
    data["claims"]["sec4.2.best_is_lowrank"]["reproduced"] = float("nan")  # NaN (Python's json writes it)
    data["claims"]["no.such.claim"] = {"reproduced": 1}
    data["runs"][0]["final_val_ce"] = None  # the grid section's table
    data["runs"][1]["final_val_ce"] = "abc"
    g.write_text(json.dumps(data))
    junk = tmp_path / "junk.json"
    junk.write_text('{"stage": "convert", "claims": ')
    nostage = tmp_path / "nostage.json"
    nostage.write_text('{"claims": {}}')
    assert render(tmp_path, [g, junk, nostage], settings) == 0
    paper = _strict((tmp_path / "paper.json").read_text())
    by = {c["id"]: c for c in paper["claims"]}
    for cid, key in (("table5.val_loss.baseline", "reproduced"), ("sec4.2.routed_beat_baseline", "samples"),
                     ("sec4.2.best_is_lowrank", "reproduced")):
        assert by[cid]["verdict"] == "not run", by[cid]
        assert str(g) in by[cid]["note"] and f"claims['{cid}'].{key}" in by[cid]["note"], by[cid]["note"]
    assert by["sec4.4.paired_reduction_all_positive"]["verdict"] != "not run"  # the rest stands
    text = " ".join(paper["problems"])
    assert "no.such.claim" in text and "junk.json" in text and "nostage.json" in text
    assert "runs[0]" in text and "runs[1]" in text and "final_val_ce" in text
    page = (tmp_path / "paper.html").read_text()
    assert 'id="problems"' in page and "junk.json" in page and "Table 5 reproduced" in page


def test_runs_with_gradient_norm_outliers_are_flagged_and_their_claims_say_so(tmp_path):
    """A run whose training recorded gradient-norm outliers: the training section names it above its
    tables and marks it in the run list; the grid's claims that rest on it, and the claims of a later
    stage that read it (the per-run kernel check here), say so in their notes; a stage that did not read it
    (a check of another run's reads) does not."""
    settings = load_and_resolve(REPO / "config.yaml")
    flagged = "tiny-lr-nfull-r8-s0"
    event = {"update": 41, "norm": 5.0e8, "median": 2.5}

    g = grid_result(settings, tmp_path)
    res = tmp_path / "runs" / flagged / "result.json"
    res.write_text(json.dumps({**json.loads(res.read_text()), "grad_norm": {"mean": 1.0, "outliers": [event]}}))
    pub = engine.load_published(PUBLISHED)
    dirs = {run.run_id: tmp_path / "runs" / run.run_id for run in grid.plan(settings)}
    atomic_write_json(g, {**grid.summarize(settings, dirs, set(pub), pub), "provenance": {"started": "2026-12-01T10:00:00"}})
    reads, other = tmp_path / "reads.json", tmp_path / "other.json"  # stages that read trained weights
    atomic_write_json(reads, {"stage": "kernel_reads", "runs": [{"run_id": flagged}, {"run_id": "tiny-baseline-s0"}],
                              "claims": {"appI.trained_reads_bf16_criterion": {"reproduced": True, "note": "16 reads"}}})
    atomic_write_json(other, {"stage": "kernel_reads", "runs": [{"run_id": "tiny-attnres-n4-r64-s0"}],
                              "claims": {"table10.rel_l2_err_pct.1b.fla.r1536.forward": {"reproduced": 1e-3}}})
    assert render(tmp_path, [g, reads, other], settings) == 0
    by = {c["id"]: c for c in _strict((tmp_path / "paper.json").read_text())["claims"]}
    text = f"rests on {flagged}, whose training had 1 gradient-norm outlier, the largest 5e+08 at update 41"
    assert text in by["table5.val_loss.lr.nfull.r128"]["note"]
    assert "rests on" not in by["table5.val_loss.baseline"]["note"]
    assert (f"16 reads; computed from runs that include {flagged} (1 gradient-norm outlier"
            in by["appI.trained_reads_bf16_criterion"]["note"])
    assert "outlier" not in by["table10.rel_l2_err_pct.1b.fla.r1536.forward"]["note"]
    page = (tmp_path / "paper.html").read_text()
    assert "Gradient-norm outliers:</b> 1 run had" in page and f"<code>{flagged}</code>: 1 gradient-norm outlier" in page
    assert "⚠ 1, largest 5e+08 at update 41" in page


def test_a_failing_section_is_contained(tmp_path, monkeypatch):
    from lrattnres.report.sections import kernel

    def boom(ctx):
        raise KeyError("rows")

    monkeypatch.setattr(kernel, "build", boom)
    assert render(tmp_path, []) == 0
    page = (tmp_path / "paper.html").read_text()
    assert "This section could not be drawn" in page and "KeyError" in page and 'id="all-claims"' in page


def test_a_failing_render_keeps_the_older_report(tmp_path, monkeypatch):
    assert render(tmp_path, []) == 0
    before = {p: (tmp_path / p).read_bytes() for p in ("paper.html", "paper.json", "claims.tsv")}

    def broken(*a, **k):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(report, "render", broken)
    with pytest.raises(RuntimeError):
        render(tmp_path, [])
    assert {p: (tmp_path / p).read_bytes() for p in before} == before
    assert not list(tmp_path.glob(".*.tmp"))  # no half-written temporary file left behind


def _recorded_paper(root: Path, **override) -> Path:
    """A synthetic recorded report of the gpu scale (paper.json shape), where reports/recorded.yaml
    names it under ``root``."""
    path = root / recorded.read_list(REPO / recorded.RECORDED)[recorded.REPORT]
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"scale": "gpu", "provenance": {"commit": "0123456789abcdef", "dirty": False, "device": "cuda: NVIDIA H200 x1",
                                          "started": "2026-11-30T20:00:00+00:00", "finished": "2026-12-01T06:30:00+00:00"},
           "claims": [{"id": "sec4.2.routed_beat_baseline", "verdict": "reproduced", "kind": "direction",
                       "reproduced": 0.021, "interval": [0.011, 0.031], "n": 12},
                      {"id": "sec4.4.paired_reduction_all_positive", "verdict": "inconclusive", "kind": "direction",
                       "reproduced": 0.004, "interval": [-0.01, 0.018], "n": 3}]}
    doc.update(override)
    path.write_text(json.dumps(doc))
    return path


def test_recorded_report_column(tmp_path):
    settings = load_and_resolve(REPO / "config.yaml")
    assert recorded.REPORT in recorded.read_list(REPO / recorded.RECORDED)
    path = _recorded_paper(tmp_path)
    assert render(tmp_path, [], settings, root=tmp_path) == 0
    label = "gpu scale, cuda: NVIDIA H200 x1, 01234567, 2026-12-01"
    page = (tmp_path / "paper.html").read_text()
    glance = page[page.index('id="glance-table"'):page.index("</table>", page.index('id="glance-table"'))]
    assert f"recorded: {label}" in glance and "[+0.011, +0.031], n = 12" in glance
    claims_table = page[page.index('id="claims-table"'):]
    assert f"recorded: {label}" in claims_table
    row = claims_table[claims_table.index('id="claim-sec4.4.paired_reduction_all_positive"'):]
    assert "inconclusive" in row[: row.index("</tr>")]
    import pandas as pd

    frame = pd.read_csv(tmp_path / "claims.tsv", sep="\t", keep_default_na=False).set_index("id")
    assert frame.loc["sec4.2.routed_beat_baseline", "recorded_verdict"] == "reproduced"
    assert frame.loc["table5.val_loss.baseline", "recorded_verdict"] == ""
    # absent: no column; not a paper.json: no column, the problem named
    path.unlink()
    assert render(tmp_path, [], settings, root=tmp_path) == 0
    assert "recorded: " not in (tmp_path / "paper.html").read_text()
    assert "recorded_verdict" not in (tmp_path / "claims.tsv").read_text()
    _recorded_paper(tmp_path, claims={"a": 1})
    assert render(tmp_path, [], settings, root=tmp_path) == 0
    paper = read_json(tmp_path / "paper.json")
    assert any("recorded report" in p and "'claims'" in p for p in paper["problems"])
    assert "recorded: " not in (tmp_path / "paper.html").read_text()


def test_recorded_list_is_read_or_refused_naming_file_and_key(tmp_path):
    """reports/recorded.yaml: the repository's names files that exist; a malformed list stops the
    report with the file and the key named."""
    listed = recorded.read_list(REPO / recorded.RECORDED)
    assert {"kernel", "train_step", recorded.REPORT} <= set(listed)
    assert all((REPO / recorded.resolve_path(rel, REPO)).is_file() for name, rel in listed.items()
               if name != recorded.REPORT)
    f = tmp_path / "recorded.yaml"
    f.write_text("")
    assert recorded.read_list(f) == {}
    for text, want in (("kernel: [a, b]\n", "key 'kernel'"), ("- a.json\n", "expected a mapping"),
                       ("kernel: {\n", "not valid YAML")):
        f.write_text(text)
        with pytest.raises(InputError, match=want) as err:
            recorded.read_list(f)
        assert str(f) in str(err.value)


def test_a_bad_recorded_list_is_a_note_on_the_page(tmp_path):
    """A missing or malformed reports/recorded.yaml, a bad entry or a listed file that does not exist
    never stops the report: each is a note on the page and in paper.json naming the file and key."""
    settings = load_and_resolve(REPO / "config.yaml")
    atomic_write_json(tmp_path / "settings.json", settings)
    f = tmp_path / "recorded.yaml"

    def notes(text: str | None) -> list[str]:
        f.unlink(missing_ok=True)
        if text is not None:
            f.write_text(text)
        assert report.main(["--settings", str(tmp_path / "settings.json"), "--published", str(PUBLISHED),
                            "--recorded", str(f), "--html", str(tmp_path / "p.html"), "--json",
                            str(tmp_path / "p.json"), "--root", str(REPO)]) == 0
        paper = read_json(tmp_path / "p.json")
        page = (tmp_path / "p.html").read_text()
        assert paper["problems"] == [] and all(str(escape(n)) in page for n in paper["recorded_notes"])
        return paper["recorded_notes"]

    assert notes(None) == [f"{f}: absent, so no results measured elsewhere are shown (git checkout {f} restores "
                           "the list)"]
    assert "not valid YAML" in notes("kernel: {\n")[0]
    kernel = recorded.read_list(REPO / recorded.RECORDED)["kernel"]
    got = notes(f"kernel: 3\ntrain_step: benchmarks/results/none.json\nkernel2: {kernel}\n")
    assert len(got) == 2 and "key 'kernel': expected a file path" in got[0] and "left out" in got[0]
    assert "recorded result 'train_step': benchmarks/results/none.json does not exist" in got[1]
    assert "record it (benchmarks/README.md" in got[1] and "take the line out of reports/recorded.yaml" in got[1]
    # an absent recorded report: what it means (no column; this run is fine) and what makes it
    (note,) = notes("gpu_report: reports/none.json\n")
    assert note.startswith("recorded report ('gpu_report' in reports/recorded.yaml): reports/none.json does not exist")
    assert "nothing is wrong with this run" in note and "python -m lrattnres piece report --into reports" in note
    assert notes("") == [] and 'id="recorded-notes"' not in (tmp_path / "p.html").read_text()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
]


def _dom(url: str, profile: Path) -> str:
    proc = subprocess.run([_chromium(), *CHROME_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not [line for line in console if "error" in line.lower() or "Uncaught" in line], console
    return proc.stdout


def _rows(dom: str) -> list[tuple[str, bool]]:
    """(claim id, hidden) of every row of the all-claims table in a dumped DOM."""
    body = dom[dom.index('id="claims-table"'):]
    body = body[: body.index("</table>")]
    return [(m.group(1), "hidden" in m.group(0)) for m in re.finditer(r'<tr id="claim-([^"]+)"[^>]*>', body)]


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (scripts/install.sh test installs it)")
def test_page_renders_in_headless_chromium(built_report, tmp_path):
    html = built_report["html"]
    url = html.resolve().as_uri()
    page = _dom(url, tmp_path / "profile")
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
    common = [_chromium(), *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    proc = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2000", url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.stat().st_size > 10_000


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (scripts/install.sh test installs it)")
def test_glance_section_leads_the_page(built_report, tmp_path):
    page = _dom(built_report["html"].resolve().as_uri(), tmp_path / "profile")
    sections = re.findall(r'<section id="([^"]+)"', page)
    assert sections[0] == "glance" and sections.index("grid") < sections.index("accounting")
    glance = page[page.index('<section id="glance">'):]
    glance = glance[: glance.index("</section>")]
    assert "<h2>Results at a glance</h2>" in glance
    rows = re.findall(r'<tr data-claim="([^"]+)">(.*?)</tr>', glance, re.S)
    published = engine.load_published(PUBLISHED)
    assert [cid for cid, _ in rows] == [cid for cid, r in published.items() if "glance" in r]
    assert 10 <= len(rows) <= 14
    paper = {c["id"]: c for c in read_json(built_report["json"])["claims"]}
    for cid, cells in rows:
        tds = re.findall(r"<td>(.*?)</td>", cells, re.S)
        assert len(tds) == 5, cid  # conclusion, paper location, published, reproduced, verdict
        assert f">{paper[cid]['verdict']}</span>" in tds[4], (cid, tds[4])
        links = re.findall(r'href="#([^"]+)"', tds[0])
        assert f"claim-{cid}" in links and all(f'id="{a}"' in page for a in links), (cid, links)
        iv, kind = paper[cid]["interval"], paper[cid]["interval_kind"]
        if iv and iv[0] == iv[1]:
            assert "no spread" in tds[3] and "interval" not in tds[3], (cid, tds[3])
        elif iv and kind == "threshold":  # a single run's band is no 95% interval
            assert "threshold band [" in tds[3] and "95%" not in tds[3], (cid, tds[3])
        elif iv:
            assert "95% interval [" in tds[3] and f"n = {paper[cid]['n']}" in tds[3], (cid, tds[3])
        if paper[cid]["verdict"] != "not run":  # where the value was measured
            assert "this run (tiny scale)" in tds[3] or "recorded on " in tds[3], (cid, tds[3])
        if paper[cid]["verdict"] == "inconclusive" and paper[cid]["unresolved"]:
            assert str(escape(paper[cid]["unresolved"])) in tds[4], (cid, tds[4])
    # a statistical verdict of the synthetic grid shows its interval in the glance
    assert paper["sec4.2.routed_beat_baseline"]["verdict"] == "contradicted"


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (scripts/install.sh test installs it)")
def test_claims_filter_works_from_disk(built_report, tmp_path):
    """The inline filter, driven from disk: choosing values hides the other rows and counts the rest;
    the choice can come from the address too."""
    paper = read_json(built_report["json"])["claims"]
    rows = _rows(_dom(built_report["html"].resolve().as_uri(), tmp_path / "p0"))
    assert len(rows) == len(paper) and not any(hidden for _, hidden in rows)

    def chosen(verdict="", kind="", section=""):
        return [c["id"] for c in paper if (not verdict or c["verdict"] == verdict) and (not kind or c["kind"] == kind)
                and (not section or c["section"] == section)]

    # the user's way: change the selects; a script appended to a copy of the page does it
    drive = built_report["dir"] / "driven.html"
    script = """<script>
      function pick(k, v) { var s = document.querySelector('select[data-filter="' + k + '"]');
        s.value = v; s.dispatchEvent(new Event('change')); }
      pick('kind', 'direction'); pick('verdict', 'inconclusive');
    </script></body>"""
    drive.write_text(built_report["html"].read_text().replace("</body>", script))
    dom = _dom(drive.resolve().as_uri(), tmp_path / "p1")
    visible = [cid for cid, hidden in _rows(dom) if not hidden]
    want = chosen("inconclusive", "direction")
    assert want and visible == want
    assert f'<b id="claims-shown">{len(want)}</b>' in dom
    # from the address
    dom = _dom(built_report["html"].resolve().as_uri() + "?section=C.3&kind=shape", tmp_path / "p2")
    visible = [cid for cid, hidden in _rows(dom) if not hidden]
    assert visible == chosen(kind="shape", section="C.3") and visible


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
    """The recorded kernel table gains the flushed-L2 graph columns when the rows carry them (newer
    recordings have them) and keeps its old columns for older files; rows with per-kernel GPU times
    get a table of where the time goes."""
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


def test_intervals_say_what_they_are_and_unresolved_verdicts_say_why():
    from lrattnres.report.html import fmt_interval, verdict_cell

    assert fmt_interval([-0.5, 1.5], 4, "95%") == "95% interval [-0.5, +1.5], n = 4"
    band = fmt_interval([-10.0, 10.0], 1, "threshold")
    assert band.startswith("threshold band [-10, +10]") and "95%" not in band and "interval" not in band
    flat = fmt_interval([0.0, 0.0], 32, "95%")
    assert flat == "no spread: every value +0, n = 32" and "[" not in flat
    assert fmt_interval(None, 3) == "n = 3" and fmt_interval([1, 2], 5) == "[+1, +2], n = 5"  # a claim that does not say
    why = "2 routing settings: fewer than 3 to resolve an effect"
    cell = verdict_cell({"verdict": "inconclusive", "unresolved": why})
    assert ">inconclusive</span>" in cell and why in cell
    assert why not in verdict_cell({"verdict": "contradicted", "unresolved": why})
    # the claims engine marks both: two routing settings cannot resolve, whichever side they lie on
    rec = {"id": "x", "kind": "direction", "published": 0.01, "quantity": "q", "stage": "grid"}
    out = engine.judge(rec, {"reproduced": -0.02, "samples": [-0.021, -0.019], "unit": "routing settings"}, "tiny")
    assert out["verdict"] == "inconclusive" and out["interval"][1] < 0 and out["interval_kind"] == "95%"
    assert out["unresolved"] == why
    single = engine.judge(dict(rec, threshold=0.005), {"reproduced": 0.02}, "tiny")
    assert single["verdict"] == "reproduced" and single["interval_kind"] == "threshold" and single["unresolved"] is None
    assert "threshold band [" in single["note"] and "95% interval" not in single["note"]


def test_the_glance_says_where_a_value_comes_from_and_what_stands_for_a_row_not_run():
    from lrattnres.report.context import ReportContext
    from lrattnres.report.sections import glance

    pub = {"table2.err.0.5b.n8": {"source": "Table 2", "quantity": "fp64_max_logit_err", "kind": "invariant"}}
    claims = {"table2.err.0.5b.n8": {"id": "table2.err.0.5b.n8", "verdict": "not run", "source": "Table 2",
                                      "quantity": "fp64_max_logit_err", "kind": "invariant"},
              "table2.err.0.5b.nfull": {"id": "table2.err.0.5b.nfull", "verdict": "match", "reproduced": 7.4e-14,
                                         "source": "Table 2", "quantity": "fp64_max_logit_err", "kind": "invariant"},
              "sec4.9.gain": {"id": "sec4.9.gain", "verdict": "mismatch", "reproduced": 1.0, "published": 2.0,
                              "note": "off", "source": "Section 4.9", "quantity": "q", "kind": "exact"}}
    ctx = ReportContext(scale="tiny", published=pub, claims=claims,
                        recorded={"throughput_gpu_1b": {"_path": "benchmarks/results/t.json", "claims": {"sec4.9.gain": {}},
                                                        "provenance": {"device": "cuda: NVIDIA H200"}}})
    assert glance.source(ctx, "table2.err.0.5b.nfull") == "this run (tiny scale)"
    assert glance.source(ctx, "sec4.9.gain") == "recorded on cuda: NVIDIA H200: benchmarks/results/t.json"
    cell = glance._reproduced(ctx, "table2.err.0.5b.n8", pub["table2.err.0.5b.n8"], claims["table2.err.0.5b.n8"])
    assert "no run of this row at the tiny scale" in cell and "nfull: 7.400e-14 (match)" in cell
    listed = glance.mismatches(ctx)
    assert "1 claim does not match" in listed and "claim-sec4.9.gain" in listed and "recorded on cuda" in listed
    ctx.claims = {"table2.err.0.5b.nfull": claims["table2.err.0.5b.nfull"]}
    assert "No claim mismatches." in glance.mismatches(ctx)

