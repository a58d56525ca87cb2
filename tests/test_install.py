"""scripts/install.sh and envs/constraints.txt: the lock a fresh machine installs from."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "envs" / "constraints.txt"


def _pins() -> dict[str, str]:
    pins = {}
    for n, line in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line.strip())
        assert m, f"{CONSTRAINTS}:{n}: expected name==version, got {line!r}"
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert name not in pins, f"{CONSTRAINTS}:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def test_constraints_pin_the_corpus_packages_and_leave_the_accelerator_stack_alone():
    pins = _pins()
    # the embedded corpus reads these packages' docstrings (torch is pinned by install.sh itself)
    for name in ("numpy", "sympy", "pandas", "networkx", "matplotlib", "datasets", "huggingface-hub"):
        assert name in pins, f"{name} is not pinned in {CONSTRAINTS}"
    # a GPU machine keeps its CUDA torch and triton: pinning them would replace them
    for name in pins:
        assert not (name in ("torch", "triton", "lrattnres") or name.startswith("nvidia-")), name


def test_install_script_uses_the_constraints_unless_unlocked():
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert "-c envs/constraints.txt" in text and '"${LOCK:-1}" = 1' in text
