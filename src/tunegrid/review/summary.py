"""One row per cell, built with pandas from the result files: what a reviewer filters and sorts on."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunegrid.cell_view import CellView
from tunegrid.columns import COLUMNS, summary_columns
from tunegrid.outcome import CellResult
from tunegrid.review.quality import default_review, quality_columns, trained_curve
from tunegrid.runtime.files import read_json, read_jsonl
from tunegrid.study.grid_axes import SETTING_AXES
from tunegrid.vocabulary import axis_names


def summary_row(record: dict[str, Any] | CellResult) -> dict[str, Any]:
    """A cell's row, from its result (a CellResult, or result.json as written by any version): its id, its axes,
    then the column table's columns (tunegrid.columns)."""
    result = record if isinstance(record, CellResult) else CellResult.from_json(record)
    # the axes that stand for a setting read as trained: the cell's own train/distributed values (a result written
    # before an axis or a setting existed reads at its neutral value and the schema's default: CellResult.from_json)
    settings = {axis: getattr(getattr(result.cell, section), key) for axis, (section, key) in SETTING_AXES.items()}
    recorded = {**result.axes.axes(), **settings}
    axes = {name: recorded[name] for name in axis_names()}
    return {"cell_id": result.cell_id, **axes, **summary_columns(CellView(result, axes))}


# Column types, decided once: a numeric column is float64 whatever a cell wrote ("inf" the string, inf
# the float, a missing value), so one odd cell cannot make pyarrow refuse the whole table. The table's columns
# say their own; these are the axis and the metrics.jsonl columns among them.
NUMERIC_COLUMNS = (
    *(c.name for c in COLUMNS if c.name is not None and c.dtype == "float"),
    "step_time_noise",
    "loss_fall",
    "loss_deviation",
    "collective_timeout_s",
)
INTEGER_COLUMNS = tuple(c.name for c in COLUMNS if c.name is not None and c.dtype == "int")


def typed(frame: Any) -> Any:
    """Numbers as numbers (inf stays inf, missing is NaN); every other column is text or null."""
    import pandas as pd

    for column in frame.columns:
        if column in NUMERIC_COLUMNS:
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
        elif column in INTEGER_COLUMNS:
            # int64 when every cell has one, else float64 with NaN (what the report's arithmetic expects)
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
        elif frame[column].dtype == object:
            values = frame[column].map(lambda v: None if v is None or (isinstance(v, float) and v != v) else v)
            if len({type(v) for v in values if v is not None}) > 1:  # mixed kinds: one text column
                values = values.map(lambda v: None if v is None else str(v))
            frame[column] = values
    return frame


def step_time_noise(metric_lines: list[dict[str, Any]]) -> float | None:
    """How far a cell's measured speed may be from its median by chance: the median absolute deviation of its step
    times after the first (whose time includes the warm-up), relative to their median. Robust as the median
    throughput it qualifies is: one step slowed by another job on the host moves neither. Two fixes whose
    throughput differs by less than this are equally fast as measured (review/precision_advice.py). None with
    fewer than two such steps."""
    times = [float(line["step_time_s"]) for line in metric_lines[1:] if line.get("step_time_s")]
    if len(times) < 2:
        return None
    middle = statistics.median(times)
    return statistics.median(abs(t - middle) for t in times) / middle if middle > 0 else None


def build_summary(
    result_paths: Iterable[str | Path], sync_path: str | Path | None = None, review: dict[str, Any] | None = None
) -> Any:
    """One row per cell, with its quality columns (review/quality.py) read from each cell's metrics.jsonl."""
    import pandas as pd

    synced = read_json(sync_path) if sync_path else {}
    rows, curves, skipped = [], {}, {}
    for path in result_paths:
        row = summary_row(read_json(path))
        row["mlflow_run_id"] = (synced.get(row["cell_id"]) or {}).get("run_id") or row["mlflow_run_id"]
        metrics = Path(path).parent / "metrics.jsonl"
        # the losses after each update: steps the GradScaler skipped are left out (review/quality.py)
        lines = read_jsonl(metrics) if metrics.exists() else []
        curves[row["cell_id"]], skipped[row["cell_id"]] = trained_curve(lines)
        row["step_time_noise"] = step_time_noise(lines)
        rows.append(row)
    judged = quality_columns(rows, curves, review or default_review(), skipped)
    for row, quality in zip(rows, judged, strict=True):
        row.update(quality)
    return typed(pd.DataFrame(rows))


def write_summary(
    result_paths: Iterable[str | Path],
    csv_path: str | Path,
    sync_path: str | Path | None = None,
    review: dict[str, Any] | None = None,
) -> Any:
    from tunegrid.runtime.files import atomic_write_text

    frame = build_summary(result_paths, sync_path, review)
    atomic_write_text(csv_path, frame.to_csv(index=False))
    # Parquet keeps types, and keeps the outcome "nan" a string (pandas' read_csv turns it into NaN
    # unless called with keep_default_na=False).
    parquet = Path(csv_path).with_suffix(".parquet")
    tmp = parquet.with_name(f".{parquet.name}.tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(parquet)
    return frame
