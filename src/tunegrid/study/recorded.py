"""A cell's spec as an earlier version of tunegrid recorded it (an old result.json's `cell`, the specs that
tests/data's evidence files keep), read with today's keys.

A key the record predates is filled with the value the cell then ran at: an axis at its neutral value (the axis
table, as summary.csv reads an old result's axes), a section's key at the schema's default (filled as a study's
are, by the defaulting validator), the model's name its axis. The recorded values are not judged again: they are
what the cell trained with. A key today's spec has no place for is still refused (CellSpec.from_json), but for
the cell's plan, which the spec held before the contract carried it. This is the one place a spec is completed:
the stages read a complete spec and copy no default of their own.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tunegrid.cell_spec import SECTIONS, CellSpec
from tunegrid.study.config import defaulting_validator, load_schema
from tunegrid.study.grid_axes import cell_debug
from tunegrid.vocabulary import with_neutrals


def recorded_spec(raw: dict[str, Any], study: str = "") -> CellSpec:
    """The spec `raw` records, completed to today's keys; `study`: its study's name where the record lacks it."""
    axes = with_neutrals(raw["axes"])
    defaults = _section_defaults()
    # the debug section a cell sees is the study's after its fault and repeat chose from it
    defaults["debug"] = cell_debug(defaults["debug"], axes["fault"], axes["repeat"])
    defaults["model"]["name"] = axes["model"]
    spec = {"study": raw.get("study", study), "cell_id": raw.get("cell_id", ""), "axes": axes}
    for name, kind in SECTIONS.items():
        recorded = raw.get(name) or {}
        # a study's section may hold keys a cell's does not (hardware.mem_mb: the job's request, not how it
        # trains); a recorded key the section does not hold stays, for from_json to refuse
        missing = {f.name: defaults[name][f.name] for f in fields(kind) if f.name not in recorded}
        spec[name] = {**missing, **recorded}
    # the rest as recorded (the stack; any other key, for from_json to refuse), less the cell's plan: a spec
    # written before the contract carried the plan held it beside its sections
    spec |= {k: v for k, v in raw.items() if k not in spec and k != "plan"}
    return CellSpec.from_json(spec)


def _section_defaults() -> dict[str, dict[str, Any]]:
    """Each section as the schema fills it for a study that sets none of its keys (a model's: for an entry under
    `models` that sets none), nested defaults included."""
    empty: dict[str, Any] = {name: {} for name in SECTIONS if name != "model"}
    empty["models"] = {"model": {}}
    for _ in defaulting_validator()(load_schema()).iter_errors(empty):
        pass  # only the defaults it fills are wanted: an empty study is no study
    return {**{name: empty[name] for name in SECTIONS if name != "model"}, "model": empty["models"]["model"]}
