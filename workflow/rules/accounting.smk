# Appendix F: added FLOPs, parameter deltas, activation memory, for the paper's architectures and
# for the presets of the selected scale.


rule accounting:
    input:
        src=stage_sources("lrattnres.accounting"),
    output:
        f"{R}/accounting.json",
    params:
        spec=lambda wc: spec(
            {
                "architectures": {name: name for name in sorted(set(S["presets"].values()))},
                "ranks": S["accounting"]["ranks"],
                "blocks": S["accounting"]["blocks"],
            }
        ),
    log:
        f"{LOGS}/accounting.log",
    resources:
        mem_mb=res("accounting", "mem_mb", 2000),
        runtime=res("accounting", "runtime", 10),
    conda:
        "../../envs/lrattnres.yaml"
    shell:
        "python -m lrattnres accounting --spec {params.spec:q} --out {output} > {log} 2>&1"
