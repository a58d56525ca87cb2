# The report: every stage's result beside the published numbers, with verdicts.
#
# The outputs are flagged update(): Snakemake keeps the previous report while the job runs and puts
# it back if the job fails, and the stage itself writes each file to a temporary name and renames it.
# A malformed stage value does not fail the job: the page lists it and its claims are "not run".


rule report:
    input:
        settings=rules.settings.output[0],
        published="reports/published.yaml",
        results=REPORT_INPUTS,
        # results measured elsewhere (reports/recorded.yaml, not the config): the list and every file
        # it names that exists, so that a new recording reruns the report and nothing else; a missing
        # or malformed list is a note on the page
        recorded_files=recorded_files(),
    output:
        html=update("reports/paper.html"),
        json=update("reports/paper.json"),
        tsv=update("reports/claims.tsv"),
    log:
        f"{LOGS}/report.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("report", "mem_mb", 2000),
        runtime=res("report", "runtime", 10),
    params:
        code=stage_code("report"),
        # the list's path even when it is absent (the page then says so); when present it is an input
        recorded=lambda wc: RECORDED,
    shell:
        stage(
            "report --settings {input.settings:q} --published {input.published:q} "
            "--recorded {params.recorded:q} "
            "--results {input.results:q} --html {output.html:q} --json {output.json:q} "
            "--tsv {output.tsv:q} > {log:q} 2>&1",
        )
