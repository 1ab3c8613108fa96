"""What a cell's MLflow run says about how it ended: the diagnosis as its first tag and its description, the
figures a reviewer compares as run metrics, and the links between a failing run and the runs that prove its fix.

The description is MLflow's run note (the tag `mlflow.note.content`, markdown on the run page); links in it are
relative to the MLflow UI that shows it, so they work wherever the store is served.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from tunegrid.outcome import CellResult, origin_label
from tunegrid.vocabulary import Outcome

DIAGNOSIS_TAG = "diagnosis"  # the run's first tag: `<outcome>: <reason>` ("running" until the cell ends)
NOTE_TAG = "mlflow.note.content"  # MLflow's run description
FIXED_BY_TAG = "fixed_by"  # on a failing run: the run ids of the cells that prove its fix, comma-separated
PROVES_TAG = "proves_fix_of"  # on such a cell's run: the failing runs whose fix it proves
RUNNING = "running"
FAILED_TAG = "failed"  # yes | no: the study's view sorts by it, failures first


def diagnosis_line(result: CellResult) -> str:
    """One line: the outcome, then the reason the cell gave (what failed, where, after how many steps)."""
    return f"{result.outcome}: {result.reason or 'no reason recorded'}"


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def result_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The cell's figures as run metrics (the runs page's columns), as summary.csv names them: final loss, peak
    memory, median tokens/s, the estimate over the measured peak and, for a non-finite cell, its first step.
    Only finite values: MLflow would store an infinity as the largest float."""
    memory, training = result.get("memory") or {}, result.get("training") or {}
    nan = (result.get("diagnosis") or {}).get("nan") or {}
    figures = {
        "final_loss": training.get("final_loss"),
        "peak_bytes": memory.get("peak_bytes"),
        "tokens_per_s_median": (result.get("throughput") or {}).get("tokens_per_s_median"),
        "estimate_over_measured": memory.get("estimate_over_measured"),
        "nan_step": nan.get("step"),
    }
    return {key: number for key, value in figures.items() if (number := _finite(value)) is not None}


ML_VIEW = "workflowType=machine_learning"  # MLflow's pages of training runs, not of GenAI evaluations


def run_page(experiment_id: str, run_id: str) -> str:
    return f"#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW}"


def compare_link(experiment_id: str, run_ids: list[str]) -> str:
    runs = quote(json.dumps(run_ids, separators=(",", ":")))
    return f"#/compare-runs?runs={runs}&experiments={quote(json.dumps([experiment_id]))}"


def _facts(result: CellResult, axes: list[str]) -> list[tuple[str, str]]:
    rows = [("cell", f"`{result.cell_id or result.cell.cell_id}`")]
    values = result.axes.axes()
    if axes:
        rows += [("axes that vary", ", ".join(f"{axis} {values.get(axis)}" for axis in axes))]
    nan = result.diagnosis.nan
    if nan:
        forward = origin_label(nan.forward_origin) or "not traced"
        backward = origin_label(nan.backward_origin) or "not traced"
        rows += [("first non-finite", f"step {nan.step}, {nan.kind}")]
        rows += [("origin", f"forward: `{forward}`; backward: `{backward}`")]
    return rows


def description(
    result: CellResult,
    experiment_id: str = "",
    fixes: Iterable[tuple[str, str, str]] = (),
    proves: Iterable[tuple[str, str, str]] = (),
    axes: list[str] | None = None,
    run_id: str = "",
) -> str:
    """The run's description (markdown): the diagnosis, the cell's facts (its values of the study's varying
    `axes`), then the links. `fixes` are (what changes, run id, run name) of the runs that prove a failing cell's
    fix; `proves` the same for the failing runs a cell proves the fix of. With the run's own `run_id`, a failing
    run's description links to MLflow's comparison of it with those runs."""
    lines = [f"**{result.outcome}**: {result.reason or 'no reason recorded'}", ""]
    lines += ["| | |", "|---|---|"] + [f"| {key} | {value} |" for key, value in _facts(result, axes or [])]
    fixes, proves = list(fixes), list(proves)
    if fixes:
        lines += ["", "**Fixed in this grid by** (the runs that prove it):", ""]
        lines += [f"- {change}: [{name}]({run_page(experiment_id, fix_run)})" for change, fix_run, name in fixes]
        if run_id:
            runs = [run_id, *dict.fromkeys(fix_run for _, fix_run, _ in fixes)]
            lines += ["", f"[Compare it with them]({compare_link(experiment_id, runs)})"]
    if proves:
        lines += ["", "**Proves the fix of**:", ""]
        lines += [f"- {change}: [{name}]({run_page(experiment_id, failing)})" for change, failing, name in proves]
    return "\n".join(lines)


def change_text(change: dict[str, Any]) -> str:
    return ", ".join(f"{axis} {value}" for axis, value in change.items()) or "the same settings"


def fix_links(
    recommendations: list[dict[str, Any]], axes: dict[str, dict[str, Any]]
) -> dict[str, list[tuple[str, str]]]:
    """For each failing cell the recommendations name: (what changes, cell) of the cells that prove each fix —
    the fix's evidence cells that differ from the failing cell in what the fix changes only (its twins), or all of
    its evidence where none is a twin. `axes` are every cell's axes, by cell id."""
    links: dict[str, list[tuple[str, str]]] = {}
    for rec in recommendations:
        for failing in rec.get("failing", []):
            mine = axes.get(failing, {})
            for fix in rec.get("fixes", []):
                change = fix.get("change") or {}
                evidence = [cell for cell in fix.get("evidence", []) if cell in axes]
                twins = [
                    cell for cell in evidence if all(axes[cell].get(a) == v for a, v in mine.items() if a not in change)
                ]
                for cell in twins or evidence:
                    pair = (change_text(change), cell)
                    if pair not in links.setdefault(failing, []):
                        links[failing].append(pair)
    return links


def outcome_tags(result: CellResult) -> dict[str, str]:
    """The diagnosis, the description (without links: those come once the report has found the fixes) and
    whether the cell failed."""
    return {
        DIAGNOSIS_TAG: diagnosis_line(result),
        NOTE_TAG: description(result),
        FAILED_TAG: "no" if result.outcome == Outcome.OK else "yes",
    }
