# Token shards and their manifest: the input of every training and evaluation job. The tokeniser's
# thread count is the rule's `threads` (config data.num_threads), not part of its params: changing it
# reruns nothing.
from lrattnres.data.docs import by_name as doc_collections

DATA = S["data"]
PACK = DATA["pack"]["path"] if DATA["source"] == "pack" else None


if PACK:

    # The documentation pack (lrattnres/data/docs.py), built from the installed Debian documentation
    # packages when it is absent. It is data, not code: an existing pack is kept (its sha256 goes into
    # the manifest), so that a pack carried to a machine without those packages is used as it is.
    rule corpus_pack:
        output:
            PACK,
        log:
            f"{LOGS}/corpus_pack.log",
        conda:
            "../../envs/lrattnres.yaml"
        resources:
            attempt=attempt,
            mem_mb=res("corpus_pack", "mem_mb", 4000),
            runtime=res("corpus_pack", "runtime", 30),
        params:
            collections=",".join(
                c.name for c in doc_collections(DATA["pack"]["collections"])
            ),
            min_chars=DATA["pack"]["min_chars"],
        shell:
            stage(
                "corpus-pack --out {output:q} --collections {params.collections:q} "
                "--min-chars {params.min_chars} > {log:q} 2>&1",
                # the pack is pinned by its sha256 (config.yaml): a code change does not remake it
                code=False,
            )


# A data stage that streams from the Hub needs the network: resources.prepare_data.local runs it on
# the machine that runs Snakemake; data.hf.local_dir reads a pre-staged copy instead (docs/slurm.md).
rule prepare_data:
    input:
        pack=[PACK] if PACK else [],
    output:
        manifest=f"{R}/data/manifest.json",
    log:
        f"{LOGS}/prepare_data.log",
    localrule: bool(res("prepare_data", "local", False))
    conda:
        "../../envs/lrattnres.yaml"
    threads: S["data"].get("num_threads", 2)
    resources:
        attempt=attempt,
        mem_mb=res("prepare_data", "mem_mb", 4000),
        runtime=res("prepare_data", "runtime", 30),
    params:
        code=stage_code("prepare-data"),
        spec=lambda wc: spec(science_data_spec(science(S)["data"])),
        out=lambda wc, output: os.path.dirname(output.manifest),
    shell:
        stage(
            "prepare-data --spec {params.spec:q} --out {params.out:q} "
            "--threads {threads} --no-progress > {log:q} 2>&1",
        )
