"""Unit tests of the training recipe: schedule, parameter split, spec validation, loss terms."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lrattnres.train import spec as spec_mod
from lrattnres.train.metrics import grad_norm_summary
from lrattnres.train.optim import build_optimizers, is_adam_param, split_params
from lrattnres.train.schedule import lr_multiplier
from lrattnres.train.val import loss_sums


def test_schedule_shape():
    total, warm = 100, 10
    m = [lr_multiplier(s, total, warm, 0.2) for s in range(total)]
    assert m[0] == pytest.approx(0.1) and m[9] == pytest.approx(1.0)  # linear warmup, never 0
    assert all(a < b for a, b in zip(m[:10], m[1:10]))
    assert all(x == 1.0 for x in m[10:80])  # constant
    assert m[80] == pytest.approx(1.0) and m[99] == pytest.approx(1 / 20)  # linear warmdown over last 20%
    assert all(a > b for a, b in zip(m[80:], m[81:]))
    diffs = [m[i] - m[i + 1] for i in range(80, 99)]
    assert max(diffs) - min(diffs) < 1e-12  # linear
    # a floor, and overlapping warmup/warmdown in very short runs (the smaller factor wins)
    assert lr_multiplier(99, 100, 10, 0.2, final_lr_frac=0.1) == pytest.approx(0.1 + 0.9 / 20)
    assert lr_multiplier(0, 4, 3, 0.5) == pytest.approx(1 / 3)
    assert lr_multiplier(3, 4, 3, 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        lr_multiplier(100, 100, 10, 0.2)


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8, bias=True)])
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.queries = torch.nn.Parameter(torch.zeros(4, 2))
        self.embed_route_key = torch.nn.Linear(4, 2, bias=False)
        self.gain = torch.nn.Parameter(torch.ones(4))


def test_param_grouping_rule():
    model = _Toy()
    muon, adam = split_params(model)
    assert [n for n, _ in muon] == ["layers.0.weight", "layers.1.weight", "embed_route_key.weight"]
    assert sorted(n for n, _ in adam) == sorted(
        ["embed.weight", "layers.0.bias", "layers.1.bias", "head.weight", "queries", "gain"])
    assert is_adam_param("_orig_mod.module.queries", torch.zeros(3, 3))
    assert is_adam_param("module.embed.weight", torch.zeros(3, 3))
    assert not is_adam_param("layers.0.attn.qkv.weight", torch.zeros(3, 3))
    bad = torch.nn.Module()
    bad.w = torch.nn.Parameter(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="'w'"):
        split_params(bad)


def test_param_grouping_on_the_model():
    from lrattnres.model import build_model

    model = build_model({"preset": "smoke", "vocab_size": 50, "method": "lr", "blocks": 2, "rank": 8})
    muon, adam = split_params(model)
    assert {n for n, _ in adam} == {"embed.weight", "head.weight", "queries"}
    assert all(p.ndim == 2 for _, p in muon) and len(muon) == 4 * model.cfg.n_layers
    s = spec_mod.resolve({"model": "smoke", "steps": 1, "micro_batch": 1, "seq_len": 8})
    opts = build_optimizers(model, s["optim"])
    assert isinstance(opts["muon"], torch.optim.Muon) and isinstance(opts["adam"], torch.optim.AdamW)
    g = opts["muon"].param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"]) == (1e-3, 0.95, 0.1)
    g = opts["adam"].param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["weight_decay"]) == (3e-4, (0.9, 0.95), 0.0)


def test_spec_validation_names_the_key():
    base = {"model": {"preset": "tiny", "method": "lr"}, "steps": 10, "micro_batch": 2, "seq_len": 16}
    s = spec_mod.resolve(base)
    assert s["z_loss"] == 1e-5 and s["grad_clip"] == 1.0 and s["schedule"]["warmdown_frac"] == 0.2
    for bad, key in [
        ({"optim": {"muon": {"lrr": 1}}}, "optim.muon.lrr"),
        ({"optim": {"adam": {"betas": [0.9]}}}, "optim.adam.betas"),
        ({"seq_len": 0}, "seq_len"),
        ({"precision": "fp16"}, "precision"),
        ({"val": {"every": -1}}, "val.every"),
        ({"tokens": 5}, "steps"),
        ({"model": {"preset": "tiny", "bogus": 1}}, "model.bogus"),
        ({"bogus": 1}, "bogus"),
    ]:
        with pytest.raises(spec_mod.SpecError, match=key.replace(".", r"\.")):
            spec_mod.resolve({**base, **bad})
    assert spec_mod.total_steps({**s, "steps": None, "tokens": 1000}, world_size=2) == math.ceil(1000 / 64)
    new = spec_mod.resolve({**base, "seed": 3, "device": "cpu"})
    assert spec_mod.diff_keys(s, new) == ["seed"]


def test_zloss_counted_once():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64) * 3
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 0] = -100
    ce_sum, z_sum = loss_sums(logits, targets)
    valid = targets != -100
    lse = logits.logsumexp(-1)
    ref_ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert ce_sum.item() == pytest.approx(ref_ce.item(), rel=1e-6)
    assert z_sum.item() == pytest.approx((lse[valid] ** 2).sum().item(), rel=1e-6)
    # the trainer's loss is ce + coef * mean(lse^2), not ce + 2 * coef * ...: gradient check
    coef, n = 1e-2, valid.sum().item()
    x = logits.clone().requires_grad_(True)
    ce_s, z_s = loss_sums(x, targets)
    ((ce_s + coef * z_s) / n).backward()
    y = logits.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(y.flatten(0, 1), targets.flatten()) + coef * (y.logsumexp(-1)[valid] ** 2).mean()
    ref.backward()
    torch.testing.assert_close(x.grad, y.grad.to(x.grad.dtype), rtol=1e-5, atol=1e-7)


def test_grad_norm_summary():
    s = grad_norm_summary([0.5, 1.5, 2.0, 1.0], 1.0)
    assert s["mean"] == pytest.approx(1.25) and s["above_clip_pct"] == pytest.approx(50.0)
    assert s["var"] == pytest.approx(((0.75 ** 2) + 0.25 ** 2 + 0.75 ** 2 + 0.25 ** 2) / 4)
    assert s["max"] == 2.0 and s["count"] == 4 and "outliers" not in s
    assert grad_norm_summary([], 1.0) == {"mean": None, "var": None, "max": None, "above_clip_pct": None, "count": 0}
    from lrattnres.train.guard import GradGuard

    g = GradGuard(factor=10, window=3, min_history=1)
    g.replay([1.0, 50.0, 2.0])
    s = grad_norm_summary([1.0, 50.0, 2.0], 1.0, g)
    assert s["outliers"] == [{"update": 1, "norm": 50.0, "median": 1.0}] and s["max"] == 50.0
    assert s["guard"] == {"factor": 10.0, "window": 3, "min_history": 1}
    json.dumps(s, allow_nan=False)  # result.json's grad_norm section is plain JSON


def test_muon_matches_torch_muon():
    from lrattnres.train.optim import Muon

    torch.manual_seed(0)
    ws = [torch.randn(8, 5), torch.randn(4, 12)]
    a = [w.clone().requires_grad_(True) for w in ws]
    b = [w.clone().requires_grad_(True) for w in ws]
    kw = dict(lr=1e-2, momentum=0.95, weight_decay=0.1, nesterov=True, ns_steps=5, adjust_lr_fn="original")
    ours, ref = Muon(a, ns_dtype="bf16", **kw), torch.optim.Muon(b, **kw)
    f32 = Muon([w.clone().requires_grad_(True) for w in ws], ns_dtype="fp32", **kw)
    for _ in range(3):
        g = [torch.randn_like(w) for w in ws]
        for ps in (a, b, f32.param_groups[0]["params"]):
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
        ours.step(), ref.step(), f32.step()
    for x, y, z in zip(a, b, f32.param_groups[0]["params"]):
        assert torch.equal(x, y)
        torch.testing.assert_close(z, y, rtol=0, atol=2e-3)  # fp32 iteration: close, not equal
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.zeros(3, requires_grad=True)], lr=1e-3)


def test_fused_loss_matches_plain():
    torch.manual_seed(1)
    logits = (torch.randn(3, 7, 13) * 4).requires_grad_(True)
    targets = torch.randint(0, 13, (3, 7))
    targets[1, 2] = -100
    grads, vals = [], []
    for fused in (True, False):
        logits.grad = None
        ce, z = loss_sums(logits, targets, fused=fused)
        (0.3 * ce + 0.01 * z).backward()
        grads.append(logits.grad.clone())
        vals.append((ce.item(), z.item()))
    assert vals[0] == pytest.approx(vals[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert grads[0][1, 2].abs().max() == 0  # ignored target: no gradient


def test_status_lines_interval_mean_loss_rate_and_eta():
    """One line after the first update, then one per interval with the mean loss and the token rate of
    the updates since the last line, and a last one at close; the ETA from the mean time per update."""
    from lrattnres.train.metrics import StatusLines

    t = [100.0]
    lines = []
    st = StatusLines("run", total_steps=10, start_step=2, every_s=60, say=lines.append, clock=lambda: t[0])
    t[0] += 10
    st.update(3, 4.0, 1000)  # first update of this process: a line at once
    assert lines == ["[train] run: step 3/10 (30.0%), loss 4.0000, 100 tokens/s, elapsed 0:10, eta 1:10"]
    for step, loss in ((4, 3.0), (5, 2.0)):
        t[0] += 25
        st.update(step, loss, 1000)
    assert len(lines) == 1  # 50 s since the last line: not yet
    t[0] += 25
    st.update(6, 1.0, 1000)
    assert lines[-1] == "[train] run: step 6/10 (60.0%), loss 2.0000, 40 tokens/s, elapsed 1:25, eta 1:25"
    st.close()
    assert len(lines) == 2  # nothing since the last line
    t[0] += 5
    st.update(7, 0.5, 1000)
    st.close()
    assert lines[-1].startswith("[train] run: step 7/10 (70.0%), loss 0.5000, 200 tokens/s, elapsed 1:30")


def test_spec_log_every_s_default_and_check():
    from lrattnres.train.spec import RESUMABLE_CHANGES, SpecError, resolve

    base = {"model": "smoke", "steps": 1, "micro_batch": 1, "seq_len": 8}
    assert resolve(base)["log_every_s"] == 60.0
    assert resolve(dict(base, log_every_s=0))["log_every_s"] == 0
    with pytest.raises(SpecError, match="'log_every_s'"):
        resolve(dict(base, log_every_s=-1))
    assert "log_every_s" in RESUMABLE_CHANGES  # how often it prints never blocks a resume
