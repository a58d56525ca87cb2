# Section 4.9 / Appendix I / Table 3: complete training-step throughput with the paper's protocol,
# one job per model size (throughput_size), merged into one result (throughput). A job keeps its
# finished timed runs in <preset>.partial.json beside its output; a retry continues from them. Under
# LRATTNRES_DEADLINE (epoch seconds; set here from the job's wall time unless the caller set it) the
# stage stops before the deadline and exits 75, which Snakemake's retries continue. The stage refuses
# a plan whose estimated GPU memory exceeds the scale's cluster.gpu_memory_gib less its margin before
# it builds anything; the cluster section reaches it as a resource (an execution setting: no rerun).
from lrattnres.throughput.cli import cluster_arg

THROUGHPUT_PRESETS = list(S["throughput"].get("presets", []))
THROUGHPUT_CLUSTER = cluster_arg(S.get("cluster"))


rule throughput_size:
    input:
        data=rules.prepare_data.output.manifest,
        published="reports/published.yaml",
    output:
        f"{R}/throughput/{{preset}}.json",
    log:
        f"{LOGS}/throughput/{{preset}}.log",
    wildcard_constraints:
        preset="|".join(map(re.escape, THROUGHPUT_PRESETS)) or "no-preset",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 1
    resources:
        attempt=attempt,
        mem_mb=res("throughput", "mem_mb", 4000),
        runtime=throughput_runtime,
        gpu=res("throughput", "gpu", 0),
        gpu_slots=gpu_slots("throughput"),
        cpus_per_gpu=res("throughput", "cpus_per_gpu", 1),
        cluster_memory=THROUGHPUT_CLUSTER,
    params:
        code=stage_code("throughput"),
        spec=lambda wc, input: spec(
            {**S["throughput"], "presets": [wc.preset], "published": input.published}
        ),
    shell:
        stage(
            "throughput --spec {params.spec:q} --cluster {resources.cluster_memory:q} --data {input.data:q} "
            "--out {output:q} > {log:q} 2>&1",
            gpu=True,
            launcher='LRATTNRES_DEADLINE="${{LRATTNRES_DEADLINE:-$(( $(date +%s) + {resources.runtime} * 60 - 120 ))}}" '
            "python -m lrattnres",
        )


rule throughput:
    input:
        parts=expand(f"{R}/throughput/{{preset}}.json", preset=THROUGHPUT_PRESETS),
    output:
        f"{R}/throughput.json",
    log:
        f"{LOGS}/throughput.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("throughput_all", "mem_mb", 2000),
        runtime=res("throughput_all", "runtime", 10),
    params:
        code=stage_code("throughput"),
    shell:
        stage(
            "throughput --aggregate {input.parts:q} --out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.throughput.output[0])
