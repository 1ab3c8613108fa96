# The study's resolved config (defaults filled), the file every job reads its cell from: jobs get this path and
# a cell id, never the study or a spec on their command line (no "Argument list too long", nothing in the logs).
# Re-made when the resolved study changes (its params); the jobs take it `ancient`, so a change re-runs only the
# cells whose own spec changed (their params), not every cell.
rule study_config:
    output:
        study=STUDY_FILE,
    log:
        f"{LOGS}/study_config.log",
    localrule: True
    params:
        study=spec_json(STUDY),
    run:
        hooks.write_study_file(params.study, output.study, log[0])


# One cell's plan before it trains (target, budget, memory estimate, verdict, the job's host memory), a typed
# file (tunegrid.prepare.cell_plan.CellPlan) the `finetune` job takes its `mem_mb` from. Reads file headers only.
rule cell_plan:
    # in the Snakemake process (no torch, ~ms a cell); `python scripts/tunegrid.py cell-plan` by hand
    input:
        study=ancient(STUDY_FILE),
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
            write_cell_plan(input.study, wildcards.cell_id, input.model, input.capabilities, output.plan).to_json()
        )


# Before spending GPU hours: which cells this target cannot run (unsupported), which the estimate says
# will not fit (predicted_oom), and every cell's estimated peak. `snakemake --cores 8 plan`; trains nothing.
rule plan:
    input:
        study=ancient(STUDY_FILE),
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
        " --study-file {input.study} --capabilities {input.capabilities} --models {params.models}"
        " --out {output.plan} > {log} 2>&1"
