"""``python -m lrattnres throughput``: time one or more sizes (continuing a partial state), or merge
the results of single sizes (``--aggregate``).

``--scale NAME`` takes the spec from that scale's ``throughput`` section of ``--config`` (default
config.yaml; ``--spec`` keys override it) and the memory check's GPU from its ``cluster`` section;
``--cluster`` gives the cluster section directly (the workflow passes the scale's). Exit codes: 0
done; 2 a bad spec or a plan that does not fit the GPU's memory; 75 stopped at the deadline (a rerun
continues); 1 a method that ran out of GPU memory, or a size left without a row."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lrattnres import deadline
from lrattnres.config import load_and_resolve
from lrattnres.data import load_manifest
from lrattnres.devices import resolve_device
from lrattnres.errors import SpecError
from lrattnres.io import atomic_write_json, read_json, read_spec_arg
from lrattnres.memory import FitError
from lrattnres.provenance import now, provenance
from lrattnres.throughput.measure import MethodFailed, gpu_name, run
from lrattnres.throughput.partial import PARTIAL_FORMAT, load_partial, partial_key, partial_path
from lrattnres.throughput.spec import resolve_spec
from lrattnres.throughput.summary import aggregate

MEMORY_KEYS = ("gpu_memory_gib", "memory_margin", "memory_overhead_gib", "memory_anchors")
ANCHOR_KEYS = ("preset", "micro_batch", "peak_gib", "method")


def cluster_arg(cluster: dict | None) -> str:
    """The ``--cluster`` value of a scale's cluster section: what the memory check reads, as compact
    JSON (the workflow passes it as a resource, whose printed value must hold no ", ")."""
    c = {k: v for k, v in (cluster or {}).items() if k in MEMORY_KEYS}
    if "memory_anchors" in c:
        c["memory_anchors"] = [{k: a[k] for k in ANCHOR_KEYS if k in a} for a in c["memory_anchors"]]
    return json.dumps(c, separators=(",", ":"), sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lrattnres throughput",
                                description="training-step throughput with the protocol of Section 4.9 / Appendix I")
    p.add_argument("--spec", default="{}", help="JSON object of settings (see lrattnres.throughput.spec.DEFAULTS)")
    p.add_argument("--scale", default=None, help="take the spec (and the cluster) from this scale of --config; "
                   "--spec keys override it")
    p.add_argument("--config", default="config.yaml", help="the config file --scale reads (default config.yaml)")
    p.add_argument("--cluster", default=None, help="JSON object: the cluster section whose gpu_memory_gib, "
                   "memory_margin, memory_overhead_gib and memory_anchors the memory check uses")
    p.add_argument("--data", default=None, help="data manifest: time on its first training batches (else synthetic tokens)")
    p.add_argument("--out", required=True, help="result JSON (written once, complete)")
    p.add_argument("--partial", default=None, help="partial-state file, rewritten after every timed run and continued "
                   "by the next run of the same spec (default: <out stem>.partial.json beside --out)")
    p.add_argument("--aggregate", nargs="+", default=None, metavar="RESULT",
                   help="merge these results (one per size) into --out; times nothing")
    args = p.parse_args(argv)

    if args.aggregate:
        started = now()
        result = aggregate([read_json(x) for x in args.aggregate], args.aggregate)
        result["provenance"] = provenance(result["spec"], started=started)
        atomic_write_json(args.out, result)
        return 0
    try:
        spec = read_spec_arg(args.spec)
    except ValueError as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 2
    cluster = None
    if args.scale:
        settings = load_and_resolve(args.config, {"scale": args.scale})
        spec = {**settings.get("throughput", {}), **(spec or {})}
        cluster = settings.get("cluster")
    if args.cluster:
        try:
            cluster = json.loads(args.cluster)
        except ValueError as e:
            print(f"throughput: --cluster: not a JSON object ({e})", file=sys.stderr)
            return 2
        if not isinstance(cluster, dict):
            print(f"throughput: --cluster: expected a JSON object, got {type(cluster).__name__}", file=sys.stderr)
            return 2
    cluster = {k: v for k, v in (cluster or {}).items() if k in MEMORY_KEYS} or None
    try:
        s = resolve_spec(spec)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        return 2
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    ppath = Path(args.partial) if args.partial else partial_path(args.out)
    data_sha = None
    if args.data and s["tokens"] == "data":
        data_sha = load_manifest(args.data, verify="size")["_sha256"]
    key = partial_key(s, gpu_name(resolve_device(s["device"], where="throughput spec key 'device'")), data_sha)
    if (left := deadline.left()) is not None and left <= 0:
        print(f"throughput: the deadline ({deadline.ENV}) has passed; nothing started, rerun to continue", file=sys.stderr)
        return deadline.EXIT_DEADLINE
    earlier = load_partial(ppath, key, say)

    def keep(state: dict) -> None:
        atomic_write_json(ppath, {"format": PARTIAL_FORMAT, "key": key, "updated": now(), **state})

    try:
        result = run(s, data=args.data, log=say, partial=earlier, on_run=keep, cluster=cluster)
    except deadline.DeadlineReached as e:
        print(f"throughput: {e} ({ppath})", file=sys.stderr)
        return deadline.EXIT_DEADLINE
    except FitError as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 2
    except MethodFailed as e:
        print(f"throughput: FAILED: {e} ({ppath})", file=sys.stderr)
        return 1
    atomic_write_json(args.out, result)
    ppath.unlink(missing_ok=True)
    print(f"[throughput] wrote {args.out} ({'complete' if result['complete'] else 'partial'}, "
          f"{result['elapsed_s']:.0f} s)", file=sys.stderr)
    return 0
