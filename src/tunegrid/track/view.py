"""The study's runs page as a comparison table, and the review written onto its runs.

MLflow's runs page takes its filter, sort and columns from a shared view: an experiment tag
`mlflow.sharedViewState.<key>` opened by `...runs?viewStateShareKey=<key>` (a filter or sort in the address would
override the view, so the view holds them). `workflowType=machine_learning` opens the page as a table of training
runs, not MLflow's GenAI evaluations. The view shows the study's current cell runs, failures first, with the
columns a reviewer compares: outcome, reason, the axes that vary in the study, final loss, peak memory, tokens/s,
the estimate over the measured peak, and a non-finite cell's first step and origin.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tunegrid.outcome import CellResult
from tunegrid.track.current import CURRENT_TAG
from tunegrid.track.diagnosis import (
    DIAGNOSIS_TAG,
    FAILED_TAG,
    FIXED_BY_TAG,
    NOTE_TAG,
    PROVES_TAG,
    description,
    diagnosis_line,
    fix_links,
)
from tunegrid.track.store import client, with_retries
from tunegrid.track.tracking import CELL_TAG
from tunegrid.vocabulary import axis_names

VIEW_KEY = "tunegrid-review"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
CURRENT_FILTER = f"tags.`{CURRENT_TAG}` = 'yes'"
FIGURES = ("final_loss", "peak_bytes", "tokens_per_s_median", "estimate_over_measured", "nan_step")


def column(kind: str, key: str) -> str:
    return f"{kind}.`{key}`"


def runs_view(url: str, experiment_id: str) -> str:
    """The address of the study's view: its current runs as a table, failures first."""
    query = f"workflowType=machine_learning&compareRunsMode=TABLE&viewStateShareKey={VIEW_KEY}"
    return f"{url}/#/experiments/{experiment_id}/runs?{query}"


def varying_axes(runs: list[Any]) -> list[str]:
    """The axes whose tag differs among the runs, in the axis table's order."""
    return [axis for axis in axis_names() if len({run.data.tags.get(axis) for run in runs}) > 1]


def view_state(runs: list[Any]) -> dict[str, Any]:
    """The view's state: the filter, the sort and the columns, the run name as wide as the longest name."""
    columns = [column("tags", "outcome"), column("tags", "outcome.reason")]
    columns += [column("tags", axis) for axis in varying_axes(runs)]
    columns += [column("metrics", key) for key in FIGURES] + [column("tags", "nan.forward_module")]
    name = column("attributes", "Run Name")
    widths = {name: _width([run.info.run_name or "" for run in runs], 190, 420), column("tags", "outcome.reason"): 360}
    for axis in varying_axes(runs):  # each axis column as wide as its longest value: a model's name shows whole
        widths[column("tags", axis)] = _width([run.data.tags.get(axis) or "" for run in runs], 90, 240)
    return {
        "searchFilter": CURRENT_FILTER,
        "orderByKey": column("tags", FAILED_TAG),
        "orderByAsc": False,
        "selectedColumns": columns,
        "columnOrder": [name, *columns],
        "columnWidths": widths,
        "runsHiddenMode": "SHOW_ALL",
    }


def _width(texts: list[str], least: int, most: int) -> int:
    """A column's width in pixels for its longest text (MLflow cuts a longer one with an ellipsis)."""
    return min(max(7 * max(map(len, texts), default=0) + 48, least), most)


def current_runs(c: Any, experiment_id: str) -> list[Any]:
    from mlflow.entities import ViewType

    runs, token = [], None
    while True:
        page = with_retries(
            lambda t=token: c.search_runs(
                [experiment_id], CURRENT_FILTER, ViewType.ACTIVE_ONLY, max_results=1000, page_token=t
            ),
            "search current runs",
        )
        runs += list(page)
        token = page.token
        if not token:
            return runs


def write_view(uri: str, experiment_id: str) -> str:
    """Write the study's view onto its experiment (again: the axes and names are the store's now); its key."""
    c = client(uri)
    state = view_state(current_runs(c, experiment_id))
    shared = {"name": "tunegrid: the study's cells, failures first", "createdAt": int(time.time() * 1000)}
    shared["state"] = json.dumps(state)
    with_retries(lambda: c.set_experiment_tag(experiment_id, VIEW_TAG, json.dumps(shared)), "write the view")
    return VIEW_KEY


def publish_review(
    uri: str, experiment_id: str, results: list[dict[str, Any]], recommendations: list[dict[str, Any]]
) -> dict[str, Any]:
    """After the report: each current cell run's diagnosis and description, the links between each failing run
    and the runs that prove its fix (tags and descriptions), and the study's view."""
    from mlflow.entities import RunTag

    c = client(uri)
    runs = {run.data.tags.get(CELL_TAG): run for run in current_runs(c, experiment_id)}
    by_cell = {result.cell_id: result for result in map(CellResult.from_json, results)}
    links = fix_links(recommendations, {cell: result.axes.axes() for cell, result in by_cell.items()})
    proves: dict[str, list[tuple[str, str]]] = {}
    for failing, fixes in links.items():
        for change, cell in fixes:
            proves.setdefault(cell, []).append((change, failing))

    def named(pairs: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
        return [(what, runs[cell].info.run_id, runs[cell].info.run_name) for what, cell in pairs if cell in runs]

    axes, linked = varying_axes(list(runs.values())), 0
    for cell, run in runs.items():
        result = by_cell.get(cell)
        if result is None:
            continue
        fixes, proven = named(links.get(cell, [])), named(proves.get(cell, []))
        tags = {
            NOTE_TAG: description(result, experiment_id, fixes, proven, axes, run.info.run_id),
            DIAGNOSIS_TAG: diagnosis_line(result),
        }
        if fixes:
            tags[FIXED_BY_TAG] = ",".join(dict.fromkeys(run_id for _, run_id, _ in fixes))
        if proven:
            tags[PROVES_TAG] = ",".join(dict.fromkeys(run_id for _, run_id, _ in proven))
        linked += bool(fixes)
        batch = [RunTag(key, value) for key, value in tags.items()]
        with_retries(lambda r=run.info.run_id, b=batch: c.log_batch(r, tags=b), "review tags")
    return {"runs": len(runs), "failing_linked": linked, "view": write_view(uri, experiment_id)}


def read_results(paths: list[Path]) -> list[dict[str, Any]]:
    from tunegrid.runtime.files import read_json

    return [read_json(path) for path in paths]
