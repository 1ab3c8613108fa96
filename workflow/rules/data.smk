rule dataset:
    output:
        data=f"{RESULTS}/data/train.jsonl",
    params:
        examples=STUDY["data"]["examples"],
        seed=STUDY["data"]["seed"],
    localrule: True
    log:
        f"{LOGS}/dataset.log",
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} dataset"
        " --examples {params.examples} --seed {params.seed}"
        " --out {output.data} > {log} 2>&1"
