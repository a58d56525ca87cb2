"""The smoke DAG on a real one-node Slurm cluster, submitted through workflow/profiles/slurm.

The cluster (Debian's slurmctld, slurmd, slurm-client and munge; fake GPUs as GRES) is started by
scripts/slurm/start.sh, which needs root. Every rule that asks for a GPU at the paper scale is made
to ask for one here too, so that GPU jobs go through Slurm's GPU scheduling (`--gpus`); the smoke
models still train on the CPU.  Every test that needs the cluster is in this file (one run at a time
uses it); the last, a training job stopped and requeued, is one of the fault suite's faults.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ONE_OF_EACH, REPO, copy_repo, job_counts, popen_snakemake, snakemake, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

START = REPO / "scripts" / "slurm" / "start.sh"
PROFILE = "workflow/profiles/slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
# Rules that run on GPUs at the paper scale (config.yaml, scales.paper.resources).
GPU_RULES = tuple(
    rule for rule, r in (yaml.safe_load((REPO / "config.yaml").read_text())["scales"]["paper"].get("resources") or {}).items()
    if (r or {}).get("gpu", 0) > 0
)


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/sbin") if os.access(f"{d}/{name}", os.X_OK)), None)


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """A running one-node cluster (started if needed, left running); its node name."""
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster needs root (scripts/slurm/start.sh)")
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}): apt-get install slurmctld slurmd slurm-client munge")
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        pytest.skip("snakemake-executor-plugin-slurm not installed: pip install -e '.[pipeline,slurm]'")
    proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=180)
    if proc.returncode in (77, 78, 79):
        pytest.skip(f"no test cluster: {proc.stderr.strip()}")
    if proc.returncode != 0:
        logs = ""
        for f in ("/var/log/slurm/slurmctld.log", "/var/log/slurm/slurmd.log"):
            if os.path.exists(f):
                logs += f"\n--- {f}\n" + "".join(open(f, errors="replace").readlines()[-20:])
        pytest.fail(f"scripts/slurm/start.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}{logs}")
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()


def cluster_flags(jobs: int = 8) -> list[str]:
    """What a user's own profile would add for this cluster (no accounting database, quick polls)."""
    return [
        "--slurm-no-account",
        "--slurm-status-command", "squeue",
        "--slurm-init-seconds-before-status-checks", "2",
        "--seconds-between-status-checks", "2",
        "--latency-wait", "5",
        "--jobs", str(jobs),
    ]


def gpu_flags(workdir: Path, rules: set[str]) -> list[str]:
    """--set-resources making every GPU rule of the DAG (``rules``: the Snakefile's) ask Slurm for one
    (fake) GPU, on top of the profile's own set-resources (a command-line --set-resources replaces the
    profile's whole key)."""
    present = [r for r in GPU_RULES if r in rules]
    if not present:
        return []
    prof = yaml.safe_load((workdir / PROFILE / "config.yaml").read_text())
    entries = [f"{r}:{k}={v}" for r, kv in (prof.get("set-resources") or {}).items() for k, v in kv.items()]
    entries += [f"{r}:gpu=1" for r in present] + [f"{r}:cpus_per_gpu=1" for r in present]
    return ["--set-resources", *entries]


def slurm_logs(workdir: Path) -> str:
    out = []
    for f in sorted((workdir / "results" / "slurm").rglob("*.log")):
        out.append(f"--- {f.relative_to(workdir)}\n{f.read_text(errors='replace')[-1500:]}")
    return "\n".join(out[-8:])


def test_profile_keys():
    prof = yaml.safe_load((REPO / PROFILE / "config.yaml").read_text())
    assert prof["executor"] == "slurm"
    assert prof["slurm-requeue"] is True and prof["retries"] >= 1
    assert prof["rerun-incomplete"] is True and prof["latency-wait"] >= 30
    assert prof["slurm-logdir"] and prof["slurm-keep-successful-logs"] is True
    # account and partition are the user's (their own profile or --default-resources)
    assert "slurm_account" not in json.dumps(prof) and "slurm_partition" not in json.dumps(prof)
    assert "default-resources" not in prof, "would hide the user's default-resources (account, partition)"
    # the workflow's own profile, loaded beside this one and winning key by key, leaves the
    # cluster's settings alone
    default = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    assert default["cores"] == "all" and default["rerun-incomplete"] is True
    assert not {"executor", "jobs", "keep-going", "latency-wait", "set-resources"} & set(default)
    assert default["retries"] == prof["retries"] and default["printshellcmds"] == prof["printshellcmds"]


def snakefile_localrules():
    """The rules the Snakefile names in its ``localrules:`` block (bookkeeping run beside Snakemake)."""
    text = (REPO / "Snakefile").read_text()
    block = re.search(r"^localrules:\n((?:[ \t]+\w+,?\n)+)", text, re.M)
    assert block, "Snakefile has no localrules block"
    return {name.strip(" \t,") for name in block.group(1).splitlines()}


def test_smoke_dag_through_the_slurm_profile(slurm_cluster, tmp_path):
    """Every rule of the smoke DAG through the profile (on conftest.ONE_OF_EACH's grid, 34 jobs instead
    of 45; the local smoke DAG checks the whole grid's verdicts): each job but the Snakefile's local
    rules is a Slurm job with its log in the profile's folder, GPU rules get (fake) GPUs, and the
    report is made."""
    work = copy_repo(tmp_path / "repo")
    config = ["--config", "scale=smoke", *ONE_OF_EACH]
    rules = set(snakemake(work, "--list-rules", *config).stdout.split())
    flags = gpu_flags(work, rules)
    every_rule = set(job_counts(snakemake(work, "-n", "reports/paper.html", *config).stdout))
    assert every_rule == rules - {"all"}, rules - {"all"} - every_rule
    t0 = time.time()
    proc = snakemake(
        work, "reports/paper.html", "--profile", PROFILE, *config, *cluster_flags(), *flags,
        check=False, timeout=1500,
    )
    elapsed = time.time() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    paper = json.loads((work / "reports" / "paper.json").read_text())
    assert paper["scale"] == "smoke" and len(paper["claims"]) >= 100
    # every job but the Snakefile's localrules (bookkeeping) went through sbatch: one Slurm job id
    # per job, logs in the profile's folder
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
    planned = int(re.search(r"^total\s+(\d+)$", out, re.M).group(1))
    local = re.findall(r"^localrule (\w+):", out, re.M)
    assert local and set(local) <= snakefile_localrules(), local
    assert "train" not in local and len(submitted) + len(local) == planned, out[-4000:]
    remote = {m.group(1) for _, log in submitted if (m := re.search(r"/rule_(\w+?)/", log))}
    assert remote | set(local) == every_rule, every_rule - remote - set(local)
    for _, log in submitted:
        log = Path(log.rstrip(")."))
        assert log.is_file() and log.is_relative_to(work / "results" / "slurm"), log
    # GPU rules were scheduled with GPUs (fake GRES): Slurm's record of one such job shows them
    if flags:
        gpu_jobs = [jid for jid, log in submitted if any(f"/rule_{r}/" in log for r in GPU_RULES)]
        assert gpu_jobs, "no GPU rule was submitted"
        shown = subprocess.run(["scontrol", "show", "job", gpu_jobs[-1]], capture_output=True, text=True).stdout
        assert "gpu" in shown, shown
    print(f"smoke DAG on Slurm: {elapsed:.0f} s, {len(submitted)} Slurm jobs")



@pytest.fixture(scope="module")
def local_data_stage(slurm_cluster, tmp_path_factory):
    """A copy of the repository whose data stage ran through the profile with
    resources.prepare_data.local (the data stage may need the network): its work folder and
    Snakemake's output.  The training-job tests below submit their runs from it."""
    work = copy_repo(tmp_path_factory.mktemp("slurm-jobs") / "repo")
    proc = snakemake(
        work, "results/smoke/data/manifest.json", "--profile", PROFILE, "--config", "scale=smoke",
        'resources={"prepare_data": {"local": true}}', *cluster_flags(jobs=2), check=False, timeout=900,
    )
    return work, proc


def test_data_stage_runs_where_snakemake_runs_when_local(local_data_stage):
    """resources.prepare_data.local: the data stage runs on the machine that runs Snakemake, as a
    local rule, and is not submitted to Slurm."""
    work, proc = local_data_stage
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    assert re.search(r"^localrule prepare_data:", out, re.M) and "has been submitted with SLURM jobid" not in out, out[-3000:]
    assert (work / "results" / "smoke" / "data" / "manifest.json").is_file()


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_training_job_lands_on_one_node_with_its_gpus(local_data_stage, launcher):
    """A training job of 2 (fake) GPUs submitted through the profile: sbatch --nodes=1 --gpus-per-node=2
    and the signal lead of lrattnres/jobplan.py; its 2 ranks start by torchrun --standalone, or by the
    spanning launcher (srun --overlap inside the executor's job step, torchrun's c10d rendezvous).
    Each launcher trains a run of its own in the folder whose data stage ran above."""
    from lrattnres.config import load_and_resolve
    from lrattnres.grid import plan

    work, data = local_data_stage
    assert data.returncode == 0, (data.stdout + data.stderr)[-3000:]
    res = {"train": {"gpu": 2, "cpus_per_gpu": 1, "launcher": launcher}}
    run = plan(load_and_resolve(work / "config.yaml", {"scale": "smoke"}))[("torchrun", "srun").index(launcher)].run_id
    proc = snakemake(
        work, f"results/smoke/runs/{run}/result.json", "--profile", PROFILE, "--config", "scale=smoke",
        f"resources={json.dumps(res)}", *cluster_flags(jobs=2), check=False, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    assert "rule prepare_data:" not in out  # the data stage is done once, above
    (jid,) = [j for j, log in re.findall(r"has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", out)
              if "/rule_train/" in log]
    shown = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True).stdout
    assert "NumNodes=1 " in shown and re.search(r"TresPerNode=\S*gpu:2", shown), shown
    log = (work / "results" / "smoke" / "logs" / "train" / f"{run}.log").read_text()
    assert "world 2" in log, log[-2000:]
    cmd = next(line for line in out.splitlines() if "--job-log results/smoke/logs/train/" in line)
    cmd = cmd.split("Shell command: ", 1)[-1]
    # inside a Slurm job the trainer gets a deadline before the job's end (lrattnres/slurmjob.py)
    prefix = 'LRATTNRES_DEADLINE="${LRATTNRES_DEADLINE:-$(python -m lrattnres.slurmjob deadline --lead 360)}" '
    assert cmd.startswith(prefix), cmd
    cmd = cmd[len(prefix):]
    if launcher == "srun":
        assert cmd.startswith("srun --overlap --nodes=1") and "--rdzv-backend=c10d" in cmd, cmd
    else:
        assert cmd.startswith("torchrun --standalone --nproc-per-node 2 --shutdown-timeout 300"), cmd


# ====================================================================== a Slurm job requeued (a fault of the fault suite)


def test_training_job_stopped_then_requeued_resumes_with_identical_weights(slurm_cluster, tmp_path, faults):
    """A training job submitted through the Slurm profile is interrupted twice while it runs:
    1. `scancel --signal=TERM` (what `--signal=TERM@300` does before the time limit): the trainer
       checkpoints and exits 75, the Slurm job fails, Snakemake submits it again (retries) and the
       new job resumes;
    2. `scontrol requeue` of that new job (what preemption with PreemptMode=REQUEUE does: SIGTERM,
       then back to the queue): Slurm starts the same job again and it resumes.
    The job asks for 2 (fake) GPUs, so it runs 2 data-parallel ranks under torchrun, as the paper
    scale's 8-GPU jobs do (gloo on this CPU machine). The final weights equal those of an
    uninterrupted run, bit for bit."""
    from lrattnres.config import load_and_resolve
    from lrattnres.grid import plan
    from lrattnres.train.checkpoint import read_model

    work = copy_repo(tmp_path / "repo")
    overrides = {"steps": 300, "checkpoint": {"every": 5}}
    overrides_file = tmp_path / "longer_training.yaml"
    overrides_file.write_text(json.dumps({"scale": "smoke", "train": overrides}))
    config = ["--configfile", "config.yaml", str(overrides_file)]
    runs = plan(load_and_resolve(work / "config.yaml", {"scale": "smoke", "train": overrides}))
    run = next((r.run_id for r in runs if r.method == "lr"), runs[0].run_id)
    rundir = work / "results" / "smoke" / "runs" / run
    train_log = work / "results" / "smoke" / "logs" / "train" / f"{run}.log"
    attempt_logs = train_log.parent / "attempts"
    prof = yaml.safe_load((work / PROFILE / "config.yaml").read_text())
    extra = [f"train:{k}={v}" for k, v in (prof.get("set-resources") or {}).get("train", {}).items()]
    gpus = ["--set-resources", "train:gpu=2", "train:cpus_per_gpu=1", *extra]
    proc = popen_snakemake(
        work, f"results/smoke/runs/{run}/model.safetensors", "--profile", PROFILE, *config, *cluster_flags(jobs=2), *gpus
    )
    t0 = time.time()

    def resumed() -> list[str]:
        text = "".join(p.read_text() for p in [train_log, *attempt_logs.glob(f"{run}.*.log")] if p.exists())
        return re.findall(r"resumed at step (\d+)", text)

    try:
        # 1. SIGTERM to the running job once it has written a checkpoint
        wait_for(lambda: (rundir / "checkpoint.json").exists() and _slurm_job_of(run), 300, proc,
                  f"the first checkpoint of {run}")
        first = _slurm_job_of(run)
        assert not (rundir / "model.safetensors").exists(), "training finished before it could be stopped: raise its steps"
        subprocess.run(["scancel", "--signal=TERM", first], check=True, capture_output=True, text=True)
        # 2. requeue the resubmitted job once it has resumed
        wait_for(lambda: resumed() and (_slurm_job_of(run) or first) != first, 300, proc, "the resubmitted job to resume")
        second = _slurm_job_of(run)
        step1 = int(resumed()[0])
        assert not (rundir / "model.safetensors").exists(), "training finished before it could be requeued: raise its steps"
        subprocess.run(["scontrol", "requeue", second], check=True, capture_output=True, text=True)
        t_requeue = time.time()
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{out[-6000:]}\n{slurm_logs(work)}"
    ids = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    assert len(ids) == 3 and first in ids and second in ids, out[-4000:]
    shown = subprocess.run(["scontrol", "show", "job", second], capture_output=True, text=True).stdout
    assert int(re.search(r"Restarts=(\d+)", shown).group(1)) >= 1, shown
    assert re.search(r"gpu[:=]2", shown), shown  # Slurm gave the job its 2 GPUs
    step2 = int(resumed()[-1])
    assert "world 2" in train_log.read_text()
    assert 0 < step1 < step2 < overrides["steps"], (step1, step2)
    second_log = next((work / "results" / "slurm").rglob(f"{second}.log")).read_text()
    assert second_log.count("Building DAG of jobs") >= 2, second_log[-3000:]

    # the same run without interruption, by hand, from the spec the run recorded
    recorded = json.loads((rundir / "spec.json").read_text())
    ref = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "lrattnres", "train", "--spec", json.dumps(recorded["spec"]),
         "--data", str(work / "results" / "smoke" / "data" / "manifest.json"), "--out", str(ref),
         "--threads", "1", "--no-progress"],
        cwd=work, env=dict(os.environ, PYTHONPATH=str(work)), check=True, capture_output=True, timeout=900,
    )
    (a, ma), (b, mb) = read_model(rundir / "model.safetensors"), read_model(ref / "model.safetensors")
    assert ma["step"] == mb["step"] == overrides["steps"] and a.keys() == b.keys()
    differ = [k for k in a if not bool((a[k] == b[k]).all())]
    assert not differ, f"weights differ after resume: {differ[:5]}"
    faults("Slurm: SIGTERM, then requeue of a training job", runs=1, lost=int(bool(differ)))
    print(f"SIGTERM to Slurm job {first} (resumed at step {step1}), requeue of job {second} (resumed at step "
          f"{step2}) of {overrides['steps']}: identical weights; {time.time() - t0:.0f} s "
          f"(after the requeue {time.time() - t_requeue:.0f} s)")


def _slurm_job_of(run: str) -> str | None:
    """The Slurm job id of the training job of ``run`` (the executor puts rule and wildcards in the
    job's comment)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%k|%T"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        jid, comment, state = line.split("|", 2)
        if comment.startswith("rule_train_") and comment.endswith(run) and state == "RUNNING":
            return jid
    return None


# ====================================================================== a run longer than its job: requeued runs


def test_a_run_longer_than_its_job_requeues_itself_until_done(slurm_cluster, tmp_path):
    """A training job of one minute whose run needs several (lrattnres/slurmjob.py, as the train rule
    runs it): each run of the job stops at the deadline before the job's end (squeue's end time less
    the lead), writes its checkpoint and requeues the job; Slurm starts the same job again and it
    resumes. The job completes under one job id after several runs, with the weights of an
    uninterrupted run, bit for bit."""
    from conftest import word_corpus

    from lrattnres.train.checkpoint import read_model

    (tmp_path / "data").mkdir()
    manifest = word_corpus(tmp_path / "data", seed=0)
    spec = {"model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}, "seed": 1, "steps": 2000,
            "micro_batch": 2, "grad_accum": 1, "seq_len": 32, "schedule": {"warmup_steps": 10},
            "val": {"every": 0, "final": False}, "checkpoint": {"every": 0}, "device": "cpu", "log_every_s": 5}
    train = (f"python -m lrattnres train --spec '{json.dumps(spec)}' --data {manifest} --out OUT --threads 1 "
             "--no-progress")
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"export PATH={Path(sys.executable).parent}:$PATH PYTHONPATH={REPO} OMP_NUM_THREADS=1\n"
        f"cd {tmp_path}\n"
        'LRATTNRES_DEADLINE="${LRATTNRES_DEADLINE:-$(python -m lrattnres.slurmjob deadline --lead 48)}" '
        + train.replace("OUT", str(tmp_path / "run")) + " --requeue-at-deadline\n")
    log = tmp_path / "slurm.log"
    jid = subprocess.run(["sbatch", "--parsable", "-t", "1", "--requeue", "--open-mode=append", "-o", str(log), "-c", "1",
                          str(script)], capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    t0 = time.time()
    state = ""
    while time.time() - t0 < 900:
        shown = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\w+)", shown).group(1) if "JobState=" in shown else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        time.sleep(3)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert state == "COMPLETED", f"job {jid}: {state}\n{text[-4000:]}"
    restarts = int(re.search(r"Restarts=(\d+)", shown).group(1))
    assert restarts >= 1 and text.count(f"requeued Slurm job {jid}") == restarts, text[-4000:]
    assert len(re.findall(r"resumed at step \d+", text)) == restarts
    subprocess.run(train.replace("OUT", str(tmp_path / "ref")), shell=True, cwd=tmp_path, check=True, capture_output=True,
                   env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO),
                            OMP_NUM_THREADS="1"), timeout=900)
    (a, ma), (b, mb) = read_model(tmp_path / "run" / "model.safetensors"), read_model(tmp_path / "ref" / "model.safetensors")
    assert ma["step"] == mb["step"] == 2000 and all(bool((a[k] == b[k]).all()) for k in a)
    print(f"one job of 1 min, {restarts + 1} runs, {time.time() - t0:.0f} s")
