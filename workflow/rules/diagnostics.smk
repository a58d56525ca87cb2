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
        mem_mb=res("diagnostics", "mem_mb", 4000),
        runtime=res("diagnostics", "runtime", 30),
        gpu=res("diagnostics", "gpu", 0),
        cpus_per_gpu=res("diagnostics", "cpus_per_gpu", 1),
    params:
        runs=lambda wc, input: os.path.dirname(os.path.dirname(input.results[0])),
    shell:
        "python -m lrattnres diagnostics --settings {input.settings} --runs {params.runs} "
        "--data {input.data} --published {input.published} --threads {threads} "
        "--out {output} > {log} 2>&1"


REPORT_INPUTS.append(rules.diagnostics.output[0])
