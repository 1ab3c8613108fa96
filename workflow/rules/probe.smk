# The probe measures and writes JSON only; `probe_tracking` logs it to MLflow (so the probe never waits
# on the store, and a store that is down costs the probe nothing).
rule probe:
    output:
        capabilities=str(PATHS.capabilities),
    log:
        str(PATHS.log("probe")),
    conda:
        "../../envs/tunegrid.yaml"
    resources:
        gpu=get_probe_gpus,
    params:
        world_sizes=" ".join(map(str, probe_world_sizes(STUDY))),
        budget_s=STUDY["probe"]["budget_s"],
    # gpus_per_rank 0: the cells train on the CPU even where a GPU is visible, so the probe measures it (in the
    # command rather than a param: a study that does not hide GPUs keeps the probe's command as it was)
    shell:
        ("CUDA_VISIBLE_DEVICES= " if STUDY["hardware"]["gpus_per_rank"] == 0 else "") + f"python {SCRIPT} probe"
        " --budget-s {params.budget_s} --world-sizes {params.world_sizes}"
        " --out {output.capabilities} > {log} 2>&1"
