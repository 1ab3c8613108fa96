rule probe:
    output:
        capabilities=f"{RESULTS}/probe/capabilities.json",
    log:
        f"{LOGS}/probe.log",
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} probe"
        " --out {output.capabilities} > {log} 2>&1"
