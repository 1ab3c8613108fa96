"""A point of the grid as a type: `Cell`, a frozen dataclass with one field per row of the axis table.

Light module (the Snakefile imports it through tunegrid.config at parse time).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, field, make_dataclass
from typing import Any

from tunegrid.vocabulary import AXIS_TABLE, Axis, format_cell_id

__all__ = ["Cell", "CellAxes", "cell_class"]


class CellAxes:
    """What every Cell is, whichever axes the table holds: its id and its axes as a dict."""

    @property
    def cell_id(self) -> str:
        return format_cell_id(self.axes())

    def axes(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@functools.cache
def cell_class(table: tuple[Axis, ...]) -> type[CellAxes]:
    """The Cell dataclass of an axis table: one typed field per axis, its neutral value as the default."""
    required = [(a.name, a.type) for a in table if a.neutral is None]
    optional = [(a.name, a.type, field(default=a.neutral)) for a in table if a.neutral is not None]
    cell = make_dataclass("Cell", [*required, *optional], bases=(CellAxes,), frozen=True, kw_only=True)
    cell.__module__ = __name__
    return cell


# One point of the grid: the axes only (everything else comes from the study); its fields are AXIS_TABLE's.
Cell = cell_class(AXIS_TABLE)
