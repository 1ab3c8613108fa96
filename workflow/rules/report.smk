# The comparison report, built from the files (never from MLflow, so the store may be down).
# Every figure is also registered for `snakemake --report results/<study>/report.html`.
rule comparison_report:
    input:
        summary=rules.summary.output.parquet,
        results=get_result_files(),
        capabilities=rules.probe.output.capabilities,
        environment=rules.environment.output.env,
        study=rules.study_config.output.study,  # read for an imported recipe's fixes (its base section)
    output:
        html=report(str(PATHS.report_file("index.html")), caption="../report/index.rst", category="Review"),
        outcomes=report(str(PATHS.report_file("outcomes.png")), caption="../report/outcomes.rst", category="Review"),
        loss=report(str(PATHS.report_file("loss_curves.png")), caption="../report/loss_curves.rst", category="Review"),
        memory=report(str(PATHS.report_file("memory.png")), caption="../report/memory.rst", category="Review"),
        recommendations=report(
            str(PATHS.report_file("recommendations.json")), caption="../report/recommendations.rst", category="Review"
        ),
    log:
        str(PATHS.log("report")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        study=STUDY["study"],
        out_dir=lambda wildcards, output: os.path.dirname(output.html),
    shell:
        f"python {SCRIPT} report"
        " --summary {input.summary} --capabilities {input.capabilities} --environment {input.environment}"
        " --study {params.study} --out-dir {params.out_dir} {input.results} > {log} 2>&1"


# `snakemake mlflow_ui` serves the study's store with MLflow's own server until Ctrl-C. Loopback by
# default; another tracking.ui_host needs tracking.ui_allowed_hosts (checked with the config).
rule mlflow_ui:
    input:
        tracking=rules.tracking_init.output.tracking,
    log:
        str(PATHS.log("mlflow_ui")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        host=STUDY["tracking"]["ui_host"],
        port=STUDY["tracking"]["ui_port"],
        allowed=(
            f"--allowed-hosts {shlex.quote(STUDY['tracking']['ui_allowed_hosts'])}"
            if STUDY["tracking"]["ui_allowed_hosts"]
            else ""
        ),
    shell:
        f"python {SCRIPT} mlflow-ui --tracking {{input.tracking}} --host {{params.host}} --port {{params.port}}"
        " {params.allowed} --log {log}"
