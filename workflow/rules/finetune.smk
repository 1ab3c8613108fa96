# One job per grid cell. A failed fine-tune (nan, oom, timeout) is a successful job: the outcome is
# data in result.json. The shell line is complete, so any cell can be re-run by hand from its log.
rule finetune:
    input:
        spec=rules.cell_config.output.spec,  # the cell's resolved spec: re-made, and the cell re-run, when it changes
        model=get_cell_model_dir,
        data=rules.dataset.output.data,
        tracking=get_tracking_file,
        capabilities=rules.probe.output.capabilities,
        probe_run=get_probe_run_file,  # read beside the capabilities: the probe's MLflow run id
        # the cell's contract: the job runs from it and takes its mem_mb from it; re-made only when the cell's spec,
        # model or probe changes, each of which re-runs the cell anyway
        plan=rules.cell_plan.output.plan,
        stacks=get_stack_records,  # built (or refused) before any cell trains
    output:
        result=str(PATHS.result("{cell_id}")),
    log:
        str(PATHS.cell_log("{cell_id}")),
    benchmark:
        str(PATHS.benchmark("finetune", "{cell_id}"))
    conda:
        "../../envs/tunegrid.yaml"
    # every rank of a distributed cell is a process of this one job: it asks for all their cores and
    # GPUs (a cell on several nodes: `nodes`, one task and its ranks' cores on each). `gpu` (not `gpus`) is what the SLURM executor turns into --gpus.
    threads: get_cell_cpus
    resources:
        mem_mb=get_cell_mem_mb,
        gpu=get_cell_job_gpus,
        cpus_per_task=get_cell_job_cpus,
        host_cores=get_cell_host_cores,
        runtime=int(STUDY["train"]["time_limit_s"] // 60) + 5,
        nodes=get_cell_job_nodes,
        tasks=get_cell_job_nodes,  # one task per node (sbatch --ntasks)
        tasks_per_gpu=0,  # no --ntasks-per-gpu (the plugin reads `tasks` as that on a GPU job)
    shell:
        f"python {SCRIPT} finetune --contract {{input.plan}} > {{log}} 2>&1"
