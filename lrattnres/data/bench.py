"""Tokenisation throughput: ``python -m lrattnres.data.bench [--packages numpy sympy] [--threads 1 2]``.

Extracts the embedded corpus of the given packages (not timed), then times cl100k
``encode_ordinary_batch`` over it (wall clock and process CPU time) for each thread count, repeated
``--repeat`` times (best run reported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .sources import EmbeddedSource
from .tokenizer import get_encoding


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres.data.bench", description=__doc__)
    p.add_argument("--packages", nargs="+", default=["numpy", "sympy"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--chunk", type=int, default=2048, help="documents per encode_ordinary_batch call")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    texts = list(EmbeddedSource(args.packages).iter_texts())
    extract_s = time.perf_counter() - t0
    enc = get_encoding()
    chars = sum(map(len, texts))
    results = []
    for th in args.threads:
        best = None
        for _ in range(args.repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            n = 0
            for a in range(0, len(texts), args.chunk):
                n += sum(map(len, enc.encode_ordinary_batch(texts[a:a + args.chunk], num_threads=th)))
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if best is None or wall < best[1]:
                best = (n, wall, cpu)
        n, wall, cpu = best
        results.append({"threads": th, "tokens": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                        "tokens_per_s": round(n / wall), "tokens_per_cpu_s": round(n / cpu)})
    out = {"packages": args.packages, "documents": len(texts), "chars": chars, "extract_s": round(extract_s, 2),
           "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0], "results": results}
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
