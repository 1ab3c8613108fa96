"""A parent MLflow run per study execution (one `snakemake` invocation), its cells linked to it by tag.

The cells are top-level runs (tag `tunegrid.invocation` = the parent's run id), not nested: MLflow's runs
page collapses nested runs under their parent, so a user filtering for the failed cells would see none.

The Snakefile puts an execution id into the environment at parse time (inherited by local jobs and by
SLURM jobs, which sbatch exports the environment to); the first cell of the execution creates the
parent run under a file lock, the others find it in results/<study>/executions/<id>.json. That record
also holds the cells in flight and the outcome counts: each cell updates the parent's `cells.*` tags as
it ends, and the last one in flight marks the parent finished (a later cell of the same execution marks
it running again). So a successful execution needs no closing process of its own; the Snakefile's hook
starts one only when there is more to do (see `needs_closing`): a failed job, cells left in flight, or
a report or summary rebuilt during the execution to attach.
An execution that trains nothing (everything up to date) creates no parent run.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tunegrid.runtime.files import read_json, write_json

EXECUTION_ENV = "TUNEGRID_EXECUTION_ID"
COMMAND_ENV = "TUNEGRID_SNAKEMAKE_COMMAND"
INVOCATION_TAG = "tunegrid.invocation"  # on each cell run: the run id of its invocation


def new_execution_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def current_execution_id() -> str:
    return os.environ.get(EXECUTION_ENV, "")


def execution_started(execution_id: str) -> float | None:
    """When the invocation began (its id starts with the local time it was parsed at), so its run's
    duration is the invocation's, not the span between its first and last cell."""
    try:
        return time.mktime(time.strptime(execution_id.split("-")[0], "%Y%m%dT%H%M%S"))
    except ValueError:
        return None


def _current_record(study_dir: Path) -> Path | None:
    """The record of the current execution, if one of its cells has opened a parent run."""
    execution_id = current_execution_id()
    record_path = _record_path(study_dir, execution_id) if execution_id else None
    return record_path if record_path is not None and record_path.exists() else None


def _record_path(study_dir: Path, execution_id: str) -> Path:
    return study_dir / "executions" / f"{execution_id}.json"


def parent_run_id(
    uri: str,
    experiment_id: str,
    study: str,
    study_dir: Path,
    probe_run_id: str = "",
    cell_id: str = "",
    params: dict[str, str] | None = None,
) -> str | None:
    """The parent run of the current execution, created by whichever cell asks first, with `params` (the settings
    every cell of the study shares, logged once here rather than on each cell's run). With `cell_id`, that
    cell is recorded as in flight (and a parent some earlier cell had marked finished runs again)."""
    from tunegrid.track.store import client, with_retries

    execution_id = current_execution_id()
    if not execution_id:  # a cell run by hand, outside Snakemake: a top-level run
        return None
    record_path = _record_path(study_dir, execution_id)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(record_path):
        record = read_json(record_path) if record_path.exists() else None
        try:
            c = client(uri)
            if record is None:
                tags = {
                    "kind": "study",
                    "study": study,
                    "tunegrid.execution_id": execution_id,
                    "snakemake.command": os.environ.get(COMMAND_ENV, ""),
                    "tunegrid.status": "running",
                }
                if probe_run_id:
                    tags["probe.run_id"] = probe_run_id
                started = execution_started(execution_id)
                start_ms = int(started * 1000) if started else None
                run = with_retries(
                    lambda: c.create_run(
                        experiment_id, start_time=start_ms, run_name=f"{study} @ {execution_id}", tags=tags
                    ),
                    "parent run",
                )
                if params:
                    _log_params(c, run.info.run_id, params)
                _end_killed_parents(c, experiment_id, execution_id)
                record = {
                    "run_id": run.info.run_id,
                    "execution_id": execution_id,
                    "started": time.time(),
                    "running": [],
                    "counts": {},
                    "finished": False,
                }
            elif cell_id and record.get("finished"):
                with_retries(lambda: c.update_run(record["run_id"], status="RUNNING"), "parent running")
                with_retries(lambda: c.set_tag(record["run_id"], "tunegrid.status", "running"), "parent status")
                record["finished"] = False
        except Exception:  # noqa: BLE001 — the store is down: cells become top-level runs, the files keep everything
            return None if record is None else str(record["run_id"])
        if cell_id and cell_id not in record["running"]:
            record["running"].append(cell_id)
        write_json(record_path, record)
        return str(record["run_id"])


def _log_params(c: Any, run_id: str, params: dict[str, str]) -> None:
    """The study's shared settings on its run; what MLflow refuses of them costs only itself."""
    from tunegrid.track.refusals import checked
    from tunegrid.track.store import with_retries

    accepted, _ = checked("param", params)
    for i in range(0, len(accepted), 100):
        with_retries(lambda chunk=accepted[i : i + 100]: c.log_batch(run_id, params=chunk), "study params")


def _end_killed_parents(c: Any, experiment_id: str, execution_id: str) -> None:
    """Parent runs of earlier invocations still RUNNING were cut off (a kill -9 leaves no hook to close
    them; Snakemake's lock means no two invocations of one study run at once): mark them KILLED."""
    stale = c.search_runs([experiment_id], filter_string="tags.kind = 'study' and attributes.status = 'RUNNING'")
    for run in stale:
        if run.data.tags.get("tunegrid.execution_id") != execution_id:
            c.set_tag(
                run.info.run_id,
                "tunegrid.status",
                f"killed: its invocation ended without closing it; next invocation {execution_id}",
            )
            c.set_terminated(run.info.run_id, status="KILLED")


def cell_ended(uri: str, study_dir: Path, cell_id: str, outcome: str) -> None:
    """Count the cell's outcome on the parent run; the last cell in flight marks the parent finished.

    Never raises: the parent run is a view, the cell's files and its own run hold the facts."""
    from mlflow.entities import RunTag

    from tunegrid.track.store import client, with_retries

    record_path = _current_record(study_dir)
    if record_path is None:
        return
    with _locked(record_path):
        record = read_json(record_path)
        if cell_id not in record["running"]:  # reported already, or the hook closed the run meanwhile
            return
        record["running"].remove(cell_id)
        record["counts"][outcome] = record["counts"].get(outcome, 0) + 1
        done = not record["running"]
        try:
            c = client(uri)
            tags = [RunTag(f"cells.{k}", str(v)) for k, v in record["counts"].items()]
            tags.append(RunTag("cells.total", str(sum(record["counts"].values()))))
            if done:
                tags.append(RunTag("tunegrid.status", "done"))
            with_retries(lambda: c.log_batch(record["run_id"], tags=tags), "parent tags")
            if done:
                with_retries(lambda: c.set_terminated(record["run_id"], status="FINISHED"), "parent end")
                record["finished"] = True
        except Exception as exc:  # noqa: BLE001 — reported, not raised: the hook closes the run instead
            print(f"WARNING: could not update the execution's parent run: {exc}", flush=True)
        write_json(record_path, record)


def needs_closing(study_dir: Path, status: str, attachments: list[Path]) -> bool:
    """The Snakefile hook's question, answered from the record alone (no mlflow import): is a closing
    process worth starting? Yes after a failure, with cells still in flight, or with files to attach that
    this execution wrote."""
    record_path = _current_record(study_dir)
    if record_path is None:
        return False
    record = read_json(record_path)
    if status != "FINISHED" or record.get("running") or not record.get("finished", False):
        return True
    return any(p.is_file() and p.stat().st_mtime >= record["started"] for p in attachments)


@contextmanager
def _locked(record_path: Path) -> Iterator[None]:
    with open(record_path.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def close_execution(
    uri: str, experiment_id: str, study_dir: Path, status: str, attachments: list[Path]
) -> dict[str, Any] | None:
    """Counts of the nested cells' outcomes (recounted from the store, so runs that mlflow_sync created
    count too) as tags, the report attached, the run terminated with `status`."""
    from mlflow.entities import RunTag

    from tunegrid.track.store import client, with_retries

    record_path = _current_record(study_dir)
    if record_path is None:
        return None
    with _locked(record_path):
        record = read_json(record_path)
        record.update(running=[], finished=True)  # what is still in flight now will never report back
        write_json(record_path, record)
    run_id = record["run_id"]
    c = client(uri)
    children = with_retries(
        lambda: c.search_runs(
            [experiment_id], filter_string=f"tags.`{INVOCATION_TAG}` = '{run_id}'", max_results=50000
        ),
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
