"""One table of what a result shows (tunegrid.columns): summary.csv's columns, a run's tags and the report's audit
table are made from it, and nothing adds a column or a tag beside it but what the table names as outside it."""

from __future__ import annotations

import ast
import json

from conftest import REPO

from tunegrid.columns import COLUMNS, QUALITY_SOURCED, TAG_FAMILIES_OUTSIDE, TAGS_OUTSIDE
from tunegrid.review.report import AUDIT_COLUMNS
from tunegrid.review.summary import summary_row
from tunegrid.track.tags import axis_tags, run_tags
from tunegrid.vocabulary import axis_names

OLD = REPO / "tests" / "data" / "result-a7de793-gemma3-tiny_fp16_bs8_nf4_s0.json"
SRC = REPO / "src" / "tunegrid"


def _every_part() -> dict:
    """The recorded result with every part the table reads set, so every row's tag is written."""
    raw = json.loads(OLD.read_text())
    evidence = {"before_the_stall": {"rank": 1, "median_ratio": 3.0}, "parted_ranks": [1], "parted_at_step": 2}
    collective = {"op": "ALLREDUCE", "missing_ranks": [1], "timeout_s": 5, "step": 3, "kind": "straggler"}
    raw["diagnosis"] = {
        "nan": raw["diagnosis"]["nan"],
        "oom": {"stage": "step"},
        "collective": {**collective, "evidence": evidence, "last_step_per_rank": {}},
        "rank_crash": {"ranks": [1], "exit": "SIGKILL"},
    }
    raw["distributed"] = {"slow_link": {"ratio": 4.0, "collective_s_median": 0.5}}
    raw["fp32_islands"] = {"mode": "calibrated", "modules": [{"module": "m", "max_abs": 7.0, "ratio_to_fp16_max": 1}]}
    raw["optimizer"] = {"state_bytes": 10, "paging": "none"}
    raw["memory"] = {**raw["memory"], "cpu_onednn_off": "bf16 MoE"}
    raw["env"] = {**raw["env"], "device": "cpu", "scheduler": {"SLURM_JOB_ID": "7"}}
    raw["resumed_from_step"] = 2
    return raw


def test_the_summary_columns_are_the_id_the_axes_and_the_table():
    table = [c.name for c in COLUMNS if c.name is not None]
    assert list(summary_row(json.loads(OLD.read_text()))) == ["cell_id", *axis_names(), *table]
    assert len(set(table)) == len(table)
    assert not set(QUALITY_SOURCED) & set(table)


def test_every_tag_comes_from_the_table_or_is_named_outside_it():
    raw = _every_part()
    tags = run_tags(raw)
    table = {c.tag for c in COLUMNS if c.tag is not None}
    assert table <= set(tags), table - set(tags)  # every row's tag is written where its part is set
    outside = set(tags) - table
    assert all(t in TAGS_OUTSIDE or t.startswith(TAG_FAMILIES_OUTSIDE) for t in outside), outside
    assert set(axis_tags(raw["cell"]["axes"])) - set(axis_names()) <= set(TAGS_OUTSIDE)


def test_the_reports_audit_columns_are_the_tables_labels():
    assert AUDIT_COLUMNS == ["cell", *(c.label for c in COLUMNS if c.label is not None)]


def test_no_module_writes_a_tag_of_a_result_outside_the_table():
    """The tag functions of track/tags.py build no name of their own but the families named outside the table."""
    tree = ast.parse((SRC / "track" / "tags.py").read_text())
    run_tags_def = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_tags")
    written = {
        t.slice.value
        for n in ast.walk(run_tags_def)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
    }
    assert not written, written  # a tag by a constant name belongs in the table
