"""``python -m lrattnres convert``: convert and check one checkpoint, or combine the results of several
(``--aggregate``, the ``convert_all`` result)."""

from __future__ import annotations

import argparse
import logging
import sys

from lrattnres.convert.construction import RankError
from lrattnres.convert.runner import run
from lrattnres.convert.summary import aggregate_results
from lrattnres.io import atomic_write_json, read_json, read_spec_arg

log = logging.getLogger("lrattnres.convert")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres convert",
                                description="convert a standard AttnRes checkpoint to full-width-RMS LR-AttnRes "
                                            "(Section 4.8), or aggregate conversion results")
    p.add_argument("--checkpoint", help="model.safetensors of a standard AttnRes run")
    p.add_argument("--data", help="data manifest (manifest.json or its folder)")
    p.add_argument("--spec", help="JSON: rank, val_tokens, batch_size, claim_row [, precision, device, rtol, seq_len]")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--save", default=None,
                   help="write the converted weights here (a .safetensors file, with its .sha256 beside it)")
    p.add_argument("--published", default=None, help="published claims file (default: reports/published.yaml)")
    p.add_argument("--aggregate", nargs="+", default=None, metavar="RESULT",
                   help="combine per-checkpoint convert results into one (convert_all)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress bar (plain progress lines instead, as whenever stderr is not a terminal)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    if args.aggregate is not None:
        if args.checkpoint or args.data or args.spec or args.save:
            p.error("--aggregate takes result files only (no --checkpoint/--data/--spec/--save)")
        results = []
        for path in args.aggregate:
            r = read_json(path)
            if not isinstance(r, dict) or r.get("stage") != "convert" or "fp64_max_logit_err" not in r:
                raise ValueError(f"{path}: not a per-checkpoint convert result (stage 'convert' with fp64_max_logit_err)")
            results.append(r)
        out = aggregate_results(results)
        atomic_write_json(args.out, out)
        log.info("aggregated %d conversions into %s: %d claims", len(results), args.out, len(out["claims"]))
        return 0

    for name in ("checkpoint", "data", "spec"):
        if getattr(args, name) is None:
            p.error(f"--{name} is required (or use --aggregate)")
    spec = read_spec_arg(args.spec)
    try:
        result = run(args.checkpoint, args.data, spec, save=args.save, published=args.published,
                     progress=not args.no_progress)
    except RankError as e:  # a clear refusal, not a traceback
        print(f"convert: {args.checkpoint}: {e}", file=sys.stderr)
        return 2
    atomic_write_json(args.out, result)
    log.info("wrote %s", args.out)
    return 0
