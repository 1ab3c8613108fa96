rule summary:
    input:
        results=get_result_files(),
        sync=get_sync_file(),
    output:
        csv=report(
            str(PATHS.summary),
            caption="../report/summary.rst",
            category="Summary",
        ),
        parquet=str(PATHS.summary_parquet),
    log:
        str(PATHS.log("summary")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        # the reference settings and tolerances: a change re-runs the summary, never a cell
        review=json.dumps(STUDY["review"], sort_keys=True),
    shell:
        f"python {SCRIPT} summary"
        " --out {output.csv} --sync={input.sync} --review {params.review:q} {input.results} > {log} 2>&1"
