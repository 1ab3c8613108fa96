"""A throwaway axis added through the axis table alone: the schema accepts it, it makes distinct cells and
ids, the summary has its column and the outcome matrix its own positions; without a plot role the
figures refuse a grid that varies it."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from conftest import make_study

from tunegrid import vocabulary
from tunegrid.review import plots
from tunegrid.review.summary import summary_row
from tunegrid.study.config import ConfigError, expand_cells, resolve_study
from tunegrid.vocabulary import Axis, CurvePlace, MatrixPlace, Outcome, PlotRole, parse_cell_id

RANK = Axis(
    name="lora_rank",
    type=int,
    items={"type": "integer", "minimum": 1},
    description="LoRA rank (a throwaway axis of this test)",
    default=(8,),
    id_prefix="r",
    neutral=8,
    plot=PlotRole(matrix=MatrixPlace.ROW, curves=CurvePlace.PANEL),
)


@pytest.fixture
def with_rank(monkeypatch):
    monkeypatch.setattr(vocabulary, "AXIS_TABLE", (*vocabulary.AXIS_TABLE, RANK))


def _study(ranks):
    grid = {"model": ["gemma3-hot"], "precision": ["fp32", "fp16"], "quant": ["none"], "lora_rank": ranks}
    return resolve_study(make_study(grid=grid))


def _result(cell, outcome):
    return {
        "cell_id": cell.cell_id,
        "cell": {"axes": cell.axes()},
        "outcome": outcome,
        "reason": "",
    }


def test_a_new_axis_is_one_row_of_the_table(with_rank, tmp_path):
    cells = expand_cells(_study([8, 16]))
    ids = [c.cell_id for c in cells]
    assert len(cells) == len(set(cells)) == len(set(ids)) == 4
    # the neutral value keeps the ids of cells from before the axis; another value adds its suffix
    assert "gemma3-hot_fp32_bs2_none_s0" in ids and "gemma3-hot_fp32_bs2_none_s0_r16" in ids
    assert all(parse_cell_id(c.cell_id) == c.axes() for c in cells)

    rows = [summary_row(_result(c, Outcome.OK if c.lora_rank == 8 else Outcome.NAN)) for c in cells]
    assert [r["lora_rank"] for r in rows] == [c.lora_rank for c in cells]
    old = summary_row({"cell_id": "x", "cell": {"axes": {**cells[0].axes()}}, "outcome": "ok", "reason": ""})
    del old["lora_rank"]  # a result from before the axis reads as its neutral value
    recorded = {k: v for k, v in cells[0].axes().items() if k != "lora_rank"}
    assert summary_row({"cell_id": "x", "cell": {"axes": recorded}, "outcome": "ok", "reason": ""})["lora_rank"] == 8

    frame = pd.DataFrame(rows)
    matrix_rows, cols, row_axes, _ = plots._matrix_layout(frame)
    assert "lora_rank" in row_axes and len(matrix_rows) * len(cols) == 4  # one position per cell
    plots.plot_outcomes(frame, tmp_path / "outcomes.png")
    plots.plot_losses(frame, {}, tmp_path / "losses.png")


def test_a_varying_axis_without_a_plot_role_is_refused(monkeypatch):
    monkeypatch.setattr(vocabulary, "AXIS_TABLE", (*vocabulary.AXIS_TABLE, dataclasses.replace(RANK, plot=None)))
    frame = pd.DataFrame([summary_row(_result(c, Outcome.OK)) for c in expand_cells(_study([8, 16]))])
    with pytest.raises(plots.PlotLayoutError, match="lora_rank"):
        plots._matrix_layout(frame)
    # one value: nothing to tell apart, so nothing to refuse
    plots._matrix_layout(frame[frame["lora_rank"] == 8])


def test_the_schema_refuses_an_axis_the_table_does_not_hold():
    with pytest.raises(ConfigError, match="lora_rank"):
        _study([8])
