"""Shared fixtures: a throw-away copy of the repository for workflow runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


# Without CUDA the kernel tests run the Triton kernels through Triton's interpreter.  It has to be
# chosen before triton is first imported, since triton decorates its own library functions (tl.sum,
# ...) then; a test module that imports the kernels before tests/test_kernels.py is collected would
# otherwise leave them compiled-mode and every interpreted kernel fails.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if not _has_cuda():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


def copy_repo(dest: Path) -> Path:
    """Copy the working tree (tracked and untracked-not-ignored files) to ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        target = dest / rel
        if src.is_symlink():  # e.g. profiles -> workflow/profiles, where Snakemake looks for its profile
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(src))
        elif src.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def head_commit() -> str:
    """The commit the provenance of a result made from this tree names: LRATTNRES_COMMIT where set,
    else HEAD.  The tests run in a git checkout (CI clones the repository), so there is one."""
    named = os.environ.get("LRATTNRES_COMMIT")
    if named:
        return named
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    sha = proc.stdout.strip()
    assert proc.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha), (
        f"{REPO} is not a git checkout with a commit (git rev-parse HEAD: {proc.stderr.strip() or sha!r})")
    return sha


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; oversubscribed threads on a busy CPU are 10x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    return copy_repo(tmp_path / "repo")


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run Snakemake of this venv in ``workdir``."""
    env = dict(os.environ, PYTHONPATH=str(workdir))
    cmd = [sys.executable, "-m", "snakemake", *args]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


# ---- the fault suite's record (tests/test_fault_tolerance.py) ----------------------------------------

FAULTS: list[dict] = []


@pytest.fixture
def faults(request):
    """``faults(name, runs=1, lost=0)``: record a fault a test injected, how many runs it checked
    afterwards and how many of them lost anything (finished work, a valid checkpoint, progress)."""

    def record(name: str, runs: int = 1, lost: int = 0) -> None:
        FAULTS.append({"test": request.node.name, "fault": name, "runs": runs, "lost": lost})

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not FAULTS:
        return
    terminalreporter.write_sep("-", "fault suite")
    for f in FAULTS:
        terminalreporter.write_line(f"{f['fault']}: {f['runs']} run(s) checked, {f['lost']} lost anything ({f['test']})")
    lost = sum(f["lost"] for f in FAULTS)
    terminalreporter.write_line(f"{len(FAULTS)} faults tried; {lost} runs lost anything (goal: 0)")
