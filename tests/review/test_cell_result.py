"""result.json as a type: old files still read, nothing a worker writes is dropped, and summary.csv, the
MLflow tags and the report read the same CellResult."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, one_cell_spec

from tunegrid.outcome import CellResult, Diagnosis, compose_result
from tunegrid.review.summary import summary_row
from tunegrid.runtime.files import dumps
from tunegrid.track.tags import run_tags
from tunegrid.vocabulary import Outcome

OLD = REPO / "tests" / "data" / "result-a7de793-gemma3-tiny_fp16_bs8_nf4_s0.json"


def test_a_result_json_from_before_the_type_still_reads():
    raw = json.loads(OLD.read_text())
    result = CellResult.from_json(raw)
    assert result.outcome is Outcome.NAN and result.diagnosis.nan.kind == "loss_nonfinite"
    assert result.distributed == {} and result.lora_sha256 is None  # fields it predates take their defaults
    assert CellResult.from_json(result.to_json()) == result
    assert {k: v for k, v in result.to_json().items() if k in raw} == {**raw, "diagnosis": raw["diagnosis"]}
    # its spec reads typed, the keys it predates at the values it ran at; its cell is written back as recorded
    assert "loss" not in raw["cell"]["train"] and result.cell.train.loss == "full" and result.axes.quant == "nf4"
    assert result.plan == raw["cell"]["plan"] and result.to_json()["cell"] == raw["cell"]

    row = summary_row(raw)
    assert row["outcome"] == "nan" and row["nan_step"] == 0 and row["nan_kind"] == "loss_nonfinite"
    assert row["nan_forward_module"].endswith("layers.0.mlp.down_proj") and row["quant"] == "nf4"
    assert row == summary_row(result)
    tags = run_tags(raw)
    assert tags["nan.kind"] == "loss_nonfinite" and tags["outcome"] == "nan" and tags == run_tags(result)

    # older still: a result from before the world_size and grad_accum axes reads at their neutral values
    older = json.loads(OLD.read_text())
    for axis in ("world_size", "grad_accum"):
        older["cell"]["axes"].pop(axis, None)
    assert summary_row(older)["effective_batch"] == 8 and summary_row(older)["grad_accum"] == 1


def test_a_key_no_field_holds_is_an_error_not_a_silent_drop():
    raw = json.loads(OLD.read_text())
    with pytest.raises(ValueError, match="surprise"):
        CellResult.from_json({**raw, "surprise": 1})
    with pytest.raises(ValueError, match="hunch"):
        Diagnosis.from_json({"hunch": {}})


def test_a_result_of_today_writes_its_cell_as_the_spec_s_json_with_the_plan(tmp_path):
    spec, plan = one_cell_spec(), json.loads(OLD.read_text())["cell"]["plan"]
    result = compose_result(spec, plan, tmp_path, -9, None, 0.0, ["tunegrid", "finetune"])
    assert result["cell"] == {**spec.to_json(), "plan": plan}
    read = CellResult.from_json(json.loads(dumps(result)))
    assert read.cell == spec and read.plan == plan and read.recorded_cell is None
    assert dumps(read.to_json()) == dumps(result)  # the same file, byte for byte


def test_composing_keeps_every_fact_the_worker_wrote(tmp_path):
    facts = {
        "outcome": "ok",
        "reason": "trained all 3 steps with finite loss",
        "rank": 0,
        "stage": "adapter",
        "distributed": {"world_size": 2, "backend": "gloo", "collective_timeout_s": 60},
        "lora_sha256": "ab" * 32,
        "training": {"steps_run": 3},
        "wall_s": 1.0,
    }
    (tmp_path / "worker.json").write_text(json.dumps(facts))
    old = CellResult.from_json(json.loads(OLD.read_text()))  # its spec and plan, as a supervisor has them
    result = compose_result(old.cell, old.plan, tmp_path, 0, None, 0.0, ["tunegrid", "finetune"])
    assert result["distributed"]["backend"] == "gloo"  # once dropped by a whitelist of keys
    assert result["lora_sha256"] == "ab" * 32 and result["stage"] == "adapter"
    assert CellResult.from_json(result).training == {"steps_run": 3}
    (tmp_path / "worker.json").write_text(json.dumps({**facts, "new_fact": 1}))
    with pytest.raises(ValueError, match="new_fact"):
        compose_result(old.cell, old.plan, tmp_path, 0, None, 0.0, ["tunegrid", "finetune"])


def test_each_part_of_a_diagnosis_reads_typed_and_writes_back_as_it_was():
    raw = {
        "oom": {"stage": "step", "peak_bytes": 9, "bytes_at_failure": 8, "extra": [1]},
        "collective": {
            "op": "ALLREDUCE",
            "missing_ranks": [1],
            "timeout_s": 5,
            "step": 3,
            "seq": 7,
            "kind": "straggler",
            "last_step_per_rank": {"0": 3, "1": 2},
            "evidence": {
                "before_the_stall": {"rank": 1, "median_ratio": 4.0},
                "parted_ranks": [1],
                "parted_at_step": 2,
            },
        },
        "rank_crash": {"ranks": [1], "exit": "SIGKILL", "last_lines": ["x"]},
        "nonfinite_events": 0,
    }
    diagnosis = Diagnosis.from_json(json.loads(json.dumps(raw)))
    assert (diagnosis.oom.stage, diagnosis.oom.peak_bytes, diagnosis.oom.reserved_peak_bytes) == ("step", 9, None)
    collective = diagnosis.collective
    assert (collective.op, collective.missing_ranks, collective.kind, collective.parted_at_step) == (
        "ALLREDUCE",
        [1],
        "straggler",
        2,
    )
    assert collective.straggler == {"rank": 1, "median_ratio": 4.0}
    assert (diagnosis.rank_crash.ranks, diagnosis.rank_crash.exit) == ([1], "SIGKILL")
    assert diagnosis.to_json() == raw  # every key as written, those no field reads too
    with pytest.raises(ValueError, match="no Diagnosis field"):
        Diagnosis.from_json({"nan_reason": 1})
