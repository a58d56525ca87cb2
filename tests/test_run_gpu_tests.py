"""scripts/run_gpu_tests.py: the GPU suite it selects, and the log it writes (checked here on the CPU,
where every GPU case skips)."""

from __future__ import annotations

import json
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


def test_log_names_commit_device_versions_and_every_result(tmp_path):
    """Two parts (on the CPU, --gpus 2 deals the cases as on two GPUs): the log's header, each part's
    pytest report, and the summary over both parts with every skip and its reason."""
    log = tmp_path / "gpu.log"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--allow-cpu", "--gpus", "2", "--log", str(log), "--tests",
                           "tests/test_kernels_tuner.py", "tests/test_diagnostics.py", "--", "-k",
                           "with_bf16_autocast or fault"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = log.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("GPU test suite of lrattnres")
    assert f"commit: {head_commit()} " in text
    assert any(line.startswith("device") for line in lines) and "torch: " in text
    assert "versions: " in text and "triton " in text and "pytest " in text
    selected = int(re.search(r"^selected: (\d+) cases \(the GPU suite\), in 2 part\(s\)$", text, re.M).group(1))
    assert selected >= 4  # the tuner's fault cases and the diagnostics' CUDA case
    parts = re.findall(r"^===== part (\d) of 2: (\d+) cases, GPU (\d), exit 0$", text, re.M)
    assert [(p, g) for p, _, g in parts] == [("1", "0"), ("2", "1")] and sum(int(n) for _, n, _ in parts) == selected
    # pytest's own report of each case, then the summary with every skip and its reason
    assert "PASSED tests/test_kernels_tuner.py::" in text and "SKIPPED [1] tests/test_diagnostics.py" in text
    assert f"{selected - 1} passed, 0 failed, 0 errors, 1 skipped of {selected} selected" in text
    assert "SKIPPED tests/test_diagnostics.py::test_routing_diagnostics_with_bf16_autocast[cuda-1e-05]: needs CUDA" in text
