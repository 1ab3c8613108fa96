"""How the report writes a table: column labels a person reads, numbers written for people (no 4.027e+08), one
unit per column of bytes (named in its header, the exact bytes MLflow's metrics hold on hover) and every cell name
a link to its MLflow run."""

from __future__ import annotations

import html
import numbers
from typing import Any

from tunegrid.review.run_links import CellLinks, run_link
from tunegrid.units import human_bytes

# Column labels a person reads, and the MLflow metric a column is (where the runs page has it)
LABELS = {
    "cell_id": "cell",
    "nan_step": "first non-finite step",
    "nan_kind": "kind",
    "nan_forward_module": "forward origin",
    "nan_backward_module": "backward origin",
    "fp16_headroom_worst_module": "worst fp16 headroom: module",
    "fp16_headroom_worst_where": "worst fp16 headroom: where (a layer's output is the residual stream after it)",
    "fp16_headroom_worst_ratio": "worst |activation| at real tokens / 65504 (sampled steps + the failing step)",
    "steps_run": "steps",
    "effective_batch": "effective batch (micro-batch x accumulation x ranks)",
    "resumed_from_step": "resumed from step",
    "final_loss": "final loss",
    "skipped_steps": "skipped",
    "quality_note": "quality judged on",
    "peak_bytes": "peak memory",
    "estimate_over_measured": "estimate / peak",
    "tokens_per_s": "tokens/s",
    "mlflow_run_id": "MLflow run",
}
METRICS = {  # column -> the MLflow metric of the same figure (tracking: track/diagnosis.result_metrics)
    "final_loss": "final_loss",
    "peak_bytes": "peak_bytes",
    "tokens_per_s": "tokens_per_s_median",
    "estimate_over_measured": "estimate_over_measured",
    "nan_step": "nan_step",
}
COUNT_COLUMNS = ("steps_run", "skipped_steps", "nan_step", "effective_batch", "resumed_from_step")
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
CELL_COLUMNS = ("cell_id", "cell", "plain cell", "reference_cell")  # the columns that name a cell


def label(column: str) -> str:
    return LABELS.get(column, column.replace("_", " "))


def is_bytes(column: str) -> bool:
    return "bytes" in column


def byte_unit(values: list[Any]) -> tuple[str, int]:
    """One unit for a column of bytes: the largest in which its median value is at least 1."""
    finite = sorted(abs(float(v)) for v in values if isinstance(v, numbers.Real) and v == v and abs(v) != float("inf"))
    top = finite[len(finite) // 2] if finite else 0.0
    return next(((name, size) for name, size in UNITS if top >= size), ("B", 1))


def missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def fmt(value: Any, column: str = "") -> str:
    if missing(value):
        return ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if is_bytes(column):
        return human_bytes(value)
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if column in COUNT_COLUMNS or isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.4g}"


def fmt_in(value: Any, unit: tuple[str, int]) -> str:
    """Bytes in the column's unit, one decimal ("391.0"), the unit named once in the header."""
    if missing(value) or not isinstance(value, numbers.Real):
        return fmt(value)
    return f"{float(value) / unit[1]:,.1f}" if unit[1] > 1 else f"{int(value):,}"


def cell_html(row: dict[str, Any], column: str, links: CellLinks | None, unit: tuple[str, int] | None = None) -> str:
    """One cell of a table: a cell name as a link to its run, bytes in the column's unit (exact on hover)."""
    value = row.get(column)
    extra = row.get(f"_{column}_html")  # a note a table adds to a value (an estimate miss, a step-0 figure)
    if column in CELL_COLUMNS and links is not None and not missing(value):
        text = links.cell(value)
    elif column == "mlflow_run_id":
        text = run_link(html.escape(fmt(value)), links.run_base if links else None)
    elif unit is not None and isinstance(value, numbers.Real) and not missing(value):
        return f"<td class='num' title='{int(value):,} bytes'>{fmt_in(value, unit)}</td>"
    else:
        text = html.escape(fmt(value, column))
    css = " class='num'" if isinstance(value, numbers.Real) and not isinstance(value, bool) else ""
    return f"<td{css}>{text}{extra or ''}</td>"


def header(column: str, unit: tuple[str, int] | None) -> str:
    name = html.escape(label(column)) + (f" ({unit[0]})" if unit else "")
    metric = METRICS.get(column)
    return f"<th title='MLflow metric: {metric}'>{name}</th>" if metric else f"<th>{name}</th>"


def table(rows: list[dict[str, Any]], columns: list[str], links: CellLinks | None = None, css: str = "") -> str:
    if not rows:
        return "<p class='none'>none</p>"
    units = {c: byte_unit([r.get(c) for r in rows]) if is_bytes(c) else None for c in columns}
    head = "".join(header(c, units[c]) for c in columns)
    body = "".join("<tr>" + "".join(cell_html(r, c, links, units[c]) for c in columns) + "</tr>" for r in rows)
    return f"<div class='scroll {css}'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
