"""The invocation's parent MLflow run, kept current by the cells themselves (a real sqlite store)."""

from __future__ import annotations

import os
import time

import pytest

from tunegrid.track.execution import EXECUTION_ENV, cell_ended, close_execution, needs_closing, parent_run_id
from tunegrid.track.store import client, init_experiment


@pytest.fixture
def store(tmp_path, monkeypatch, sqlite_store):
    monkeypatch.setenv(EXECUTION_ENV, "20261123T000000-1")
    uri = sqlite_store(tmp_path / "mlflow.db")
    return uri, init_experiment(uri, "exec", tmp_path / "art"), tmp_path / "study"


def _parent(uri, run_id):
    return client(uri).get_run(run_id)


def test_parent_finishes_with_its_last_cell_in_flight_and_runs_again_for_a_later_one(store):
    uri, experiment_id, study_dir = store
    run_id = parent_run_id(uri, experiment_id, "s", study_dir, cell_id="a")
    assert parent_run_id(uri, experiment_id, "s", study_dir, cell_id="b") == run_id, "one parent per invocation"

    cell_ended(uri, study_dir, "a", "ok")
    parent = _parent(uri, run_id)
    assert parent.info.status == "RUNNING", "b is still in flight"
    assert parent.data.tags["cells.ok"] == "1" and parent.data.tags["cells.total"] == "1"

    cell_ended(uri, study_dir, "b", "nan")
    parent = _parent(uri, run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["tunegrid.status"] == "done"
    assert parent.data.tags["cells.nan"] == "1" and parent.data.tags["cells.total"] == "2"

    assert parent_run_id(uri, experiment_id, "s", study_dir, cell_id="c") == run_id
    assert _parent(uri, run_id).info.status == "RUNNING", "a later cell of the same invocation"
    cell_ended(uri, study_dir, "c", "ok")
    parent = _parent(uri, run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["cells.total"] == "3"
    cell_ended(uri, study_dir, "c", "ok")  # a second report of the same cell counts once
    assert _parent(uri, run_id).data.tags["cells.total"] == "3"


def test_the_hook_starts_a_closing_process_only_when_there_is_more_to_do(store, tmp_path):
    uri, experiment_id, study_dir = store
    report = tmp_path / "index.html"
    report.write_text("old report")
    os.utime(report, (time.time() - 3600,) * 2)
    assert not needs_closing(study_dir, "FINISHED", [report]), "no cell ran: no parent run"

    run_id = parent_run_id(uri, experiment_id, "s", study_dir, cell_id="a")
    assert needs_closing(study_dir, "FINISHED", [report]), "a cell in flight"
    cell_ended(uri, study_dir, "a", "ok")
    assert not needs_closing(study_dir, "FINISHED", [report]), "closed by its cell; the report predates it"
    assert needs_closing(study_dir, "FAILED", [report]), "a failed job is always recorded"
    report.write_text("new report")
    assert needs_closing(study_dir, "FINISHED", [report]), "a report written by this invocation, to attach"

    closed = close_execution(uri, experiment_id, study_dir, "FINISHED", [report])
    assert closed is not None and closed["run_id"] == run_id
    assert [a.path for a in client(uri).list_artifacts(run_id)] == ["index.html"]


def test_a_cell_left_in_flight_is_closed_by_the_hook_as_failed(store):
    uri, experiment_id, study_dir = store
    run_id = parent_run_id(uri, experiment_id, "s", study_dir, cell_id="a")
    parent_run_id(uri, experiment_id, "s", study_dir, cell_id="b")
    cell_ended(uri, study_dir, "a", "ok")  # b's supervisor was killed: it never reports
    assert needs_closing(study_dir, "FAILED", [])
    close_execution(uri, experiment_id, study_dir, "FAILED", [])
    assert _parent(uri, run_id).info.status == "FAILED"
    cell_ended(uri, study_dir, "b", "error")  # a straggler reporting after the close changes nothing
    assert _parent(uri, run_id).info.status == "FAILED"


def test_the_next_invocation_marks_a_killed_invocations_parent_and_cell_runs_killed(store, monkeypatch):
    from tunegrid.track.tracking import CellRun

    uri, experiment_id, study_dir = store
    killed_parent = parent_run_id(uri, experiment_id, "t", study_dir, cell_id="a")
    cut = CellRun(uri, experiment_id)
    cut.start("a", {}, {})  # the cell the kill cut off: its run stays RUNNING
    monkeypatch.setenv(EXECUTION_ENV, "20261123T010000-2")  # the next snakemake invocation
    new_parent = parent_run_id(uri, experiment_id, "t", study_dir, cell_id="a")
    again = CellRun(uri, experiment_id)
    again.start("a", {}, {})
    c = client(uri)
    assert new_parent != killed_parent
    old = c.get_run(killed_parent)
    assert old.info.status == "KILLED" and old.data.tags["tunegrid.status"].startswith("killed")
    superseded = c.get_run(cut.run_id)
    assert superseded.info.status == "KILLED" and superseded.data.tags["tunegrid.superseded_by"] == again.run_id
    assert c.get_run(new_parent).info.status == "RUNNING"
