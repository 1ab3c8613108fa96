# `tunegrid doctor`: one cell reproduced, then only the fixes its diagnosis calls for. Two checkpoints decide the
# waves from the cells' own results: doctor_reproduce (did the baseline fail: then its same-seed re-run) and
# doctor_diagnose (deterministic or transient; the candidates, from the precision and quantization rows and the
# estimate). Each doctor_try runs a batch of candidates and says whether a fix of the baseline holds; `first` stops
# at the first that does. Every cell is an ordinary `finetune` job, so the doctor runs on SLURM and resumes like
# any study.
# Target: results/<study>/doctor/<cell_id>/<all|first>/doctor.json (`snakemake doctor`: the first cell, all).


wildcard_constraints:
    mode="all|first",
    index="[0-9]+",


rule doctor:
    input:
        get_doctor_target(),


checkpoint doctor_reproduce:
    input:
        baseline=str(PATHS.result("{cell_id}")),
    output:
        reproduce=str(PATHS.doctor_reproduce("{cell_id}")),
    log:
        str(PATHS.log("doctor", "{cell_id}", "reproduce")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    shell:
        f"python {SCRIPT} doctor-reproduce --baseline {{input.baseline}} --out {{output.reproduce}} > {{log}} 2>&1"


checkpoint doctor_diagnose:
    input:
        baseline=str(PATHS.result("{cell_id}")),
        reproduce=rules.doctor_reproduce.output.reproduce,
        repeat=get_doctor_repeat,
        contracts=get_doctor_contracts,  # the contracts of the cells the choice compares
        study=rules.study_config.output.study,
        capabilities=rules.probe.output.capabilities,
    output:
        diagnosis=str(PATHS.doctor_diagnosis("{cell_id}")),
    log:
        str(PATHS.log("doctor", "{cell_id}", "diagnosis")),
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
        verdict=str(PATHS.doctor_try("{cell_id}", "{mode}", "{index}")),
    log:
        str(PATHS.log("doctor", "{cell_id}", "{mode}", "try-{index}")),
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
        doctor=str(PATHS.doctor_file("{cell_id}", "{mode}", "doctor.json")),
        screen=str(PATHS.doctor_file("{cell_id}", "{mode}", "screen.txt")),
        summary=str(PATHS.doctor_file("{cell_id}", "{mode}", "summary.csv")),
        report=str(PATHS.doctor_file("{cell_id}", "{mode}", "report/index.html")),
    log:
        str(PATHS.log("doctor", "{cell_id}", "{mode}", "verdict")),
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.doctor),
    shell:
        f"python {SCRIPT} doctor-verdict --study-file {{input.study}} --diagnosis {{input.diagnosis}}"
        " --mode {wildcards.mode} --capabilities {input.capabilities} --environment {input.environment}"
        " --out-dir {params.out_dir} {input.tries} > {log} 2>&1"
