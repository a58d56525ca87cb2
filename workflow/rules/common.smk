# Shared helpers: the resolved settings of the selected scale, source-file inputs, spec quoting.
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)

from lrattnres.config import ConfigError, resolve, resolve_rank
from lrattnres.data.spec import science as science_data_spec
from lrattnres.deps import closure, package_files, package_modules

try:
    S = resolve(config, source="config.yaml (with --config/--configfile overrides)")
except ConfigError as err:
    raise WorkflowError(f"invalid configuration: {err}")

SCALE = S["scale"]
R = S["results"]
LOGS = f"{R}/logs"

# Rules run `python -m lrattnres ...` from the repository whether or not the package is installed.
# Without --sdm conda, `python` is the interpreter running Snakemake (the project's venv), so the
# workflow works without activating it; with conda, it is the rule's environment.
_deploy = {m.name for m in (workflow.deployment_settings.deployment_method or ())}
_bindir = (
    "" if "CONDA" in _deploy else f"export PATH={Path(sys.executable).parent}:$PATH; "
)
shell.prefix(f"{_bindir}export PYTHONPATH={workflow.basedir}:${{{{PYTHONPATH:-}}}}; ")


def stage_sources(*modules):
    """The first-party files a stage imports (see lrattnres/deps.py): inputs of its rule."""
    return list(closure("lrattnres.__main__", "lrattnres.cli", *modules))


def spec(obj):
    """A stage's settings as one JSON argument (quote with {params.spec:q})."""
    return json.dumps(obj, sort_keys=True)


def res(rule_name, key, fallback):
    """Resource ``key`` of a rule at this scale (config `resources`), else the scale's default."""
    table = S.get("resources", {})
    for block in (table.get(rule_name, {}), table.get("default", {})):
        if key in block:
            return block[key]
    return fallback


# Result files the report reads: each stage's .smk appends its outputs.
REPORT_INPUTS = []
