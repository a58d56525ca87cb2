# Appendix I: the fused kernel against the reference (bf16 on a GPU, the Triton interpreter in fp32 on
# a CPU), and the explainer's four-number example through both.


rule kernel_check:
    input:
        src=stage_sources("lrattnres.kernel_check", "kernels"),
    output:
        f"{R}/kernel_check.json",
    log:
        f"{LOGS}/kernel_check.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("kernel_check", "mem_mb", 2000),
        runtime=res("kernel_check", "runtime", 10),
        gpu=res("kernel_check", "gpu", 0),
        gpu_slots=gpu_slots("kernel_check"),
    params:
        spec=lambda wc: spec(S.get("kernel_check", {})),
    shell:
        stage(
            "kernel-check --spec {params.spec:q} --out {output:q} > {log:q} 2>&1",
            gpu=True,
        )


REPORT_INPUTS.append(rules.kernel_check.output[0])
