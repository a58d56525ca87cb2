# Section 4.8 / Table 2: every standard AttnRes run of seed 0 converted to full-width-RMS LR-AttnRes
# without retraining, checked in FP64 and by paired validation cross-entropy.
from lrattnres.gridplan import conversions

CONVERSIONS = {c["run_id"]: c for c in conversions(S)}
CONVERT_SETTINGS = {k: v for k, v in S.get("convert", {}).items() if k != "rank"}


rule convert:
    input:
        model=f"{R}/runs/{{run}}/model.safetensors",
        data=rules.prepare_data.output.manifest,
        published="reports/published.yaml",
    output:
        f"{R}/convert/{{run}}.json",
    log:
        f"{LOGS}/convert/{{run}}.log",
    wildcard_constraints:
        run="|".join(map(re.escape, CONVERSIONS)) or "no-conversion",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        attempt=attempt,
        mem_mb=res("convert", "mem_mb", 4000),
        runtime=res("convert", "runtime", 30),
        gpu=res("convert", "gpu", 0),
        gpu_slots=gpu_slots("convert"),
        cpus_per_gpu=res("convert", "cpus_per_gpu", 1),
    params:
        code=stage_code("convert"),
        spec=lambda wc: spec(
            {
                **CONVERT_SETTINGS,
                "rank": CONVERSIONS[wc.run]["rank"],
                "claim_row": CONVERSIONS[wc.run]["claim_row"],
            }
        ),
    shell:
        stage(
            "convert --checkpoint {input.model:q} "
            "--data {input.data:q} --spec {params.spec:q} --published {input.published:q} "
            "--out {output:q} --no-progress > {log:q} 2>&1",
            gpu=True,
            launcher="OMP_NUM_THREADS={threads} python -m lrattnres",
        )


rule convert_all:
    input:
        results=expand(f"{R}/convert/{{run}}.json", run=CONVERSIONS),
        published="reports/published.yaml",
    output:
        f"{R}/convert.json",
    log:
        f"{LOGS}/convert_all.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("convert_all", "mem_mb", 2000),
        runtime=res("convert_all", "runtime", 10),
    params:
        code=stage_code("convert"),
    shell:
        stage(
            "convert --aggregate {input.results:q} --published {input.published:q} "
            "--out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.convert_all.output[0])
