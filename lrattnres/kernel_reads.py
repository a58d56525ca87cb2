"""Appendix I's check on a trained model: every routing read of one batch through the fused operator
against the reference, with the inputs and upstream gradients of a real forward and backward.

``python -m lrattnres kernel-reads --checkpoint RUN/model.safetensors --data MANIFEST --out RUN.json``
``python -m lrattnres kernel-reads --aggregate A.json B.json ... --published P.yaml --out ALL.json``

The paper: "We test the trained 1B and 4B checkpoints on H100 using one 2048-token batch per case.
At each routing read, the native operator and independent PyTorch/autograd reference receive
identical BF16 inputs and loss-derived upstream gradients. All 408 reads across six cases pass the
elementwise BF16 criterion |x - x_ref| <= 0.05 + 0.05|x_ref|" (48 reads at 1B, 88 at 4B).

Here: the model of one run reads the first sequence of the validation split (the run's sequence
length: 2,048 tokens at the paper scale) in its training precision (bf16 autocast on a GPU). Every
read's sources and query are captured as the model passes them to its router, the read itself is
computed by the reference (``routing.route``), and the cross-entropy's backward gives each read's
upstream gradient. Then each read runs through the fused operator (``kernels.attnres``: bf16 on a
GPU; on a CPU the Triton interpreter in fp32, whose bf16 arithmetic is wrong) with those inputs and
that gradient, against the reference in fp64 (lrattnres/kernel_check.py's ``compare``): the
criterion's largest ratio (<= 1 passes) and the relative L2 errors of Table 10 (output, source
gradients, query gradient). The workflow runs it per run of the size pair, beside the model
(``kernel_check_run``), and merges the runs' results (``kernel_check_trained``) into the claims
``appI.trained_reads_bf16_criterion`` and Table 10's rows of this project's kernel
(``table10.rel_l2_err_pct.<size>.fast.r<r>.<output>``; other scales report their pair under the
paper's ids, by the same r/d).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from lrattnres.claims import load_published
from lrattnres.data import iter_eval_batches, load_manifest
from lrattnres.io import atomic_write_json, read_json, read_spec_arg
from lrattnres.kernel_check import compare
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.kernel_reads")

PAPER_WIDTH = {"1b": 1536, "4b": 2560}
OUTPUTS = (("forward", "rel_out"), ("source_grad", "rel_src_grad"), ("query_grad", "rel_query_grad"))


def capture_reads(model, inputs, targets, doc_ids, precision: str) -> list[dict]:
    """The routing reads of one forward and backward of ``model``: per read its sources, query, key
    norm and eps as the model passed them, and the loss-derived gradient of its output."""
    import torch
    import torch.nn.functional as F

    from lrattnres.routing import route

    reads: list[dict] = []

    def router(sources, query, *, norm="slice", eps=1e-6):
        rec = {"sources": [s.detach().clone() for s in sources], "query": query.detach().clone(), "norm": norm,
               "eps": eps}
        out = route(sources, query, norm=norm, eps=eps)
        if out.requires_grad:
            out.register_hook(lambda g: rec.__setitem__("grad", g.detach().clone()))
        reads.append(rec)
        return out

    model._fused_router = lambda device: router  # the model asks this for its router (lrattnres/model.py)
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=inputs.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(inputs, doc_ids)
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100)
        loss.backward()
    finally:
        del model._fused_router
    return reads


def check_reads(reads: list[dict], fused) -> list[dict]:
    """Each read through ``fused`` against the fp64 reference with its captured upstream gradient."""
    out = []
    for t, rec in enumerate(reads):
        if "grad" not in rec:
            raise RuntimeError(f"read {t + 1}: no upstream gradient was captured (the read does not reach the loss)")
        stats = compare(fused, rec["sources"], rec["query"], rec["norm"], grad=rec["grad"], eps=rec["eps"])
        out.append({"read": t + 1, "S": len(rec["sources"]), "r": int(rec["query"].shape[-1]), "norm": rec["norm"],
                    "dtype": str(rec["sources"][0].dtype).split(".")[-1], **stats})
    return out


def run(checkpoint: str, data: str, spec: dict) -> dict[str, Any]:
    import torch

    import kernels
    from lrattnres.train.checkpoint import load_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, info = load_model(checkpoint, device)
    cfg = info["model_config"]
    tspec = info.get("spec") or {}
    precision = tspec.get("precision", "fp32") if cuda else "fp32"
    seq_len = int(spec.get("tokens") or tspec.get("seq_len") or cfg["max_seq_len"])
    manifest = load_manifest(data, verify="size")
    batch = next(iter(iter_eval_batches(manifest, "val", 1, seq_len)))
    result: dict[str, Any] = {"stage": "kernel_reads", "run_id": os.path.basename(os.path.dirname(os.path.abspath(checkpoint))),
                              "checkpoint": str(checkpoint), "preset": cfg.get("preset"), "method": cfg["method"],
                              "d": cfg["d_model"], "r": cfg.get("rank"), "N": cfg.get("blocks"), "tokens": int(batch.inputs.numel()),
                              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "precision": precision}
    if cfg["method"] not in ("attnres", "lr", "lr-fullrms"):
        result.update(reads=[], note=f"method {cfg['method']!r} has no fused reads")
        return result
    try:
        import triton  # noqa: F401
    except ImportError:
        result.update(reads=[], note="triton is not installed: the fused kernels were not checked")
        return result
    model.train()
    reads = capture_reads(model, batch.inputs.to(device), batch.targets.to(device), batch.doc_ids.to(device), precision)
    fused = kernels.attnres if cuda else kernels.attnres_triton
    if not cuda:
        reads = [dict(r, sources=[s.float() for s in r["sources"]], query=r["query"].float(), grad=r["grad"].float())
                 for r in reads]
    rows = check_reads(reads, fused)
    result["reads"] = rows
    result["how"] = "bf16 on CUDA" if cuda else "fp32 through the Triton interpreter on the CPU"
    result["criterion_max"] = max(r["criterion_max"] for r in rows)
    result["passed"] = sum(r["criterion_max"] <= 1.0 for r in rows)
    result["rel_err_pct_max"] = {name: 100.0 * max(r[key] for r in rows) for name, key in OUTPUTS}
    log.info("%s: %d reads, %d pass, criterion max %.3g", result["run_id"], len(rows), result["passed"],
             result["criterion_max"])
    return result


def claims(results: list[dict], sizes: dict[str, str], settings: dict, ids: set[str]) -> dict[str, dict]:
    """Appendix I's and Table 10's claims from the per-run results; ``sizes``: run id -> 1b | 4b;
    ``settings``: the scale's (below the paper's own runs, the notes say what the runs stand for)."""
    out: dict[str, dict] = {}
    checked = [r for r in results if r.get("reads")]
    if not checked:
        return out
    n = sum(len(r["reads"]) for r in checked)
    passed = sum(r["passed"] for r in checked)
    worst = max(r["criterion_max"] for r in checked)
    where = "" if settings.get("paper_runs") else f"; {settings.get('scale')} scale: the size pair's trained models"
    cid = "appI.trained_reads_bf16_criterion"
    if cid in ids:
        counts = ", ".join(f"{r['run_id']}: {len(r['reads'])}" for r in checked)
        out[cid] = {"reproduced": worst, "note": f"{passed} of {n} reads of {len(checked)} trained checkpoints pass "
                    f"({counts}; {checked[0]['how']}){where}"}
    for r in checked:
        size = sizes.get(r["run_id"])
        if size not in PAPER_WIDTH or not r.get("r"):
            continue
        paper_r = round(r["r"] / r["d"] * PAPER_WIDTH[size])
        for name, _ in OUTPUTS:
            cid = f"table10.rel_l2_err_pct.{size}.fast.r{paper_r}.{name}"
            if cid in ids:
                out[cid] = {"reproduced": r["rel_err_pct_max"][name],
                            "note": f"max over {len(r['reads'])} reads of {r['run_id']} (r = {r['r']}, d = {r['d']}), "
                                    f"{r['how']}{where}"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres kernel-reads", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="the run's final weights (model.safetensors)")
    p.add_argument("--data", help="data manifest (the batch: the first sequence of its validation split)")
    p.add_argument("--spec", default="{}", help="JSON: tokens (default: the run's sequence length)")
    p.add_argument("--aggregate", nargs="+", metavar="RESULT", help="merge per-run results into claims")
    p.add_argument("--sizes", default="{}", help="with --aggregate: JSON {run id: 1b | 4b}")
    p.add_argument("--settings", help="with --aggregate: the resolved settings JSON of the scale")
    p.add_argument("--published", default=None, help="published.yaml (claim ids)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    started = now()
    if args.aggregate:
        if not args.settings:
            p.error("--aggregate needs --settings (the scale's settings.json)")
        ids = set(load_published(args.published)) if args.published else set()
        results = [read_json(x) for x in args.aggregate]
        out = {"stage": "kernel_reads", "runs": [{k: v for k, v in r.items() if k != "reads"} for r in results],
               "claims": claims(results, json.loads(args.sizes), read_json(args.settings), ids)}
        out["provenance"] = provenance({"runs": args.aggregate}, started=started)
        atomic_write_json(args.out, out)
        return 0
    if not args.checkpoint or not args.data:
        p.error("--checkpoint and --data are required without --aggregate")
    spec = read_spec_arg(args.spec)
    if not isinstance(spec, dict) or set(spec) - {"tokens"}:
        print(f"kernel-reads: --spec: expected an object with at most the key 'tokens', got {spec!r}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated
    result = run(args.checkpoint, args.data, spec)
    result["provenance"] = provenance(spec, started=started)
    atomic_write_json(args.out, result)
    return 0
