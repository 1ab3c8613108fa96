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
