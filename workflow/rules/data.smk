# Token shards and their manifest: the input of every training and evaluation job.


rule prepare_data:
    input:
        src=stage_sources("lrattnres.data.cli"),
    output:
        manifest=f"{R}/data/manifest.json",
    log:
        f"{LOGS}/prepare_data.log",
    conda:
        "../../envs/lrattnres.yaml"
    threads: 2
    resources:
        mem_mb=res("prepare_data", "mem_mb", 4000),
        runtime=res("prepare_data", "runtime", 30),
    params:
        spec=lambda wc: spec(S["data"]),
        out=lambda wc, output: os.path.dirname(output.manifest),
    shell:
        "python -m lrattnres prepare-data --spec {params.spec:q} --out {params.out} > {log} 2>&1"
