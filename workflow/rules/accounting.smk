# Appendix F: added FLOPs, parameter deltas, activation memory, for the paper's architectures and
# for the presets of the selected scale.


rule accounting:
    output:
        f"{R}/accounting.json",
    log:
        f"{LOGS}/accounting.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("accounting", "mem_mb", 2000),
        runtime=res("accounting", "runtime", 10),
    params:
        code=stage_code("accounting"),
        spec=lambda wc: spec(
            {
                "architectures": {
                    name: name for name in sorted(set(S["presets"].values()))
                },
                "ranks": S["accounting"]["ranks"],
                "blocks": S["accounting"]["blocks"],
            }
        ),
    shell:
        stage(
            "accounting --spec {params.spec:q} --out {output:q} > {log:q} 2>&1",
        )


REPORT_INPUTS.append(rules.accounting.output[0])
