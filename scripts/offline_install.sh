#!/usr/bin/env bash
# Install a bundle made by scripts/offline_bundle.py (it is the bundle's install.sh) on a machine
# without network:
#   bash BUNDLE/install.sh DIR && source DIR/env.sh
# checks every file against SHA256SUMS and the interpreter against the bundle's target (Python X.Y,
# machine), installs the wheels into DIR/site with `pip install --no-index --no-deps --target`,
# unpacks the downstream tasks' data into DIR/task-data and writes DIR/env.sh, which puts DIR/site
# first on PYTHONPATH (and DIR/site/bin on PATH), names the task data in LRATTNRES_TASK_DATA and keeps
# Hugging Face's libraries offline.
# Environment: PYTHON, the interpreter that runs the project (default python3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash $0 DIR" >&2
  exit 2
fi
py=${PYTHON:-python3}

(cd "$here" && sha256sum --check --quiet SHA256SUMS)
"$py" - "$here/manifest.json" <<'PY'
import json, platform, sys
target = json.load(open(sys.argv[1]))["target"]
want, have = target["python_version"], "%d.%d.%d" % sys.version_info[:3]
if not (have + ".").startswith(want + "."):
    sys.exit(f"install.sh: the bundle is for Python {want}, {sys.executable} is {have} (set PYTHON)")
if platform.machine() != target["arch"]:
    sys.exit(f"install.sh: the bundle is for {target['arch']}, this machine is {platform.machine()}")
PY

mkdir -p "$1"
dir=$(cd "$1" && pwd)
shopt -s nullglob
wheels=("$here"/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  "$py" -m pip install --disable-pip-version-check --quiet --no-index --no-deps --no-compile --upgrade \
    --target "$dir/site" "${wheels[@]}"
fi
if [ -f "$here/task-data.tar.xz" ]; then
  rm -rf "$dir/task-data"
  "$py" - "$here/task-data.tar.xz" "$dir/task-data" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    try:
        tar.extractall(sys.argv[2], filter="data")
    except TypeError:  # a Python without extraction filters
        tar.extractall(sys.argv[2])
PY
fi

{
  printf 'export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\n' "$dir/site"
  printf 'export PATH=%q:$PATH\n' "$dir/site/bin"
  if [ -d "$dir/task-data" ]; then printf 'export LRATTNRES_TASK_DATA=%q\n' "$dir/task-data"; fi
  echo "export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1"
} >"$dir/env.sh"
echo "installed ${#wheels[@]} wheels into $dir/site; before running the project: source $dir/env.sh"
