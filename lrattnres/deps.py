"""Which first-party source files a stage imports, so Snakemake can rerun exactly what a change affects.

Snakemake does not track imported modules.  A stage's files are the closure of the package modules
its command imports (found statically with ``ast``, imports inside functions included), plus what it
finds at run time (the report's sections and templates): :func:`stage_files`.  Each rule gives its
stage's :func:`stage_code`, one fingerprint of those files' contents, as its ``code`` param, which
Snakemake's params trigger compares with the one recorded when the job ran: a real content change of
one of the files reruns the jobs whose stage imports it, and only those; a bare touch reruns nothing.
The job's command shows the fingerprint (``--code``) and its log records it.
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from lrattnres.cli import STAGES

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("lrattnres", "kernels")
# Modules that decide how a job runs (which GPU, whether a retry may run, where its ranks start, how
# long it may take, whether it fits its GPU's memory), never what it computes: not inputs of any rule,
# so that a change to them reruns nothing.
EXECUTION_MODULES = ("lrattnres.attempts", "lrattnres.gpus", "lrattnres.jobplan", "lrattnres.memory",
                     "lrattnres.slurmjob")


def module_file(name: str) -> Path | None:
    """The source file of first-party module ``name`` (a package maps to its __init__.py)."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            # ``from pkg import sub`` may name a submodule
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


@lru_cache(maxsize=None)
def closure(*modules: str) -> tuple[str, ...]:
    """Sorted repo-relative paths of every first-party file reachable by import from ``modules``."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen or name in EXECUTION_MODULES:
            continue
        path = module_file(name)
        if path is None:
            continue
        seen[name] = path
        # importing a.b.c runs a/__init__.py and a/b/__init__.py too
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_imports(path, name))
    return tuple(sorted({str(p.relative_to(REPO)) for p in seen.values()}))


# What a stage reads at run time besides the modules it imports: the report finds its sections by name
# and reads its templates as files.
DISCOVERED = {"lrattnres.report": (("lrattnres.report.sections", "*.py"), ("lrattnres.report.templates", "*.j2"))}
FINGERPRINT_DIGITS = 16


def stage_files(module: str) -> tuple[str, ...]:
    """Sorted repo-relative paths of the files a stage's command runs: ``module`` (the stage's module
    in lrattnres/cli.py's STAGES) with every module it imports, the command line's own, and what
    :data:`DISCOVERED` says the stage finds at run time."""
    modules, files = [], []
    for package, pattern in DISCOVERED.get(module, ()):
        if pattern == "*.py":
            modules += package_modules(package)
        else:
            files += package_files(package, pattern)
    return tuple(sorted({*closure("lrattnres.__main__", "lrattnres.cli", module, *modules), *files}))


def fingerprint(files: Iterable[str]) -> str:
    """One hash of the files' repository paths and contents (sha256, its first FINGERPRINT_DIGITS hex
    digits): it changes with a real change of any of them, not with a bare touch."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256((REPO / rel).read_bytes()).digest())
    return h.hexdigest()[:FINGERPRINT_DIGITS]


def stage_code(stage: str) -> str:
    """The fingerprint of the code stage ``stage`` (a subcommand of ``python -m lrattnres``) runs: a
    rule's ``code`` param."""
    return fingerprint(stage_files(STAGES[stage][0]))


def package_files(package: str, pattern: str = "*.py") -> list[str]:
    """Every file of a sub-package (e.g. all report sections, which are discovered at run time)."""
    root = REPO.joinpath(*package.split("."))
    return sorted(str(p.relative_to(REPO)) for p in root.rglob(pattern) if "__pycache__" not in p.parts)


def package_modules(package: str) -> list[str]:
    """Module names of every .py file of a sub-package (for discovered modules such as sections)."""
    names = []
    for rel in package_files(package):
        parts = list(Path(rel).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names
