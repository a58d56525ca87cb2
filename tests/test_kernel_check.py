"""The kernel-check stage: the four-number example and the elementwise criterion, and that they fail
for a wrong operator."""

from __future__ import annotations

import pytest
import torch

from lrattnres.kernel_check import compare, four_number_example, validate_spec
from lrattnres.routing import route


def test_four_number_example_holds_for_the_reference():
    assert four_number_example(lambda s, q: route(s, q, norm="slice", eps=0.0)) < 1e-12


def test_four_number_example_catches_a_wrong_operator():
    # full-width normalisation is a different function: the example must notice
    assert four_number_example(lambda s, q: route(s, q, norm="full", eps=0.0)) > 0.1


def test_compare_reference_with_itself_passes_and_a_bad_gradient_fails():
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(8, 24, generator=gen) for _ in range(4)]
    query = torch.randn(6, generator=gen)
    ok = compare(route, sources, query, "slice")
    assert ok["finite"] and ok["criterion_max"] < 1e-4 and ok["rel_query_grad"] < 1e-5

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, *srcs):
            return route(list(srcs), q).detach()

        @staticmethod
        def backward(ctx, g):
            return (None, *[2 * g for _ in range(ctx.needs_input_grad.__len__() - 1)])

    def wrong(srcs, q, norm, eps):
        return Wrong.apply(q, *srcs)

    bad = compare(wrong, sources, query, "slice")
    assert bad["criterion_max"] > 1 or not bad["finite"]


def test_spec_errors_name_the_key():
    with pytest.raises(ValueError, match="'casez'"):
        validate_spec({"casez": []})
    with pytest.raises(ValueError, match=r"cases\[0\]"):
        validate_spec({"cases": [{"d": 8}]})
    with pytest.raises(ValueError, match="norm"):
        validate_spec({"cases": [{"d": 8, "r": "d", "S": 2, "tokens": 4, "norm": "rms"}]})


# ------------------------------------------------------------------ Appendix I on a trained model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke LR-AttnRes model trained a few updates on a small corpus, and its data manifest."""
    import json
    import random

    from lrattnres.data import prepare
    from lrattnres.train.loop import train

    d = tmp_path_factory.mktemp("reads")
    rng = random.Random(0)
    words = "the of and to in is that for it as was with be by on not routing depth query key value".split()
    with open(d / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 80)))}) + "\n")
    prepare({"source": "local", "local": {"glob": str(d / "docs.jsonl")}, "val_tokens": 1500, "shard_tokens": 20000,
             "vocab": "compact"}, d / "data", progress=False)
    manifest = str(d / "data" / "manifest.json")
    spec = {"model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}, "seed": 0, "steps": 8,
            "micro_batch": 4, "seq_len": 32, "schedule": {"warmup_steps": 1}, "val": {"final": False},
            "device": "cpu", "optim": {"adam": {"lr": 0.01}}}
    train(spec, manifest, d / "run", progress=False)
    return d / "run" / "model.safetensors", manifest


def test_every_read_of_a_trained_model_passes_with_loss_derived_gradients(trained):
    from lrattnres.kernel_reads import run

    checkpoint, manifest = trained
    r = run(str(checkpoint), manifest, {})
    assert r["stage"] == "kernel_reads" and r["run_id"] == "run" and r["tokens"] == 32
    assert len(r["reads"]) == 4 == 2 * 2  # one read after each of the 2L writes
    assert [x["S"] for x in r["reads"]] == [2, 2, 3, 3]  # N = 2 blocks: the embedding, block sums, the partial sum
    assert r["passed"] == 4 and r["criterion_max"] <= 1.0 and all(x["finite"] for x in r["reads"])
    assert r["rel_err_pct_max"]["forward"] < 1e-3  # fp32 through the interpreter: agreement to rounding


def test_captured_reads_carry_the_models_inputs_and_gradients(trained):
    from lrattnres.data import iter_eval_batches, load_manifest
    from lrattnres.kernel_reads import capture_reads
    from lrattnres.train.checkpoint import load_model

    checkpoint, manifest = trained
    model, _ = load_model(checkpoint)
    b = next(iter(iter_eval_batches(load_manifest(manifest), "val", 1, 32)))
    reads = capture_reads(model, b.inputs, b.targets, b.doc_ids, "fp32")
    assert len(reads) == 4 and "_fused_router" not in vars(model)  # the model's own router is back
    assert all(float(r["grad"].abs().sum()) > 0 for r in reads)
    assert any(float(r["query"].abs().sum()) > 0 for r in reads)  # trained: the queries left zero
    torch.testing.assert_close(reads[0]["sources"][0], model.embed(b.inputs))


def test_a_wrong_kernel_fails_the_trained_check(trained, monkeypatch):
    import kernels
    from lrattnres import kernel_reads

    def off(sources, query, *, norm="slice", eps=1e-6):
        return route(sources, query, norm=norm, eps=eps) + 0.2  # off by more than the criterion allows

    monkeypatch.setattr(kernels, "attnres_triton", off)
    r = kernel_reads.run(str(trained[0]), trained[1], {})
    assert r["passed"] < len(r["reads"]) and r["criterion_max"] > 1.0


def test_trained_reads_become_appendix_i_and_table_10_claims(trained, tmp_path):
    import json

    from lrattnres.kernel_reads import main

    checkpoint, manifest = trained
    one = tmp_path / "run.json"
    assert main(["--checkpoint", str(checkpoint), "--data", manifest, "--out", str(one)]) == 0
    res = json.loads(one.read_text())
    attn = dict(res, run_id="other", r=32, d=32)  # stands for the size pair's AttnRes (r = d)
    (tmp_path / "other.json").write_text(json.dumps(attn))
    out = tmp_path / "all.json"
    sizes = json.dumps({"run": "1b", "other": "4b"})
    published = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "reports" / "published.yaml")
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"scale": "smoke", "paper_runs": False}))
    assert main(["--aggregate", str(one), str(tmp_path / "other.json"), "--sizes", sizes, "--settings", str(settings),
                 "--published", published, "--out", str(out)]) == 0
    c = json.loads(out.read_text())["claims"]
    assert c["appI.trained_reads_bf16_criterion"]["reproduced"] <= 1.0
    assert "8 of 8 reads" in c["appI.trained_reads_bf16_criterion"]["note"]
    assert c["appI.trained_reads_bf16_criterion"]["note"].endswith("; smoke scale: the size pair's trained models")
    # r = d/4 at 1B is Table 10's r = 384; r = d at 4B its r = 2560
    assert set(c) >= {f"table10.rel_l2_err_pct.1b.fast.r384.{o}" for o in ("forward", "source_grad", "query_grad")}
    assert "table10.rel_l2_err_pct.4b.fast.r2560.forward" in c
    assert c["table10.rel_l2_err_pct.1b.fast.r384.forward"]["reproduced"] == res["rel_err_pct_max"]["forward"]
