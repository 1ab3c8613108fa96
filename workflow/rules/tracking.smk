# The store and the experiment are created once, before the cells fan out: concurrent first writers
# to a fresh sqlite store crash on table creation. MLFLOW_TRACKING_URI, when set, overrides the default
# store. Neither it nor HF_TOKEN is an `envvars:` entry: Snakemake refuses to start when a listed variable
# is unset (both are optional), and its local executor writes listed ones into each spawned job's command
# as `export NAME='value'` (a secret in process lists and verbose logs). Jobs inherit the environment
# locally and on SLURM (sbatch --export=ALL) instead.
# Bookkeeping rules (`localrule: True`) run where snakemake runs, with no queueing for a few seconds of
# work: the store, the sync, the dataset, the plan, the summary and the report. The probe and the cells
# go to the cluster.


rule tracking_init:
    output:
        tracking=str(PATHS.tracking),
    log:
        str(PATHS.log("tracking_init")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        uri=STUDY["tracking"]["tracking_uri"],
        experiment=STUDY["tracking"]["experiment"] or f"tunegrid/{STUDY['study']}",
        artifact_root=str(PATHS.artifacts),
        system_metrics=STUDY["tracking"]["system_metrics_interval_s"],
    shell:
        f"python {SCRIPT} tracking-init"
        " --tracking-uri={params.uri:q} --experiment {params.experiment:q}"
        " --artifact-root {params.artifact_root} --system-metrics-interval-s {params.system_metrics}"
        " --out {output.tracking} > {log} 2>&1"


# metrics.jsonl is the source of truth: any cell whose store was down or locked while it trained
# gets its run created or completed here, after the grid.
rule mlflow_sync:
    input:
        tracking=rules.tracking_init.output.tracking,
        results=get_result_files(),
    output:
        sync=str(PATHS.tracking_sync),
    log:
        str(PATHS.log("mlflow_sync")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        logs=str(PATHS.cell_logs_dir),
    shell:
        f"python {SCRIPT} sync"
        " --tracking {input.tracking} --logs {params.logs} --out {output.sync} {input.results} > {log} 2>&1"


# The probe's record as an MLflow run of its own; each cell run links to it (tag probe.run_id).
rule probe_tracking:
    input:
        tracking=rules.tracking_init.output.tracking,
        capabilities=rules.probe.output.capabilities,
    output:
        run=str(PATHS.probe_run),
    log:
        str(PATHS.log("probe_tracking")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} probe-tracking"
        " --tracking {input.tracking} --capabilities {input.capabilities} --out {output.run} > {log} 2>&1"


# After the report: each current cell run's description, the links between a failing run and the runs that prove
# its fix, and the study's runs page as a comparison table (the view `snakemake mlflow_ui` prints).
rule mlflow_review:
    input:
        tracking=rules.tracking_init.output.tracking,
        sync=rules.mlflow_sync.output.sync,
        recommendations=str(PATHS.report_file("recommendations.json")),
        results=get_result_files(),
    output:
        review=str(PATHS.tracking_review),
    log:
        str(PATHS.log("mlflow_review")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} mlflow-review"
        " --tracking {input.tracking} --recommendations {input.recommendations} --out {output.review}"
        " {input.results} > {log} 2>&1"
