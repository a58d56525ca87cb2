"""scripts/run_gpu_tests.py: the GPU suite it selects, and the log it writes (checked here on the CPU,
where every GPU case skips)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import GPU_SUITE_FILES, REPO, head_commit

SCRIPT = REPO / "scripts" / "run_gpu_tests.py"


# One collection, seen from outside the suite's filter: every collected case with its ``gpu`` mark
# (before tests/conftest.py selects), then the cases the collection keeps.
_COLLECT = """
import json, sys, pytest

class Seen:
    every, kept = {}, []

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items):
        self.every.update({i.nodeid: i.get_closest_marker("gpu") is not None for i in items})
        yield
        self.kept[:] = [i.nodeid for i in items]

seen = Seen()
code = pytest.main(["-p", "no:cacheprovider", "-n", "0", "--collect-only", "-q", *sys.argv[1:]], plugins=[seen])
print(json.dumps({"code": int(code), "every": seen.every, "kept": seen.kept}))
"""


def test_gpu_suite_is_the_kernel_tests_and_every_gpu_case():
    kernel_files = [f"tests/{name}" for name in GPU_SUITE_FILES]
    assert kernel_files == ["tests/test_kernels.py", "tests/test_kernels_naive.py", "tests/test_kernels_tuner.py"]
    files = [*kernel_files, "tests/test_diagnostics.py", "tests/test_routing.py"]
    proc = subprocess.run([sys.executable, "-c", _COLLECT, *files, "--gpu-suite"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    every, suite = got["every"], got["kept"]
    assert got["code"] == 0 and len(suite) == len(set(suite))
    kernels = {i for i in every if i.split("::")[0] in kernel_files}
    gpu = {i for i, marked in every.items() if marked}
    for f in kernel_files:  # every case of each kernel test file, GPU-marked or not
        assert any(i.startswith(f + "::") for i in kernels), f
    assert gpu - kernels and kernels - gpu  # GPU cases outside the kernel files, CPU cases inside them
    assert set(suite) == kernels | gpu
    assert "tests/test_diagnostics.py::test_routing_diagnostics_with_bf16_autocast[cuda-1e-05]" in suite
    assert "tests/test_diagnostics.py::test_routing_diagnostics_with_bf16_autocast[cpu-0.00390625]" in every
    assert not any(i.startswith("tests/test_routing.py::") for i in suite)


def test_refuses_to_run_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--log", str(tmp_path / "x.log")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and not (tmp_path / "x.log").exists()


# A suite of its own (with --all: no --gpu-suite filter): cases that pass, one that skips, one marked
# gpu_alone, and one that fails when BREAK=1 is set.
FAKE_SUITE = """
import os, pytest

@pytest.mark.parametrize("i", range(4))
def test_passes(i):
    assert i < 4

@pytest.mark.skip(reason="needs CUDA")
def test_skips():
    pass

@pytest.mark.gpu_alone
def test_alone():
    assert os.environ.get("PYTEST_XDIST_WORKER") is None  # one at a time: not on an xdist worker

def test_breaks_on_request():
    assert os.environ.get("BREAK") != "1"
"""
ALONE = "test_fake.py::test_alone"


def _run(tmp_path, *args, env=None):
    suite = tmp_path / "test_fake.py"
    suite.write_text(FAKE_SUITE)
    return subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--all", "--tests", str(suite), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def _meta(log):
    return json.loads(log.with_name(log.name + ".json").read_text())


def test_log_names_commit_device_versions_and_every_result(tmp_path):
    """Two parts (on the CPU, --gpus 2 deals the cases as on two GPUs): the log's header, each part's
    pytest report (a line per case; the gpu_alone case after the others, one at a time), the summary
    over both parts with every skip and its reason, and the JSON summary beside the log."""
    log = tmp_path / "gpu.log"
    proc = _run(tmp_path, "--gpus", "2", "--log", str(log))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = log.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("GPU test suite of lrattnres")
    assert f"commit: {head_commit()} " in text
    assert any(line.startswith("device") for line in lines) and "torch: " in text
    assert "versions: " in text and "triton " in text and "pytest " in text
    assert re.search(r"^selected: 7 cases \(the whole suite\), in 2 part\(s\)$", text, re.M)
    assert "workers: 1 per GPU; 1 cases marked gpu_alone run after the others, one at a time" in text
    parts = re.findall(r"^===== part (\d) of 2: (\d+) cases \((\d) alone\), GPU (\d), exit (.+)$", text, re.M)
    assert [(p, n, g) for p, n, _, g, _ in parts] == [("1", "4", "0"), ("2", "3", "1")]
    assert sum(int(a) for _, _, a, _, _ in parts) == 1 and all(codes == "0" or codes == "0, 0" for *_, codes in parts)
    # the alone case runs in its own pytest after the part's others
    part = text[text.rindex("===== part", 0, text.index(f"{ALONE} PASSED")):]
    assert part.index("----- shared: ") < part.index("----- alone: 1 cases, one at a time") < part.index(ALONE)
    # pytest's own line for each case, then the summary with every skip and its reason
    assert len(re.findall(r"test_fake\.py::test_passes\[\d\] PASSED", text)) == 4
    assert "6 passed, 0 failed, 0 errors, 1 skipped of 7 selected" in text
    assert re.search(r"^SKIPPED \S*test_fake\.py::test_skips: needs CUDA$", text, re.M)
    assert not list(tmp_path.glob("gpu.log.part*"))  # the live reports are folded into the log
    meta = _meta(log)
    assert meta["commit"] == head_commit() and meta["shard"] == meta["shards"] == 1 and meta["exit_ok"]
    assert meta["selected"] == meta["selected_total"] == 7 and meta["skipped"] == 1 and meta["passed"] == 6
    assert len(meta["durations"]) == 7 and all(t >= 0 for t in meta["durations"].values())  # every case's seconds
    assert len(re.findall(r"^SLOWEST \d+\.\d s \S*test_fake\.py::", text, re.M)) == 7


def test_a_failing_case_fails_the_run(tmp_path):
    """A failing case is named in the log's summary and in its JSON, and the exit status is 1."""
    log = tmp_path / "gpu.log"
    proc = _run(tmp_path, "--log", str(log), env={"BREAK": "1"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = log.read_text()
    assert "5 passed, 1 failed, 0 errors, 1 skipped of 7 selected" in text
    assert re.search(r"^FAILED \S*test_fake\.py::test_breaks_on_request$", text, re.M)
    assert "AssertionError" in text  # pytest's traceback is in the log
    assert not _meta(log)["exit_ok"] and len(_meta(log)["failures"]) == 1


def test_shards_on_workers_merge_into_one_log(tmp_path):
    """--shard K/N runs every N-th case from the K-th (the shared cases on two pytest-xdist workers);
    --merge joins the shards of one run into one log, and refuses a missing shard or a shard of
    another commit."""
    logs = [tmp_path / f"shard{k}.log" for k in (1, 2)]
    for k, log in enumerate(logs, 1):
        proc = _run(tmp_path, "--shard", f"{k}/2", "--workers", "2", "--log", str(log))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert " on 2 workers" in log.read_text() and "created: 2/2 workers" in log.read_text()
    metas = [_meta(log) for log in logs]
    assert [m["selected"] for m in metas] == [4, 3] and {m["selected_total"] for m in metas} == {7}
    assert "; shard 2 of 2: cases 2, 4, 6, ... of 7" in logs[1].read_text()

    merged = tmp_path / "all.log"

    def merge(*shards):
        return subprocess.run([sys.executable, str(SCRIPT), "--merge", *map(str, shards), "--log", str(merged)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)

    proc = merge(*logs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = merged.read_text()
    assert text.index("##### shard 1 of 2: shard1.log") < text.index("##### shard 2 of 2: shard2.log")
    assert "6 passed, 0 failed, 0 errors, 1 skipped of 7 selected" in text
    assert f"commit: {head_commit()}" in text and _meta(merged)["passed"] == 6

    refused = merge(logs[0])
    assert refused.returncode != 0 and "expected each of 1..2 once" in refused.stderr
    logs[1].with_name("shard2.log.json").write_text(json.dumps(dict(metas[1], commit="0" * 40)))
    refused = merge(*logs)
    assert refused.returncode != 0 and "shard2.log has commit '" + "0" * 40 in refused.stderr
