# Shared helpers: the resolved settings of the selected scale, spec quoting, the command every stage
# runs through (with the fingerprint of the stage's code), GPU resources.
import json
import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)

from lrattnres import gpus, jobplan
from lrattnres.config import ConfigError, resolve, science
from lrattnres.data.spec import science as science_data_spec
from lrattnres.deps import stage_code
from lrattnres.recorded import RECORDED
from lrattnres.recorded import load as load_recorded
from lrattnres.recorded import resolve_path

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


def recorded_files():
    """reports/recorded.yaml and the files it names that exist (results measured elsewhere): report
    inputs; a pattern names its newest recording. A missing or malformed list is never an error
    here: the report page notes it.
    """
    entries, _notes = load_recorded(RECORDED)
    listed = [RECORDED] if os.path.exists(RECORDED) else []
    found = (resolve_path(p) for p in entries.values())
    return listed + [p for p in found if p and os.path.exists(p)]


def attempt(wildcards, attempt):
    """Snakemake's attempt number of a job, as a resource that the shell command passes on."""
    return attempt


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


# GPUs (lrattnres/gpus.py): every GPU job declares `gpu` (the GPUs it uses; what a cluster executor
# requests) and `gpu_slots`. Each GPU has GPU_SLOTS slots; the jobs of a rule that the scale lets k
# jobs share a GPU (resources jobs_per_gpu = k) take GPU_SLOTS / k of them per GPU, every other GPU
# job (the timing jobs always) all of them, so it has its GPU to itself. On one machine the workflow offers GPU_SLOTS slots per GPU:
# `--resources gpu=N` says how many GPUs there are (default: the machine's), and the slots, not the
# `gpu` count, then limit what runs at once. A cluster's scheduler places jobs itself.
GPU_SLOTS = math.lcm(
    *(
        int(block.get("jobs_per_gpu", 1))
        for block in S.get("resources", {}).values()
        if isinstance(block, dict)
    ),
    1,
)


def gpu_slots(rule_name):
    """The GPU slots a job of ``rule_name`` takes (0 for a CPU job)."""
    k = int(res(rule_name, "jobs_per_gpu", 1))
    return int(res(rule_name, "gpu", 0)) * GPU_SLOTS // k


# one machine: no --jobs, no cluster executor
if workflow.global_resources["_nodes"].value is None:
    _given = workflow.global_resources.get("gpu").value
    _n_gpus = gpus.count() if _given is None else int(_given)
    if workflow.global_resources.get("gpu_slots").value is None:
        workflow.global_resources["gpu_slots"] = _n_gpus * GPU_SLOTS
    workflow.global_resources["gpu"] = None  # counted by the slots
    _gpu_rules = sorted(r for r in S.get("resources", {}) if int(res(r, "gpu", 0)) > 0)
    if _n_gpus == 0 and _gpu_rules:
        print(
            f"warning: scale {SCALE!r} runs {', '.join(_gpu_rules)} on GPUs, and this machine shows "
            "none (CUDA_VISIBLE_DEVICES, /dev/nvidia*): those jobs cannot start here; "
            "--resources gpu=N names the GPUs to use",
            file=sys.stderr,
        )


_PARTITION_LIMITS = {}


def partition_limit(rule_name):
    """Under Snakemake's Slurm executor, the time limit (minutes) of the partition of the rule's jobs
    (sinfo, asked once per partition), which caps an automatic wall time; None elsewhere or where the
    partition has no limit."""
    plugin = workflow.executor_plugin
    if plugin is None or getattr(plugin, "name", None) != "slurm":
        return None
    part = jobplan.slurm_partition(workflow.resource_settings, rule_name)
    if part not in _PARTITION_LIMITS:
        _PARTITION_LIMITS[part] = jobplan.partition_limit_min(part)
    return _PARTITION_LIMITS[part]


def _capped(minutes, rule_name):
    cap = jobplan.runtime_cap_min(S, partition_limit(rule_name))
    return min(minutes, cap) if cap else minutes


def train_runtime(wc):
    """The wall time of a run's training job: config's minutes, or (auto) estimated from the run's
    size and tokens, at most the longest job the cluster takes (lrattnres/jobplan.py); a longer run
    continues in the next run of the same job."""
    given = res("train", "runtime", 60)
    if given != "auto":
        return given
    run = RUNS[wc.run]
    return _capped(
        jobplan.runtime_min(S, train_spec(S, run), run.preset) or 60, "train"
    )


def throughput_runtime(wc):
    """The wall time of one size's timing job: config's minutes, or (auto) from Appendix I's protocol."""
    given = res("throughput", "runtime", 30)
    if given != "auto":
        return given
    return _capped(
        jobplan.throughput_runtime_min(S, wc.preset) or 60, "throughput_size"
    )


def stage(command, gpu=False, launcher="python -m lrattnres", code=True):
    """The shell command of a rule: ``command`` (a stage and its arguments, every path quoted with
    {...:q}) run as `python -m lrattnres --job-log <log> --attempt <n> --code <c> <stage> ...`. The
    exit status is recorded beside the log, every attempt's log is kept, and a retry of a failure that
    a retry cannot fix stops at once (lrattnres/attempts.py). ``--code`` is the rule's `code` param:
    stage_code(<stage>), the fingerprint of the files the stage imports (lrattnres/deps.py), which
    Snakemake's params trigger compares with the one the job ran with, so that a real change of one of
    them reruns exactly the jobs of the stages that import it (``code=False``: a rule whose output a
    code change must not redo). A stage that may run on a GPU (``gpu``) first claims the GPU slots its
    job declares and then sees only that GPU, or none where the job declares none (lrattnres/gpus.py).
    """
    job = "--job-log {log:q} --attempt {resources.attempt}" + (
        " --code {params.code}" if code else ""
    )
    if gpu:
        job += f" --gpu-slots {{resources.gpu_slots}}/{GPU_SLOTS}"
    return f"{launcher} {job} {command}"


# Result files the report reads: each stage's .smk appends its outputs.
REPORT_INPUTS = []
