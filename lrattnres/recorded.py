"""Where results measured on another machine are recorded: ``reports/recorded.yaml``.

The file maps a name to a path relative to the repository root, e.g.
``kernel: benchmarks/results/kernel_bench_h200_2026-12-01.json``, or to a pattern (``*``, ``?``,
``[...]``) that names the newest of several recordings (:func:`resolve_path`), so that a new
recording replaces the one before it as soon as it is committed.  The report shows each file in its
section (``kernel``, ``train_step``, ``throughput_gpu*``, ``gpu_grid``) and ``gpu_report``, the
``paper.json`` of a report made at another scale, as a column beside this report's verdicts.

It is not part of the experiment's config: the Snakefile lists the file and the paths it names among
the report rule's inputs, so a new recording reruns the report and nothing else. Nor can it stop the
experiment: for the workflow and the report stage (:func:`load`), a missing or malformed list, a bad
entry or a listed file that is absent is a note on the report page, never a failed target.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from lrattnres.errors import InputError

RECORDED = "reports/recorded.yaml"  # the list, relative to the repository root
REPORT = "gpu_report"  # the key that names a paper.json made elsewhere, not a result file


def _entry_problem(path: Path, name, rel) -> str | None:
    if not isinstance(name, str) or not isinstance(rel, str) or not rel.strip():
        return f"{path}: key {name!r}: expected a file path relative to the repository root, got {rel!r}"
    return None


def _read_mapping(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of names to result files, got {type(data).__name__}")
    return data


def read_list(path: str | Path) -> dict[str, str]:
    """The recorded files of ``path`` as {name: path relative to the repository root}; an empty
    file records nothing.  A file that is not such a mapping raises :class:`InputError`."""
    path = Path(path)
    data = _read_mapping(path)
    for name, rel in data.items():
        if (problem := _entry_problem(path, name, rel)) is not None:
            raise InputError(problem)
    return dict(data)


def load(path: str | Path) -> tuple[dict[str, str], list[str]]:
    """``(entries, notes)``: what :func:`read_list` reads, never raising. A missing or malformed file
    records nothing and a bad entry is left out, each with a note naming the file and the key."""
    path = Path(path)
    if not path.exists():
        return {}, [f"{path}: absent, so no results measured elsewhere are shown (git checkout {path} restores "
                    "the list)"]
    try:
        data = _read_mapping(path)
    except InputError as e:
        return {}, [f"{e}; no results measured elsewhere are shown until the list is fixed"]
    entries, notes = {}, []
    for name, rel in data.items():
        if (problem := _entry_problem(path, name, rel)) is not None:
            notes.append(problem + "; left out until the entry is fixed")
        else:
            entries[name] = rel
    return entries, notes


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def resolve_path(rel: str, root: str | Path = ".") -> str | None:
    """The file a listed entry names, relative to ``root``: the entry itself, or for a pattern the
    file it matches with the latest YYYY-MM-DD date in its name (then the last name); None when a
    pattern matches nothing."""
    if not any(c in rel for c in "*?["):
        return rel
    root = Path(root)
    found = [p.relative_to(root).as_posix() for p in root.glob(rel) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda f: (max(_DATE.findall(Path(f).name), default=""), f))
