# The training runs of the grid (lrattnres/grid.py plans them from the scale's `grid` settings):
# the rank/grouping sweep, the baseline, seeds, the full-width-RMS control, projected keys and the
# size pair. Run folders are named <preset>-<method>-n<N>-r<rank>-s<seed>.
from lrattnres.grid import plan as plan_grid, train_spec

RUNS = {run.run_id: run for run in plan_grid(S)}


rule train:
    input:
        data=rules.prepare_data.output.manifest,
        src=stage_sources(
            "lrattnres.train.cli", "lrattnres.train.loop", "lrattnres.model", "kernels"
        ),
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
        attempt=attempt,
        mem_mb=res("train", "mem_mb", 4000),
        runtime=res("train", "runtime", 60),
        gpu=res("train", "gpu", 0),
        gpu_slots=gpu_slots("train"),
        cpus_per_gpu=res("train", "cpus_per_gpu", 1),
    params:
        spec=lambda wc: spec(train_spec(S, RUNS[wc.run])),
        out=lambda wc, output: os.path.dirname(output.result),
        # the GPU count of a training job is its data-parallel world size: part of the experiment
        launcher=lambda wc, resources: (
            f"torchrun --standalone --nproc-per-node {resources.gpu} -m lrattnres"
            if resources.gpu > 1
            else "python -m lrattnres"
        ),
    shell:
        stage(
            "train --spec {params.spec:q} --data {input.data:q} --out {params.out:q} "
            "--threads {threads} --no-progress > {log:q} 2>&1",
            gpu=True,
            launcher="{params.launcher}",
        )


rule grid_summary:
    input:
        runs=expand(f"{R}/runs/{{run}}/result.json", run=RUNS),
        settings=rules.settings.output[0],
        published="reports/published.yaml",
        src=stage_sources("lrattnres.grid", "lrattnres.claims"),
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
        runs=lambda wc, input: os.path.dirname(os.path.dirname(input.runs[0])),
    shell:
        stage(
            "summarize-grid --settings {input.settings:q} --runs {params.runs:q} "
            "--published {input.published:q} --out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.grid_summary.output[0])
