# One job per library stack the grid names (`stacks:` in the study): a virtual environment layered on the one
# tunegrid runs in, with the stack's pins installed by pip from the package registry, cached under
# results/stacks/<hash of the pins>/ and reused by every study and every run that asks for the same pins. Local:
# it needs the registry, which cluster nodes may not reach, and it writes the shared results folder the jobs read.
# Every cell waits for every stack (common.smk), so pins pip cannot resolve stop the run before any cell trains.
rule stack:
    output:
        record=str(PATHS.stack_record("{stack}")),
        freeze=str(PATHS.stack_freeze("{stack}")),
    log:
        str(PATHS.log("stacks", "{stack}")),
    benchmark:
        str(PATHS.benchmark("stacks", "{stack}"))
    localrule: True
    conda:
        "../../envs/tunegrid.yaml"
    params:
        pins=get_stack_pins,  # the pins themselves: a changed pin re-runs the job (and builds another key)
        # the results folder every study shares (record: <results>/<study>/stacks/<name>/stack.json), where the
        # cells' specs look for the stack's interpreter (tunegrid.study.stacks.stack_ref)
        results=lambda wildcards, output: str(Path(output.record).parents[3]),
    # pip's refusal is the log's last lines; they are repeated on stderr so that the run's own output names it
    shell:
        f"python {SCRIPT} stack"
        " --name {wildcards.stack} --pins {params.pins:q} --results {params.results}"
        " --record {output.record} --freeze {output.freeze} > {log} 2>&1"
        " || {{ grep 'error:' {log} >&2; exit 2; }}"
