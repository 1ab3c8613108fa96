# Config validation, the grid, and the input functions every stage uses. Parsing stays light:
# tunegrid.config imports no torch, so `snakemake -n` on thousands of cells is quick.
import json
import os
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from tunegrid import warm
from tunegrid.config import ConfigError, cell_spec, cells_by_id, resolve_study, spec_json, study_config
from tunegrid.execution import COMMAND_ENV, EXECUTION_ENV, new_execution_id

try:
    _study = study_config(config, workflow.config_settings.overwrite_config or {}, workflow.overwrite_configfiles or [])
    config.clear()
    config.update(_study)
    STUDY = resolve_study(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None
# snakemake's own validator fills the schema's defaults into `config` as well.
validate(config, schema="../schemas/config.schema.yaml")

# Absolute, so `--directory elsewhere` works and the logged command re-runs from any folder.
SCRIPT = str(Path(workflow.basedir) / "scripts" / "tunegrid.py")
RESULTS = f"results/{STUDY['study']}"
LOGS = f"results/logs/{STUDY['study']}"
CELLS = cells_by_id(STUDY)
# The resolved study, written once per invocation (onstart) for the jobs: they get this path and a cell
# id, never the study or a spec on their command line (no "Argument list too long", nothing in the logs).
STUDY_FILE = f"{RESULTS}/study.json"
TRACKING = STUDY["tracking"]["enabled"]
WARM = []  # (process, socket path) of this invocation's warm worker

# One MLflow parent run per invocation: jobs (local, or SLURM jobs that inherit the submitting
# environment) read the id from the environment. setdefault: a SLURM job's own parse keeps the id of
# the invocation that submitted it. Not a param, so it never triggers a re-run.
os.environ.setdefault(EXECUTION_ENV, new_execution_id())
os.environ.setdefault(COMMAND_ENV, " ".join(["snakemake", *sys.argv[1:]]))
os.environ.setdefault("TUNEGRID_CONFIGFILES", os.pathsep.join(map(str, workflow.overwrite_configfiles or [])))


wildcard_constraints:
    model="[A-Za-z0-9][A-Za-z0-9.-]*",
    cell_id="[A-Za-z0-9][A-Za-z0-9.-]*_(fp32|bf16|fp16)_bs[0-9]+_(none|nf4|nf4-experts)_s[0-9]+(_ws[0-9]+)?",


def get_cell(wildcards):
    try:
        return CELLS[wildcards.cell_id]
    except KeyError:
        raise WorkflowError(f"{wildcards.cell_id!r} is not a cell of study {STUDY['study']!r}") from None


def get_cell_spec(wildcards):
    return spec_json(cell_spec(STUDY, get_cell(wildcards)))


def get_cell_model_dir(wildcards):
    return f"{RESULTS}/models/{get_cell(wildcards).model}"


def get_cell_gpus(wildcards):
    return get_cell(wildcards).world_size * STUDY["hardware"]["gpus_per_rank"]


def get_probe_gpus(wildcards):
    """The probe measures the devices the cells will train on, so it asks for what one rank asks for."""
    return STUDY["hardware"]["gpus_per_rank"]


def get_cell_cpus(wildcards):
    return get_cell(wildcards).world_size * STUDY["train"]["threads"]


def get_cell_mem_mb(wildcards):
    return 4000 * get_cell(wildcards).world_size


def get_model_spec(wildcards):
    return json.dumps(STUDY["models"][wildcards.model], sort_keys=True)


def get_model_dirs():
    return [f"{RESULTS}/models/{model}" for model in STUDY["grid"]["model"]]


def get_tracking_file(wildcards):
    return [f"{RESULTS}/tracking.json"] if TRACKING else []


def get_result_files():
    return [f"{RESULTS}/runs/{cell_id}/result.json" for cell_id in CELLS]


def get_sync_file():
    return [f"{RESULTS}/tracking-sync.json"] if TRACKING else []


def get_final_outputs():
    return [
        f"{RESULTS}/env/environment.json",
        f"{RESULTS}/probe/capabilities.json",
        f"{RESULTS}/summary.csv",
        f"{RESULTS}/report/index.html",
        *get_sync_file(),
    ]


def start_warm_worker():
    """onstart (local runs with jobs to do, never a dry run): the warm worker (tunegrid.warm), whose
    socket the jobs find in the environment. A cluster job's own snakemake runs no hooks."""
    if not (workflow.local_exec and STUDY["execution"]["warm_worker"]) or os.environ.get(warm.SOCKET_ENV):
        return
    path = warm.socket_path(os.environ[EXECUTION_ENV])
    WARM.append((warm.start(path, Path(f"{LOGS}/warm_worker.log")), path))
    os.environ[warm.SOCKET_ENV] = str(path)


def write_study_file():
    """onstart: the resolved study for the jobs (rewritten only when it changed)."""
    from tunegrid.files import write_text_if_changed

    write_text_if_changed(STUDY_FILE, spec_json(STUDY))


def stop_warm_worker():
    while WARM:
        warm.stop(*WARM.pop())


def close_execution(status):
    """onsuccess/onerror: the cells keep this invocation's parent MLflow run up to date themselves; a
    closing process (seconds: it imports mlflow) runs only when there is more to do — a failure, cells
    left in flight, or a report/summary written by this invocation to attach.

    Never fails the workflow: the files hold everything, MLflow is a view of them."""
    import subprocess

    from tunegrid.execution import needs_closing

    attach = [Path(p) for p in (f"{RESULTS}/report/index.html", f"{RESULTS}/summary.csv")]
    if not TRACKING or not needs_closing(Path(RESULTS), status, attach):
        return
    command = [sys.executable, SCRIPT, "execution-end", "--tracking", f"{RESULTS}/tracking.json",
               "--study-dir", RESULTS, "--status", status, "--attach", *[str(p) for p in attach if p.is_file()]]
    with open(f"{LOGS}/execution-end.log", "a") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=300)
