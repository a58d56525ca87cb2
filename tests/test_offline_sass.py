"""benchmarks/offline_sass.py: the kernels compile for sm_90 on a machine without a GPU, and STAGES > 1
does hand the source loop to Triton's pipeliner (cp.async copies), while STAGES 1 leaves it alone."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _has_cuobjdump() -> bool:
    try:
        import triton
    except Exception:  # pragma: no cover - triton missing
        return False
    return bool(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")))


@pytest.mark.skipif(not _has_cuobjdump(), reason="triton with its cuobjdump is needed")
def test_pipelined_source_loop_uses_async_copies():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it on CPU machines
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline_sass.py"), "--configs", "split,split-stages2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    by = {(r["config"], r["kernel"]): r for r in rows}
    kernels = ("table-fwd", "table-bwd", "args-fwd", "args-bwd")
    assert set(by) == {(c, k) for c in ("split", "split-stages2") for k in kernels}
    for k in kernels:
        assert by[("split", k)]["ldgsts"] == 0, k
        assert by[("split-stages2", k)]["ldgsts"] > 0, k
        assert 0 < by[("split", k)]["registers"] <= 255
        assert by[("split", k)]["build_s"] > 0, k  # built, not read from a cache


def test_unknown_configuration_is_named():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline_sass.py"), "--configs", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown --configs ['nope']" in proc.stderr


def test_inner_loop_size_reads_the_shortest_backward_branch():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import offline_sass

    listing = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0c60*/              @!P0 BRA 0x1fc0 ;",  # forward branch: not a loop
        "        /*1000*/                   IADD3 R2, R2, 0x1, RZ ;",
        "        /*1150*/                   LDG.E R4, [R2.64] ;",
        "        /*1fb0*/               @P6 BRA 0x1150 ;",  # inner loop: 0x1150 .. 0x1fb0
        "        /*2000*/                   BRA 0x1000 ;",  # outer loop
        "        /*3b00*/                   BRA 0x3b00;",  # the trap's branch to itself
    ])
    assert offline_sass.inner_loop_size(listing) == (0x1FB0 - 0x1150) // 16 + 1
    assert offline_sass.inner_loop_size("        /*0000*/  EXIT ;") is None
