"""Which of a cell's settings are params of its MLflow run, and which are logged once, on the study's run.

A cell run's params are what tells it from the study's other cells: the axes and settings whose value is not the
same in all of the study's cells (a model's config where the grid has two models); every axis is a tag of the run
too. What every cell shares is a param of the invocation's study run (`kind=study`), so comparing two cell runs
shows only what differs.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tunegrid.track.records import flatten


@lru_cache(maxsize=4)
def _study_specs(study_file: str, mtime_ns: int) -> tuple[str, ...]:
    from tunegrid.runtime.files import read_json
    from tunegrid.study.config import cell_spec, cells_by_id, resolve_study

    study = resolve_study(read_json(Path(study_file)))
    return tuple(json.dumps(cell_spec(study, cell).to_json()) for cell in cells_by_id(study).values())


def study_specs(run_dir: Path) -> list[dict[str, Any]]:
    """The specs of every cell of the study a run folder belongs to (its study.json); none when it has none
    (a cell run by hand) or one this version cannot read."""
    from tunegrid.study.paths import StudyPaths

    study_file = StudyPaths.of_run_dir(run_dir).study_file
    try:
        return [json.loads(spec) for spec in _study_specs(str(study_file), study_file.stat().st_mtime_ns)]
    except (OSError, ValueError):
        return []


def split_params(spec: dict[str, Any], specs: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """(the cell run's params, the study run's): the axes and settings that vary among `specs` (the study's
    cells), then those all of them share. Without the study's specs, everything is the cell's. The plan a
    cell was given (its spec's `plan`: target, estimate, time limits) is no setting: the run's tags and metrics
    carry its figures (`target`, `memory.estimate_bytes`) and result.json the whole of it."""
    mine = flatten("", spec, {})
    others = [flatten("", other, {}) for other in specs]
    if len(others) < 2:
        return mine, {}
    cell, common = {}, {}
    for key, value in mine.items():
        if key.startswith("plan.") and not any(key in other for other in others):
            continue
        varies = any(other.get(key) != value for other in others)
        (cell if varies else common)[key] = value
    return cell, common
