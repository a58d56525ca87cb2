# The report: every stage's result beside the published numbers, with verdicts.


rule report:
    input:
        settings=rules.settings.output[0],
        published="reports/published.yaml",
        results=REPORT_INPUTS,
        # result files measured elsewhere (config `recorded`): a new recording reruns the report
        recorded=[p for p in config.get("recorded", {}).values() if os.path.exists(p)],
        src=stage_sources(
            "lrattnres.report",
            "lrattnres.claims",
            *package_modules("lrattnres.report.sections"),
        )
        + package_files("lrattnres.report.templates", "*.j2"),
    output:
        html="reports/paper.html",
        json="reports/paper.json",
    log:
        f"{LOGS}/report.log",
    conda:
        "../../envs/lrattnres.yaml"
    resources:
        attempt=attempt,
        mem_mb=res("report", "mem_mb", 2000),
        runtime=res("report", "runtime", 10),
    shell:
        stage(
            "report --settings {input.settings:q} --published {input.published:q} "
            "--results {input.results:q} --html {output.html:q} --json {output.json:q} > {log:q} 2>&1",
        )
