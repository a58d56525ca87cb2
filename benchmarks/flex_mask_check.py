"""Compiled flex attention with document masking against masked SDPA, per way of building the block mask.

    python benchmarks/flex_mask_check.py --out DIR

Why: the 1B training step compiled with flex attention (block mask built inside the graph) reaches
NaN losses on an H200 within 8 updates, its first loss 1.3e-3 off masked SDPA's (measured
2026-11-29 with benchmarks/train_step_bench.py --attention flex).  This times
nothing; for bf16 q, k, v [2, 16, 2048, 128] with synthetic documents it compares output and q/k/v
gradients with masked SDPA for:
  in-graph        lrattnres.attention.document_block_mask (sort-free index lists), inside torch.compile
  in-graph-sort   the same blocks through BlockMask.from_kv_blocks (torch.argsort orders the index lists,
                  compiled by Inductor): the construction that reaches the NaN losses
  outside         create_block_mask evaluated eagerly, passed into the compiled flex_attention
Writes flex_mask_check.json (relative L2 errors, finiteness, device, versions, date).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lrattnres.attention import causal_attention, document_block_mask  # noqa: E402
from lrattnres.io import atomic_write_json  # noqa: E402


def _sorted_variant(doc_ids):
    """document_block_mask's blocks, index lists ordered by BlockMask.from_kv_blocks (argsort)."""
    from torch.nn.attention.flex_attention import BlockMask

    bm = document_block_mask(doc_ids)
    return BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--mean-doc", default="1000,60", help="mean synthetic document lengths")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("flex_mask_check needs a CUDA GPU", file=sys.stderr)
        return 1
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, T, hd = 2, 16, 2048, 128
    rows = []
    for mean_doc in (float(x) for x in a.mean_doc.split(",")):
        g = torch.Generator().manual_seed(int(mean_doc))
        doc = (torch.rand(B, T, generator=g) < 1 / mean_doc).int().cumsum(1).cuda()
        q, k, v = (torch.randn(B, H, T, hd, generator=g).cuda().to(torch.bfloat16).requires_grad_() for _ in range(3))
        go = torch.randn(B, H, T, hd, generator=g).cuda().to(torch.bfloat16)
        ref = causal_attention(q, k, v, doc, backend="sdpa")
        ref_grads = torch.autograd.grad(ref, (q, k, v), go)

        def outside_mask(d):
            return create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (d[b, qi] == d[b, ki]), B, None, T, T, device="cuda")

        variants = {
            "in-graph": lambda q, k, v, d: flex_attention(q, k, v, block_mask=document_block_mask(d)),
            "in-graph-sort": lambda q, k, v, d: flex_attention(q, k, v, block_mask=_sorted_variant(d)),
        }
        bm_out = outside_mask(doc)
        variants["outside"] = lambda q, k, v, d: flex_attention(q, k, v, block_mask=bm_out)
        for name, fn in variants.items():
            torch._dynamo.reset()
            row = {"mean_doc": mean_doc, "variant": name}
            try:
                out = torch.compile(fn, fullgraph=True, dynamic=False)(q, k, v, doc)
                grads = torch.autograd.grad(out, (q, k, v), go)
                for key, x, y in (("out", out, ref), *zip(("dq", "dk", "dv"), grads, ref_grads)):
                    row[f"{key}_rel_l2"] = _rel(x, y)
                    row[f"{key}_finite"] = bool(torch.isfinite(x).all())
            except Exception as e:  # noqa: BLE001 - record and go on
                row["error"] = repr(e)[:400]
            print(row, flush=True)
            rows.append(row)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "shape": [B, H, T, hd], "rows": rows}
    atomic_write_json(os.path.join(a.out, "flex_mask_check.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
