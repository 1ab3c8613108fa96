# Before spending GPU hours: which cells this target cannot run (unsupported), which the estimate says
# will not fit (predicted_oom), and every cell's estimated peak. `snakemake --cores 8 plan`; trains nothing.
rule plan:
    input:
        capabilities=rules.probe.output.capabilities,
        models=get_model_dirs(),
    output:
        plan=f"{RESULTS}/plan.csv",
    log:
        f"{LOGS}/plan.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        models=lambda wildcards, input: os.path.dirname(input.models[0]),
    shell:
        f"python {SCRIPT} plan"
        f" --study-file {STUDY_FILE} --capabilities {{input.capabilities}} --models {{params.models}}"
        " --out {output.plan} > {log} 2>&1"
