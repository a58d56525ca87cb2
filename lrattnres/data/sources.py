"""Document sources. Each yields document texts in a fixed order and can skip a consumed prefix.

- ``EmbeddedSource``: docstrings (longer than ``min_chars``) of installed packages, read with ``ast``
  from the installed ``.py`` files without importing the packages. Order: packages in the configured
  order, files by sorted relative path, docstrings in source order (module, then classes/functions
  depth-first). Exact duplicate docstrings are dropped (counted), so that no text is both in the
  validation and the training split.
- ``HFSource``: a Hugging Face dataset streamed with ``datasets`` (Ultra-FineWeb by default), at one
  commit of its Hub repository: ``revision`` when it is a commit hash (pinned), else the commit the
  branch or tag points to when the stream opens; the manifest records it (``resolved_revision``). A
  pre-staged copy is checked against the pinned commit where ``huggingface-cli download`` recorded
  its own (``.cache/huggingface/download/*.metadata``).
- ``LocalSource``: the user's txt (one document per file), jsonl (one per line, ``field``) or parquet
  (one per row, ``field``) files matched by a glob, in sorted path order.
- ``PackSource``: a pack of extracted documentation (:mod:`lrattnres.data.docs`), in pack order.

``iter_docs(skip)`` yields ``(group, text)``: the group names the document's origin (package,
file, dataset or documentation collection), so the manifest can count documents, tokens and UNK
tokens per origin. ``iter_texts`` yields the texts alone.
"""

from __future__ import annotations

import ast
import functools
import glob as _glob
import hashlib
import importlib.util
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from lrattnres.errors import UserError

from .docs import PackError, header_packages, iter_pack, read_header
from .manifest import sha256_file


# ------------------------------------------------------------------------------------------------
# embedded: docstrings of installed packages


def _docstrings_of_file(args: tuple[str, int]) -> list[str]:
    """Docstrings longer than ``min_chars`` in one file, in source order (module first)."""
    path, min_chars = args
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError, RecursionError):
        return []
    out: list[str] = []
    stack: list[ast.AST] = [tree]
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    while stack:
        node = stack.pop()
        if isinstance(node, kinds):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > min_chars:
                out.append(doc)
        children = [c for c in ast.iter_child_nodes(node) if _may_hold_defs(c)]
        stack.extend(reversed(children))
    return out


def _may_hold_defs(node: ast.AST) -> bool:
    return not isinstance(node, (ast.expr, ast.expr_context, ast.operator, ast.arguments))


def package_files(name: str) -> tuple[Path, list[str]] | None:
    """(root, sorted relative paths of .py files) of an installed top-level package, or None."""
    try:
        spec = importlib.util.find_spec(name)  # finds a top-level package without executing it
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        roots = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin and spec.origin.endswith(".py"):
        p = Path(spec.origin)
        return p.parent, [p.name]
    else:
        return None
    root = roots[0]
    rels: set[str] = set()
    for r in roots:
        for dirpath, dirnames, filenames in os.walk(r):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for fn in filenames:
                if fn.endswith(".py"):
                    rels.add(Path(dirpath, fn).relative_to(r).as_posix())
    return root, sorted(rels)


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    try:
        return dict(metadata.packages_distributions())
    except Exception:  # pragma: no cover
        return {}


def _dist_of(name: str) -> str | None:
    dists = _packages_distributions().get(name)
    return dists[0] if dists else None


def _is_stdlib(name: str) -> bool:
    return name in getattr(sys, "stdlib_module_names", ())


def package_meta(name: str) -> dict[str, Any]:
    if _is_stdlib(name):
        import platform

        return {"name": name, "distribution": "python (standard library)",
                "version": platform.python_version(), "license": "PSF-2.0"}
    dist = _dist_of(name) or name
    info: dict[str, Any] = {"name": name, "distribution": dist, "version": None, "license": None}
    try:
        md = metadata.metadata(dist)
    except metadata.PackageNotFoundError:
        return info
    info["version"] = md.get("Version")
    classifiers = [c.split("::")[-1].strip() for c in md.get_all("Classifier") or [] if c.startswith("License ::")]
    lic = (md.get("License-Expression") or "").strip()
    if not lic:
        raw = (md.get("License") or "").strip()
        if raw and "\n" not in raw and len(raw) <= 80 and raw.upper() not in ("UNKNOWN", "NONE"):
            lic = raw
        elif classifiers:
            lic = "; ".join(classifiers)
        elif raw:
            lic = raw.splitlines()[0].strip()[:120]
    lic = lic or None
    info["license"] = lic
    if classifiers:
        info["license_classifiers"] = classifiers
    return info


class EmbeddedSource:
    kind = "embedded"

    def __init__(self, packages: list[str], max_documents: int | None = None, min_chars: int = 200,
                 workers: int = 2, missing: str = "skip", **_: Any):
        self.packages = list(packages)
        self.max_documents = max_documents
        self.min_chars = min_chars
        self.workers = max(1, int(workers))
        self.missing = missing
        self.stats: dict[str, Any] = {}
        self.package_info: list[dict[str, Any]] = []

    def _plan(self) -> list[tuple[dict, Path, list[str]]]:
        plan = []
        missing = []
        for name in self.packages:
            found = package_files(name)
            if found is None:
                missing.append(name)
                continue
            root, rels = found
            info = package_meta(name)
            info["files"] = len(rels)
            info["documents_extracted"] = 0
            plan.append((info, root, rels))
        if missing and self.missing == "error":
            raise ValueError(f"spec.embedded.packages: not installed: {', '.join(missing)}")
        if missing:
            print(f"[data] embedded: packages not installed, skipped: {', '.join(missing)}", file=sys.stderr)
        self.stats["missing_packages"] = missing
        if not plan:
            raise ValueError(
                f"empty corpus: none of the embedded packages {self.packages} is installed"
            )
        return plan

    def fingerprint(self) -> Any:
        """What the documents depend on besides the spec: the installed packages' versions."""
        return [(n, package_meta(n)["version"]) for n in self.packages]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "packages": self.package_info,
            "requested_packages": self.packages,
            "max_documents": self.max_documents,
            "min_chars": self.min_chars,
            "order": "packages in configured order; files by sorted relative path; docstrings in "
            "source order (module, classes, functions depth-first); exact duplicates dropped",
            **self.stats,
        }

    def iter_texts(self, skip: int = 0) -> Iterator[str]:
        for _, text in self.iter_docs(skip):
            yield text

    def iter_docs(self, skip: int = 0) -> Iterator[tuple[str, str]]:
        """``(package, docstring)`` in source order, after skipping ``skip`` documents."""
        plan = self._plan()
        self.package_info = [p[0] for p in plan]
        seen: set[bytes] = set()
        yielded = 0
        dups = 0
        jobs = [(info, str(root / rel)) for info, root, rels in plan for rel in rels]
        args = [(path, self.min_chars) for _, path in jobs]
        pool = None
        if self.workers > 1 and len(args) > 8:
            import multiprocessing as mp

            ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
            pool = ctx.Pool(self.workers)
            results = pool.imap(_docstrings_of_file, args, chunksize=4)
        else:
            results = map(_docstrings_of_file, args)
        try:
            for (info, _), docs in zip(jobs, results):
                for doc in docs:
                    key = hashlib.sha1(doc.encode("utf-8", "surrogatepass")).digest()
                    if key in seen:
                        dups += 1
                        continue
                    seen.add(key)
                    info["documents_extracted"] += 1
                    yielded += 1
                    self.stats["duplicates_skipped"] = dups
                    if yielded > skip:
                        yield info["name"], doc
                    if self.max_documents is not None and yielded >= self.max_documents:
                        return
        finally:
            self.stats["duplicates_skipped"] = dups
            if pool is not None:
                pool.terminate()
                pool.join()


# ------------------------------------------------------------------------------------------------
# hf: a datasets stream (Ultra-FineWeb by default)


def _default_load_dataset(*args, **kwargs):
    import datasets

    return datasets.load_dataset(*args, **kwargs)


class StagingError(UserError, ValueError):
    """A Hub dataset that can be read neither from the network nor from a pre-staged copy."""


_OFF = ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = 10.0) -> str | None:
    """Why this machine cannot reach the Hugging Face Hub (offline mode set, no route to its host or
    to the HTTPS proxy), or None when a connection opens."""
    import socket
    from urllib.parse import urlparse

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _OFF:
            return f"{var} is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlparse(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else endpoint
    host, port = target.hostname or "huggingface.co", target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"{'proxy ' if proxy else ''}{host}:{port}: {e.strerror or e}"
    return None


def _is_hub_id(name: str) -> bool:
    return "/" in name and not os.path.exists(name)


def is_commit(revision: Any) -> bool:
    """Whether ``revision`` names one commit (40 hex digits), not a branch or tag that moves."""
    return isinstance(revision, str) and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision.lower())


def _hub_commit(dataset: str, revision: str | None) -> str:
    """The commit a branch or tag (default: main) of a Hub dataset points to now (network)."""
    from huggingface_hub import HfApi

    return HfApi().dataset_info(dataset, revision=revision).sha


def copy_commits(local_dir: str | os.PathLike) -> set[str]:
    """The commits a copy made by ``huggingface-cli download --local-dir`` was downloaded from (its
    ``.cache/huggingface/download/*.metadata`` files, commit on the first line); empty where none
    are recorded."""
    root = Path(local_dir) / ".cache" / "huggingface" / "download"
    out = set()
    for meta in root.rglob("*.metadata") if root.is_dir() else ():
        try:
            first = meta.read_text(encoding="utf-8").splitlines()[:1]
        except (OSError, UnicodeDecodeError):
            continue
        if first and is_commit(first[0].strip()):
            out.add(first[0].strip().lower())
    return out


class HFSource:
    kind = "hf"
    #: the function that opens the stream; tests may replace it, the default is datasets.load_dataset
    load_dataset: Callable[..., Any] = staticmethod(_default_load_dataset)

    def __init__(self, dataset: str, split: str, column: str, revision: str | None = None,
                 name: str | None = None, data_files: Any = None, local_dir: str | None = None, **_: Any):
        self.dataset = dataset
        self.local_dir = local_dir
        self.split = split
        self.column = column
        self.revision = revision
        self.name = name
        self.data_files = data_files
        self.stats: dict[str, Any] = {}

    def fingerprint(self) -> Any:
        """None where the spec identifies the stream (a pinned commit, local files); for a Hub dataset at
        a branch or tag, the commit it points to now, so that a half-built corpus never continues on
        another commit (None where the Hub cannot be asked: the build's preflight says why)."""
        if self.local_dir or not _is_hub_id(self.dataset) or is_commit(self.revision):
            return None
        try:
            return self.resolved_revision()
        except Exception:  # noqa: BLE001 - no network: reported by preflight
            return None

    def resolved_revision(self) -> str | None:
        """The commit the stream reads: the pinned one, the one a pre-staged copy was downloaded from,
        or the one the Hub's branch or tag points to; None for local files and an unrecorded copy."""
        if getattr(self, "_resolved", None) is not None:
            return self._resolved
        if self.local_dir:
            commits = copy_commits(self.local_dir)
            found = commits.pop() if len(commits) == 1 else None
            self.stats["revision_source"] = ("the copy's download records" if found else
                                             "unknown: the copy records no single commit")
        elif not _is_hub_id(self.dataset):
            return None
        elif is_commit(self.revision):
            found = self.revision.lower()
            self.stats["revision_source"] = "pinned (data.hf.revision)"
        else:
            try:
                found = _hub_commit(self.dataset, self.revision)
            except Exception as e:  # noqa: BLE001 - any failure to ask the Hub is the same refusal
                raise StagingError(
                    f"data.hf.revision: cannot resolve {self.revision or 'main'!r} of {self.dataset} to a commit "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); expected a reachable Hub "
                    "or a pinned commit hash (the dataset page's 'History', or huggingface_hub.HfApi()"
                    f".dataset_info({self.dataset!r}).sha)") from None
            self.stats["revision_source"] = (f"the Hub's {self.revision or 'main'} when the stream opened; pin it "
                                             "(data.hf.revision) for a stream that cannot change")
        self._resolved = found
        return found

    def describe(self) -> dict[str, Any]:
        d = {
            "kind": self.kind,
            "dataset": self.dataset,
            "name": self.name,
            "split": self.split,
            "column": self.column,
            "revision": self.revision,
            "resolved_revision": getattr(self, "_resolved", None),
            "data_files": self.data_files,
            "datasets_version": _version("datasets"),
            "order": "the dataset's streaming order",
            **self.stats,
        }
        return d

    def preflight(self) -> str:
        """Where the stream comes from: ``local_dir`` (a pre-staged copy of the dataset's repository: its
        README's split definitions and the data files, read in the same order) when given, else the Hub,
        which must be reachable. :class:`StagingError` otherwise, before any work or download starts."""
        if self.local_dir:
            if not os.path.isdir(self.local_dir):
                raise StagingError(f"data.hf.local_dir: {self.local_dir}: no such folder; expected a pre-staged copy "
                                   f"of {self.dataset} (docs/slurm.md, 'The paper's data')")
            commits = copy_commits(self.local_dir)
            if is_commit(self.revision) and commits and commits != {self.revision.lower()}:
                raise StagingError(
                    f"data.hf.local_dir: {self.local_dir} was downloaded from commit(s) "
                    f"{', '.join(sorted(c[:12] for c in commits))} of {self.dataset}, not data.hf.revision "
                    f"{self.revision[:12]}; expected a copy of that commit (huggingface-cli download ... --revision "
                    f"{self.revision}; docs/slurm.md, 'The paper's data')")
            return self.local_dir
        if self.load_dataset is _default_load_dataset and _is_hub_id(self.dataset):
            why = hub_unreachable()
            if why is not None:
                raise StagingError(
                    f"data.hf: {self.dataset} streams from the Hugging Face Hub, which this machine cannot reach "
                    f"({why}), and data.hf.local_dir names no pre-staged copy; expected the network (run the data "
                    "stage where it is: resources.prepare_data.local: true) or a copy (docs/slurm.md, 'The paper's data')")
        return self.dataset

    def open(self):
        """The stream, from where :meth:`preflight` says."""
        kwargs: dict[str, Any] = {"split": self.split, "streaming": True}
        if self.name is not None:
            kwargs["name"] = self.name
        if self.data_files is not None:
            kwargs["data_files"] = self.data_files
        where = self.preflight()
        commit = self.resolved_revision()
        if not self.local_dir:  # a copy is of one revision already
            if commit is not None:
                kwargs["revision"] = commit  # the commit recorded in the manifest is the one read
            elif self.revision is not None:
                kwargs["revision"] = self.revision
        try:
            return self.load_dataset(where, **kwargs)
        except Exception as e:
            raise RuntimeError(f"hf source {where!r} (split {self.split!r}): cannot open the stream: {e}") from e

    def state(self) -> Any:
        """The stream's position after the last yielded row (``IterableDataset.state_dict``), or None.

        Called between yields by the thread that iterates; lets a restart resume without re-reading.
        """
        ds = getattr(self, "_ds", None)
        if ds is None or not hasattr(ds, "state_dict"):
            return None
        try:
            return json.loads(json.dumps(ds.state_dict()))  # a detached, JSON-able copy
        except Exception:  # not serialisable / not supported: the caller falls back to counting
            return None

    def iter_texts(self, skip: int = 0, resume: Any = None) -> Iterator[str]:
        for _, text in self.iter_docs(skip, resume):
            yield text

    def iter_docs(self, skip: int = 0, resume: Any = None) -> Iterator[tuple[str, str]]:
        """``(dataset, text)`` of the rows; ``resume`` (a ``state()``) restarts the stream there, then
        ``skip`` rows are dropped."""
        self._ds = None
        ds = self.open()
        if resume is not None:
            ds.load_state_dict(resume)
            self.stats["resumed_from_state"] = True
        self._ds = ds
        n = 0
        for row in ds:
            n += 1
            if n <= skip:
                continue
            if self.column not in row:
                raise ValueError(
                    f"hf source {self.dataset!r}: column {self.column!r} not in the rows "
                    f"(columns: {', '.join(map(str, row))})"
                )
            text = row[self.column]
            yield self.dataset, "" if text is None else str(text)


# ------------------------------------------------------------------------------------------------
# local files


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class LocalSource:
    kind = "local"

    def __init__(self, glob: str, format: str = "auto", field: str = "text", **_: Any):
        self.glob = glob
        self.format = format
        self.field = field
        self.files: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {}

    def _paths(self) -> list[str]:
        paths = sorted(p for p in _glob.glob(os.path.expanduser(self.glob), recursive=True) if os.path.isfile(p))
        if not paths:
            raise FileNotFoundError(f"empty corpus: spec.local.glob {self.glob!r} matches no files")
        return paths

    def _format_of(self, path: str) -> str:
        if self.format != "auto":
            return self.format
        low = path.lower()
        if low.endswith((".jsonl", ".json", ".ndjson")):
            return "jsonl"
        if low.endswith(".parquet"):
            return "parquet"
        return "txt"

    def fingerprint(self) -> Any:
        """The matched files with their sizes and modification times."""
        out = []
        for p in self._paths():
            st = os.stat(p)
            out.append((p, st.st_size, st.st_mtime_ns))
        return out

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "glob": self.glob, "format": self.format, "field": self.field,
                "files": self.files, "order": "files by sorted path; rows/lines in file order", **self.stats}

    def _iter_file(self, path: str, fmt: str) -> Iterator[str]:
        if fmt == "txt":
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
        elif fmt == "jsonl":
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"{path}:{lineno}: not UTF-8 text (expected one JSON object per "
                                         "line)") from None
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                    if not isinstance(obj, dict) or self.field not in obj:
                        raise ValueError(f"{path}:{lineno}: field {self.field!r} missing (spec.local.field)")
                    v = obj[self.field]
                    yield "" if v is None else str(v)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
            except Exception as e:
                raise ValueError(f"{path}: not a readable parquet file ({e})") from None
            if self.field not in pf.schema_arrow.names:
                raise ValueError(
                    f"{path}: column {self.field!r} missing (spec.local.field; columns: "
                    f"{', '.join(pf.schema_arrow.names)})"
                )
            for batch in pf.iter_batches(columns=[self.field], batch_size=1024):
                for v in batch.column(0).to_pylist():
                    yield "" if v is None else str(v)
        else:  # pragma: no cover - validated in spec
            raise ValueError(f"unknown format {fmt!r}")

    def iter_texts(self, skip: int = 0) -> Iterator[str]:
        for _, text in self.iter_docs(skip):
            yield text

    def iter_docs(self, skip: int = 0) -> Iterator[tuple[str, str]]:
        """``(file name, text)`` of every document, files by sorted path."""
        self.files = []
        n = 0
        for path in self._paths():
            fmt = self._format_of(path)
            rec = {"path": path, "format": fmt, "documents": 0, "size": os.path.getsize(path)}
            self.files.append(rec)
            for text in self._iter_file(path, fmt):
                n += 1
                rec["documents"] += 1
                if n > skip:
                    yield os.path.basename(path), text


# ------------------------------------------------------------------------------------------------
# pack: extracted documentation (lrattnres.data.docs)


class PackSource:
    """The documents of a corpus pack (``python -m lrattnres corpus-pack``), optionally a subset of
    its collections, in pack order. ``sha256``, when given, must match the pack file."""

    kind = "pack"

    def __init__(self, path: str, collections: list[str] | None = None, sha256: str | None = None,
                 min_chars: int | None = None, **_: Any):
        self.path = path
        self.collections = list(collections) if collections else None
        self.sha256 = sha256
        self.min_chars = min_chars
        self.stats: dict[str, Any] = {}

    def _check(self) -> tuple[dict, str]:
        header = read_header(self.path)
        digest = sha256_file(self.path)
        if self.sha256 is not None and digest != self.sha256:
            raise PackError(f"{self.path}: sha256 {digest[:16]}... differs from spec.pack.sha256 "
                            f"{self.sha256[:16]}... (another pack than the configured one)")
        if self.min_chars is not None and header["min_chars"] != self.min_chars:
            raise PackError(f"{self.path}: built with min_chars {header['min_chars']}, spec.pack.min_chars is "
                            f"{self.min_chars} (rebuild the pack, or set the spec to the pack's)")
        names = [c["name"] for c in header["collections"]]
        unknown = sorted(set(self.collections or ()) - set(names))
        if unknown:
            raise PackError(f"{self.path}: no collection(s) {unknown} in the pack (it has {names}); "
                            "spec.pack.collections")
        return header, digest

    def fingerprint(self) -> Any:
        try:
            return self._check()[1]
        except ValueError:
            return None  # reported by the build itself

    def describe(self) -> dict[str, Any]:
        header, digest = self._check()

        keep = set(self.collections or [c["name"] for c in header["collections"]])
        cols = [c for c in header["collections"] if c["name"] in keep]
        # every Debian package the kept collections were extracted from, with its version
        packages = ({k: v for c in cols for k, v in c["packages"].items()} if all("packages" in c for c in cols)
                    else header_packages({"collections": cols}))
        return {"kind": self.kind, "path": self.path, "sha256": digest,
                "pack_format": header["format"], "min_chars": header["min_chars"],
                "packages": dict(sorted(packages.items())),
                "collections": cols,
                "order": "collections in pack order, files by sorted path", **self.stats}

    def iter_texts(self, skip: int = 0) -> Iterator[str]:
        for _, text in self.iter_docs(skip):
            yield text

    def iter_docs(self, skip: int = 0) -> Iterator[tuple[str, str]]:
        self._check()
        keep = set(self.collections) if self.collections else None
        n = 0
        for source, _, text in iter_pack(self.path):
            if keep is not None and source not in keep:
                continue
            n += 1
            if n > skip:
                yield source, text


def make_source(spec: dict):
    kind = spec["source"]
    if kind == "embedded":
        return EmbeddedSource(**spec["embedded"])
    if kind == "hf":
        return HFSource(**spec["hf"])
    if kind == "local":
        return LocalSource(**spec["local"])
    if kind == "pack":
        return PackSource(**spec["pack"])
    raise ValueError(f"spec.source: unknown source {kind!r}")  # pragma: no cover
