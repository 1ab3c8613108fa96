"""One vocabulary: the schema's enums, the cell ids and the wildcard pattern agree with tunegrid.vocabulary."""

from __future__ import annotations

import re

import yaml
from conftest import REPO, make_study

from tunegrid.config import expand_cells, resolve_study
from tunegrid.vocabulary import AXES, OUTCOMES, PRECISIONS, QUANTS, Outcome, cell_id_pattern


def test_schema_enums_are_the_vocabulary():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    grid = schema["properties"]["grid"]["properties"]
    assert tuple(grid["precision"]["items"]["enum"]) == PRECISIONS
    assert tuple(grid["quant"]["items"]["enum"]) == QUANTS
    assert set(AXES) <= set(grid)


def test_every_cell_id_matches_the_wildcard_pattern_and_nothing_else_does():
    grid = {
        "model": ["gemma3-hot", "qwen3moe-tiny"],
        "precision": list(PRECISIONS),
        "batch_size": [2, 16],
        "quant": list(QUANTS),
        "seed": [0, 3],
        "world_size": [1, 2],
        "grad_accum": [1, 4],
    }
    study = resolve_study(make_study(grid=grid))
    pattern = re.compile(cell_id_pattern())
    ids = [cell.cell_id for cell in expand_cells(study)]
    assert len(ids) == 2 * len(PRECISIONS) * 2 * 3 * 2 * 2 * 2 and all(pattern.fullmatch(i) for i in ids)
    # a suffix only where the axis is not 1: ids of cells from before the axis existed stay as they were
    assert "gemma3-hot_fp32_bs2_none_s0" in ids and "gemma3-hot_fp32_bs2_none_s0_ws2_ga4" in ids
    assert not pattern.fullmatch("gemma3-hot_fp8_bs2_none_s0") and not pattern.fullmatch("gemma3-hot_fp16_bs2_int8_s0")


def test_outcomes_are_strings_as_written_in_results():
    assert Outcome.NAN == "nan" and f"{Outcome.PREDICTED_OOM}" == "predicted_oom"
    assert OUTCOMES == ("ok", "nan", "oom", "predicted_oom", "timeout", "error", "unsupported")


def test_every_outcome_has_a_colour_in_the_report():
    from tunegrid.review.plots import OUTCOME_COLOURS

    assert set(OUTCOME_COLOURS) == set(OUTCOMES)
