"""The compiled training step's gradients against the eager step's, both against an fp64 reference.

A compiled or fused path is right only when its gradients match the eager reference's (DESIGN.md).
The tolerance comes from the arithmetic, not a guess: the eager step in the same precision (fp32, or
bf16 autocast) is the reference implementation, and its error against the same weights and batch in
fp64 measures what that precision costs, parameter by parameter.  The compiled step passes when
every parameter's gradient error (relative L2 against fp64) is at most :data:`FACTOR` times the
eager step's plus a small floor (:data:`FLOOR`: the eager error of a parameter can be small by
chance).  The fault this catches is not subtle: the compiled flex path gave gradient norms 1e8 times
the eager ones (docs/attention.md).

Both steps are the trainer's (``LossModule`` under ``torch.compile(dynamic=False)`` or not,
``accumulate_gradients`` over micro-batches with several documents per row); the fp64 reference is
the same weights in fp64 with the reference router and masked SDPA, its loss summed in fp64.  Checks
run at initialisation and after the weights have moved (:func:`move_weights`: a few updates at a
high learning rate), reusing one compiled step.  Used by tests/test_gpu_model_grads.py and
benchmarks/compiled_grad_probe.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lrattnres.attention import resolve_backend
from lrattnres.data.loader import batch_from_rows
from lrattnres.model import build_model
from lrattnres.train.loop import LossModule, accumulate_gradients, apply_update
from lrattnres.train.optim import build_optimizers
from lrattnres.train.spec import DEFAULTS
from lrattnres.train.val import IGNORE_INDEX

# compiled error <= FACTOR x eager error + FLOOR[precision], per parameter (relative L2 against fp64)
FACTOR = 4.0
FLOOR = {"fp32": 1e-5, "bf16": 2e-3}
Z_LOSS = 1e-5  # the recipe's z-loss coefficient (config.yaml, base.recipe)

# A small model of the gpu scale's head width (64), two layers, sequences of four flex blocks.
GPU_SHAPE = dict(n_layers=2, d_model=128, n_heads=2, d_ff=352, max_seq_len=512, vocab_size=512)
# The CPU's: the smoke preset's width, 64 tokens.
CPU_SHAPE = dict(n_layers=2, d_model=32, n_heads=2, d_ff=88, max_seq_len=64, vocab_size=128)
METHODS = ("baseline", "attnres", "lr", "lr-fullrms", "plr")


def model_spec(method: str, attention: str, shape: dict, **over) -> dict:
    """A model dict for ``lrattnres.model.build_model``: ``shape`` with N = 2 routing blocks and
    r = d/4 (r = d for AttnRes)."""
    spec = {**shape, "method": method, "attention": attention, **over}
    if method != "baseline":
        spec.setdefault("blocks", 2)
        spec.setdefault("rank", shape["d_model"] if method == "attnres" else shape["d_model"] // 4)
    return spec


def document_batches(n: int, micro_batch: int, seq_len: int, vocab: int, mean_doc: float, seed: int,
                     min_docs: int = 3) -> list:
    """``n`` micro-batches of random tokens whose rows pack documents of geometric length (mean
    ``mean_doc``), at least ``min_docs`` per row, through the data loader's own ``batch_from_rows``
    (token 0 is the end-of-text that closes a document)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows = rng.integers(1, vocab, size=(micro_batch, seq_len + 1))
        rows[rng.random(rows.shape) < 1.0 / mean_doc] = 0
        for r in rows:
            if (r[:-1] == 0).sum() < min_docs - 1:
                r[[seq_len * (k + 1) // min_docs for k in range(min_docs - 1)]] = 0
        out.append(batch_from_rows(rows, eot_id=0))
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.detach().double().clone())
            for n, p in model.named_parameters()}


def step_grads(fwd, lm, batches, device: torch.device, segments: bool = False) -> tuple[dict, dict]:
    """The trainer's gradient of one global batch (no clipping): ``({name: fp64 grad}, {"ce", "z",
    "norm"})``."""
    model = lm.model
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    ce, z, norm = accumulate_gradients(fwd, lm, batches, params, device, Z_LOSS, None, segments=segments)
    grads = _grads(model)
    for p in params:
        p.grad = None
    return grads, {"ce": ce, "z": z, "norm": norm}


def reference_grads(model, batches, device: torch.device) -> tuple[dict, dict]:
    """The same weights in fp64 (reference router, masked SDPA), loss summed in fp64: ``({name:
    grad}, {"ce", "norm"})``."""
    cfg = {**model.cfg.to_dict(), "router": "reference", "attention": "sdpa"}
    ref = build_model(cfg).to(device=device, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    n_tok = sum(int((b.targets != IGNORE_INDEX).sum()) for b in batches)
    ce_total = 0.0
    for b in batches:
        targets = b.targets.to(device)
        logits = ref(b.inputs.to(device), b.doc_ids.to(device))
        lse = torch.logsumexp(logits, dim=-1)
        valid = targets != IGNORE_INDEX
        ce = torch.where(valid, lse - logits.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0).sum()
        zs = torch.where(valid, lse.square(), 0.0).sum()
        ((ce + Z_LOSS * zs) / n_tok).backward()
        ce_total += ce.item()
    grads = _grads(ref)
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    return grads, {"ce": ce_total / n_tok, "norm": norm}


def rel_err(g: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``g`` against ``ref`` (absolute where ``ref`` is zero)."""
    scale = float(ref.norm())
    return float((g - ref).norm()) / (scale if scale > 0 else 1.0)


def measure(model, batches, device: torch.device, precision: str, fwd_compiled=None,
            tamper: Callable[[dict], None] | None = None, backend: str = "inductor") -> dict[str, Any]:
    """The eager and the compiled step's gradients against the fp64 reference, per parameter.

    ``fwd_compiled``: the compiled ``LossModule`` (made here when None, with torch.compile's
    ``backend``, Inductor as the trainer; pass it again to check the same compiled step after the
    weights moved).  ``tamper``: called with the compiled step's
    gradients before they are compared (to check that the check can fail).  Returns
    ``{"params": {name: {"eager", "compiled", "ref_norm"}}, "eager", "compiled", "reference"
    (losses and norms), "fwd_compiled"}``."""
    lm = LossModule(model, precision)
    fwd = fwd_compiled if fwd_compiled is not None else torch.compile(lm, dynamic=False, backend=backend)
    flash = resolve_backend(model.cfg.attention, device) == "flash"
    ref, ref_info = reference_grads(model, batches, device)
    eager, eager_info = step_grads(lm, lm, batches, device, flash)
    comp, comp_info = step_grads(fwd, lm, batches, device, flash)
    if tamper is not None:
        tamper(comp)
    params = {n: {"eager": rel_err(eager[n], ref[n]), "compiled": rel_err(comp[n], ref[n]),
                  "ref_norm": float(ref[n].norm())} for n in ref}
    return {"params": params, "eager": eager_info, "compiled": comp_info, "reference": ref_info, "fwd_compiled": fwd}


def judge(params: dict[str, dict], precision: str, factor: float = FACTOR, floor: float | None = None) -> list[str]:
    """One line per parameter whose compiled error exceeds ``factor`` x its eager error + ``floor``
    (or is not finite); empty when the compiled step passes."""
    floor = FLOOR[precision] if floor is None else floor
    bad = []
    for name, e in params.items():
        bound = factor * e["eager"] + floor
        if not (math.isfinite(e["compiled"]) and e["compiled"] <= bound):
            bad.append(f"{name}: compiled error {e['compiled']:.3g} > {factor:g} x eager error {e['eager']:.3g} + "
                       f"{floor:g} (relative L2 against fp64)")
    return bad


def summary(result: dict, precision: str) -> dict[str, Any]:
    """What a probe records of one :func:`measure`: the worst parameter's errors and bound ratio,
    the failures, and the three steps' losses and norms."""
    floor = FLOOR[precision]
    ratios = {n: e["compiled"] / (FACTOR * e["eager"] + floor) if math.isfinite(e["compiled"]) else math.inf
              for n, e in result["params"].items()}
    worst = max(ratios, key=ratios.get)
    return {"pass": not judge(result["params"], precision), "failures": judge(result["params"], precision),
            "worst_param": worst, "worst_ratio_to_bound": ratios[worst], **{f"worst_{k}": v for k, v in
                                                                             result["params"][worst].items()},
            "max_compiled_err": max(e["compiled"] for e in result["params"].values()),
            "max_eager_err": max(e["eager"] for e in result["params"].values()),
            "eager": result["eager"], "compiled": result["compiled"], "reference": result["reference"]}


def move_weights(model, batches, device: torch.device, lr_scale: float = 20.0, steps: int = 3) -> None:
    """A few eager fp32 updates of the trainer's optimisers at ``lr_scale`` times the paper's learning
    rates (Muon 0.02, Adam 0.006 at the default 20), so the weights and routing queries leave their
    initialisation."""
    optim = {g: {**DEFAULTS["optim"][g], "lr": DEFAULTS["optim"][g]["lr"] * lr_scale} for g in ("muon", "adam")}
    opts = build_optimizers(model, optim, device.type)
    lm = LossModule(model, "fp32")
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(steps):
        accumulate_gradients(lm, lm, batches[i % len(batches):i % len(batches) + 1], params, device, Z_LOSS, 1.0)
        apply_update(opts, device)
