# The training runs of the grid (lrattnres/gridplan.py plans them from the scale's `grid` settings):
# the rank/grouping sweep, the baseline, seeds, the full-width-RMS control, projected keys and the
# size pair. Run folders are named <preset>-<method>-n<N>-r<rank>-s<seed>.
from lrattnres.gridplan import plan as plan_grid, train_spec
from lrattnres.pieces import TRAIN_EXECUTION_KEYS

RUNS = {run.run_id: run for run in plan_grid(S)}
# Where a training job runs (lrattnres/jobplan.py): one node (--nodes=1, --gpus-per-node), or
# several through the job's own srun and torchrun's rendezvous; then the Slurm executor runs the
# command in the batch script (an "mpi" job) with one task per node.
TRAIN_JOB = jobplan.slurm_resources(S, S["presets"]["main"])
TRAIN_SPANS = {
    k: TRAIN_JOB[k] for k in ("mpi", "tasks", "cpus_per_task") if k in TRAIN_JOB
}


rule train:
    input:
        data=rules.prepare_data.output.manifest,
    output:
        result=f"{R}/runs/{{run}}/result.json",
        model=f"{R}/runs/{{run}}/model.safetensors",
        model_sha256=f"{R}/runs/{{run}}/model.safetensors.sha256",
    log:
        f"{LOGS}/train/{{run}}.log",
    wildcard_constraints:
        run="|".join(map(re.escape, RUNS)),
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        **TRAIN_SPANS,
        attempt=attempt,
        mem_mb=res("train", "mem_mb", 4000),
        runtime=train_runtime,
        gpu=TRAIN_JOB["gpu"],
        gpu_slots=gpu_slots("train") if TRAIN_JOB["nodes"] == 1 else 0,
        cpus_per_gpu=res("train", "cpus_per_gpu", 1),
        nodes=TRAIN_JOB["nodes"],
        # the signal lead covers an update and a checkpoint write; logs append across requeues
        slurm_extra=lambda wc: jobplan.slurm_resources(S, RUNS[wc.run].preset)[
            "slurm_extra"
        ],
        # execution settings, which rerun nothing: what a checkpoint of other training code does, and
        # how long before a Slurm job's end its trainer stops and requeues the job (lrattnres/slurmjob.py)
        on_code_change=S["train"].get("on_code_change", "restart"),
        deadline_lead=lambda wc: jobplan.deadline_lead_s(S, RUNS[wc.run].preset),
    params:
        code=stage_code("train"),
        # what the run computes: a change of it reruns the job (Snakemake's params trigger)
        science=lambda wc: spec(
            {
                k: v
                for k, v in train_spec(S, RUNS[wc.run]).items()
                if k not in TRAIN_EXECUTION_KEYS
            }
        ),
        # the spec the trainer reads, with the keys that say how a run reports and saves itself
        # (TRAIN_EXECUTION_KEYS: status lines, checkpoint cadence, the gradient-norm guard). A
        # function of the job's resources too, so Snakemake counts it as derived and leaves it out
        # of its params trigger: those keys rerun nothing.
        spec=lambda wc, resources: spec(train_spec(S, RUNS[wc.run])),
        out=lambda wc, output: os.path.dirname(output.result),
        # the GPU count of a training job is its data-parallel world size: part of the experiment
        # (the trainer refuses a world size whose tokens per update are not the spec's)
        launcher=lambda wc, resources: jobplan.launcher(
            S, RUNS[wc.run].preset, resources.gpu or None
        ),
    shell:
        stage(
            "train --spec {params.spec:q} --data {input.data:q} --out {params.out:q} "
            "--on-code-change {resources.on_code_change} --requeue-at-deadline "
            "--threads {threads} --no-progress > {log:q} 2>&1",
            gpu=True,
            # inside a Slurm job: stop before the job's end and requeue it (a run longer than one job)
            launcher='LRATTNRES_DEADLINE="${{LRATTNRES_DEADLINE:-$(python -m lrattnres.slurmjob deadline '
            '--lead {resources.deadline_lead})}}" {params.launcher}',
        )


rule grid_summary:
    input:
        runs=expand(f"{R}/runs/{{run}}/result.json", run=RUNS),
        settings=rules.settings.output[0],
        published="reports/published.yaml",
    output:
        f"{R}/grid.json",
    log:
        f"{LOGS}/grid_summary.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("grid_summary", "mem_mb", 2000),
        runtime=res("grid_summary", "runtime", 10),
    params:
        code=stage_code("summarize-grid"),
        runs=lambda wc, input: os.path.dirname(os.path.dirname(input.runs[0])),
    shell:
        stage(
            "summarize-grid --settings {input.settings:q} --runs {params.runs:q} "
            "--published {input.published:q} --out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.grid_summary.output[0])
