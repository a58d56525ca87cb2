# Token shards and their manifest: the input of every training and evaluation job. The tokeniser's
# thread count is the rule's `threads` (config data.num_threads), not part of its params: changing it
# reruns nothing.


rule prepare_data:
    input:
        src=stage_sources("lrattnres.data.cli"),
    output:
        manifest=f"{R}/data/manifest.json",
    log:
        f"{LOGS}/prepare_data.log",
    conda:
        "../../envs/lrattnres.yaml"
    threads: S["data"].get("num_threads", 2)
    resources:
        attempt=attempt,
        mem_mb=res("prepare_data", "mem_mb", 4000),
        runtime=res("prepare_data", "runtime", 30),
    params:
        spec=lambda wc: spec(science(S)["data"]),
        out=lambda wc, output: os.path.dirname(output.manifest),
    shell:
        stage(
            "prepare-data --spec {params.spec:q} --out {params.out:q} "
            "--threads {threads} --no-progress > {log:q} 2>&1",
        )
