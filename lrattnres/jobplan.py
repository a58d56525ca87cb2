"""What a training job asks of a cluster: where its ranks run, how they start, how long it may take,
and how early Slurm warns it.

Placement (``resources.train``: ``gpu`` per node, ``nodes``, ``launcher``):

* one GPU: ``python -m lrattnres``;
* one node (``nodes: 1``): ``sbatch --nodes=1 --gpus=<gpu> --gpus-per-node=<gpu>`` and, inside the
  job, ``torchrun --standalone --nproc-per-node <gpu>`` (a rendezvous local to the node);
* several nodes (``nodes: N > 1``): ``sbatch --nodes=N --ntasks=N --gpus-per-node=<gpu>``; the job
  runs ``srun --nodes=N --ntasks-per-node=1`` and on each node ``torchrun --nnodes=N
  --nproc-per-node=<gpu> --rdzv-backend=c10d --rdzv-endpoint=<first node>:<port>
  --rdzv-id=$SLURM_JOB_ID`` (Snakemake's Slurm executor runs the job's command in the batch script,
  like an MPI job's, so that its own ``srun`` spans the nodes);
* ``launcher: srun`` uses the spanning launcher on one node too (``srun --overlap`` inside the
  executor's job step): the same start-up as a job of several nodes.

Time (``cluster``): one update takes ``tokens_per_update / (tokens_per_s_per_gpu[size] x GPUs)``;
a checkpoint write takes the largest rank's share (lrattnres/memory.py's partition of the weights
and optimiser state) at ``checkpoint_write_gbps`` plus hashing at ``checkpoint_hash_gbps``. A
preempted or timed-out rank first finishes its update (or a periodic validation), then writes; the
signal lead (``sbatch --signal=TERM@<lead>``) and torchrun's ``--shutdown-timeout`` both cover
that plus ``signal_margin_s`` (Slurm may signal up to a minute off). A job's wall time
(``resources.train.runtime: auto``) is the run's tokens at that speed, its checkpoints and
validations, the start-up, times ``1 + job_margin``, at most the longest job the cluster takes:
``runtime_max_min``, or the partition's own limit (``sinfo``) where that is shorter
(:func:`runtime_cap_min`). A run longer than that is a chain of runs of the same Slurm job: its
trainer stops at a deadline before the job's end and requeues the job, which resumes from the
checkpoint (lrattnres/slurmjob.py; :func:`jobs_needed` says how many runs).
``python -m lrattnres jobs [--scale paper] [--partition P]`` (lrattnres/jobs_cli.py) prints the plan.

Launch options are used only where the installed torch has them (:func:`torchrun_supports`): torchrun's
``--shutdown-timeout`` (PyTorch 2.11 and later) sets how long torchrun waits for its workers after
forwarding a SIGTERM; before it, torchrun kills them :data:`TORCHRUN_DEFAULT_SHUTDOWN_S` seconds
later, so a job whose update and checkpoint write take longer is refused (:func:`launcher`).
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
from typing import Any

from lrattnres import batch, memory
from lrattnres.errors import UserError
from lrattnres.gridplan import plan, train_spec
from lrattnres.presets import PAPER_VOCAB, get_preset
from lrattnres.throughput.spec import for_preset, resolve_spec

RDZV_PORT_BASE = 29400  # c10d rendezvous port: the base plus the job id modulo RDZV_PORT_SPAN
RDZV_PORT_SPAN = 20000
VAL_SPEEDUP = 3.0  # a forward pass costs about a third of a training step
LAUNCHERS = ("auto", "torchrun", "srun")
DEFAULT_LEAD_S = 300  # the signal lead and shutdown timeout where the scale gives no estimates
TORCHRUN_DEFAULT_SHUTDOWN_S = 30  # torchrun's wait between forwarding SIGTERM and SIGKILL without the option


class JobPlanError(UserError, ValueError):
    pass


def placement(settings: dict, gpus_per_node: int | None = None) -> dict[str, Any]:
    """``{gpus_per_node, nodes, world, launcher}``: launcher python | torchrun | srun.
    ``gpus_per_node``: the job's own GPU count where it differs from the config's (a
    ``--set-resources train:gpu=N``)."""
    train = settings.get("resources", {}).get("train", {})
    gpn, nodes = int(train.get("gpu", 0) or 0), int(train.get("nodes", 1) or 1)
    if gpus_per_node is not None:
        gpn = int(gpus_per_node)
    choice = train.get("launcher", "auto")
    if choice not in LAUNCHERS:
        raise JobPlanError(f"resources.train.launcher: {choice!r}; expected one of {', '.join(LAUNCHERS)}")
    if nodes > 1 and gpn < 1:
        raise JobPlanError(f"resources.train.nodes: {nodes} nodes without GPUs (resources.train.gpu 0); "
                           "expected gpu >= 1 for a job of several nodes")
    if nodes > 1 and choice == "torchrun":
        raise JobPlanError("resources.train.launcher: torchrun --standalone runs on one node; expected auto or "
                           f"srun for {nodes} nodes")
    if nodes > 1 or choice == "srun":
        how = "srun"
    elif gpn > 1:
        how = "torchrun"
    else:
        how = "python"
    return {"gpus_per_node": gpn, "nodes": nodes, "world": max(1, gpn) * nodes, "launcher": how}


def _cluster(settings: dict) -> dict:
    return settings.get("cluster") or {}


def update_s(settings: dict, preset: str) -> float | None:
    """Estimated seconds of one update of ``preset`` (None without a speed estimate)."""
    tps = (_cluster(settings).get("tokens_per_s_per_gpu") or {}).get(preset)
    if not tps:
        return None
    b = batch.split(settings, preset)
    return b["tokens_per_update"] / (tps * b["world"])


def checkpoint_write_s(settings: dict, preset: str) -> float | None:
    """Estimated seconds for the ranks to write and hash a checkpoint (the largest share)."""
    c = _cluster(settings)
    if not c.get("checkpoint_write_gbps"):
        return None
    shape = get_preset(preset)
    shape["vocab_size"] = shape["vocab_size"] or PAPER_VOCAB
    world = batch.world_size(settings)
    muon, adam = memory.parameter_shapes(shape, "attnres", shape["d_model"])
    # the weights (4 bytes) and the state (Muon 4, AdamW 8) of the parameters a rank owns
    share = max(8 * a + 12 * b for a, b in zip(memory.zero_partition(muon, world), memory.zero_partition(adam, world)))
    gb = share / 1e9
    return gb / c["checkpoint_write_gbps"] + gb / c.get("checkpoint_hash_gbps", c["checkpoint_write_gbps"])


def _val_s(settings: dict, preset: str, tokens: float) -> float:
    tps = (_cluster(settings).get("tokens_per_s_per_gpu") or {}).get(preset) or 0
    return tokens / (VAL_SPEEDUP * tps * batch.world_size(settings)) if tps else 0.0


def lead_s(settings: dict, preset: str) -> int | None:
    """Seconds from SIGTERM to a clean exit: the update under way (or a periodic validation, the longer),
    the checkpoint, the margin; :data:`DEFAULT_LEAD_S` without the estimates."""
    up, write = update_s(settings, preset), checkpoint_write_s(settings, preset)
    if up is None or write is None:
        return DEFAULT_LEAD_S
    train = settings["train"]
    b = batch.split(settings, preset)
    val = train.get("val", {})
    periodic = _val_s(settings, preset, val.get("batches", 0) * (b["val_batch_size"] or b["micro_batch"])
                      * train["seq_len"]) if val.get("every") else 0.0
    return int(math.ceil(max(up, periodic) + write + _cluster(settings).get("signal_margin_s", 60)))


def run_estimate_s(settings: dict, spec: dict, preset: str) -> float | None:
    """Estimated seconds of a whole training run of ``spec`` (None without a speed estimate)."""
    up = update_s(settings, preset)
    if up is None:
        return None
    b = batch.split(settings, preset)
    steps = spec.get("steps") or math.ceil(spec["tokens"] / b["tokens_per_update"])
    c, train = _cluster(settings), settings["train"]
    every = (train.get("checkpoint") or {}).get("every") or 0
    write = checkpoint_write_s(settings, preset) or 0.0
    val = train.get("val", {})
    n_val = steps // val["every"] if val.get("every") else 0
    periodic = _val_s(settings, preset, val.get("batches", 0) * (b["val_batch_size"] or b["micro_batch"]) * train["seq_len"])
    final = _val_s(settings, preset, settings.get("data", {}).get("val_tokens", 0))
    return (c.get("job_startup_s", 0) + steps * up + (steps // every if every else 0) * write
            + n_val * periodic + final)


def parse_slurm_minutes(text: str) -> int | None:
    """Minutes of a Slurm time limit as ``sinfo`` prints it (``30``, ``2:00:00``, ``1-00:00:00``,
    ``2-12``), or None for ``infinite``, ``UNLIMITED``, ``n/a`` and anything unreadable."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        return None
    days, a, b, c = m.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        h, mi, sec = int(a), int(b or 0), int(c or 0)
        return int(days) * 1440 + h * 60 + mi + math.ceil(sec / 60) if sec else int(days) * 1440 + h * 60 + mi
    if c is not None:  # hours:minutes:seconds
        return int(a) * 60 + int(b) + (1 if int(c) else 0)
    if b is not None:  # minutes:seconds
        return int(a) + (1 if int(b) else 0)
    return int(a)  # minutes


def partition_limit_min(partition: str | None = None, run=subprocess.run) -> int | None:
    """The time limit (minutes) of Slurm partition ``partition``, or of the default partition (the
    one ``sinfo`` marks with ``*``), as ``sinfo`` reports it; None where it is unlimited or unknown
    (no ``sinfo``, no answer, no such partition)."""
    try:
        proc = run(["sinfo", "-h", "-o", "%P|%l"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    limits = {}
    default = None
    for line in proc.stdout.splitlines():
        name, _, limit = line.strip().partition("|")
        if not name:
            continue
        if name.endswith("*"):
            name = name[:-1]
            default = name
        limits[name] = parse_slurm_minutes(limit)
    return limits.get(partition if partition else default)


def slurm_partition(resource_settings, rule: str) -> str | None:
    """The partition Snakemake's Slurm executor submits ``rule``'s jobs to: the ``slurm_partition`` of
    ``--set-resources`` for the rule, else of ``--default-resources``; None for the cluster's default
    partition. ``resource_settings``: Snakemake's (``workflow.resource_settings``)."""
    for mapping in ((getattr(resource_settings, "overwrite_resources", None) or {}).get(rule),
                    getattr(resource_settings, "default_resources", None)):
        try:
            value = mapping.get("slurm_partition") if mapping is not None else None
        except (AttributeError, KeyError, TypeError):
            value = None
        if hasattr(value, "raw"):  # a snakemake.resources.Resource: the text given, unevaluated
            value = value.raw
        value = value.strip("'\" ") if isinstance(value, str) else None
        if value:
            return value
    return None


def runtime_cap_min(settings: dict, partition_min: int | None = None) -> int | None:
    """The longest job a training or timing job may ask for: ``cluster.runtime_max_min`` or the
    partition's limit ``partition_min``, the shorter; None where neither is known."""
    caps = [x for x in (_cluster(settings).get("runtime_max_min"), partition_min) if x]
    return min(caps) if caps else None


def deadline_lead_s(settings: dict, preset: str) -> int:
    """Seconds before a job's end at which its trainer stops on its own to continue in the job's next
    run: the signal lead and ``signal_margin_s`` (Slurm may signal up to a minute early), so that the
    trainer's own checkpoint comes before Slurm's signal."""
    return int(lead_s(settings, preset) or DEFAULT_LEAD_S) + int(_cluster(settings).get("signal_margin_s", 60))


def runtime_min(settings: dict, spec: dict, preset: str, partition_min: int | None = None) -> int | None:
    """Minutes a training job of ``spec`` asks for: the estimate with the margin, at most the
    longest job the cluster takes (:func:`runtime_cap_min`); None without the estimates."""
    est = run_estimate_s(settings, spec, preset)
    if est is None:
        return None
    c = _cluster(settings)
    want = math.ceil(est * (1 + c.get("job_margin", 0.0)) / 60)
    cap = runtime_cap_min(settings, partition_min)
    return min(want, cap) if cap else want


def jobs_needed(settings: dict, spec: dict, preset: str, partition_min: int | None = None) -> int | None:
    """How many runs of a job of at most :func:`runtime_cap_min` a training run takes: each trains
    from its start-up to its deadline (:func:`deadline_lead_s` before the end), less the update and
    checkpoint it finishes there."""
    est = run_estimate_s(settings, spec, preset)
    c = _cluster(settings)
    cap = runtime_cap_min(settings, partition_min)
    if est is None or not cap:
        return None if est is None else 1
    want = est * (1 + c.get("job_margin", 0.0))
    if want <= cap * 60:
        return 1
    per_job = (cap * 60 - deadline_lead_s(settings, preset) - c.get("job_startup_s", 0)
               - (update_s(settings, preset) or 0) - (checkpoint_write_s(settings, preset) or 0))
    if per_job <= 0:
        raise JobPlanError(f"cluster.runtime_max_min: a job of {cap} min leaves no time to train after the start-up "
                           f"and the signal lead ({deadline_lead_s(settings, preset)} s); expected a longer job")
    return max(1, math.ceil((want - c.get("job_startup_s", 0)) / per_job))


def throughput_runtime_min(settings: dict, preset: str, partition_min: int | None = None) -> int | None:
    """Minutes the throughput job of ``preset`` asks for, from the timing protocol (lrattnres/throughput/):
    every method compiles once in the job, then every repeat of every method warms up and times at most
    ``max_updates`` updates at the size's speed; with ``target_half_width``, the extra repeats of the
    resolved gain's two methods up to ``max_repeats`` (at most ``budget_s``). With the margin, at most
    the cluster's longest job. None without a speed."""
    c = _cluster(settings)
    tps = (c.get("tokens_per_s_per_gpu") or {}).get(preset)
    if not tps:
        return None
    t = resolve_spec({**settings.get("throughput", {}), "presets": [preset]})
    tokens = t["grad_accum_by_preset"].get(preset, t["grad_accum"]) * t["micro_batch"] * t["seq_len"]
    methods = len(t["methods_by_preset"].get(preset, t["methods"]))
    repeats = t["repeats_by_preset"].get(preset, t["repeats"])
    per_run = (t["warmup"] + t["max_updates"]) * tokens / tps
    extra = 0.0
    if t["target_half_width"] is not None:
        extra = max(0, t["max_repeats"] - repeats) * 2 * per_run
        budget = for_preset(t, "budget_s", preset)
        extra = min(extra, budget) if budget else extra
    compile_s = methods * c.get("compile_s", 0) if t["compile"] else 0
    want = math.ceil((c.get("job_startup_s", 0) + compile_s + methods * repeats * per_run + extra)
                     * (1 + c.get("job_margin", 0.0)) / 60)
    cap = runtime_cap_min(settings, partition_min)
    return min(want, cap) if cap else want


@functools.cache
def torchrun_supports(option: str) -> bool:
    """Whether the installed torch's torchrun takes ``option``: read from its argument parser's source
    (torch/distributed/run.py) without importing torch."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        src = Path(root) / "distributed" / "run.py"
        if src.is_file():
            return f'"{option}"' in src.read_text(encoding="utf-8", errors="replace")
    return False


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def shutdown_option(settings: dict, preset: str) -> str:
    """torchrun's ``--shutdown-timeout <lead>`` where the installed torch has it; without it, nothing,
    where its fixed wait covers the update and the checkpoint write, else :class:`JobPlanError`."""
    lead = lead_s(settings, preset)
    if torchrun_supports("--shutdown-timeout"):
        return f" --shutdown-timeout {lead}"
    up, write = update_s(settings, preset), checkpoint_write_s(settings, preset)
    needed = (up or 0) + (write or 0)
    if up is None or write is None or needed < TORCHRUN_DEFAULT_SHUTDOWN_S:
        return ""
    raise JobPlanError(
        f"resources.train: torchrun of torch {_torch_version()} has no --shutdown-timeout (PyTorch 2.11 and later): it "
        f"kills its workers {TORCHRUN_DEFAULT_SHUTDOWN_S} s after forwarding SIGTERM, and a {preset} rank needs about "
        f"{needed:.0f} s to finish its update and write its checkpoint; expected torch >= 2.11 (pip install -e "
        "'.[slurm]' pins it)")


# torchrun options every multi-GPU launch needs, by launcher (lrattnres/jobplan.py's commands)
TORCHRUN_OPTIONS = {"torchrun": ("--standalone", "--nproc-per-node"),
                    "srun": ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id")}


def launcher(settings: dict, preset: str, gpus_per_node: int | None = None) -> str:
    """The command that starts ``python -m lrattnres`` on every rank of a training job (each torchrun
    option only where the installed torch has it: :class:`JobPlanError` names one that is missing)."""
    p = placement(settings, gpus_per_node)
    if p["launcher"] == "python":
        return "python -m lrattnres"
    missing = [o for o in TORCHRUN_OPTIONS[p["launcher"]] if not torchrun_supports(o)]
    if missing:
        raise JobPlanError(f"resources.train: torchrun of torch {_torch_version()} has no {', '.join(missing)}, which the "
                           f"{p['launcher']} launch of a job of {p['world']} ranks needs; expected a torch that has them "
                           "(pip install -e '.[slurm]')")
    shutdown = shutdown_option(settings, preset)
    if p["launcher"] == "torchrun":
        return f"torchrun --standalone --nproc-per-node {p['gpus_per_node']}{shutdown} -m lrattnres"
    train = settings.get("resources", {}).get("train", {})
    cpus = int(train.get("cpus_per_gpu", 1) or 1) * p["gpus_per_node"]
    srun = (f"srun --overlap --nodes={p['nodes']} --ntasks={p['nodes']} --ntasks-per-node=1 "
            f"--gpus-per-node={p['gpus_per_node']} --cpus-per-task={cpus} --kill-on-bad-exit=1")
    endpoint = f"$(hostname):$(({RDZV_PORT_BASE}+SLURM_JOB_ID%{RDZV_PORT_SPAN}))"
    return (f"{srun} torchrun --nnodes={p['nodes']} --nproc-per-node={p['gpus_per_node']} --rdzv-backend=c10d "
            f"--rdzv-endpoint={endpoint} --rdzv-id=$SLURM_JOB_ID{shutdown} -m lrattnres")


def slurm_resources(settings: dict, preset: str) -> dict[str, Any]:
    """The train rule's resources that shape its Slurm submission (Snakemake's Slurm executor turns
    ``gpu`` into --gpus, ``nodes`` into --nodes, ``tasks`` into --ntasks; ``mpi`` makes it run the
    job's command in the batch script, not in a job step of its own)."""
    p = placement(settings)
    train = settings.get("resources", {}).get("train", {})
    extra = [f"--signal=TERM@{lead_s(settings, preset)}", "--open-mode=append"]
    if p["gpus_per_node"] > 0:
        extra.append(f"--gpus-per-node={p['gpus_per_node']}")
    if train.get("slurm_extra"):
        extra.append(train["slurm_extra"])
    out: dict[str, Any] = {"nodes": p["nodes"], "slurm_extra": " ".join(extra)}
    if p["nodes"] > 1:  # the job's own srun spans the nodes; no GPU count per job for the executor
        out.update(gpu=0, mpi="srun", tasks=p["nodes"],
                   cpus_per_task=int(train.get("cpus_per_gpu", 1) or 1) * p["gpus_per_node"])
    else:
        out.update(gpu=p["gpus_per_node"])
    return out


def plan_rows(settings: dict, partition_min: int | None = None) -> list[dict[str, Any]]:
    """Per size of the scale's training runs: the placement, launcher, lead, wall time and jobs
    (``partition_min``: the partition's time limit, where known)."""
    rows, seen = [], set()
    for run in plan(settings):
        spec = train_spec(settings, run)
        key = (run.preset, spec.get("steps"), spec.get("tokens"))
        if key in seen:
            continue
        seen.add(key)
        b = batch.split(settings, run.preset)
        rows.append({"preset": run.preset, "steps": spec.get("steps"), "tokens": b["tokens_per_update"] * spec["steps"]
                     if spec.get("steps") else spec.get("tokens"), **placement(settings),
                     "update_s": update_s(settings, run.preset), "checkpoint_s": checkpoint_write_s(settings, run.preset),
                     "lead_s": lead_s(settings, run.preset), "estimate_h": (run_estimate_s(settings, spec, run.preset) or 0) / 3600,
                     "runtime_min": runtime_min(settings, spec, run.preset, partition_min),
                     "jobs": jobs_needed(settings, spec, run.preset, partition_min),
                     "deadline_lead_s": deadline_lead_s(settings, run.preset),
                     "command": launcher(settings, run.preset), "slurm": slurm_resources(settings, run.preset)})
    return rows
