"""A cell's record: its MLflow run, opened as the ranks start and finished at the end, and result.json, the
job's declared output, written last of all."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import CellContract
from tunegrid.outcome import CellResult
from tunegrid.run.recorder_read import dump_files
from tunegrid.runtime.files import read_jsonl, write_json
from tunegrid.study.paths import StudyPaths
from tunegrid.track.diagnosis import diagnosis_line, result_metrics
from tunegrid.track.tags import (
    ARTIFACT_FILES,
    cell_tags,
    dataset_input,
    env_tags,
    rerun_tags,
    result_params,
    run_name,
    run_tags,
    study_cell_ids,
)
from tunegrid.vocabulary import Outcome


def record_result(
    contract: CellContract,
    tracker: Any,
    result: dict[str, Any],
    unsent: list[dict[str, Any]],
    visible: str | None,
) -> dict[str, Any]:
    """The cell's composed result recorded: the metrics not yet sent, the MLflow run finished, the log's last
    line, and result.json; returns result.json's content."""
    spec, job = contract.spec, contract.job
    run_dir, result_path = job.run, Path(job.result_path)
    result["visible_devices"] = visible  # the job's own GPUs ("" none, null as the cluster granted)
    tracker.log_records(unsent)
    filled = tracker.reconcile(read_jsonl(run_dir / "metrics.jsonl"))
    if tracker.enabled:
        result["tracking"] = {
            "run_id": tracker.run_id,
            "points_sent_live": tracker.sent_points,
            "points_filled": filled,
            "errors": tracker.errors,
        }
    record = CellResult.from_json(result)  # the declared shape: a key no field holds is an error
    result = record.to_json()
    # the cell's log ends with how the cell ended (a failing cell's log would otherwise end mid-progress-bar)
    print(f"tunegrid: {spec.cell_id} ended {diagnosis_line(record)}", flush=True)
    # result.json is the job's declared output: it appears last, once everything the job owes (the
    # MLflow run finished, the parent's counts) is done, so a kill before it re-runs the cell and a
    # kill after it finds nothing left to do. The copy MLflow keeps is staged beside it.
    staged = run_dir / ".staged" / "result.json"
    write_json(staged, result)
    if tracker.enabled:
        log_path = Path(job.log_path) if job.log_path else None
        _finish_run(tracker, record, result, staged, Path(job.data_path), log_path)
        from tunegrid.track.execution import cell_ended

        cell_ended(tracker.uri, StudyPaths.of_result(result_path).study_dir, spec.cell_id, result["outcome"])
    _kill_point("before_result")
    write_json(result_path, result)
    shutil.rmtree(staged.parent, ignore_errors=True)
    return result


def _finish_run(
    tracker: Any, record: CellResult, result: dict[str, Any], staged: Path, data_path: Path, log_path: Path | None
) -> None:
    """The cell's MLflow run at its end: the dataset input, outcome tags, params and artifacts. `result` is
    `record`'s JSON, where the run's end notes what the store refused."""
    run_dir = staged.parent.parent  # <run_dir>/.staged/result.json
    if data_path.is_file():
        tracker.log_dataset(dataset_input(record, data_path))
    artifacts = [staged] + [run_dir / name for name in ARTIFACT_FILES if name != "result.json"]
    artifacts += sorted((run_dir / "ranks").glob("rank*.log")) + [
        path for _, path in sorted(dump_files(run_dir / "flight_recorder")[0].items())
    ]
    if log_path is not None:
        artifacts.append(log_path)
    tracker.finish(
        {**run_tags(record), "attempts": str(len(result["attempts"]))},
        artifacts,
        failed=record.outcome != Outcome.OK,
        params=result_params(result),
        end_time=record.ended_at,
        metrics=result_metrics(result),
        name=run_name(record.outcome, record.cell.cell_id, study_cell_ids(run_dir)),
    )
    if tracker.errors:  # the store was unreachable at the end: say so in the file too
        result["tracking"]["errors"] = tracker.errors
    if tracker.refused:  # keys MLflow would not take (named, never valued): the files hold them
        result["tracking"]["refused"] = tracker.refused


def _kill_point(name: str) -> None:
    """TUNEGRID_KILL_AT=<name>: the supervisor SIGKILLs itself there (a test's `kill -9` of the job at its worst)."""
    if os.environ.get("TUNEGRID_KILL_AT") == name:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def open_cell_run(
    spec: CellSpec,
    plan: dict[str, Any],
    capabilities: dict[str, Any],
    tracking: dict[str, Any],
    result_path: Path,
    command: list[str],
    snakemake_job: str,
    started: float,
) -> Any:
    """The cell's MLflow run: axes, env and re-run tags, params, the parent (invocation) and probe links. `plan`:
    the plan as the cell runs it (result.json's `cell.plan`)."""
    from tunegrid.track.execution import INVOCATION_TAG, parent_run_id
    from tunegrid.track.params import split_params, study_specs
    from tunegrid.track.store import tracking_uri_for_cells
    from tunegrid.track.tracking import CellRun

    tracker = CellRun(tracking_uri_for_cells(tracking), tracking["experiment_id"])
    tags = {**cell_tags(spec), "command": shlex.join(command), "target": str(plan["target"])}
    tags.update(env_tags(capabilities))
    tags.update(rerun_tags(result_path, snakemake_job))
    probe_run = capabilities.get("mlflow_run_id") or ""
    if probe_run:
        tags["probe.run_id"] = probe_run
    # the params flatten result.json's cell (the spec's JSON and the plan), as the sync does from the file
    params, common = split_params({**spec.to_json(), "plan": plan}, study_specs(result_path.parent))
    parent = parent_run_id(
        tracker.uri,
        tracking["experiment_id"],
        spec.study,
        StudyPaths.of_result(result_path).study_dir,
        probe_run,
        spec.cell_id,
        params=common,
    )
    if parent:
        tags[INVOCATION_TAG] = parent
    tracker.start(spec.cell_id, tags, params, start_time=started)
    tracker.monitor_system(float(tracking.get("system_metrics_interval_s", 0)))
    return tracker
