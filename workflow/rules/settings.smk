# The resolved settings of the scale, written once for the stages that read a whole scale.


rule settings:
    output:
        f"{R}/settings.json",
    log:
        f"{LOGS}/settings.log",
    conda:
        "../../envs/lrattnres.yaml"
    params:
        settings=lambda wc: spec(S),
    shell:
        "python -c 'import sys; from lrattnres.io import atomic_write_text; "
        "atomic_write_text(sys.argv[1], sys.argv[2])' {output} {params.settings:q} > {log} 2>&1"
