"""What a training job asks of Slurm (lrattnres/jobplan.py): placement on one node or several, the
generated sbatch and srun/torchrun arguments, the signal lead and the wall time of each size."""

from __future__ import annotations

import shlex

import pytest
from conftest import REPO

from lrattnres import jobplan
from lrattnres.config import ConfigError, deep_merge, load_yaml, resolve
from lrattnres.grid import plan, train_spec

RAW = load_yaml(REPO / "config.yaml")


def paper(**over) -> dict:
    return resolve(deep_merge(dict(RAW, scale="paper"), over))


class _Resources(dict):
    """A job's resources as Snakemake's Slurm executor reads them (get() and attributes)."""

    def __getattr__(self, k):
        return self[k]


def sbatch(settings: dict, preset: str) -> list[str]:
    """The sbatch call Snakemake's Slurm executor makes for a training job of ``preset``: the
    plugin's own submit string for the resources the train rule declares."""
    from types import SimpleNamespace

    sub = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    utils = pytest.importorskip("snakemake_executor_plugin_slurm.utils")
    spec = train_spec(settings, next(r for r in plan(settings) if r.preset == preset))
    res = _Resources(mem_mb=400000, runtime=jobplan.runtime_min(settings, spec, preset),
                     cpus_per_gpu=settings["resources"]["train"]["cpus_per_gpu"],
                     **jobplan.slurm_resources(settings, preset))
    if not res["gpu"]:
        res.pop("gpu")
    job = SimpleNamespace(resources=res, threads=1, name="train", is_group=lambda: False)
    params = dict(run_uuid="x", slurm_logfile="log", comment_str="rule_train", account="", partition="", workdir="")
    call = sub.get_submit_command(job, params) + utils.set_gres_string(job)
    return shlex.split(call)


def torchrun_args(cmd: str):
    from torch.distributed.run import get_args_parser

    args = shlex.split(cmd.replace("$(", "(").replace("$SLURM_JOB_ID", "JOBID"))
    i = args.index("torchrun")
    return args[:i], get_args_parser().parse_args(args[i + 1:] + ["train"])


def test_one_node_job_lands_on_one_node_with_its_gpus():
    s = paper()
    for preset in ("0.5B", "1B", "4B"):
        call = sbatch(s, preset)
        lead = jobplan.lead_s(s, preset)
        assert "--nodes=1" in call and "--gpus=8" in call and "--gpus-per-node=8" in call, call
        assert "--cpus-per-gpu=12" in call and f"--signal=TERM@{lead}" in call and "--open-mode=append" in call
        assert not any(a.startswith("--ntasks=") for a in call)
        cmd = jobplan.launcher(s, preset)
        before, t = torchrun_args(cmd)
        assert before == [] and t.standalone and t.nproc_per_node == "8" and t.shutdown_timeout == lead
        assert t.module and t.training_script == "lrattnres"


def test_several_nodes_span_through_srun_and_the_rendezvous():
    s = paper(resources={"train": {"nodes": 2}})
    call = sbatch(s, "4B")
    assert "--nodes=2" in call and "--ntasks=2" in call and "--gpus-per-node=8" in call, call
    assert not any(a.startswith("--gpus=") for a in call)  # GPUs per node, never a total Slurm may split unevenly
    assert "--cpus-per-task=96" in call
    res = jobplan.slurm_resources(s, "4B")
    assert res["mpi"] == "srun" and res["tasks"] == 2  # the executor runs the command in the batch script
    srun, t = torchrun_args(jobplan.launcher(s, "4B"))
    assert srun[0] == "srun" and {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gpus-per-node=8",
                                  "--overlap", "--kill-on-bad-exit=1"} <= set(srun)
    assert not t.standalone and t.nnodes == "2" and t.nproc_per_node == "8" and t.rdzv_backend == "c10d"
    assert t.rdzv_id == "JOBID" and t.rdzv_endpoint.startswith("(hostname):") and t.shutdown_timeout == jobplan.lead_s(s, "4B")
    assert jobplan.placement(s)["world"] == 16
    spec = train_spec(s, next(r for r in plan(s) if r.preset == "4B"))
    assert spec["grad_accum"] == 8 and spec["micro_batch"] * 2048 * 8 * 16 == 262144


def test_srun_launcher_on_one_node():
    s = paper(resources={"train": {"launcher": "srun"}})
    assert "--nodes=1" in sbatch(s, "1B") and "--gpus=8" in sbatch(s, "1B")
    srun, t = torchrun_args(jobplan.launcher(s, "1B"))
    assert srun[0] == "srun" and "--nodes=1" in srun and "--overlap" in srun and t.nnodes == "1"


def test_smaller_scales_keep_their_launchers():
    s = resolve(dict(RAW, scale="smoke"))
    assert jobplan.launcher(s, "smoke") == "python -m lrattnres"
    assert jobplan.launcher(s, "smoke", gpus_per_node=2).startswith("torchrun --standalone --nproc-per-node 2 ")
    assert jobplan.slurm_resources(s, "smoke")["slurm_extra"] == f"--signal=TERM@{jobplan.DEFAULT_LEAD_S} --open-mode=append"
    g = resolve(dict(RAW, scale="gpu"))
    assert jobplan.slurm_resources(g, "gpu-small")["slurm_extra"].endswith("--gpus-per-node=1")


def test_impossible_placements_are_refused():
    with pytest.raises(ConfigError, match=r"resources.train.launcher: torchrun --standalone runs on one node"):
        paper(resources={"train": {"nodes": 2, "launcher": "torchrun"}})
    with pytest.raises(ConfigError, match=r"resources.train.nodes: 2 nodes without GPUs"):
        resolve(deep_merge(dict(RAW, scale="smoke"), {"resources": {"train": {"nodes": 2}}}))


def test_the_signal_lead_covers_an_update_and_a_checkpoint_write():
    s = paper()
    for preset in ("0.5B", "1B", "4B"):
        lead = jobplan.lead_s(s, preset)
        assert lead >= jobplan.update_s(s, preset) + jobplan.checkpoint_write_s(s, preset) + 60
    assert jobplan.lead_s(s, "4B") > jobplan.lead_s(s, "0.5B")
    slow = paper(cluster={"checkpoint_write_gbps": 0.05})  # a slow file system lengthens it
    assert jobplan.lead_s(slow, "4B") > jobplan.lead_s(s, "4B") + 100
    # the largest rank's share: about 1/8 of the 4B's 34 GB (weights and optimiser state), not all of it
    gb = jobplan.checkpoint_write_s(s, "4B") / (1 / 0.5 + 1 / 1.0)  # written at 0.5 GB/s, hashed at 1 GB/s
    assert 34.4 / 8 < gb < 34.4 / 4


def test_wall_time_follows_size_and_tokens():
    s = paper()
    rows = {r["preset"]: r for r in jobplan.plan_rows(s)}
    assert rows["0.5B"]["runtime_min"] < rows["1B"]["runtime_min"] < rows["4B"]["runtime_min"]
    assert rows["0.5B"]["runtime_min"] < 8 * 60 and rows["0.5B"]["tokens"] == 38146 * 262144
    assert rows["4B"]["runtime_min"] == s["cluster"]["runtime_max_min"] and rows["4B"]["jobs"] > 1
    assert rows["1B"]["jobs"] == 1 and all(r["runtime_min"] <= s["cluster"]["runtime_max_min"] for r in rows.values())
    # the chain: each run of the job trains from its start-up to its deadline; together they cover the estimate
    c, r4 = s["cluster"], rows["4B"]
    per_run = (r4["runtime_min"] * 60 - r4["deadline_lead_s"] - c["job_startup_s"] - r4["update_s"] - r4["checkpoint_s"])
    assert (r4["jobs"] - 1) * per_run < r4["estimate_h"] * 3600 * (1 + c["job_margin"]) - c["job_startup_s"] <= r4["jobs"] * per_run
    two = {r["preset"]: r for r in jobplan.plan_rows(paper(resources={"train": {"nodes": 2}}))}
    assert two["1B"]["tokens"] == rows["1B"]["tokens"] and two["1B"]["runtime_min"] < 0.6 * rows["1B"]["runtime_min"]


def test_train_rule_resources_come_from_the_plan():
    text = (REPO / "workflow" / "rules" / "train.smk").read_text()
    assert "jobplan.slurm_resources" in text and "jobplan.launcher" in text and "runtime=train_runtime" in text
    import yaml

    prof = yaml.safe_load((REPO / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    assert "train" not in (prof.get("set-resources") or {})  # the rule's slurm_extra is not overridden


def test_cli_prints_the_plan(capsys):
    from lrattnres import jobs_cli

    assert jobs_cli.main(["--scale", "paper"]) == 0
    out = capsys.readouterr().out
    assert "| 4B | 76,294 | 20.0B | 1 x 8 |" in out and "torchrun --standalone --nproc-per-node 8" in out


def test_throughput_wall_time_follows_the_protocol():
    s = paper()
    one, four = jobplan.throughput_runtime_min(s, "1B"), jobplan.throughput_runtime_min(s, "4B")
    # three compilations (once per method) + 15 timed runs of 33 updates of 262,144 tokens at the size's
    # speed, with the margin
    c = s["cluster"]
    want = (c["job_startup_s"] + 3 * c["compile_s"] + 15 * 33 * 262144 / c["tokens_per_s_per_gpu"]["4B"]) * 1.25 / 60
    assert four == pytest.approx(want, abs=1) and 60 < one < four < 6 * 60
    extra = paper(throughput={"methods": ["fla-rd", "fused-rd", "fused-rd4", "baseline", "reference-rd4"]})
    # two extra rows cost their compilation and five timed runs each, with the margin
    added = 2 * (c["compile_s"] + 5 * 33 * 262144 / c["tokens_per_s_per_gpu"]["1B"]) * 1.25 / 60
    assert jobplan.throughput_runtime_min(extra, "1B") == pytest.approx(one + added, abs=1)
    assert jobplan.throughput_runtime_min(resolve(dict(RAW, scale="gpu")), "1B") is None  # no speeds: config's minutes
    # resolving the rank gain adds repeats of its two methods, at most the budget
    more = paper(throughput={"target_half_width": 0.3, "max_repeats": 10})
    capped = paper(throughput={"target_half_width": 0.3, "max_repeats": 10, "budget_s": 600})
    assert jobplan.throughput_runtime_min(more, "1B") > jobplan.throughput_runtime_min(capped, "1B") > one


@pytest.mark.parametrize("text, minutes", [("30", 30), ("2:00:00", 120), ("1-00:00:00", 1440), ("2-12", 3600),
                                           ("7-00:00", 10080), ("45:30", 46), ("infinite", None), ("UNLIMITED", None),
                                           ("n/a", None)])
def test_slurm_time_limits_are_read_as_sinfo_prints_them(text, minutes):
    assert jobplan.parse_slurm_minutes(text) == minutes


def test_the_partitions_limit_caps_every_job_and_lengthens_the_chain():
    """sinfo's limit of the job's partition (or the default one, marked *) caps the wall time where it is
    shorter than cluster.runtime_max_min; the run then takes more runs of its job."""
    from types import SimpleNamespace

    out = "debug|infinite\ngpu*|1-00:00:00\ngpu-short|4:00:00\n"
    fake = lambda *a, **k: SimpleNamespace(returncode=0, stdout=out, stderr="")  # noqa: E731
    assert jobplan.partition_limit_min(None, run=fake) == 1440
    assert jobplan.partition_limit_min("gpu-short", run=fake) == 240
    assert jobplan.partition_limit_min("debug", run=fake) is None and jobplan.partition_limit_min("nope", run=fake) is None
    failed = lambda *a, **k: SimpleNamespace(returncode=1, stdout="", stderr="slurm_load_partitions: error")  # noqa: E731
    assert jobplan.partition_limit_min(None, run=failed) is None
    s = paper(cluster={"runtime_max_min": 2880})
    spec = train_spec(s, next(r for r in plan(s) if r.preset == "4B"))
    assert jobplan.runtime_cap_min(s) == 2880 and jobplan.runtime_cap_min(s, 240) == 240
    assert jobplan.runtime_min(s, spec, "4B") == 2880 and jobplan.runtime_min(s, spec, "4B", 240) == 240
    assert jobplan.jobs_needed(s, spec, "4B", 240) > 4 * jobplan.jobs_needed(s, spec, "4B")
    assert jobplan.throughput_runtime_min(s, "4B", 60) == 60
    with pytest.raises(jobplan.JobPlanError, match="leaves no time to train"):
        jobplan.jobs_needed(s, spec, "4B", 15)


def test_the_trainer_stops_before_slurms_signal_can_come():
    """The deadline of a run of a chained job lies before the earliest moment Slurm may send its
    signal (the lead, up to signal_margin_s early): the trainer checkpoints and requeues by itself."""
    s = paper()
    for preset in ("0.5B", "1B", "4B"):
        assert jobplan.deadline_lead_s(s, preset) >= jobplan.lead_s(s, preset) + s["cluster"]["signal_margin_s"]


def test_torchruns_shutdown_timeout_only_where_torch_has_it(monkeypatch):
    """--shutdown-timeout (torch >= 2.11) is passed where the installed torchrun has it; without it a job
    whose update and checkpoint fit torchrun's fixed 30 s runs without it, a slower one is refused."""
    from importlib import metadata

    from packaging.version import Version

    installed = Version(metadata.version("torch").split("+")[0])
    assert jobplan.torchrun_supports("--shutdown-timeout") == (installed >= Version("2.11"))
    assert jobplan.torchrun_supports("--no-such-option") is False
    assert all(jobplan.torchrun_supports(o) for opts in jobplan.TORCHRUN_OPTIONS.values() for o in opts)
    two_nodes = paper(resources={"train": {"nodes": 2}})
    monkeypatch.setattr(jobplan, "torchrun_supports", lambda option: option != "--rdzv-endpoint")
    with pytest.raises(jobplan.JobPlanError, match=r"has no --rdzv-endpoint, which the srun launch of a job of 16 ranks"):
        jobplan.launcher(two_nodes, "1B")
    monkeypatch.setattr(jobplan, "torchrun_supports", lambda option: option != "--shutdown-timeout")
    s = paper()
    cmd = jobplan.launcher(s, "1B")
    assert "--shutdown-timeout" not in cmd and torchrun_args(cmd)[1].shutdown_timeout is None
    with pytest.raises(ConfigError, match=r"scales.paper.resources.train: torchrun of torch .* has no --shutdown-timeout "
                                          r".* a 4B rank needs about \d+ s .* expected torch >= 2.11"):
        paper(cluster={"checkpoint_write_gbps": 0.1})  # refused when the workflow starts


def test_the_partition_of_a_rules_jobs_comes_from_snakemakes_resources():
    """--set-resources for the rule wins over --default-resources; neither: the default partition."""
    from types import SimpleNamespace

    from snakemake.resources import Resources

    both = SimpleNamespace(overwrite_resources={"train": Resources.from_mapping({"slurm_partition": "gpu-long"})},
                           default_resources=Resources.from_mapping({"slurm_partition": "gpu", "mem_mb": 1000}))
    assert jobplan.slurm_partition(both, "train") == "gpu-long" and jobplan.slurm_partition(both, "report") == "gpu"
    # as the command line gives them: expressions, evaluated only in a rule's context
    cli = SimpleNamespace(overwrite_resources={"train": Resources.parse(["slurm_partition=gpu-long"], allow_expressions=True)},
                          default_resources=Resources.parse(["slurm_partition=gpu"], allow_expressions=True, defaults="full"))
    assert jobplan.slurm_partition(cli, "train") == "gpu-long" and jobplan.slurm_partition(cli, "report") == "gpu"
    plain = SimpleNamespace(overwrite_resources={}, default_resources={"slurm_partition": "'gpu'"})
    assert jobplan.slurm_partition(plain, "train") == "gpu"
    assert jobplan.slurm_partition(SimpleNamespace(overwrite_resources={}, default_resources=None), "train") is None
