"""A point of the grid as a type: `Cell`, a frozen dataclass with one field per row of the axis table; and
the grid's exclusions (`grid.exclude`), the cells a study leaves out of the product.

Light module (the Snakefile imports it through tunegrid.study.config at parse time).
"""

from __future__ import annotations

from typing import Any

from tunegrid.cell_spec import Cell, CellAxes, cell_class
from tunegrid.vocabulary import axis_table

__all__ = ["Cell", "CellAxes", "cell_class", "excluded", "exclusion_problems", "exclusion_schema"]


def exclusion_schema() -> dict[str, Any]:
    """The JSON schema of `grid.exclude`: entries keyed by the table's axes, each value one the axis takes."""
    return {
        "type": "array",
        "description": (
            "cells left out of the grid's product: every cell that has all the axis values of one entry is "
            "dropped, e.g. [{model: qwen3moe-tiny, precision: fp16-islands}]; each value must be one the grid lists"
        ),
        "default": [],
        "items": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {row.name: dict(row.items) for row in axis_table()},
        },
    }


def excluded(axes: dict[str, Any], exclusions: list[dict[str, Any]]) -> bool:
    """Whether a cell (its axes) matches an entry of `grid.exclude`: every axis the entry names has its value."""
    return any(all(axes[name] == value for name, value in entry.items()) for entry in exclusions)


def exclusion_problems(grid: dict[str, Any]) -> list[str]:
    """An exclusion must name values the grid lists (a typo would otherwise drop nothing, silently), and must
    leave at least one cell."""
    problems = []
    for index, entry in enumerate(grid["exclude"]):
        for name, value in entry.items():
            if value not in grid[name]:
                problems.append(
                    f"config key 'grid.exclude.{index}.{name}': {value!r} is not a value of grid.{name} "
                    f"{grid[name]}; an exclusion names values the grid lists"
                )
    return problems
