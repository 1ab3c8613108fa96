rule environment:
    output:
        env=f"{RESULTS}/env/environment.json",
        freeze=f"{RESULTS}/env/pip-freeze.txt",
    log:
        f"{LOGS}/environment.log",
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} environment" " --out {output.env} --freeze {output.freeze} > {log} 2>&1"
