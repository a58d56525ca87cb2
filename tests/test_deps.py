"""lrattnres.deps: the first-party files a stage imports, which the rules list as inputs (a change to
one of them reruns exactly the jobs that import it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lrattnres import deps
from lrattnres.cli import STAGES

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A stand-in repository with the two first-party packages; ``write(path, text)`` adds a file."""
    monkeypatch.setattr(deps, "REPO", tmp_path)
    deps.closure.cache_clear()

    def write(rel: str, text: str = "") -> None:
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)

    for pkg in ("lrattnres", "lrattnres/sub", "kernels"):
        write(f"{pkg}/__init__.py")
    yield write
    deps.closure.cache_clear()


def test_module_file_maps_modules_and_packages(tree):
    tree("lrattnres/a.py")
    assert deps.module_file("lrattnres.a") == deps.REPO / "lrattnres" / "a.py"
    assert deps.module_file("lrattnres.sub") == deps.REPO / "lrattnres" / "sub" / "__init__.py"
    assert deps.module_file("kernels") == deps.REPO / "kernels" / "__init__.py"
    assert deps.module_file("lrattnres.absent") is None  # e.g. a name imported from a module, not a module
    assert deps.module_file("torch") is None and deps.module_file("json") is None  # not first-party


def test_imports_resolve_relative_and_from_imports(tree):
    tree("lrattnres/sub/x.py", "from . import y\nfrom .. import a\nfrom ..b import c\nfrom .z import w\n"
                               "import kernels.op as k\nfrom lrattnres.sub import q\n")
    got = deps._imports(deps.REPO / "lrattnres" / "sub" / "x.py", "lrattnres.sub.x")
    assert {"lrattnres.sub", "lrattnres.sub.y", "lrattnres", "lrattnres.a", "lrattnres.b", "lrattnres.b.c",
            "lrattnres.sub.z", "lrattnres.sub.z.w", "kernels.op", "lrattnres.sub.q"} == got
    # in a package's __init__.py, "." is the package itself
    tree("lrattnres/sub/__init__.py", "from . import y\nfrom .z import w\n")
    got = deps._imports(deps.REPO / "lrattnres" / "sub" / "__init__.py", "lrattnres.sub")
    assert got == {"lrattnres.sub", "lrattnres.sub.y", "lrattnres.sub.z", "lrattnres.sub.z.w"}


def test_closure_follows_imports_transitively_including_lazy_ones(tree):
    tree("lrattnres/stage.py", "import json\nimport torch\nfrom lrattnres import helper\n\n"
                               "def run():\n    from lrattnres.sub import deep  # lazy\n    return deep\n")
    tree("lrattnres/helper.py", "from .stage import run  # a cycle\n")
    tree("lrattnres/sub/deep.py", "import kernels.op\n")
    tree("kernels/op.py", "from ._impl import f\n")
    tree("kernels/_impl.py")
    tree("lrattnres/unrelated.py", "import kernels.op\n")
    assert deps.closure("lrattnres.stage") == (
        "kernels/__init__.py", "kernels/_impl.py", "kernels/op.py", "lrattnres/__init__.py", "lrattnres/helper.py",
        "lrattnres/stage.py", "lrattnres/sub/__init__.py", "lrattnres/sub/deep.py")
    assert deps.closure("lrattnres.helper") == deps.closure("lrattnres.stage")  # the same cycle
    assert deps.closure("lrattnres.absent") == ()


def test_closure_leaves_out_the_execution_modules(tree):
    tree("lrattnres/cli.py", "from lrattnres import attempts, gpus\nfrom lrattnres import work\n")
    for name in ("attempts", "gpus", "work"):
        tree(f"lrattnres/{name}.py")
    assert deps.closure("lrattnres.cli") == ("lrattnres/__init__.py", "lrattnres/cli.py", "lrattnres/work.py")


def test_package_files_and_modules(tree):
    tree("lrattnres/sub/one.py")
    tree("lrattnres/sub/inner/two.py")
    tree("lrattnres/sub/t.j2")
    tree("lrattnres/sub/__pycache__/one.py")  # never a source file
    assert deps.package_files("lrattnres.sub") == [
        "lrattnres/sub/__init__.py", "lrattnres/sub/inner/two.py", "lrattnres/sub/one.py"]
    assert deps.package_files("lrattnres.sub", "*.j2") == ["lrattnres/sub/t.j2"]
    assert deps.package_modules("lrattnres.sub") == ["lrattnres.sub", "lrattnres.sub.inner.two", "lrattnres.sub.one"]


def test_the_repository_stages_import_what_they_run():
    """On the repository itself: the closure of a module holds every first-party module that actually
    loads when it is imported (lazy imports may add more, never less), and the execution modules
    never count."""
    import subprocess

    for module in ("lrattnres.accounting", "lrattnres.kernel_check", "lrattnres.report", "lrattnres.grid"):
        code = (f"import sys, {module}; print(' '.join(sorted(m for m in sys.modules "
                "if m.split('.')[0] in ('lrattnres', 'kernels'))))")
        loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split()
        files = {str(deps.module_file(m).relative_to(REPO)) for m in loaded if deps.module_file(m)}
        files -= {str(deps.module_file(m).relative_to(REPO)) for m in deps.EXECUTION_MODULES}
        got = set(deps.closure(module))
        assert files <= got, (module, sorted(files - got))
    assert "kernels/fused_bwd.py" in deps.closure("lrattnres.kernel_check")  # imported at the first launch
    assert "kernels/fused_bwd.py" in deps.closure("lrattnres.model")
    assert not any(f.startswith("kernels/") for f in deps.closure("lrattnres.accounting"))
    everything = deps.closure(*(module for module, _ in STAGES.values()))
    execution = {str(deps.module_file(m).relative_to(REPO)) for m in deps.EXECUTION_MODULES}
    assert {"lrattnres/attempts.py", "lrattnres/gpus.py"} <= execution and not execution & set(everything)


def test_a_stage_runs_what_it_imports_and_the_report_what_it_finds(tree):
    tree("lrattnres/cli.py")
    tree("lrattnres/__main__.py", "from lrattnres import cli\n")
    tree("lrattnres/stage.py", "from lrattnres import helper\n")
    tree("lrattnres/helper.py")
    tree("lrattnres/report/__init__.py")
    tree("lrattnres/report/sections/__init__.py")
    tree("lrattnres/report/sections/one.py", "import kernels\n")
    tree("lrattnres/report/templates/page.html.j2", "<html>")
    assert deps.stage_files("lrattnres.stage") == ("lrattnres/__init__.py", "lrattnres/__main__.py",
                                                   "lrattnres/cli.py", "lrattnres/helper.py", "lrattnres/stage.py")
    report = deps.stage_files("lrattnres.report")
    assert {"lrattnres/report/sections/one.py", "kernels/__init__.py", "lrattnres/report/templates/page.html.j2"} <= set(report)


def test_the_fingerprint_follows_content_and_paths_not_times(tree):
    import os

    tree("lrattnres/a.py", "x = 1\n")
    tree("lrattnres/b.py", "y = 2\n")
    both = deps.fingerprint(["lrattnres/a.py", "lrattnres/b.py"])
    assert len(both) == deps.FINGERPRINT_DIGITS and both == deps.fingerprint(["lrattnres/b.py", "lrattnres/a.py"])
    os.utime(deps.REPO / "lrattnres" / "a.py", (1, 1))  # a bare touch
    assert deps.fingerprint(["lrattnres/a.py", "lrattnres/b.py"]) == both
    tree("lrattnres/a.py", "x = 1\n# a change\n")
    assert deps.fingerprint(["lrattnres/a.py", "lrattnres/b.py"]) != both
    tree("lrattnres/a.py", "x = 1\n")
    assert deps.fingerprint(["lrattnres/a.py", "lrattnres/b.py"]) == both
    assert deps.fingerprint(["lrattnres/a.py"]) != both  # which files, not only what they hold


def test_every_stage_has_a_code_fingerprint():
    codes = {stage: deps.stage_code(stage) for stage in STAGES}
    assert all(len(c) == deps.FINGERPRINT_DIGITS for c in codes.values())
    assert codes["train"] != codes["report"]

