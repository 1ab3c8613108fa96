# One rule, three sources (synthetic / hub / local); the model's config entry is a param, so editing
# it rebuilds that model and, through the input, re-runs its cells.
rule model_checkpoint:
    input:
        data=rules.dataset.output.data,
    output:
        model=directory(str(PATHS.model_dir("{model}"))),
    log:
        str(PATHS.log("checkpoint", "{model}")),
    conda:
        "../../envs/tunegrid.yaml"
    resources:
        mem_mb=8000,
    params:
        spec=get_model_spec,
    shell:
        f"python {SCRIPT} checkpoint" " --spec {params.spec:q} --data {input.data}" " --out {output.model} > {log} 2>&1"
