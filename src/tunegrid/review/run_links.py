"""The report's links into MLflow: each cell's name and run id open its run in `snakemake mlflow_ui`, on MLflow's
page of training runs (`workflowType=machine_learning`, as track.diagnosis.ML_VIEW opens it from a run's
description; the review does not import the tracker, so the query is named here too)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from tunegrid.runtime.files import read_json

ML_VIEW = "workflowType=machine_learning"  # MLflow's pages of training runs, not of GenAI evaluations


def mlflow_run_base(study_file: Path, tracking_file: Path) -> str | None:
    """Where `snakemake mlflow_ui` shows a run of this study: its address (tracking.ui_host/ui_port) and the
    experiment's runs path, to which a run id is appended. None without tracking (no runs to link)."""
    if not (study_file.is_file() and tracking_file.is_file()):
        return None
    settings = (read_json(study_file).get("tracking") or {}) if study_file.suffix == ".json" else {}
    experiment_id = read_json(tracking_file).get("experiment_id")
    if not settings.get("enabled", True) or not experiment_id:
        return None
    host = settings.get("ui_host") or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.get('ui_port') or 5000}/#/experiments/{experiment_id}/runs/"


def run_href(run_base: str, run_id: str) -> str:
    """The address of a run's page, opened on MLflow's view of training runs."""
    return f"{run_base}{run_id}?{ML_VIEW}"


def run_link(run_id_html: str, run_base: str | None) -> str:
    """A run id (already escaped) as a link to its page, or as it is without tracking."""
    if not (run_base and run_id_html):
        return run_id_html
    return f"<a href='{html.escape(run_href(run_base, run_id_html))}'>{run_id_html}</a>"


class CellLinks:
    """Cell names as links to their MLflow runs (summary.csv's `mlflow_run_id`), wherever the report names a cell;
    a cell without a run (tracking off, a run not logged) stays plain text."""

    def __init__(self, frame: Any, run_base: str | None) -> None:
        self.run_base = run_base
        self.runs: dict[str, str] = {}
        if run_base and "mlflow_run_id" in frame.columns:
            for cell_id, run_id in zip(frame["cell_id"], frame["mlflow_run_id"], strict=True):
                if isinstance(run_id, str) and run_id:
                    self.runs[str(cell_id)] = run_id

    def cell(self, cell_id: Any) -> str:
        text = html.escape(str(cell_id))
        run_id = self.runs.get(str(cell_id))
        if not (self.run_base and run_id):
            return text
        return f"<a class='cell' href='{html.escape(run_href(self.run_base, run_id))}'>{text}</a>"

    def cells(self, cell_ids: Any, sep: str = ", ") -> str:
        return sep.join(self.cell(c) for c in cell_ids)


def mlflow_note(run_base: str | None) -> str:
    if not run_base:
        return ""
    return (
        "<p class='cite'>Cell names and MLflow run ids link to <code>snakemake --cores 1 mlflow_ui</code>'s page of "
        "the run (start it first). In its runs page the filter <code>tags.outcome = 'nan'</code> finds this report's "
        "nan cells: a run of a cell that is no longer in the study's grid keeps its outcome as "
        "<code>superseded.outcome</code> and is tagged <code>tunegrid.current = no</code>.</p>"
    )
