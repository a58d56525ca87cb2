"""``python -m lrattnres evaluate-pairs``: the size-pair claims of Section 4.5 from the per-run
evaluations (accuracy gain of LR-AttnRes over AttnRes and its sign, at each size)."""

from __future__ import annotations

import argparse
import logging
import sys

from lrattnres.evaluate.claims import lr_above_attnres_each_pair, pair_claims, published_ids
from lrattnres.io import atomic_write_json, read_json
from lrattnres.provenance import now, provenance

log = logging.getLogger("lrattnres.evaluate")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres evaluate-pairs", description=__doc__.splitlines()[0])
    p.add_argument("--results", nargs="+", required=True, help="evaluate result JSONs of the size pair")
    p.add_argument("--published", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    started = now()
    results = [read_json(path) for path in args.results]
    claims = pair_claims(results, published_ids(args.published))
    direction = lr_above_attnres_each_pair(results)
    out = {
        "stage": "evaluate_pairs",
        "runs": [r.get("run_id") for r in results],  # the trained runs its claims rest on
        "pairs": direction["pairs"],
        "lr_above_attnres_each_pair": {"holds": direction["reproduced"], "note": direction["note"]},
        "claims": claims,
        "provenance": provenance({"results": args.results}, started=started),
    }
    atomic_write_json(args.out, out)
    log.info("evaluate-pairs: %d claims -> %s", len(claims), args.out)
    return 0
