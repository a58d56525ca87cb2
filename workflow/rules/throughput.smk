# Section 4.9 / Appendix I / Table 3: complete training-step throughput with the paper's protocol.


rule throughput:
    input:
        data=rules.prepare_data.output.manifest,
        published="reports/published.yaml",
        src=stage_sources("lrattnres.throughput"),
    output:
        f"{R}/throughput.json",
    log:
        f"{LOGS}/throughput.log",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        mem_mb=res("throughput", "mem_mb", 4000),
        runtime=res("throughput", "runtime", 30),
        gpu=res("throughput", "gpu", 0),
        cpus_per_gpu=res("throughput", "cpus_per_gpu", 1),
    params:
        spec=lambda wc, input: spec({**S["throughput"], "published": input.published}),
    shell:
        "python -m lrattnres throughput --spec {params.spec:q} --data {input.data} "
        "--out {output} > {log} 2>&1"


REPORT_INPUTS.append(rules.throughput.output[0])
