rule probe:
    input:
        tracking=get_tracking_file,
    output:
        capabilities=f"{RESULTS}/probe/capabilities.json",
    params:
        world_sizes=" ".join(map(str, STUDY["probe"]["world_sizes"])),
        budget_s=STUDY["probe"]["budget_s"],
    log:
        f"{LOGS}/probe.log",
    resources:
        gpu=get_probe_gpus,
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} probe"
        " --budget-s {params.budget_s} --world-sizes {params.world_sizes} --tracking={input.tracking}"
        " --out {output.capabilities} > {log} 2>&1"


# Before spending GPU hours: which cells this target cannot run (unsupported), which the estimate says
# will not fit (predicted_oom), and every cell's estimated peak. `snakemake --cores 8 plan`; trains nothing.
rule plan:
    input:
        capabilities=rules.probe.output.capabilities,
        models=get_model_dirs(),
    output:
        plan=f"{RESULTS}/plan.csv",
    params:
        models=lambda wildcards, input: os.path.dirname(input.models[0]),
    log:
        f"{LOGS}/plan.log",
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} plan"
        f" --study-file {STUDY_FILE} --capabilities {{input.capabilities}} --models {{params.models}}"
        " --out {output.plan} > {log} 2>&1"
