# Appendix I: the fused kernel against the reference (bf16 on a GPU, the Triton interpreter in fp32 on
# a CPU), and the explainer's four-number example through both.


rule kernel_check:
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
        code=stage_code("kernel-check"),
        spec=lambda wc: spec(S.get("kernel_check", {})),
    shell:
        stage(
            "kernel-check --spec {params.spec:q} --out {output:q} > {log:q} 2>&1",
            gpu=True,
        )


REPORT_INPUTS.append(rules.kernel_check.output[0])


# Appendix I on the trained size pair: every routing read of one batch (the run's sequence length)
# through the fused operator against the reference, beside each model (a piece runs it with its
# trainings), then merged into the claims.
from lrattnres.gridplan import evaluations

READ_RUNS = {e["run_id"]: e["claim_size"] for e in evaluations(S)}


rule kernel_check_run:
    input:
        result=f"{R}/runs/{{run}}/result.json",
        model=f"{R}/runs/{{run}}/model.safetensors",
        data=rules.prepare_data.output.manifest,
    output:
        f"{R}/kernel_check/{{run}}.json",
    log:
        f"{LOGS}/kernel_check/{{run}}.log",
    wildcard_constraints:
        run="|".join(map(re.escape, READ_RUNS)) or "no-run",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        attempt=attempt,
        mem_mb=res("kernel_check_run", "mem_mb", 4000),
        runtime=res("kernel_check_run", "runtime", 30),
        gpu=res("kernel_check_run", "gpu", 0),
        gpu_slots=gpu_slots("kernel_check_run"),
        cpus_per_gpu=res("kernel_check_run", "cpus_per_gpu", 1),
    params:
        code=stage_code("kernel-reads"),
    shell:
        stage(
            "kernel-reads --checkpoint {input.model:q} --data {input.data:q} "
            "--out {output:q} > {log:q} 2>&1",
            gpu=True,
            launcher="OMP_NUM_THREADS={threads} python -m lrattnres",
        )


rule kernel_check_trained:
    input:
        runs=expand(f"{R}/kernel_check/{{run}}.json", run=READ_RUNS),
        settings=rules.settings.output[0],
        published="reports/published.yaml",
    output:
        f"{R}/kernel_check_trained.json",
    log:
        f"{LOGS}/kernel_check_trained.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("kernel_check_trained", "mem_mb", 2000),
        runtime=res("kernel_check_trained", "runtime", 10),
    params:
        code=stage_code("kernel-reads"),
        sizes=lambda wc: spec(READ_RUNS),
    shell:
        stage(
            "kernel-reads --aggregate {input.runs:q} --sizes {params.sizes:q} --settings {input.settings:q} "
            "--published {input.published:q} --out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.kernel_check_trained.output[0])
