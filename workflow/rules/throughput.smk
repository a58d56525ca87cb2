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
        attempt=attempt,
        mem_mb=res("throughput", "mem_mb", 4000),
        runtime=res("throughput", "runtime", 30),
        gpu=res("throughput", "gpu", 0),
        gpu_slots=gpu_slots("throughput"),
        cpus_per_gpu=res("throughput", "cpus_per_gpu", 1),
    params:
        spec=lambda wc, input: spec({**S["throughput"], "published": input.published}),
    shell:
        stage(
            "throughput --spec {params.spec:q} --data {input.data:q} "
            "--out {output:q} > {log:q} 2>&1",
            gpu=True,
        )


REPORT_INPUTS.append(rules.throughput.output[0])
