# Appendix G / Tables 1 and 8: zero-shot downstream accuracy of the size pair with lm-eval, offline.
from lrattnres.gridplan import evaluations

EVALUATIONS = {e["run_id"]: e for e in evaluations(S)}


rule evaluate:
    input:
        model=f"{R}/runs/{{run}}/model.safetensors",
        data=rules.prepare_data.output.manifest,
        published="reports/published.yaml",
    output:
        f"{R}/evaluate/{{run}}.json",
    log:
        f"{LOGS}/evaluate/{{run}}.log",
    wildcard_constraints:
        run="|".join(map(re.escape, EVALUATIONS)) or "no-evaluation",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        attempt=attempt,
        mem_mb=res("evaluate", "mem_mb", 4000),
        runtime=res("evaluate", "runtime", 30),
        gpu=res("evaluate", "gpu", 0),
        gpu_slots=gpu_slots("evaluate"),
        cpus_per_gpu=res("evaluate", "cpus_per_gpu", 1),
    params:
        code=stage_code("evaluate"),
        spec=lambda wc: spec(S.get("evaluate", {})),
        size=lambda wc: EVALUATIONS[wc.run]["claim_size"],
    shell:
        stage(
            "evaluate --checkpoint {input.model:q} --data {input.data:q} "
            "--spec {params.spec:q} --claim-size {params.size:q} --published {input.published:q} "
            "--threads {threads} --out {output:q} > {log:q} 2>&1",
            gpu=True,
        )


rule evaluate_pairs:
    input:
        results=expand(f"{R}/evaluate/{{run}}.json", run=EVALUATIONS),
        published="reports/published.yaml",
    output:
        f"{R}/evaluate_pairs.json",
    log:
        f"{LOGS}/evaluate_pairs.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("evaluate_pairs", "mem_mb", 2000),
        runtime=res("evaluate_pairs", "runtime", 10),
    params:
        code=stage_code("evaluate-pairs"),
    shell:
        stage(
            "evaluate-pairs --results {input.results:q} --published {input.published:q} "
            "--out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.extend(expand(f"{R}/evaluate/{{run}}.json", run=EVALUATIONS))
REPORT_INPUTS.append(rules.evaluate_pairs.output[0])
