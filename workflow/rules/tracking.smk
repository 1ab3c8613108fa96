# The store and the experiment are created once, before the cells fan out: concurrent first writers
# to a fresh sqlite store crash on table creation. MLFLOW_TRACKING_URI, when set, overrides the default
# store (it is optional, so it is not an `envvars:` entry, which Snakemake would require).
rule tracking_init:
    output:
        tracking=f"{RESULTS}/tracking.json",
    params:
        uri=STUDY["tracking"]["tracking_uri"],
        experiment=STUDY["tracking"]["experiment"] or f"tunegrid/{STUDY['study']}",
        artifact_root="results/mlartifacts",
    log:
        f"{LOGS}/tracking_init.log",
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} tracking-init"
        " --tracking-uri={params.uri:q} --experiment {params.experiment:q}"
        " --artifact-root {params.artifact_root} --out {output.tracking} > {log} 2>&1"
