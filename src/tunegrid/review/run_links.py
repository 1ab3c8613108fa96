"""The report's links into MLflow: each cell's run id opens its run in `snakemake mlflow_ui`."""

from __future__ import annotations

import html
from pathlib import Path

from tunegrid.runtime.files import read_json


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


def run_link(run_id_html: str, run_base: str | None) -> str:
    """A run id (already escaped) as a link to its page, or as it is without tracking."""
    return (
        f"<a href='{html.escape(run_base)}{run_id_html}'>{run_id_html}</a>" if run_base and run_id_html else run_id_html
    )


def mlflow_note(run_base: str | None) -> str:
    if not run_base:
        return ""
    return (
        "<p class='cite'>MLflow run ids link to <code>snakemake --cores 1 mlflow_ui</code>'s page of the run (start "
        "it first). In its runs page the filter <code>tags.outcome = 'nan'</code> finds this report's nan cells: a "
        "run of a cell that is no longer in the study's grid keeps its outcome as <code>superseded.outcome</code> "
        "and is tagged <code>tunegrid.current = no</code>.</p>"
    )
