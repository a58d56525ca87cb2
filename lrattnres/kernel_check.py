"""The kernel check: the fused operator held to the reference inside the pipeline, at every scale.

``python -m lrattnres kernel-check --spec '<json>' --out kernel_check.json``

* The explainer's four-number example (d = 4, r = 2): weights (3/4, 1/4), and changing the first
  coordinate of o_A from 4 to 8 moves the first output coordinate from 3 to 6 -- through the reference
  and through ``kernels.attnres``.
* Random cases at the scale's shapes (spec ``cases``: d, r as ``"d"``/``"d/<k>"``/int, S, tokens), forward
  and backward against the reference: the paper's elementwise criterion ratio
  max |x - ref| / (0.05 + 0.05 |ref|) (Appendix I; <= 1 passes) and relative L2 errors of the output, the
  source gradients and the query gradient (Table 10's quantities).  On a GPU the fused Triton kernels
  run in bf16, as in the paper; on a CPU they run through Triton's interpreter in fp32 (the interpreter's
  bf16 arithmetic is wrong), and without Triton the check says so and claims nothing about the kernel.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Any

from lrattnres.io import atomic_write_json, read_spec_arg
from lrattnres.provenance import now, provenance
from lrattnres.ranks import resolve_rank

log = logging.getLogger("lrattnres.kernel_check")

DEFAULTS: dict[str, Any] = {
    "cases": [
        {"d": 64, "r": "d", "S": 3, "tokens": 16, "norm": "slice"},
        {"d": 72, "r": "d/8", "S": 5, "tokens": 16, "norm": "full"},
    ],
    "seed": 0,
}


def validate_spec(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise ValueError(f"kernel-check --spec: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"kernel-check spec key {unknown[0]!r} is not known; expected one of {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **spec}
    for i, case in enumerate(out["cases"]):
        missing = {"d", "r", "S", "tokens", "norm"} - set(case)
        if missing:
            raise ValueError(f"kernel-check spec cases[{i}]: missing {sorted(missing)}")
        if case["norm"] not in ("slice", "full"):
            raise ValueError(f"kernel-check spec cases[{i}].norm: {case['norm']!r} is not 'slice' or 'full'")
    return out


def _rank(r, d: int) -> int:
    return resolve_rank(r, d, where="kernel-check cases.r")


def four_number_example(op) -> float:
    """Max abs deviation of ``op`` from the explainer's example (weights 3/4, 1/4; outputs 3 -> 6)."""
    import torch

    from lrattnres.routing import routing_scores

    q = torch.tensor([math.log(3) / math.sqrt(2), 0.0], dtype=torch.float64)
    o_a = torch.tensor([4.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    o_b = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    weights = routing_scores([o_a, o_b], q, norm="slice", eps=0.0).softmax(0)
    errs = [abs(weights[0].item() - 0.75), abs(weights[1].item() - 0.25)]
    errs.append(abs(op([o_a, o_b], q)[0].item() - 3.0))
    o_a8 = o_a.clone()
    o_a8[0] = 8.0
    errs.append(abs(op([o_a8, o_b], q)[0].item() - 6.0))
    return max(errs)


def compare(fused, sources, query, norm: str, grad=None, eps: float = 1e-6) -> dict[str, float]:
    """Forward and backward of ``fused`` against the reference on the same inputs and upstream grad
    (``grad``: a given upstream gradient, e.g. a trained model's loss-derived one; default random)."""
    import torch

    from lrattnres.routing import route

    srcs = [s.detach().clone().requires_grad_(True) for s in sources]
    q = query.detach().clone().requires_grad_(True)
    out = fused(srcs, q, norm=norm, eps=eps)
    g = torch.randn_like(out) if grad is None else grad.detach().to(out.dtype)
    out.backward(g)
    ref_srcs = [s.detach().double().requires_grad_(True) for s in sources]
    ref_q = query.detach().double().requires_grad_(True)
    ref = route(ref_srcs, ref_q, norm=norm, eps=eps)
    ref.backward(g.double())

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    def crit(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).abs() / (0.05 + 0.05 * b.abs())).max().item()

    pairs = [(out, ref)] + [(s.grad, r.grad) for s, r in zip(srcs, ref_srcs)] + [(q.grad, ref_q.grad)]
    if any(a is None or not torch.isfinite(a).all() for a, _ in pairs):  # a missing gradient fails too
        return {"finite": False, "criterion_max": math.inf, "rel_out": math.inf, "rel_src_grad": math.inf, "rel_query_grad": math.inf}
    return {
        "finite": True,
        "criterion_max": max(crit(a, b) for a, b in pairs),
        "rel_out": rel(out, ref),
        "rel_src_grad": max(rel(s.grad, r.grad) for s, r in zip(srcs, ref_srcs)),
        "rel_query_grad": rel(q.grad, ref_q.grad),
    }


def run(spec: dict) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    try:
        import triton  # noqa: F401

        has_triton = True
    except ImportError:
        has_triton = False
    import kernels
    from lrattnres.routing import route

    result: dict[str, Any] = {"stage": "kernel", "device": "cuda" if cuda else "cpu", "triton": has_triton}
    err_ref = four_number_example(lambda s, q: route(s, q, norm="slice", eps=0.0))
    err_op = four_number_example(lambda s, q: kernels.attnres(s, q, norm="slice", eps=0.0))
    result["four_number_example"] = {"reference_err": err_ref, "kernels_attnres_err": err_op}
    claims = {"explainer.four_number_example": {
        "reproduced": max(err_ref, err_op),
        "note": f"reference {err_ref:.1e}, kernels.attnres {err_op:.1e} ({'fused, CUDA' if cuda else 'CPU path'})",
    }}

    cases = []
    if has_triton:
        fused = kernels.attnres if cuda else kernels.attnres_triton
        dtype = torch.bfloat16 if cuda else torch.float32
        device = "cuda" if cuda else "cpu"
        gen = torch.Generator(device="cpu").manual_seed(spec["seed"])
        for case in spec["cases"]:
            d, S, T, norm = int(case["d"]), int(case["S"]), int(case["tokens"]), case["norm"]
            r = _rank(case["r"], d)
            sources = [torch.randn(T, d, generator=gen).to(device, dtype) for _ in range(S)]
            query = (0.5 * torch.randn(r, generator=gen)).to(device, dtype)
            stats = compare(fused, sources, query, norm)
            cases.append({"d": d, "r": r, "S": S, "tokens": T, "norm": norm, "dtype": str(dtype).split(".")[-1], **stats})
            log.info("case d=%d r=%d S=%d %s: criterion %.3g, rel out %.2e", d, r, S, norm, stats["criterion_max"], stats["rel_out"])
        worst = max(c["criterion_max"] for c in cases)
        how = "bf16 on CUDA" if cuda else "fp32 through the Triton interpreter on the CPU"
        claims["appI.kernel_bf16_criterion"] = {
            "reproduced": worst,
            "note": f"max of |x - ref| / (0.05 + 0.05 |ref|) over outputs and both gradients, {len(cases)} cases, {how}",
        }
    else:
        result["note"] = "triton is not installed: the fused kernels were not checked (CPU fallback only)"
    result["cases"] = cases
    result["claims"] = claims
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres kernel-check", description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="{}")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    try:
        spec = validate_spec(read_spec_arg(args.spec))
    except (ValueError, OSError) as e:
        print(f"kernel-check: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

    started = now()
    result = run(spec)
    result["provenance"] = provenance(spec, started=started)
    atomic_write_json(args.out, result)
    return 0
