"""The Snakemake workflow: plans at every scale (the default through the README's first command), lint
and format, bad config, overrides, GPU resources, what a new recording reruns.  The smoke DAG end to
end and the reruns that follow code changes: tests/test_smoke_dag.py."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, copy_repo, job_counts, readme_command, snakemake

from lrattnres.config import load_and_resolve
from lrattnres.grid import conversions, evaluations, plan

SCALES = ("smoke", "tiny", "gpu", "paper")


@pytest.fixture(scope="module")
def shared_copy(tmp_path_factory) -> Path:
    return copy_repo(tmp_path_factory.mktemp("wf") / "repo")


@pytest.mark.parametrize("scale", SCALES)
def test_dry_run_every_scale(shared_copy, scale):
    """Every scale validates and plans its runs.  The default scale through the README's first command
    as written (the venv's snakemake with the default profile, no --config)."""
    if scale == load_and_resolve(REPO / "config.yaml", {})["scale"]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([*readme_command(), "-n"], cwd=shared_copy, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert "workflow specific profile profiles/default" in proc.stdout + proc.stderr
    else:
        proc = snakemake(shared_copy, "-n", "--config", f"scale={scale}")
    counts = job_counts(proc.stdout)
    settings = load_and_resolve(REPO / "config.yaml", {"scale": scale})
    assert counts.get("train") == counts.get("diagnose_run") == len(plan(settings)) > 0
    assert counts.get("convert") == len(conversions(settings))
    assert counts.get("evaluate") == len(evaluations(settings))
    assert counts.get("kernel_check_run") == len(evaluations(settings))  # Appendix I: every read of the size pair
    assert counts.get("throughput_size") == len(settings["throughput"]["presets"])  # one timing job per size
    for rule in ("accounting", "prepare_data", "report", "grid_summary", "convert_all", "diagnostics", "throughput",
                 "kernel_check", "kernel_check_trained"):
        assert counts.get(rule) == 1, (rule, counts)


def test_every_job_names_its_code_by_one_fingerprint(shared_copy):
    """A job lists no source file among its inputs: its command gives one fingerprint of the files its
    stage imports (--code, the rule's `code` param, lrattnres/deps.py), which Snakemake's params
    trigger compares with the one the job ran with. Every stage's job gives its own stage's."""
    import shlex

    from lrattnres import deps
    from lrattnres.cli import STAGES

    out = snakemake(shared_copy, "-n", "-p", "--forceall", "--config", "scale=smoke").stdout
    inputs = [line for line in out.splitlines() if re.match(r"^\s+input: ", line)]
    assert inputs and not [line for line in inputs if re.search(r"(^|, )(lrattnres|kernels)/", line.split(": ", 1)[1])]
    jobs = 0
    for cmd in (line[len("Shell command: "):] for line in out.splitlines() if line.startswith("Shell command: ")):
        args = shlex.split(cmd)
        if "lrattnres" not in args:
            continue
        after = args[args.index("lrattnres") + 1:]
        stage = next(a for a in after if a in STAGES)
        jobs += 1
        assert after[after.index("--code") + 1] == deps.stage_code(stage), (stage, cmd[:200])
    assert jobs >= sum(job_counts(out).values()) - 3  # all but the settings, the pack and `all`


def test_paper_scale_plans_exactly_the_papers_runs(shared_copy):
    proc = snakemake(shared_copy, "-n", "--config", "scale=paper")
    # 32 rank/grouping configurations + baseline, 2 extra seeds of each headline run, the control,
    # 6 projected configurations, the 1B and 4B pairs.
    counts = job_counts(proc.stdout)
    assert counts["train"] == 33 + 4 + 1 + 6 + 4
    # Table 2: the four 0.5B AttnRes runs, the 1B and the 4B; Table 8: the two pairs
    assert counts["convert"] == 6 and counts["evaluate"] == 4
    settings = load_and_resolve(REPO / "config.yaml", {"scale": "paper"})
    ids = {r.run_id for r in plan(settings)}
    assert "0.5B-lr-n8-r128-s2" in ids and "0.5B-attnres-n8-r1024-s2" in ids
    assert "0.5B-lr-fullrms-n8-r128-s0" in ids and "0.5B-plr-n16-r32-s0" in ids
    assert {"1B-attnres-n8-r1536-s0", "1B-lr-n8-r384-s0", "4B-attnres-n8-r2560-s0", "4B-lr-n8-r640-s0"} <= ids
    sweep = [r for r in plan(settings) if "sweep" in r.roles]
    assert len(sweep) == 32 and sum(r.method == "attnres" for r in sweep) == 4


def test_malformed_config_stops_before_any_job(shared_copy):
    proc = snakemake(shared_copy, "-n", "--config", "scale=huge", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "scale" in out and "'huge'" in out and "expected one of" in out
    proc = snakemake(shared_copy, "-n", "--config", 'train={"stepz": 3}', check=False)
    assert proc.returncode != 0 and "'stepz'" in proc.stdout + proc.stderr


def _shell_commands(stdout: str, rule: str) -> list[str]:
    """The shell commands of a dry run (-p) of one rule."""
    out, current = [], None
    for line in stdout.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):", line)
        if m:
            current = m.group(1)
        elif line.startswith("Shell command: ") and current == rule:
            out.append(line[len("Shell command: "):])
    return out


def _train_specs(stdout: str) -> list[dict]:
    import shlex

    specs = []
    for cmd in _shell_commands(stdout, "train"):
        args = shlex.split(cmd)
        specs.append(json.loads(args[args.index("--spec") + 1]))
    return specs


def test_config_overrides_reach_the_jobs(shared_copy, tmp_path):
    """The README's overrides work as written: --config with a nested number (Snakemake passes it as
    text), and a --configfile whose top-level recipe overrides the scale's own recipe."""
    out = snakemake(shared_copy, "-n", "-p", "--config", "scale=smoke", 'train={"steps": 50, "compile": false}').stdout
    specs = _train_specs(out)
    assert specs and all(s["steps"] == 50 and s["compile"] is False for s in specs)
    overrides = tmp_path / "mine.yaml"
    overrides.write_text("scale: smoke\nrecipe:\n  optim:\n    muon: {lr: 0.005}\ntrain: {steps: 7}\n")
    out = snakemake(shared_copy, "-n", "-p", "--configfile", "config.yaml", str(overrides)).stdout
    specs = [s for s in _train_specs(out) if not s.get("record_nonfinite")]
    # the learning-rate check's runs keep their multiples of the check's reference rates
    check = [s for s in _train_specs(out) if s.get("record_nonfinite")]
    assert sorted(s["optim"]["muon"]["lr"] for s in check) == [0.02, 0.04] and all(s["steps"] == 7 for s in check)
    assert specs and all(s["optim"]["muon"]["lr"] == 0.005 and s["steps"] == 7 for s in specs)
    assert all(s["optim"]["muon"]["momentum"] == 0.95 for s in specs)  # the rest of the recipe stays
    bad = snakemake(shared_copy, "-n", "--config", "scale=smoke", 'train={"steps": "fifty"}', check=False)
    assert bad.returncode != 0 and "train.steps: 'fifty' cannot be read as integer" in bad.stdout + bad.stderr


def test_multi_gpu_training_command_passes_through_torchrun(shared_copy):
    """torchrun parses its options by prefix even after `-m lrattnres`: the job options of a
    multi-GPU training command must reach the package unchanged."""
    import shlex

    from torch.distributed.run import get_args_parser

    out = snakemake(shared_copy, "-n", "-p", "--config", "scale=smoke", "--set-resources", "train:gpu=2").stdout
    cmd = _shell_commands(out, "train")[0]
    args = shlex.split(cmd.split(" > ")[0])
    # inside a Slurm job the trainer's deadline comes first (lrattnres/slurmjob.py); elsewhere it is empty
    assert args[0].startswith("LRATTNRES_DEADLINE=${LRATTNRES_DEADLINE:-$(python -m lrattnres.slurmjob deadline --lead ")
    args = args[1:]
    assert args[0] == "torchrun"
    parsed = get_args_parser().parse_args(args[1:])
    assert parsed.module and parsed.training_script == "lrattnres" and parsed.nproc_per_node == "2"
    rest = parsed.training_script_args
    assert rest[:2] == ["--job-log", args[args.index("--job-log") + 1]] and "train" in rest and "--spec" in rest


def test_default_profile_loads_by_itself(shared_copy):
    proc = snakemake(shared_copy, "-n", "--config", "scale=smoke")
    assert "workflow specific profile profiles/default" in proc.stderr + proc.stdout
    import yaml

    prof = yaml.safe_load((shared_copy / "profiles" / "default" / "config.yaml").read_text())
    assert prof["rerun-incomplete"] is True and prof["retries"] >= 1
    # a cluster profile is still what --profile selects, and the default leaves its executor alone
    slurm = yaml.safe_load((shared_copy / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    assert slurm["executor"] == "slurm" and not {"executor", "jobs", "keep-going"} & set(prof)


GPU_RULES = ("train", "evaluate", "convert", "diagnose_run", "kernel_check_run", "throughput_size", "kernel_check")
EXCLUSIVE = ("throughput_size", "kernel_check")
CONFIG_KEY = {"diagnose_run": "diagnostics", "throughput_size": "throughput"}  # the rules' resources entries


def test_gpu_scale_never_runs_a_timing_job_beside_another_gpu_job(shared_copy):
    """A dry run of the gpu scale under the default profile on a machine of one GPU: every GPU job
    declares its GPU; the resources each job declares never let Snakemake run a timing job beside
    another GPU job, nor more jobs of a rule on one GPU than the scale's jobs_per_gpu lets share it."""
    proc = snakemake(shared_copy, "-n", "--config", "scale=gpu", "--resources", "gpu=1")
    jobs: dict[str, list[dict]] = {}
    rule = None
    for line in proc.stdout.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):", line)
        if m:
            rule = m.group(1)
        m = re.match(r"^\s+resources: (.*)$", line)
        if m and rule:
            res = dict(kv.split("=", 1) for kv in m.group(1).split(", "))
            jobs.setdefault(rule, []).append({k: int(v) for k, v in res.items() if v.isdigit()})
    settings = load_and_resolve(REPO / "config.yaml", {"scale": "gpu"})
    per_gpu = settings["resources"]["train"]["jobs_per_gpu"]
    assert per_gpu > 1
    # what the workflow offers for --resources gpu=1: slots enough for every rule's sharing (common.smk)
    slots = math.lcm(*(b.get("jobs_per_gpu", 1) for b in settings["resources"].values()))
    for r in GPU_RULES:
        assert jobs.get(r), r
        assert all(j["gpu"] >= 1 and j["gpu_slots"] >= 1 for j in jobs[r]), (r, jobs[r])
    demand = {r: max(j["gpu_slots"] for j in jobs[r]) for r in GPU_RULES}
    for a in EXCLUSIVE:
        for b in GPU_RULES:
            assert demand[a] + min(j["gpu_slots"] for j in jobs[b]) > slots, (a, b, demand)
    # every other GPU job takes its share: k jobs of a rule the scale lets share a GPU fill it, never more
    for a in GPU_RULES:
        k = settings["resources"].get(CONFIG_KEY.get(a, a), {}).get("jobs_per_gpu", 1)
        assert demand[a] == slots // k and demand[a] * (k + 1) > slots, (a, k, demand)
    assert demand["kernel_check_run"] == demand["train"]  # Appendix I's reads of a run share the GPU like a training
    assert demand["train"] * per_gpu <= slots  # the scale lets this many trainings share one GPU
    # on a machine with two GPUs, two timing jobs may run at once (one per GPU)
    assert demand["throughput_size"] + demand["kernel_check"] <= 2 * slots


def test_lint_clean(shared_copy):
    proc = snakemake(shared_copy, "--lint")
    assert "Congratulations" in proc.stdout + proc.stderr


def test_snakefmt_clean():
    files = ["Snakefile", *sorted(str(p.relative_to(REPO)) for p in (REPO / "workflow" / "rules").glob("*.smk"))]
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", *files], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _planned(workdir: Path) -> dict[str, int]:
    return job_counts(snakemake(workdir, "-n", "--config", "scale=smoke").stdout)


def _record(workdir: Path, name: str, content: dict) -> None:
    """A new result measured elsewhere: the file, and its line in reports/recorded.yaml."""
    rel = f"benchmarks/results/{name}.json"
    (workdir / rel).write_text(json.dumps(content))
    listed = workdir / "reports" / "recorded.yaml"
    listed.write_text(listed.read_text() + f"{name}: {rel}\n")


def test_a_new_recording_reruns_only_the_report(tmp_path):
    """reports/recorded.yaml is an input of the report rule alone, not part of the config: with every
    output of the smoke DAG in place (empty files marked up to date), recording a result plans the
    report and nothing else."""
    work = copy_repo(tmp_path / "repo")
    summary = snakemake(work, "--summary", "--config", "scale=smoke").stdout.splitlines()
    outputs = [line.split("\t")[0] for line in summary[1:] if line.strip()]
    assert "reports/paper.html" in outputs and "results/smoke/settings.json" in outputs
    for rel in outputs:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("")
    snakemake(work, "--cores", "1", "--touch", "--config", "scale=smoke")
    assert _planned(work) == {}
    _record(work, "kernel_bench_new", {"rows": []})
    assert set(_planned(work)) == {"report", "all"}


def test_a_bad_recorded_list_fails_no_target(shared_copy):
    """reports/recorded.yaml, malformed or missing, plans every job as before (the report notes it on
    its page; tests/test_report.py)."""
    listed = shared_copy / "reports" / "recorded.yaml"
    kept = listed.read_text()
    try:
        for text in ("kernel: {\n", None):
            listed.unlink()
            if text is not None:
                listed.write_text(text)
            counts = job_counts(snakemake(shared_copy, "-n", "--config", "scale=smoke").stdout)
            assert counts.get("report") == 1 and counts.get("train") == len(plan(load_and_resolve(
                REPO / "config.yaml", {"scale": "smoke"}))), (text, counts)
    finally:
        listed.write_text(kept)


def test_per_run_diagnostics_do_not_depend_on_the_flop_counts():
    """The diagnostics take the grid's run list from its plan: a change of the accounting (or of the
    grid's summary) reruns no per-run diagnostics; the grid summary depends on both."""
    from lrattnres.deps import closure

    diagnostics = closure("lrattnres.diagnostics")
    assert "lrattnres/gridplan.py" in diagnostics
    assert "lrattnres/accounting.py" not in diagnostics and "lrattnres/grid.py" not in diagnostics
    assert {"lrattnres/gridplan.py", "lrattnres/accounting.py"} <= set(closure("lrattnres.grid"))


def test_shell_scripts_clean():
    """The install script, the conda post-deploy scripts and the GPU benchmark runner parse and are
    shfmt-formatted (2 spaces)."""
    import shutil

    files = [REPO / "scripts" / "install.sh", *sorted((REPO / "envs").glob("*.sh")),
             *sorted((REPO / "benchmarks").glob("*.sh"))]
    assert len(files) >= 3
    for f in files:
        proc = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{f}: {proc.stderr}"
    shfmt = shutil.which("shfmt") or shutil.which("shfmt", path=str(Path(sys.executable).parent))
    if shfmt is None:
        pytest.skip("shfmt (installed with snakefmt) not found")
    proc = subprocess.run([shfmt, "-i", "2", "-d", *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
