"""The evaluate report section renders Table 8 and Table 1 beside the published numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = ROOT / "reports" / "published.yaml"


def _result(method: str, claim_size: str, mean_shift: float) -> dict:
    from lrattnres.evaluate.claims import published_ids, task_claims
    from lrattnres.evaluate.tasks import TASK_NAMES

    tasks = {t: {"metric": "acc", "value": 30.0 + i + mean_shift, "n": 20} for i, t in enumerate(TASK_NAMES)}
    r = {"stage": "evaluate", "run_id": f"tiny-{method}-n4-r16-s0", "size": "tiny", "method": method,
         "claim_size": claim_size, "limit": 20, "seed": 0, "tasks": tasks,
         "mean": sum(v["value"] for v in tasks.values()) / len(tasks), "requests_per_s": 12.5,
         "lm_eval_version": "0.4.13", "_path": f"{method}.json"}
    r["claims"] = task_claims(r, published_ids(PUBLISHED))
    return r


def _ctx(results, scale="tiny"):
    from lrattnres import claims as engine
    from lrattnres.evaluate.claims import pair_claims
    from lrattnres.report.context import ReportContext

    published = engine.load_published(PUBLISHED)
    produced = {cid: c for r in results for cid, c in r.get("claims", {}).items()}
    produced.update(pair_claims(results, set(published)))
    claims = engine.evaluate_claims(published, produced, scale)
    return ReportContext(scale=scale, published=published, claims={c["id"]: c for c in claims},
                         by_stage={"evaluate": results} if results else {})


def test_section_with_results():
    if not PUBLISHED.exists():
        pytest.skip("reports/published.yaml not present")
    from lrattnres.report.sections import evaluate as sec

    results = [_result("attnres", "1b", 0.0), _result("lr", "1b", 1.0)]
    assert "table8.acc.1b.lr.piqa" in results[1]["claims"]
    html = sec.build(_ctx(results))
    assert sec.ORDER == 60 and sec.TITLE
    assert "Table 8" in html and "28.58" in html and "42.27" in html  # published beside reproduced
    assert "tiny-lr-n4-r16-s0" in html
    assert "different scale" in html
    assert "+1.00" in html  # the 1B pair's gain
    assert "sec4.5.lr_higher_acc.1b" in html


def test_section_without_results():
    if not PUBLISHED.exists():
        pytest.skip("reports/published.yaml not present")
    from lrattnres.report.sections import evaluate as sec

    html = sec.build(_ctx([]))
    assert "has not run" in html and "41.87" in html and "not run" in html
