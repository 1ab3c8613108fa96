"""A parent MLflow run per study execution (one `snakemake` invocation), the cells nested under it.

The Snakefile puts an execution id into the environment at parse time (inherited by local jobs and by
SLURM jobs, which sbatch exports the environment to); the first cell of the execution creates the
parent run under a file lock, the others find it in results/<study>/executions/<id>.json. The
Snakefile's onsuccess/onerror hook closes it with the outcome counts and the report attached.
An execution that trains nothing (everything up to date) creates no parent run.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any

from tunegrid.files import read_json, write_json

EXECUTION_ENV = "TUNEGRID_EXECUTION_ID"
COMMAND_ENV = "TUNEGRID_SNAKEMAKE_COMMAND"
PARENT_TAG = "mlflow.parentRunId"


def new_execution_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def current_execution_id() -> str:
    return os.environ.get(EXECUTION_ENV, "")


def _record_path(study_dir: Path, execution_id: str) -> Path:
    return study_dir / "executions" / f"{execution_id}.json"


def parent_run_id(uri: str, experiment_id: str, study: str, study_dir: Path, probe_run_id: str = "") -> str | None:
    """The parent run of the current execution, created by whichever cell asks first."""
    from tunegrid.tracking import client, with_retries

    execution_id = current_execution_id()
    if not execution_id:  # a cell run by hand, outside Snakemake: a top-level run
        return None
    record = _record_path(study_dir, execution_id)
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.exists():
            return str(read_json(record)["run_id"])
        tags = {
            "kind": "study",
            "study": study,
            "tunegrid.execution_id": execution_id,
            "snakemake.command": os.environ.get(COMMAND_ENV, ""),
            "tunegrid.status": "running",
        }
        if probe_run_id:
            tags["probe.run_id"] = probe_run_id
        try:
            c = client(uri)
            run = with_retries(lambda: c.create_run(experiment_id, run_name=f"{study} @ {execution_id}", tags=tags), "parent run")
        except Exception:  # the store is down: cells become top-level runs, the files keep everything
            return None
        write_json(record, {"run_id": run.info.run_id, "execution_id": execution_id, "started": time.time()})
        return str(run.info.run_id)


def close_execution(uri: str, experiment_id: str, study_dir: Path, status: str, attachments: list[Path]) -> dict[str, Any] | None:
    """Counts of the nested cells' outcomes as tags, the report attached, the run terminated."""
    from mlflow.entities import RunTag

    from tunegrid.tracking import client, with_retries

    execution_id = current_execution_id()
    record = _record_path(study_dir, execution_id) if execution_id else None
    if record is None or not record.exists():
        return None
    run_id = read_json(record)["run_id"]
    c = client(uri)
    children = with_retries(
        lambda: c.search_runs([experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}'", max_results=50000),
        "children",
    )
    counts: dict[str, int] = {}
    for child in children:
        outcome = child.data.tags.get("outcome", "running")
        counts[outcome] = counts.get(outcome, 0) + 1
    tags = [RunTag(f"cells.{k}", str(v)) for k, v in counts.items()]
    tags += [RunTag("cells.total", str(len(children))), RunTag("tunegrid.status", "done")]
    with_retries(lambda: c.log_batch(run_id, tags=tags), "parent tags")
    for path in attachments:
        if path.is_file():
            with_retries(lambda p=path: c.log_artifact(run_id, str(p)), f"parent artifact {path.name}")
    with_retries(lambda: c.set_terminated(run_id, status=status), "parent end")
    return {"run_id": run_id, "counts": counts}
