"""``prepare-data`` stage: ``python -m lrattnres.data.cli --spec '<json>' --out <dir> [--threads N]``.

Exit codes: 0 done; 2 bad input (a bad spec key, an empty or malformed source, a file that is not
UTF-8 text, a full disk), one line naming the file or key; 1 a source that cannot be reached.
"""

from __future__ import annotations

import argparse
import sys

from lrattnres.errors import one_line
from lrattnres.io import DiskFull, read_json, read_spec_arg

from .shards import prepare
from .spec import SpecError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lrattnres prepare-data", description=__doc__)
    p.add_argument("--spec", default="{}", help="JSON object of settings (or @file.json)")
    p.add_argument("--out", required=True, help="output folder (manifest.json + shards)")
    p.add_argument("--threads", type=int, default=None,
                   help="tokeniser threads and docstring parsers (overrides the spec's num_threads and "
                        "embedded.workers; execution settings)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress bars (plain progress lines instead, as whenever stderr is not a terminal)")
    args = p.parse_args(argv)
    try:
        spec = read_spec_arg(args.spec)
    except ValueError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2

    if args.threads is not None and isinstance(spec, dict):
        if args.threads < 1:
            print(f"prepare-data: --threads: expected an integer >= 1, got {args.threads}", file=sys.stderr)
            return 2
        embedded = spec.get("embedded") if isinstance(spec.get("embedded"), dict) else {}
        spec = {**spec, "num_threads": args.threads, "embedded": {**embedded, "workers": args.threads}}

    try:
        m = prepare(spec, args.out, progress=not args.no_progress)
    except SpecError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:  # the sources name their file; this is the last line of defence
        print(f"prepare-data: a source file is not UTF-8 text ({e.reason}); expected UTF-8 text (txt) or "
              "JSON lines (jsonl)", file=sys.stderr)
        return 2
    except (DiskFull, ValueError, FileNotFoundError) as e:  # bad input: one clear line
        print(f"prepare-data: {one_line(e)}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # an unreachable source
        print(f"prepare-data: error: {one_line(e)}", file=sys.stderr)
        return 1
    from pathlib import Path

    c, t = m["counts"], read_json(Path(m["_root"]) / "build.json")["timing"]
    print(
        f"prepare-data: {args.out}: {c['tokens']:,} tokens in {c['documents']:,} documents "
        f"(val {m['splits']['val']['tokens']:,} / train {m['splits']['train']['tokens']:,} tokens, "
        f"{c['empty_skipped']} empty skipped), vocab {m['vocab']} {m['vocab_size']:,}, "
        f"{t['seconds']:.1f} s, encode {t['encode_tokens_per_s']:,} tokens/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
