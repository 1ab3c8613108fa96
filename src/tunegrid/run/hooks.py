"""What the Snakefile's onstart / onsuccess / onerror do: one package call each.

onstart starts this invocation's warm worker and warm supervisor (local runs; the resolved study and the cells'
specs are rules' files, workflow/rules/plan.smk) and passes a SIGTERM on to a running `mlflow_ui` job;
onsuccess / onerror stop it and close the invocation's MLflow run when there is more to record, and an
invocation whose `mlflow_ui` was stopped on request ends cleanly. A
cluster job's own snakemake runs no hooks. Nothing here may fail the workflow's own outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_WARM: list[tuple[Any, Path]] = []  # (process, socket path) of this invocation's warm processes


def on_start(study: dict[str, Any], logs: str, local: bool, cells_to_run: int | None = None) -> None:
    """`cells_to_run`: the cell jobs this invocation will run (None: not known). The warm processes (torch and
    peft imported, ~1 s and hundreds of MiB; MLflow) serve runs with cells only, so `snakemake mlflow_ui`,
    `report` or a run with every cell done starts neither."""
    from tunegrid.run.ui import forward_sigterm_to_ui

    forward_sigterm_to_ui(logs)
    if cells_to_run != 0:
        _start_warm_worker(study, logs, local)


def on_end(
    status: str, study: dict[str, Any], results: str, logs: str, script: str, cell_ids: list[str] | None = None
) -> None:
    from tunegrid.run.ui import ui_stopped_on_request

    if status == "FAILED" and not _WARM and ui_stopped_on_request(logs):
        # `snakemake mlflow_ui` stopped by Ctrl-C or SIGTERM: Snakemake, signalled too, counts that as a failed
        # run and would end in a WorkflowError; the UI stopped as asked, so the invocation ends cleanly (its
        # directory lock is released on the way out)
        raise SystemExit(0)
    if study["tracking"]["enabled"]:  # first: the warm supervisor forks its job (no import of MLflow here)
        _close_execution(status, results, logs, script)
    while _WARM:
        from tunegrid.run import warm

        warm.stop(*_WARM.pop())
    if cell_ids is not None:
        _print_glance(study, results, cell_ids)


def _print_glance(study: dict[str, Any], results: str, cell_ids: list[str]) -> None:
    """The outcome counts, the failures' reasons grouped and the report's path, as the run's last lines
    (read after every job has ended: it costs no cell any time). Never fails the workflow."""
    from tunegrid.run.glance import glance

    try:
        lines = glance(study["study"], Path(results), cell_ids)
    except Exception as exc:  # noqa: BLE001 — a summary line must not turn a finished run into a failure
        lines = [f"(no outcome summary: {exc})"]
    if lines and study["tracking"]["enabled"]:
        lines.append("MLflow: snakemake --cores 1 mlflow_ui (prints the study's runs page)")
    if lines:  # at exit: after Snakemake's own closing lines (log path, runtime), so they end the output
        import atexit

        atexit.register(lambda: print("\n".join(lines), file=sys.stderr, flush=True))


def _start_warm_worker(study: dict[str, Any], logs: str, local: bool) -> None:
    """The warm worker and the warm supervisor (tunegrid.run.warm), whose sockets the jobs find in the
    environment. The warm supervisor saves each cell's supervisor and each tracking job the import of MLflow
    (tunegrid.run.warm_jobs), so it starts where the study tracks to MLflow."""
    from tunegrid.run import warm
    from tunegrid.runtime.devices import visible_gpu_count
    from tunegrid.track.execution import EXECUTION_ENV

    if not (local and study["execution"]["warm_worker"]):
        return
    roles = []
    gpus = visible_gpu_count()
    if gpus == 0:
        roles.append((warm.WORKER, warm.SOCKET_ENV, "warm_worker.log"))
    else:  # CUDA does not survive a fork (warm.fork_refusal): every cell's worker is spawned, none would ask it
        Path(logs).mkdir(parents=True, exist_ok=True)
        with open(f"{logs}/warm_worker.log", "a") as note:
            print(f"no warm worker: {gpus} CUDA device(s) visible, so every cell's worker is spawned", file=note)
    if study["tracking"]["enabled"]:
        roles.append((warm.SUPERVISOR, warm.SUPERVISOR_SOCKET_ENV, "warm_supervisor.log"))
    for role, env, log in roles:
        if os.environ.get(env):  # given by the environment (an enclosing invocation): its jobs use that one
            continue
        path = warm.socket_path(os.environ[EXECUTION_ENV], role)
        _WARM.append((warm.start(path, Path(f"{logs}/{log}"), role), path))
        os.environ[env] = str(path)


def _close_execution(status: str, results: str, logs: str, script: str) -> None:
    """The cells keep this invocation's parent MLflow run up to date themselves; a closing process
    (seconds: it imports mlflow) runs only when there is more to do — a failure, cells left in flight,
    or a report/summary written by this invocation to attach. The files hold everything either way."""
    from tunegrid.track.execution import needs_closing

    attach = [Path(p) for p in (f"{results}/report/index.html", f"{results}/summary.csv")]
    if not needs_closing(Path(results), status, attach):
        return
    command = [
        sys.executable,
        script,
        "execution-end",
        "--tracking",
        f"{results}/tracking.json",
        "--study-dir",
        results,
        "--status",
        status,
        "--attach",
        *[str(p) for p in attach if p.is_file()],
    ]
    with open(f"{logs}/execution-end.log", "a") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=300)
