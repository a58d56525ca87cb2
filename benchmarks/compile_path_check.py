"""Check the compiled (triton_op) path of the routing kernels read by read, on a CUDA GPU.

    python benchmarks/compile_path_check.py --out DIR

Compiles a single routing read (and a small stack of reads) with torch.compile, compares each
against the same call made eagerly through the same triton_op, and writes compile_path_check.json plus Inductor's generated code for the first case (output_code.py).
Why: a wrong result under Inductor alone (the eager call of the same kernels being right) is a
problem of how Inductor launches the kernels, which these cases separate.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.autograd as autograd  # noqa: E402
from lrattnres.io import atomic_write_json, atomic_write_text  # noqa: E402


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("nan")


def one_read(S, N, d, r, norm, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    srcs = [torch.randn(N, d, device="cuda", generator=gen).to(dtype) for _ in range(S)]
    q = (torch.randn(r, device="cuda", generator=gen) * 0.5).to(dtype)

    def f(srcs, q):
        h, stats, res = autograd.attnres_fwd_args(list(srcs), q, norm, 1e-6, "")
        return h, stats

    h0, st0 = f(srcs, q)
    torch._dynamo.reset()
    h1, st1 = torch.compile(f, fullgraph=True)(srcs, q)
    return {"h_rel": _rel(h1, h0), "stats_rel": _rel(st1, st0)}


class _Stack(torch.nn.Module):
    """Reads of a growing list of sources, as in the model (queries are rows of one parameter)."""

    def __init__(self, d, r, layers):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.randn(layers + 1, r) * 0.5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        import kernels

        sources, outs = [x], []
        for t, lin in enumerate(self.layers):
            h = kernels.attnres(sources, self.queries[t], norm="slice" if t % 2 else "full")
            outs.append(h)
            sources.append(lin(h))
        outs.append(kernels.attnres(sources, self.queries[-1]))
        return outs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    from torch._inductor.utils import run_and_get_code

    from lrattnres.provenance import provenance

    out = {"provenance": provenance(), "cases": []}
    cases = [(2, 32, 64, 16, "slice", torch.float32), (3, 600, 256, 64, "slice", torch.bfloat16)]
    for S, N, d, r, norm, dtype in cases:
        try:
            res = one_read(S, N, d, r, norm, dtype)
        except Exception as e:
            res = {"error": repr(e)[:300], "trace": traceback.format_exc()[-1500:]}
        row = {"S": S, "N": N, "d": d, "r": r, "norm": norm, "dtype": str(dtype), **res}
        print(row, flush=True)
        out["cases"].append(row)
    # a stack of reads in a training graph (sources produced inside the graph, queries are views of a
    # parameter): every read's output, compiled against eager; and Inductor's generated code
    for d, r, layers, dtype in ((64, 16, 2, torch.float32), (256, 64, 3, torch.bfloat16)):
        torch.manual_seed(0)
        m = _Stack(d, r, layers).to(device="cuda", dtype=dtype)
        x = torch.randn(2, 300, d, device="cuda", dtype=dtype)
        torch._dynamo.reset()
        mc = torch.compile(m, fullgraph=True)
        try:
            outs_c, codes = run_and_get_code(lambda: mc(x))
            outs_e = m(x)
            row = {"stack": [d, r, layers, str(dtype)], "read_rel": [_rel(a_, b_) for a_, b_ in zip(outs_c, outs_e)]}
            if d == 64:
                atomic_write_text(os.path.join(a.out, "output_code.py"), "\n\n# ----\n\n".join(codes))
        except Exception as e:
            row = {"stack": [d, r, layers, str(dtype)], "error": repr(e)[:300], "trace": traceback.format_exc()[-2000:]}
        print(row, flush=True)
        out["cases"].append(row)
    atomic_write_json(os.path.join(a.out, "compile_path_check.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
