"""Which first-party source files a stage imports, so Snakemake can rerun exactly what a change affects.

Snakemake does not track imported modules.  Each rule lists, as inputs, the closure of the package
modules its stage imports (found statically with ``ast``, lazy imports inside functions included),
plus any data files the stage reads (report templates).  A real content change of one of those files
then reruns the jobs that depend on it, and only those.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

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
