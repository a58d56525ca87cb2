"""The package's shape, read from its source with ``ast``: no import cycle between its modules, no
import inside a function but the deferrals listed here (each with its reason), no function over
MAX_FUNCTION_LINES lines."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "lrattnres"
MAX_FUNCTION_LINES = 100
# Third-party packages whose import takes seconds or is optional: a module that imports none of them
# (at load, through the package's modules it loads) may put off loading a module that does.
HEAVY = ("torch", "triton", "kernels", "lm_eval")

# Modules that import a module of the package inside a function, and why. Each such import must load
# one of HEAVY (a deferral of anything else is an import to hoist, or a cycle to untie).
DEFERRED = {
    "lrattnres.convert.construction": "lrattnres.convert also merges finished conversions (--aggregate), JSON only: "
                                      "the model and torch load where a checkpoint is converted",
    "lrattnres.convert.runner": "as lrattnres.convert.construction",
    "lrattnres.data.loader": "the data stage tokenises and shards without torch; only a batch's document "
                             "segments (lrattnres.segments) need it",
    "lrattnres.diagnostics.analyse": "lrattnres.diagnostics also merges finished runs (--aggregate), JSON only: "
                                     "torch loads where a checkpoint is analysed",
    "lrattnres.diagnostics.measures": "as lrattnres.diagnostics.analyse",
    "lrattnres.evaluate.bench": "lm-eval and torch load only where a model is evaluated",
    "lrattnres.evaluate.cli": "the offline task files and the size-pair claims need neither lm-eval nor torch; "
                              "the adapter loads both",
    "lrattnres.evaluate.lm_eval_cli": "as lrattnres.evaluate.cli",
    "lrattnres.kernel_check": "on the CPU, TRITON_INTERPRET is set before the kernels (which the routing "
                              "imports) are loaded",
    "lrattnres.kernel_reads": "as lrattnres.kernel_check",
    "lrattnres.throughput.matched": "the throughput package is read by config's checks (lrattnres/jobplan.py "
                                    "estimates a timing job from its spec): torch loads where a model is timed",
    "lrattnres.throughput.measure": "as lrattnres.throughput.matched",
    "lrattnres.throughput.spec": "as lrattnres.throughput.matched; the attention backend is resolved only "
                                 "where a spec is",
    "lrattnres.train.cli": "the command refuses a bad spec or data manifest before torch loads (seconds on a "
                           "cluster's file system)",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    named: bool  # the statement names the target (not only a package that loading it loads)


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by its dotted name (a package by its __init__.py)."""
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _in_function(tree: ast.AST) -> set[int]:
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _targets(name: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The modules an import statement names: ``import a.b``: a.b; ``from p import x, y``: p.x and p.y
    where they are modules, and p itself where one of them is not."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    subs = [f"{pkg}.{a.name}" for a in node.names if f"{pkg}.{a.name}" in known]
    return subs + ([pkg] if len(subs) < len(node.names) else [])


def import_graph(root: Path, package: str = PACKAGE) -> tuple[dict[str, Path], list[Edge], dict[str, set[str]]]:
    """(the modules, every import of one module of the package by another, at load or in a function,
    and the third-party packages each module imports at load). Importing ``a.b.c`` loads ``a`` and
    ``a.b`` too: an edge to each, except to the importing module's own packages (loaded already)."""
    known = modules(root, package)
    edges, external = [], {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        inside = _in_function(tree)
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, path.name == "__init__.py", node, known):
                top = target.split(".")[0]
                if top != package:
                    if id(node) not in inside and not getattr(node, "level", 0):
                        external[name].add(top)
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    loaded = ".".join(parts[:i])
                    if loaded in known and loaded != name and (loaded == target or loaded not in own):
                        edges.append(Edge(name, loaded, node.lineno, id(node) in inside, loaded == target))
    return known, edges, external


def find_cycle(nodes, edges: list[Edge]) -> list[Edge] | None:
    """One cycle of the graph, as its edges, or None."""
    out: dict[str, list[Edge]] = {n: [] for n in nodes}
    for e in edges:
        out[e.source].append(e)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Edge] = []

    def visit(n: str) -> list[Edge] | None:
        state[n] = 1
        for e in out[n]:
            if state.get(e.target) == 1:
                start = next((i for i, p in enumerate(path) if p.source == e.target), len(path))
                return path[start:] + [e]
            if e.target not in state:
                path.append(e)
                found = visit(e.target)
                if found:
                    return found
                path.pop()
        state[n] = 2
        return None

    for n in nodes:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def loads_heavy(known, edges: list[Edge], external: dict[str, set[str]]) -> dict[str, set[str]]:
    """The HEAVY packages each module loads when it is imported (through the modules it loads)."""
    at_load: dict[str, set[str]] = {n: set() for n in known}
    for e in edges:
        if not e.in_function:
            at_load[e.source].add(e.target)
    out = {}
    for n in known:
        seen, todo, heavy = set(), [n], set()
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                heavy |= external[m] & set(HEAVY)
                todo.extend(at_load[m])
        out[n] = heavy
    return out


def _describe(cycle: list[Edge], known) -> str:
    return " -> ".join(f"{e.source} ({known[e.source].relative_to(REPO)}:{e.line}"
                       f"{', in a function' if e.in_function else ''})" for e in cycle) + f" -> {cycle[0].source}"


def test_no_import_cycle():
    known, edges, _ = import_graph(REPO)
    cycle = find_cycle(known, edges)
    assert cycle is None, f"import cycle: {_describe(cycle, known)}"


def test_function_level_imports_are_listed_deferrals_of_heavy_modules():
    known, edges, external = import_graph(REPO)
    heavy = loads_heavy(known, edges, external)
    late = [e for e in edges if e.in_function and e.named]
    unlisted = [f"{known[e.source].relative_to(REPO)}:{e.line} imports {e.target}" for e in late
                if e.source not in DEFERRED]
    assert not unlisted, "imports inside functions of modules not in DEFERRED (import them at the top):\n" + "\n".join(
        unlisted)
    light = [f"{known[e.source].relative_to(REPO)}:{e.line} imports {e.target}, which loads none of {HEAVY}"
             for e in late if not heavy[e.target]]
    assert not light, "deferred imports of modules that load nothing heavy (import them at the top):\n" + "\n".join(light)
    stale = sorted(set(DEFERRED) - {e.source for e in late})
    assert not stale, f"DEFERRED lists modules that defer no import: {stale}"
    for name in DEFERRED:  # a deferral keeps the module itself light
        assert not heavy[name], f"{name} loads {sorted(heavy[name])} at import: nothing left to defer"


def test_no_function_is_longer_than_the_limit():
    long = []
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by what each part does):\n" + "\n".join(long)


# ---- the checks find what they look for


@pytest.fixture
def package(tmp_path):
    """A stand-in package ``pkg`` under tmp_path; ``write(rel, text)`` adds a module."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")

    def write(rel: str, text: str) -> None:
        f = tmp_path / "pkg" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)

    return write


def test_a_cycle_closed_inside_a_function_is_found(package, tmp_path):
    package("config.py", "from pkg import plan\n")
    package("plan.py", "def main():\n    from pkg.config import load\n    return load\n")
    package("leaf.py", "import json\n")
    known, edges, _ = import_graph(tmp_path, "pkg")
    cycle = find_cycle(known, edges)
    assert cycle and {(e.source, e.target) for e in cycle} == {("pkg.config", "pkg.plan"), ("pkg.plan", "pkg.config")}
    assert [e.in_function for e in cycle if e.source == "pkg.plan"] == [True]


def test_a_package_re_exporting_a_module_that_reads_its_siblings_is_no_cycle(package, tmp_path):
    package("data/__init__.py", "from .loader import load\nfrom .manifest import read\n")
    package("data/loader.py", "from .manifest import read\n")
    package("data/manifest.py", "import json\n")
    package("user.py", "from pkg.data.manifest import read\n")
    known, edges, _ = import_graph(tmp_path, "pkg")
    assert find_cycle(known, edges) is None
    assert ("pkg.user", "pkg.data") in {(e.source, e.target) for e in edges}  # importing a submodule loads its package
    # a submodule that imports its own package's names does close a cycle
    package("data/loader.py", "from pkg.data import read\n")
    known, edges, _ = import_graph(tmp_path, "pkg")
    assert find_cycle(known, edges) is not None


def test_heavy_packages_are_followed_through_load_time_imports_only(package, tmp_path):
    package("model.py", "import torch\n")
    package("plan.py", "def build():\n    from pkg.model import Model\n")
    package("stage.py", "from pkg import model\n")
    known, edges, external = import_graph(tmp_path, "pkg")
    heavy = loads_heavy(known, edges, external)
    assert heavy["pkg.model"] == heavy["pkg.stage"] == {"torch"} and heavy["pkg.plan"] == set()
