# `tunegrid doctor`: one cell reproduced, then only the fixes its diagnosis calls for. Two checkpoints decide the
# waves from the cells' own results: doctor_reproduce (did the baseline fail: then its same-seed re-run) and
# doctor_diagnose (deterministic or transient; the candidates, from the plans' tables and the estimate). Each
# doctor_try runs a batch of candidates and says whether a fix of the baseline holds; `first` stops at the first
# that does. Every cell is an ordinary `finetune` job, so the doctor runs on SLURM and resumes like any study.
# Target: results/<study>/doctor/<cell_id>/<all|first>/doctor.json (`snakemake doctor`: the first cell, all).


wildcard_constraints:
    mode="all|first",
    index="[0-9]+",


rule doctor:
    input:
        get_doctor_target(),


checkpoint doctor_reproduce:
    input:
        baseline=f"{RESULTS}/runs/{{cell_id}}/result.json",
    output:
        reproduce=f"{RESULTS}/doctor/{{cell_id}}/reproduce.json",
    log:
        f"{LOGS}/doctor/{{cell_id}}/reproduce.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} doctor-reproduce --baseline {{input.baseline}} --out {{output.reproduce}} > {{log}} 2>&1"


checkpoint doctor_diagnose:
    input:
        baseline=f"{RESULTS}/runs/{{cell_id}}/result.json",
        reproduce=rules.doctor_reproduce.output.reproduce,
        repeat=get_doctor_repeat,
        contracts=get_doctor_contracts,  # the contracts of the cells an out-of-memory choice compares
        study=rules.study_config.output.study,
        capabilities=rules.probe.output.capabilities,
    output:
        diagnosis=f"{RESULTS}/doctor/{{cell_id}}/diagnosis.json",
    log:
        f"{LOGS}/doctor/{{cell_id}}/diagnosis.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        repeat=lambda wildcards, input: input.repeat[0] if input.repeat else "",
    shell:
        f"python {SCRIPT} doctor-diagnose --study-file {{input.study}} --baseline {{input.baseline}}"
        " --repeat={params.repeat} --capabilities {input.capabilities} --out {output.diagnosis} {input.contracts}"
        " > {log} 2>&1"


checkpoint doctor_try:
    input:
        diagnosis=rules.doctor_diagnose.output.diagnosis,
        cells=get_doctor_try_cells,
        study=rules.study_config.output.study,
        capabilities=rules.probe.output.capabilities,
    output:
        verdict=f"{RESULTS}/doctor/{{cell_id}}/{{mode}}/try-{{index}}.json",
    log:
        f"{LOGS}/doctor/{{cell_id}}/{{mode}}/try-{{index}}.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} doctor-try --study-file {{input.study}} --diagnosis {{input.diagnosis}}"
        " --mode {wildcards.mode} --index {wildcards.index} --capabilities {input.capabilities}"
        " --out {output.verdict} > {log} 2>&1"


rule doctor_verdict:
    input:
        diagnosis=rules.doctor_diagnose.output.diagnosis,
        tries=get_doctor_tries,
        study=rules.study_config.output.study,
        capabilities=rules.probe.output.capabilities,
        environment=rules.environment.output.env,
    output:
        doctor=f"{RESULTS}/doctor/{{cell_id}}/{{mode}}/doctor.json",
        screen=f"{RESULTS}/doctor/{{cell_id}}/{{mode}}/screen.txt",
        summary=f"{RESULTS}/doctor/{{cell_id}}/{{mode}}/summary.csv",
        report=f"{RESULTS}/doctor/{{cell_id}}/{{mode}}/report/index.html",
    log:
        f"{LOGS}/doctor/{{cell_id}}/{{mode}}/verdict.log",
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.doctor),
    shell:
        f"python {SCRIPT} doctor-verdict --study-file {{input.study}} --diagnosis {{input.diagnosis}}"
        " --mode {wildcards.mode} --capabilities {input.capabilities} --environment {input.environment}"
        " --out-dir {params.out_dir} {input.tries} > {log} 2>&1"
