# Sections 4.6-4.7, Appendices C.4, C.5, D, E, G.1: effective sources, heatmaps, gradient norms,
# static-query utilisation, over every run of the grid.


rule diagnostics:
    input:
        results=expand(f"{R}/runs/{{run}}/result.json", run=RUNS),
        models=expand(f"{R}/runs/{{run}}/model.safetensors", run=RUNS),
        settings=rules.settings.output[0],
        data=rules.prepare_data.output.manifest,
        published="reports/published.yaml",
        src=stage_sources("lrattnres.diagnostics"),
    output:
        f"{R}/diagnostics.json",
    log:
        f"{LOGS}/diagnostics.log",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 2
    resources:
        attempt=attempt,
        mem_mb=res("diagnostics", "mem_mb", 4000),
        runtime=res("diagnostics", "runtime", 30),
        gpu=res("diagnostics", "gpu", 0),
        gpu_slots=gpu_slots("diagnostics"),
        cpus_per_gpu=res("diagnostics", "cpus_per_gpu", 1),
    params:
        runs=lambda wc, input: os.path.dirname(os.path.dirname(input.results[0])),
    shell:
        stage(
            "diagnostics --settings {input.settings:q} --runs {params.runs:q} "
            "--data {input.data:q} --published {input.published:q} --threads {threads} "
            "--out {output:q} > {log:q} 2>&1",
            gpu=True,
        )


REPORT_INPUTS.append(rules.diagnostics.output[0])
