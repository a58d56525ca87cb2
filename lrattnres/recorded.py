"""Where results measured on another machine are recorded: ``reports/recorded.yaml``.

The file maps a name to a path relative to the repository root, e.g.
``kernel: benchmarks/results/kernel_bench_h200_2026-12-01.json``.  The report shows each file in its
section (``kernel``, ``train_step``, ``throughput_gpu*``, ``gpu_grid``) and ``gpu_report``, the
``paper.json`` of a report made at another scale, as a column beside this report's verdicts.

It is not part of the experiment's config: the Snakefile lists the file and the paths it names among
the report rule's inputs, so a new recording reruns the report and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lrattnres.errors import InputError

RECORDED = "reports/recorded.yaml"  # the list, relative to the repository root
REPORT = "gpu_report"  # the key that names a paper.json made elsewhere, not a result file


def read_list(path: str | Path) -> dict[str, str]:
    """The recorded files of ``path`` as {name: path relative to the repository root}; an empty
    file records nothing.  A file that is not such a mapping raises :class:`InputError`."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of names to result files, got {type(data).__name__}")
    for name, rel in data.items():
        if not isinstance(name, str) or not isinstance(rel, str) or not rel.strip():
            raise InputError(f"{path}: key {name!r}: expected a file path relative to the repository root, "
                             f"got {rel!r}")
    return dict(data)
