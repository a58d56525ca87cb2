"""The compiled training step against the eager one, gradient by gradient (lrattnres/compiled_grads.py).

Same weights, same batch with several documents per row, every parameter's gradient against an fp64
reference: the compiled step's error must be within FACTOR (4) times the eager step's own error in
the same precision, plus a floor (fp32 1e-5, bf16 2e-3). On CUDA for every method, every attention
backend this machine has (sdpa, flex; flash where installed) and fp32 and bf16, at initialisation
and after a few updates at a high learning rate, one compile per configuration. On the CPU the same
harness runs on a tiny model with masked SDPA (compiled through dynamo and AOTAutograd), so CI
exercises it, and a deliberately corrupted gradient shows that the check can fail.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lrattnres import compiled_grads as cg
from lrattnres.model import build_model

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _check(method: str, attention: str, precision: str, device: torch.device, shape: dict, batch: dict,
           backend: str = "inductor") -> dict:
    """Build the model, measure at initialisation and after the weights moved (the same compiled step
    both times); returns both measurements, and the model, batches and compiled step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cg.model_spec(method, attention, shape))
    batches = cg.document_batches(2, batch["micro_batch"], batch["seq_len"], shape["vocab_size"], batch["mean_doc"], seed=1)
    at_init = cg.measure(model, batches, device, precision, backend=backend)
    cg.move_weights(model, cg.document_batches(3, batch["micro_batch"], batch["seq_len"], shape["vocab_size"],
                                               batch["mean_doc"], seed=2), device)
    moved = cg.measure(model, batches, device, precision, fwd_compiled=at_init["fwd_compiled"])
    return {"init": at_init, "moved": moved, "model": model, "batches": batches}


def _gpu_cases():
    backends = ["sdpa", "flex"] + (["flash"] if importlib.util.find_spec("flash_attn") else [])
    for method in cg.METHODS:
        for attention in backends:
            for precision in ("fp32", "bf16"):
                if attention == "flash" and precision == "fp32":
                    continue  # flash-attn runs in fp16/bf16 only
                yield pytest.param(method, attention, precision, id=f"{method}-{attention}-{precision}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method,attention,precision", list(_gpu_cases()))
def test_compiled_step_gradients_match_eager_gpu(method, attention, precision):
    out = _check(method, attention, precision, torch.device("cuda"), cg.GPU_SHAPE,
                 {"micro_batch": 2, "seq_len": 512, "mean_doc": 150.0})
    checks = {when: out[when] for when in ("init", "moved")}
    failures = [f"{when}: {line}" for when, res in checks.items() for line in cg.judge(res["params"], precision)]
    norms = {when: (res["eager"]["norm"], res["compiled"]["norm"], res["reference"]["norm"]) for when, res in checks.items()}
    assert not failures, f"gradient norms (eager, compiled, fp64) {norms}:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def cpu_check():
    """The harness on the CPU: LR-AttnRes, masked SDPA, fp32, compiled through dynamo and AOTAutograd
    (backend aot_eager: the captured, decomposed forward and backward graphs with eager kernels; the
    kernels Inductor generates are held to the eager step on the GPU above, since compiling them on
    the CPU takes over a minute on 2 cores)."""
    return _check("lr", "sdpa", "fp32", torch.device("cpu"), cg.CPU_SHAPE,
                  {"micro_batch": 2, "seq_len": 64, "mean_doc": 20.0}, backend="aot_eager")


def test_compiled_step_gradients_match_eager_cpu(cpu_check):
    for when in ("init", "moved"):
        res = cpu_check[when]
        assert res["params"] and set(res["params"]) >= {"queries", "embed.weight", "head.weight"}, when
        assert cg.judge(res["params"], "fp32") == [], when
        # the eager fp32 step itself is close to fp64, and both steps see the same loss
        assert max(e["eager"] for e in res["params"].values()) < 1e-4, when
        assert res["compiled"]["ce"] == pytest.approx(res["eager"]["ce"], rel=1e-5), when
        assert res["reference"]["ce"] == pytest.approx(res["eager"]["ce"], rel=1e-5), when
    # the weights moved: the routing queries left zero, and the gradients changed
    assert cpu_check["init"]["reference"]["norm"] != pytest.approx(cpu_check["moved"]["reference"]["norm"], rel=1e-3)


@pytest.mark.parametrize("name,how", [("layers.0.attn.qkv.weight", "scale"), ("queries", "zero")])
def test_a_corrupted_gradient_fails_the_check(cpu_check, name, how):
    """The compiled step that passes above, run again (no new compile) with one parameter's gradient
    off by 1% or zeroed before the comparison: the check fails and names that parameter alone."""
    def tamper(grads):
        grads[name] = grads[name] * 1.01 if how == "scale" else torch.zeros_like(grads[name])

    res = cg.measure(cpu_check["model"], cpu_check["batches"], torch.device("cpu"), "fp32",
                     fwd_compiled=cpu_check["init"]["fwd_compiled"], tamper=tamper)
    failures = cg.judge(res["params"], "fp32")
    assert [f.split(":")[0] for f in failures] == [name], failures
    assert res["params"][name]["compiled"] == pytest.approx(0.01 if how == "scale" else 1.0, rel=0.05)


def test_document_batches_pack_several_documents_per_row():
    bs = cg.document_batches(3, 4, 64, 100, mean_doc=1000.0, seed=0)  # long documents: the minimum applies
    for b in bs:
        assert b.inputs.shape == (4, 64) and b.doc_ids.shape == (4, 64)
        assert (b.doc_ids[:, -1] >= 2).all()  # at least three documents in every row
        assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
