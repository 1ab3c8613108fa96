# One cell's plan before it trains (target, budget, memory estimate, verdict, the job's host memory), a typed
# file (tunegrid.prepare.cell_plan.CellPlan) the `finetune` job takes its `mem_mb` from. Reads file headers only.
rule cell_plan:
    # in the Snakemake process (no torch, ~ms a cell); `python scripts/tunegrid.py cell-plan` by hand
    input:
        model=get_cell_model_dir,
        capabilities=rules.probe.output.capabilities,
    output:
        plan=str(PATHS.cell_plan("{cell_id}")),
    log:
        f"{LOGS}/plans/{{cell_id}}.log",
    localrule: True
    params:
        spec=get_cell_spec,  # a change of the cell's resolved spec re-plans it
    run:
        Path(log[0]).write_text(
            write_cell_plan(
                STUDY_FILE,
                wildcards.cell_id,
                input.model,
                input.capabilities,
                output.plan,
                local=workflow.local_exec,
            ).to_json()
        )


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
        cluster=lambda wildcards: "" if workflow.local_exec else "--cluster",  # cluster jobs spawn every worker
    shell:
        f"python {SCRIPT} plan"
        f" --study-file {STUDY_FILE} --capabilities {{input.capabilities}} --models {{params.models}}"
        " --out {output.plan} {params.cluster} > {log} 2>&1"
