"""Throughput of the evaluation adapter: loglikelihood requests per second on a random model.

    python -m lrattnres.evaluate.bench [--d-model 64 --n-layers 4 --vocab compact|full|<int>]
        [--requests 256] [--batch-size 8] [--max-length 128] [--device cpu] [--threads N]
        [--precision auto] [--json out.json]

The requests are real zero-shot requests of the eight tasks (the first contexts and continuations
lm-eval builds from the offline data, round-robin over tasks), so their lengths are representative.
``--vocab compact`` uses the cl100k tokenizer with the vocabulary restricted to the token ids seen in
these requests (like the small scales' compacted vocabulary); ``full`` uses all 100,277 ids.
No lm-eval run is timed, only the adapter's ``loglikelihood`` (tokenisation included).

``--synthetic`` needs neither lm-eval nor the tokenizer (e.g. on a bare GPU machine): requests are
random token ids with context lengths uniform in [20, 200] and continuation lengths uniform in [2, 24]
(roughly the cl100k lengths of the eight tasks' requests), scored with ``score_tokens``; ``--vocab``
is then an integer (default 100277). ``--check N`` also scores the first N requests in fp32 and
reports the largest difference from the timed precision (bf16 on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

from lrattnres.data.tokenizer import EOT, Tokenizer
from lrattnres.evaluate.tasks import TASK_NAMES, materialise
from lrattnres.io import atomic_write_json


def sample_requests(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (context, continuation) pairs from the eight tasks with lm-eval's prompts."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tempfile

    from lm_eval.tasks import TaskManager

    per_task = max(1, n // len(TASK_NAMES))
    with tempfile.TemporaryDirectory() as tmp:
        mat = materialise(TASK_NAMES, tmp, limit=per_task, seed=seed)
        tm = TaskManager(include_path=mat["yaml_dir"], include_defaults=False)
        loaded = tm.load(TASK_NAMES)["tasks"]
        by_task = []
        for name in TASK_NAMES:
            task = loaded[name]
            docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
            reqs = []
            for doc in docs:
                ctx = task.doc_to_text(doc)
                choices = task.doc_to_choice(doc)
                delim = task.config.target_delimiter
                reqs += [(ctx, delim + c) for c in choices]
            by_task.append(reqs)
    out, i = [], 0
    while len(out) < n and any(by_task):
        src = by_task[i % len(by_task)]
        if src:
            out.append(src.pop(0))
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrattnres.evaluate.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--method", default="lr")
    ap.add_argument("--blocks", default="4")
    ap.add_argument("--rank", type=int, default=None, help="default d/4 (d for attnres)")
    ap.add_argument("--vocab", default="compact", help="compact | full | an integer (synthetic ids)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="timed passes (after one warm-up pass of 16 requests)")
    ap.add_argument("--synthetic", action="store_true", help="random token requests; no lm-eval, no tokenizer")
    ap.add_argument("--check", type=int, default=0, help="compare N requests with an fp32 run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.synthetic:
        return _synthetic(args)

    import numpy as np
    import torch

    from lrattnres.evaluate.adapter import LRAttnResLM
    from lrattnres.model import ModelConfig, build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    reqs = sample_requests(args.requests)
    if args.vocab == "full":
        tok = Tokenizer()
    else:
        base = Tokenizer()
        seen = sorted({t for c, x in reqs for t in base.encode(c + x)} | {EOT})
        tok = Tokenizer(np.asarray(seen, dtype=np.int64)) if args.vocab == "compact" else None
        if tok is None:  # a fixed synthetic size: ids folded into range
            size = int(args.vocab)

            class _Fold:
                eot_id = 0
                vocab_size = size

                def encode(self, text):
                    return [1 + t % (size - 1) for t in base.encode(text)]

            tok = _Fold()
    d = args.d_model
    rank = args.rank or (d if args.method == "attnres" else max(1, d // 4))
    blocks = args.blocks if args.blocks == "full" else int(args.blocks)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layers=args.n_layers, d_model=d, n_heads=args.n_heads,
                      d_ff=int(round(2.75 * d)), max_seq_len=args.max_length, method=args.method, blocks=blocks,
                      rank=rank)
    torch.manual_seed(0)
    model = build_model(cfg).to(args.device).eval()
    lm = LRAttnResLM(model, tok, batch_size=args.batch_size, max_length=args.max_length, device=args.device,
                     precision=args.precision)
    wrap = [SimpleNamespace(args=r) for r in reqs]
    lm.loglikelihood(wrap[:16])  # warm-up
    rates = []
    for _ in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lm.loglikelihood(wrap)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        rates.append(len(wrap) / (time.perf_counter() - t0))
    ntok = [len(tok.encode(c + x)) for c, x in reqs]
    res = {
        "requests": len(reqs), "requests_per_s": float(np.median(rates)), "rates": rates,
        "mean_tokens_per_request": float(np.mean(ntok)), "model": {k: getattr(cfg, k) for k in (
            "vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "method", "blocks", "rank", "max_seq_len")},
        "batch_size": args.batch_size, "max_length": args.max_length, "device": args.device,
        "precision": lm.precision, "threads": torch.get_num_threads(), "stats": lm.stats,
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        atomic_write_json(args.json, res)
    return 0


def _synthetic(args) -> int:
    import numpy as np
    import torch

    from lrattnres.evaluate.adapter import LRAttnResLM
    from lrattnres.model import ModelConfig, build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = 100_277 if args.vocab in ("compact", "full") else int(args.vocab)
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(1, vocab, int(rng.integers(20, 201))).tolist(),
              rng.integers(1, vocab, int(rng.integers(2, 25))).tolist()) for _ in range(args.requests)]
    d = args.d_model
    rank = args.rank or (d if args.method == "attnres" else max(1, d // 4))
    blocks = args.blocks if args.blocks == "full" else int(args.blocks)
    cfg = ModelConfig(vocab_size=vocab, n_layers=args.n_layers, d_model=d, n_heads=args.n_heads,
                      d_ff=int(round(2.75 * d)), max_seq_len=args.max_length, method=args.method, blocks=blocks,
                      rank=rank)
    torch.manual_seed(0)
    model = build_model(cfg).to(args.device).eval()

    class _NoTok:
        eot_id = 0

        def encode(self, text):  # pragma: no cover - synthetic requests are already tokens
            raise RuntimeError("synthetic bench scores token ids")

    lm = LRAttnResLM(model, _NoTok(), batch_size=args.batch_size, max_length=args.max_length, device=args.device,
                     precision=args.precision)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    lm.score_tokens(pairs[:16])
    rates = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        got = lm.score_tokens(pairs)
        sync()
        rates.append(len(pairs) / (time.perf_counter() - t0))
    res = {"synthetic": True, "requests": len(pairs), "requests_per_s": float(np.median(rates)), "rates": rates,
           "mean_tokens_per_request": float(np.mean([len(c) + len(x) for c, x in pairs])),
           "model": {k: getattr(cfg, k) for k in ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "method",
                                                   "blocks", "rank", "max_seq_len")},
           "batch_size": args.batch_size, "device": args.device, "precision": lm.precision,
           "threads": torch.get_num_threads()}
    if args.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name(0)
        res["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.check:
        ref = LRAttnResLM(model, _NoTok(), batch_size=1, max_length=args.max_length, device=args.device,
                          precision="fp32").score_tokens(pairs[: args.check])
        diffs = [abs(a[0] - b[0]) for a, b in zip(got, ref)]
        rel = [abs(a[0] - b[0]) / max(abs(b[0]), 1e-9) for a, b in zip(got, ref)]
        res["check"] = {"n": len(ref), "max_abs_diff": max(diffs), "max_rel_diff": max(rel),
                        "mean_abs_ll_fp32": float(np.mean([abs(b[0]) for b in ref]))}
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        atomic_write_json(args.json, res)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
