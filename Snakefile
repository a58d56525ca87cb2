# LR-AttnRes replication: `snakemake --cores all reports/paper.html` runs every experiment of the
# paper at the scale chosen in config.yaml and renders the report. Rules are thin: each calls one
# `python -m lrattnres <stage>` subcommand; the logic lives in the lrattnres package.
from snakemake.utils import min_version

min_version("9.19")


configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/settings.smk"
include: "workflow/rules/accounting.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/convert.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/diagnostics.smk"
include: "workflow/rules/throughput.smk"
include: "workflow/rules/kernel.smk"
include: "workflow/rules/report.smk"  # last: it reads every stage's REPORT_INPUTS


# Bookkeeping rules run where Snakemake runs, not as cluster jobs.
localrules:
    all,
    settings,
    grid_summary,
    convert_all,
    evaluate_pairs,
    diagnostics,
    report,


rule all:
    default_target: True
    input:
        "reports/paper.html",
        "reports/paper.json",
        "reports/claims.tsv",
