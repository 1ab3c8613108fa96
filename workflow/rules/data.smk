# The training records, written once: generated pairs, or the study's own file / pinned hub dataset
# normalized to pairs or chats. Cells read only this file (a hub dataset is downloaded here, never per cell).
rule dataset:
    input:
        source=lambda wildcards: [STUDY["data"]["path"]] if STUDY["data"]["source"] in ("jsonl", "parquet") else [],
    output:
        data=str(PATHS.dataset),
    log:
        str(PATHS.log("dataset")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        # a function: Snakemake expands wildcards in a plain string param, and a recipe's prompt format holds
        # braces ("{instruction}") that are no wildcards
        spec=lambda wildcards: json.dumps(STUDY["data"], sort_keys=True),
    shell:
        f"python {SCRIPT} dataset" " --data-spec {params.spec:q}" " --out {output.data} > {log} 2>&1"
