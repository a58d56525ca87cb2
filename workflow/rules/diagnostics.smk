# Sections 4.6-4.7, Appendices C.4, C.5, D, E, G.1: effective sources, heatmaps, gradient norms,
# static-query utilisation. Each run is analysed on its own, beside its model (diagnose_run); the
# figures and claims are made from the per-run rows (diagnostics), which needs no model.


rule diagnose_run:
    input:
        result=f"{R}/runs/{{run}}/result.json",
        model=f"{R}/runs/{{run}}/model.safetensors",
        settings=rules.settings.output[0],
        data=rules.prepare_data.output.manifest,
    output:
        f"{R}/diagnostics/{{run}}.json",
    log:
        f"{LOGS}/diagnostics/{{run}}.log",
    wildcard_constraints:
        run="|".join(map(re.escape, RUNS)),
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        attempt=attempt,
        mem_mb=res("diagnostics", "mem_mb", 4000),
        runtime=res("diagnostics", "runtime", 30),
        gpu=res("diagnostics", "gpu", 0),
        gpu_slots=gpu_slots("diagnostics"),
        cpus_per_gpu=res("diagnostics", "cpus_per_gpu", 1),
    params:
        code=stage_code("diagnostics"),
        runs=lambda wc, input: os.path.dirname(os.path.dirname(input.result)),
    shell:
        stage(
            "diagnostics --settings {input.settings:q} --runs {params.runs:q} "
            "--data {input.data:q} --run {wildcards.run} --threads {threads} "
            "--out {output:q} > {log:q} 2>&1",
            gpu=True,
        )


rule diagnostics:
    input:
        rows=expand(f"{R}/diagnostics/{{run}}.json", run=RUNS),
        settings=rules.settings.output[0],
        published="reports/published.yaml",
    output:
        f"{R}/diagnostics.json",
    log:
        f"{LOGS}/diagnostics.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("diagnostics_all", "mem_mb", 2000),
        runtime=res("diagnostics_all", "runtime", 10),
    params:
        code=stage_code("diagnostics"),
    shell:
        stage(
            "diagnostics --settings {input.settings:q} --published {input.published:q} "
            "--aggregate {input.rows:q} --out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.diagnostics.output[0])
