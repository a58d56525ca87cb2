"""scripts/gpu_suite_census.py: what makes one Triton build, and a dry run of a GPU case on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_suite_census as census  # noqa: E402


def test_spec_key_follows_triton_specialisation():
    """One build per dtype, 16-byte alignment, integer equal to 1 or divisible by 16, constexpr value
    and launch option; other integer values share it."""
    from kernels import sums

    kernel = sums._sum_rows_kernel
    x, y = torch.zeros(64, 8), torch.zeros(8)

    def key(x=x, y=y, P=37, BLOCK_P=64, **opts):
        return census.spec_key(kernel, (x, y, P, 8, 5), dict(BLOCK_P=BLOCK_P, BLOCK_R=64, **opts))

    assert key() == key(P=38) == key(num_warps=4)
    others = [key(P=32), key(P=1), key(BLOCK_P=32), key(y=y.double()), key(x=x.view(-1)[1:]), key(num_warps=2)]
    assert len({key(), *others}) == 7


def test_a_gpu_case_runs_dry_and_its_builds_are_counted(tmp_path):
    """A gpu-marked bf16 case (no CUDA here) runs dry: its forward and backward launches are
    recorded, none run, and nothing is left uncounted."""
    out = tmp_path / "census.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_suite_census.py"), "--no-cases", "--json",
                           str(out), "--", "-k", "test_gpu_bf16_paper_criterion and 1536-384-5"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["by_kernel"].get("_attnres_fwd_kernel") == 1 and got["by_kernel"].get("_attnres_bwd_kernel") == 1
    assert got["not_counted"] == {}
    row = got["per_test"]["tests/test_kernels.py::test_gpu_bf16_paper_criterion"]
    assert row["specialisations"] == got["specialisations"] >= 2
