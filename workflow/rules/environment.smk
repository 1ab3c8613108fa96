rule environment:
    output:
        env=str(PATHS.environment),
        freeze=str(PATHS.pip_freeze),
    log:
        str(PATHS.log("environment")),
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} environment" " --out {output.env} --freeze {output.freeze} > {log} 2>&1"
