# Config validation, the grid, and the input functions every stage uses. Parsing stays light:
# tunegrid.study.config imports no torch, so `snakemake -n` on thousands of cells is quick.
import json
import os
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from tunegrid.run import hooks
from tunegrid.study.paths import StudyPaths
from tunegrid.study.config import ConfigError, cell_spec, cells_by_id, probe_world_sizes, resolve_study, spec_json
from tunegrid.runtime.devices import cell_gpus, gpus_per_rank
from tunegrid.runtime.telemetry import telemetry_off
from tunegrid.prepare.cell_plan import mem_mb_for_job, trains
from tunegrid.prepare.cluster import ACCOUNTING_DISABLED, accounting_disabled
from tunegrid.recipes.importer import expand_base
from tunegrid.study.config import baseline_cell as doctor_baseline
from tunegrid.review.doctor_choice import doctor_cells, memory_choice_cells, precision_choice_cells
from tunegrid.review.doctor_choice import tries as doctor_tries
from tunegrid.study.input import STUDY_FILE_ENV, study_config, study_file_named
from tunegrid.track.execution import COMMAND_ENV, EXECUTION_ENV, new_execution_id
from tunegrid.vocabulary import cell_id_pattern

try:
    # the `--config` values only: the study files are read by tunegrid itself (bounded, YAML 1.2 numbers);
    # a study with `base:` starts from a training recipe (axolotl / TRL), imported here, its own keys on top
    _study = expand_base(
        study_config(config, workflow.config_settings.config or {}, workflow.overwrite_configfiles or [])
    )
    config.clear()
    config.update(_study)
    STUDY = resolve_study(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None
# `config` as validated, defaults filled: resolve_study validates against the schema file with its grid
# built from the axis table (which the file alone does not hold, so snakemake's validate cannot check it).
config.clear()
config.update(STUDY)

# Absolute, so `--directory elsewhere` works and the logged command re-runs from any folder.
SCRIPT = str(Path(workflow.basedir) / "scripts" / "tunegrid.py")
PATHS = StudyPaths.of(STUDY["study"])  # every file of the study, named once
RESULTS = str(PATHS.study_dir)
LOGS = str(PATHS.logs_dir)
CELLS = cells_by_id(STUDY)
# what a job may also run beyond the grid: the same-seed re-run of a cell (`tunegrid doctor`, doctor.smk)
RUNNABLE = {**CELLS, **doctor_cells(STUDY)}
# The resolved study and each cell's resolved spec, made by the study_config and cell_config rules
# (workflow/rules/plan.smk) from one template that writes a rule's `params.resolved`.
STUDY_FILE = str(PATHS.study_file)
RESOLVED_TEMPLATE = str(Path(workflow.basedir) / "workflow" / "templates" / "resolved.json.j2")
TRACKING = STUDY["tracking"]["enabled"]

# One MLflow parent run per invocation: jobs (local, or SLURM jobs that inherit the submitting
# environment) read the id from the environment. setdefault: a SLURM job's own parse keeps the id of
# the invocation that submitted it. Not a param, so it never triggers a re-run.
os.environ.setdefault(EXECUTION_ENV, new_execution_id())
os.environ.setdefault(COMMAND_ENV, " ".join(["snakemake", *sys.argv[1:]]))
os.environ.setdefault("TUNEGRID_CONFIGFILES", os.pathsep.join(map(str, workflow.overwrite_configfiles or [])))
os.environ.setdefault(STUDY_FILE_ENV, study_file_named(dict(workflow.config_settings.config or {})) or "")
# no usage telemetry from MLflow or the hub in any job (tunegrid.runtime.telemetry; the user's setting wins)
telemetry_off()
# How this invocation starts its cells, for their plans (an estimate takes the worker path's constant): cluster
# jobs spawn every worker, a local run forks one-rank CPU cells where the study keeps a warm worker. In the
# environment of the cell_plan jobs (local rules), not a param: a plan follows the run that made it and is
# never re-made, nor its cell re-run, for this alone. Set again when the workflow starts executing
# (where_jobs_run): while this file is read, Snakemake does not yet know the executor.
CELL_PLAN_WORKER_ENV = "TUNEGRID_CELL_PLAN_WORKER"  # read by the cell_plan rule's shell command


def cell_plan_worker():
    return "--cluster" if not workflow.local_exec else "" if STUDY["execution"]["warm_worker"] else "--no-warm-worker"


os.environ[CELL_PLAN_WORKER_ENV] = cell_plan_worker()


def where_jobs_run():
    """onstart: what depends on the executor, known once the workflow executes and before any job runs.

    A SLURM cluster without accounting (no slurmdbd): the executor's default status command, sacct, fails on
    every poll and the workflow would wait for ever with no word. Such a cluster's job states come from squeue
    instead (the executor reads its status command at every poll), and the run says so."""
    os.environ[CELL_PLAN_WORKER_ENV] = cell_plan_worker()
    if workflow.local_exec or getattr(workflow.executor_settings, "status_command", None) != "sacct":
        return
    no_accounting = accounting_disabled()
    if no_accounting and ACCOUNTING_DISABLED in no_accounting.lower():
        workflow.executor_settings.status_command = "squeue"
        print(
            f"tunegrid: this SLURM cluster keeps no job accounting (sacct: {no_accounting}); job states come "
            "from squeue, which sees a finished job for slurm.conf's MinJobAge seconds (keep it above the "
            "status checks' interval)",
            file=sys.stderr,
        )


wildcard_constraints:
    model="[A-Za-z0-9][A-Za-z0-9.-]*",
    stack="[A-Za-z0-9][A-Za-z0-9.-]*",
    cell_id=cell_id_pattern(),


# Cells measure throughput (tokens/s), so on this host the cells running at once ask for no more cores
# than it has, whatever --cores says: `--cores 8` on a 2-core host would run eight one-thread cells on two
# cores and make their tokens/s incomparable. `--resources host_cores=N` overrides the limit.
HOST_CORES = len(os.sched_getaffinity(0))
if workflow.local_exec and "host_cores" not in workflow.global_resources:
    workflow.register_resource("host_cores", HOST_CORES)


def get_cell_host_cores(wildcards):
    return min(get_cell_cpus(wildcards), HOST_CORES) if workflow.local_exec else 0


def cells_to_run():
    """The cell jobs this invocation runs (onstart: the DAG is built by then)."""
    return sum(1 for job in workflow.dag.needrun_jobs() if job.rule.name == "finetune")


def get_cell(wildcards):
    try:
        return RUNNABLE[wildcards.cell_id]
    except KeyError:
        raise WorkflowError(f"{wildcards.cell_id!r} is not a cell of study {STUDY['study']!r}") from None


def get_cell_spec(wildcards):
    return spec_json(cell_spec(STUDY, get_cell(wildcards)).to_json())


def get_cell_model_dir(wildcards):
    return str(PATHS.model_dir(get_cell(wildcards).model))


def get_cell_gpus(wildcards):
    return cell_gpus(STUDY["hardware"]["gpus_per_rank"], get_cell(wildcards).world_size)


def get_probe_gpus(wildcards):
    """The probe measures the devices the cells will train on, so it asks for what one rank asks for."""
    return gpus_per_rank(STUDY["hardware"]["gpus_per_rank"])


def get_cell_cpus(wildcards):
    """The cores of one node of the cell (its ranks on that node): a cell on several nodes asks each for its share."""
    cell = get_cell(wildcards)
    return cell.world_size // cell.nodes * STUDY["train"]["threads"]


def get_cell_job_nodes(wildcards, input):
    """The nodes the `finetune` job asks for, one task on each (the supervisor runs in the first; each rank is a step
    on its node: tunegrid.run.nodes); one where its contract says it does not train."""
    return get_cell(wildcards).nodes if trains(input.get("plan")) else 1


def get_cell_job_cpus(wildcards, input):
    """The cores the `finetune` job asks for: every rank's, or one where its contract says it does not train."""
    return get_cell_cpus(wildcards) if trains(input.get("plan")) else 1


def get_cell_job_gpus(wildcards, input):
    return get_cell_gpus(wildcards) if trains(input.get("plan")) else 0


def get_cell_job_args(wildcards):
    """The `finetune` job's files, for the cell's contract (the cell_plan rule): the same paths its rule names."""
    cell_id = get_cell(wildcards).cell_id
    args = [
        f"--data {PATHS.dataset}",
        f"--run-dir {PATHS.run_dir(cell_id)}",
        f"--result {PATHS.result(cell_id)}",
        f"--log {PATHS.cell_log(cell_id)}",
        f"--snakemake-job {shlex.quote(f'finetune {PATHS.result(cell_id)}')}",
    ]
    return " ".join(args + [f"--tracking={PATHS.tracking}"] if TRACKING else args)


def get_cell_mem_mb(wildcards, input):
    """From the cell's contract: Snakemake evaluates this again when it schedules the job, with the plan made; in a
    dry run before it exists, the floor (tunegrid.prepare.cell_plan.MEM_FLOOR_MB_PER_RANK per rank)."""
    cell = get_cell(wildcards)
    return mem_mb_for_job(input.get("plan"), STUDY["hardware"], cell.world_size // cell.nodes)  # per node


def get_model_spec(wildcards):
    return json.dumps(STUDY["models"][wildcards.model], sort_keys=True)


def get_model_dirs():
    return [str(PATHS.model_dir(model)) for model in STUDY["grid"]["model"]]


def get_stack_pins(wildcards):
    try:
        return json.dumps(STUDY["stacks"][wildcards.stack], sort_keys=True)
    except KeyError:
        raise WorkflowError(f"{wildcards.stack!r} is not a stack of study {STUDY['study']!r}") from None


def get_stack_records(wildcards):
    """Every stack the grid names, for every cell: a stack that cannot be built stops the run before any cell."""
    return [str(PATHS.stack_record(name)) for name in STUDY["grid"]["stack"] if name in STUDY["stacks"]]


def get_cell_stack_record(wildcards):
    """The cell's library stack, built before its plan: the estimate reads what the stack changes (its imports'
    memory, its transformers' loader) from the stack's record. None for a cell on the base stack."""
    stack = get_cell(wildcards).stack
    return [str(PATHS.stack_record(stack))] if stack in STUDY["stacks"] else []


def get_tracking_file(wildcards):
    return [str(PATHS.tracking)] if TRACKING else []


def get_probe_run_file(wildcards):
    return [str(PATHS.probe_run)] if TRACKING else []


def get_result_files():
    return [str(PATHS.result(cell_id)) for cell_id in CELLS]


def get_sync_file():
    return [str(PATHS.tracking_sync)] if TRACKING else []


def get_review_file():
    return [str(PATHS.tracking_review)] if TRACKING else []


def get_final_outputs():
    return [
        str(PATHS.environment),
        str(PATHS.capabilities),
        str(PATHS.summary),
        str(PATHS.report_file("index.html")),
        *get_sync_file(),
        *get_review_file(),
    ]


# `tunegrid doctor` (doctor.smk): its waves read the checkpoints' files
def get_doctor_target():
    return str(PATHS.doctor_file(doctor_baseline(STUDY).cell_id, "all", "doctor.json"))


def _doctor_reproduced(wildcards):
    with open(checkpoints.doctor_reproduce.get(cell_id=wildcards.cell_id).output.reproduce) as fh:
        return json.load(fh)


def get_doctor_repeat(wildcards):
    repeat = _doctor_reproduced(wildcards)["repeat_cell"]
    return [str(PATHS.result(repeat))] if repeat else []


def get_doctor_contracts(wildcards):
    """The contracts whose plans the choice reads: an out-of-memory baseline's memory settings (estimate,
    verdict), a non-finite one's precision twins on a named target (the step time modelled on it)."""
    outcome = _doctor_reproduced(wildcards)["outcome"]
    baseline = doctor_baseline(STUDY, wildcards.cell_id)
    if outcome in ("oom", "predicted_oom"):
        return [str(PATHS.cell_plan(cell)) for cell in memory_choice_cells(STUDY, baseline)]
    if outcome == "nan":
        return [str(PATHS.cell_plan(cell)) for cell in precision_choice_cells(STUDY, baseline)]
    return []


def _doctor_tries(wildcards):
    with open(checkpoints.doctor_diagnose.get(cell_id=wildcards.cell_id).output.diagnosis) as fh:
        return doctor_tries(json.load(fh)["choice"])


def get_doctor_try_cells(wildcards):
    """A try's cells, less those of a candidate the try before passed over (review.doctor_stop.passed_over), and
    that try's verdict: the tries run one after another."""
    index, passed, earlier = int(wildcards.index), [], []
    if index:
        before = checkpoints.doctor_try.get(cell_id=wildcards.cell_id, mode=wildcards.mode, index=index - 1)
        earlier = [before.output.verdict]
        with open(earlier[0]) as fh:
            passed = json.load(fh).get("passed", [])
    with open(checkpoints.doctor_diagnose.get(cell_id=wildcards.cell_id).output.diagnosis) as fh:
        cells = doctor_tries(json.load(fh)["choice"], passed)[index]
    return [str(PATHS.result(cell)) for cell in cells] + earlier


def get_doctor_tries(wildcards):
    """The tries run, in order, up to the one after which the second wave stops (doctor_choice.stop: `first` at the
    first fix that holds, the default once no candidate left can rank above the fix that holds)."""
    done = []
    for index in range(len(_doctor_tries(wildcards))):
        path = checkpoints.doctor_try.get(cell_id=wildcards.cell_id, mode=wildcards.mode, index=index).output.verdict
        done.append(path)
        with open(path) as fh:
            record = json.load(fh)
            if record.get("stop", record["holds"]):
                break
    return done
