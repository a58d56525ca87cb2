# The resolved settings of the scale, written once for the stages that read a whole scale: science
# only (config.science drops resources, the results folder and thread counts), so that changing an
# execution setting rewrites nothing and reruns nothing.


rule settings:
    output:
        f"{R}/settings.json",
    log:
        f"{LOGS}/settings.log",
    conda:
        "../../envs/lrattnres.yaml"
    params:
        settings=lambda wc: spec(science(S)),
    shell:
        "python -c 'import sys; from lrattnres.io import atomic_write_text; "
        "atomic_write_text(sys.argv[1], sys.argv[2])' {output:q} {params.settings:q} > {log:q} 2>&1"
