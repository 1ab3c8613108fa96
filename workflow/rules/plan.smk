# The study's resolved config (defaults filled, overrides applied) and each cell's resolved spec, each made by a
# rule from what this invocation parsed. Their params are their content, so Snakemake re-makes a file exactly when
# what it holds changes, and re-runs what reads it: a study change re-makes the specs of the cells it changes,
# which re-plans and re-runs those cells and no other (the per-cell file is what carries the change to a cell;
# an `ancient` study file would not do: Snakemake never re-evaluates the jobs below a re-made one it skips).
# Jobs get these paths, never the study or a spec on their command line (no "Argument list too long", nothing
# in the logs). Rendered by Snakemake's template engine in its own process: no subprocess per cell.
rule study_config:
    input:
        template=RESOLVED_TEMPLATE,
    output:
        study=STUDY_FILE,
    log:
        f"{LOGS}/study_config.log",  # the template engine writes nothing to it; Snakemake's error, if any
    params:
        resolved=spec_json(STUDY),
    template_engine:
        "jinja2"


rule cell_config:
    input:
        template=RESOLVED_TEMPLATE,
    output:
        spec=str(PATHS.cell_spec("{cell_id}")),
    log:
        f"{LOGS}/specs/{{cell_id}}.log",
    params:
        resolved=get_cell_spec,
    template_engine:
        "jinja2"


# One cell's contract before it trains (tunegrid.contract.CellContract): its spec, its plan (target, budget, the
# memory estimate of each path its worker may take and the verdict, the kernels, the liveness limits, the job's
# host memory) and its job's files, in one typed file the `finetune` job runs from and takes its `mem_mb` from.
# Every decision about the cell is made here, once. Reads file headers only (no torch, ~0.2 s a cell).
rule cell_plan:
    input:
        spec=rules.cell_config.output.spec,  # re-made when the cell's spec changes, and the contract with it
        model=get_cell_model_dir,
        capabilities=rules.probe.output.capabilities,
        stack=get_cell_stack_record,  # what the cell's library stack changes in its estimate
    output:
        plan=str(PATHS.cell_plan("{cell_id}")),
    log:
        f"{LOGS}/plans/{{cell_id}}.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        job=get_cell_job_args,  # the finetune job's files: its data, run folder, result, tracking, log
    # $TUNEGRID_CELL_PLAN_WORKER: how this invocation starts its cells (common.smk)
    shell:
        f"python {SCRIPT} cell-plan"
        " --spec-file {input.spec} --model-dir {input.model} --capabilities {input.capabilities} {params.job}"
        " --out {output.plan} $TUNEGRID_CELL_PLAN_WORKER > {log} 2>&1"


# Before spending GPU hours: which cells this target cannot run (unsupported), which the estimate says
# will not fit (predicted_oom), and every cell's estimated peak: the union of the cells' contracts.
# `snakemake --cores 8 plan`; trains nothing.
rule plan:
    input:
        study=rules.study_config.output.study,
        plans=[str(PATHS.cell_plan(cell_id)) for cell_id in CELLS],
    output:
        plan=f"{RESULTS}/plan.csv",
    log:
        f"{LOGS}/plan.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        plans=lambda wildcards, input: str(Path(input.plans[0]).parent),  # the contracts' folder
    shell:
        f"python {SCRIPT} plan --study-file {{input.study}} --plans {{params.plans}} --out {{output.plan}} > {{log}} 2>&1"
