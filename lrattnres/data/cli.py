"""``prepare-data`` stage: ``python -m lrattnres.data.cli --spec '<json>' --out <dir> [--threads N]``.

Exit codes: 0 done; 2 bad input (a bad spec key, an empty or malformed source, a file that is not
UTF-8 text, a full disk), one line naming the file or key; 1 a source that cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

from lrattnres.errors import one_line
from lrattnres.io import read_spec_arg


def _file_being_read(exc: BaseException) -> str | None:
    """The source file a decoding error came from: the innermost frame of its traceback with a local
    ``path`` naming an existing file (the source readers keep the file they read as ``path``)."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_locals.get("path")
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            found = os.fspath(path)
        tb = tb.tb_next
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lrattnres prepare-data", description=__doc__)
    p.add_argument("--spec", default="{}", help="JSON object of settings (or @file.json)")
    p.add_argument("--out", required=True, help="output folder (manifest.json + shards)")
    p.add_argument("--threads", type=int, default=None,
                   help="tokeniser threads (sets the spec's num_threads; the workflow passes the rule's threads)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:
        spec = read_spec_arg(args.spec)
    except ValueError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2
    if args.threads is not None and isinstance(spec, dict):
        spec = {**spec, "num_threads": args.threads}
    from lrattnres.io import DiskFull

    from .shards import prepare
    from .spec import SpecError

    try:
        m = prepare(spec, args.out, progress=not args.no_progress)
    except SpecError as e:
        print(f"prepare-data: {e}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        where = _file_being_read(e) or "a source file"
        print(f"prepare-data: {where}: not UTF-8 text ({e.reason}: byte {e.object[e.start:e.start + 1]!r}); "
              "expected UTF-8 text (txt) or JSON lines (jsonl)", file=sys.stderr)
        return 2
    except (DiskFull, ValueError, FileNotFoundError) as e:  # bad input: one clear line
        print(f"prepare-data: {one_line(e)}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # an unreachable source
        print(f"prepare-data: error: {one_line(e)}", file=sys.stderr)
        return 1
    c, t = m["counts"], m["timing"]
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
