# tunegrid: why does a QLoRA fine-tune fail, and which setting fixes it?
# This file is a table of contents: stages live in workflow/rules/, logic in src/tunegrid/.
from snakemake.utils import min_version

min_version("9.0")


# The study: `--config study=<study>.yaml` (read by tunegrid's bounded loader; `--configfile` works too) plus
# the schema's defaults, else configs/config.yaml; `--config` overrides go on top (workflow/rules/common.smk).
include: "workflow/rules/common.smk"
include: "workflow/rules/environment.smk"
include: "workflow/rules/stacks.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/checkpoint.smk"
include: "workflow/rules/probe.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/tracking.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/doctor.smk"


rule all:
    default_target: True
    input:
        get_final_outputs(),


onstart:
    where_jobs_run()
    hooks.on_start(STUDY, LOGS, local=workflow.local_exec, cells_to_run=cells_to_run())


onsuccess:
    hooks.on_end("FINISHED", STUDY, RESULTS, LOGS, SCRIPT, cell_ids=list(CELLS))


onerror:
    hooks.on_end("FAILED", STUDY, RESULTS, LOGS, SCRIPT, cell_ids=list(CELLS))
