"""Shared fixtures and helpers: a throw-away copy of the repository for workflow runs, Snakemake runs,
the fault suite's record, the GPU suite (``--gpu-suite``), and the order of the test files, which
pytest-xdist's workers take one file at a time."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
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


# The GPU suite (scripts/run_gpu_tests.py): every case of the kernel test files (on a GPU their kernels
# compile for the device instead of running in Triton's interpreter) and every case marked ``gpu``.
GPU_SUITE_FILES = ("test_kernels.py", "test_kernels_naive.py", "test_kernels_tuner.py")

# pytest-xdist (pyproject's addopts: -n 2 --dist loadfile --no-loadscope-reorder): a worker takes a
# whole test file at a time, in the order of the collected tests, so that a file's tests share their
# module-scoped setups (the smoke DAG of tests/test_smoke_dag.py among them) and run in the order they
# are written; the Slurm tests are all in tests/test_slurm.py (one run at a time uses the cluster).
# The longest files go first (in this order, measured on two cores), so that neither worker is left
# with a long one at the end; the others follow as collected.
LONG_FILES = ("test_smoke_dag.py", "test_slurm.py", "test_kernels.py", "test_pieces.py", "test_workflow.py",
              "test_kernel_compare.py", "test_fault_tolerance.py", "test_gpu_share_bench.py",
              "test_sharded_training.py", "test_kernel_check.py")


def pytest_addoption(parser):
    parser.addoption("--gpu-suite", action="store_true",
                     help=f"only the GPU suite: every case of {', '.join(GPU_SUITE_FILES)} and every case marked gpu")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-suite"):
        keep = [i for i in items if i.path.name in GPU_SUITE_FILES or i.get_closest_marker("gpu") is not None]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if not _has_cuda():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
    # the long files first, each file's tests in the order they are written
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items[:] = sorted(items, key=lambda item: first.get(item.path.name, len(first)))


WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "model layer residual attention depth query key value token document routing weight sum block rank").split()


def word_corpus(d: Path, seed: int, docs: int = 400) -> str:
    """A jsonl corpus of random sentences over WORDS in ``d``, prepared (compact vocabulary); the
    manifest's path. The training tests' small data."""
    import random

    from lrattnres.data import prepare

    rng = random.Random(seed)
    with open(d / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120)))}) + "\n")
    prepare({"source": "local", "local": {"glob": str(d / "docs.jsonl")}, "val_tokens": 1500,
             "shard_tokens": 20000, "vocab": "compact"}, d / "data", progress=False)
    return str(d / "data" / "manifest.json")


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
    afterwards and how many of them lost anything (finished work, a valid checkpoint, progress).  The
    record travels with the test's report (pytest-xdist sends it from its worker)."""

    def record(name: str, runs: int = 1, lost: int = 0) -> None:
        request.node.user_properties.append(("fault", {"fault": name, "runs": runs, "lost": lost}))

    return record


def pytest_runtest_logreport(report):
    if report.when == "call":
        FAULTS.extend({"test": report.nodeid.split("::")[-1].split("@")[0], **value}
                      for key, value in report.user_properties if key == "fault")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not FAULTS:
        return
    terminalreporter.write_sep("-", "fault suite")
    for f in FAULTS:
        terminalreporter.write_line(f"{f['fault']}: {f['runs']} run(s) checked, {f['lost']} lost anything ({f['test']})")
    lost = sum(f["lost"] for f in FAULTS)
    terminalreporter.write_line(f"{len(FAULTS)} faults tried; {lost} runs lost anything (goal: 0)")


# ---- Snakemake runs --------------------------------------------------------------------------------


# The smoke scale's grid cut to one seed, one rank and one block count, as --config entries: every rule
# of the smoke DAG still runs (34 jobs instead of 45).  For the tests of the DAG's machinery (Slurm,
# pieces); tests/test_smoke_dag.py runs the whole grid and checks its verdicts.
ONE_OF_EACH = ('grid={"ranks": ["d/4"], "blocks": [2], "seeds": 1, "projected": []}',
               'accounting={"ranks": ["d/4"], "blocks": [2]}')


def readme_command() -> list[str]:
    """The README's first command (Quick start: install, then run the whole pipeline), with its
    ``.venv/bin/`` the folder of this interpreter (CI's .venv is what install.sh made)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^bash scripts/install\.sh && (\.venv/bin/\S+ [^\n#]*?)\s*$", text, re.M)
    assert m, "README.md: no Quick start command `bash scripts/install.sh && .venv/bin/... reports/paper.html`"
    args = shlex.split(m.group(1))
    args[0] = str(Path(sys.executable).parent / args[0].removeprefix(".venv/bin/"))
    return args


def popen_snakemake(workdir: Path, *args: str, cmd: list[str] | None = None, env: dict | None = None,
                    out=subprocess.PIPE) -> subprocess.Popen:
    """Snakemake (this venv's, or ``cmd``) in its own session (process group), so that a test can kill
    the whole group; its output to ``out`` (a pipe, or an open file for a long run)."""
    env = dict(os.environ, PYTHONPATH=str(workdir)) if env is None else env
    return subprocess.Popen(
        cmd or [sys.executable, "-m", "snakemake", *args], cwd=workdir, env=env, start_new_session=True,
        stdout=out, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(cond, timeout: float, proc: subprocess.Popen | None = None, what: str = "",
             output=lambda proc: proc.stdout.read() if proc.stdout else "") -> None:
    """Poll ``cond`` every 0.1 s until it holds; fail if ``proc`` ends first or after ``timeout``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended ({proc.returncode}) before {what}:\n{output(proc)[-5000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_counts(stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a Snakemake run or dry run as {rule: count} ({} when nothing is to do)."""
    counts: dict[str, int] = {}
    lines = stdout.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().startswith("Job stats"))
    except StopIteration:
        return counts
    for line in lines[start + 3 :]:
        m = re.match(r"^(\S+)\s+(\d+)$", line.strip())
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    counts.pop("total", None)
    return counts


def check_outputs_complete(root: Path) -> dict[str, int]:
    """Every file under ``root`` that looks like a finished output is whole: JSON parses, weights and
    checkpoints pass their sha256 check, the data manifest verifies (every shard's size and sha256),
    HTML is closed. Temporary files of atomic writes (hidden, *.tmp) may remain after a kill -9; they
    never carry an output's name. Stale checkpoints (moved aside) are left as they are."""
    from lrattnres.data import load_manifest
    from lrattnres.train import checkpoint as ckpt

    counts = {"json": 0, "weights": 0, "checkpoint": 0, "manifest": 0, "html": 0, "jsonl": 0}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).parts
        if not f.is_file() or f.name.startswith(".") or f.suffix == ".tmp" or {".snakemake", "stale"} & set(rel):
            continue
        if f.name == ckpt.CHECKPOINT_FILE:
            ckpt.read_record(f.parent)
            counts["checkpoint"] += 1
        elif f.suffix == ".json":
            try:
                json.loads(f.read_text(encoding="utf-8"))
            except ValueError as e:
                raise AssertionError(f"{f}: looks complete but is not valid JSON ({e})") from None
            counts["json"] += 1
            if f.name == "manifest.json":
                load_manifest(f, verify=True)
                counts["manifest"] += 1
        elif f.name == ckpt.MODEL_FILE:
            ckpt.read_model(f)
            counts["weights"] += 1
        elif f.suffix == ".html":
            assert f.read_text(encoding="utf-8").rstrip().endswith("</html>"), f
            counts["html"] += 1
        elif f.suffix == ".jsonl":
            # an append-only log: a kill may cut its last line, never an earlier one
            for line in f.read_text(encoding="utf-8").split("\n")[:-2]:
                json.loads(line)
            counts["jsonl"] += 1
    return counts
