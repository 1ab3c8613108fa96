"""A spec recorded by an earlier version reads with today's keys: those it predates at the values the cell ran at
(the axis table's neutral values, the schema's defaults), the recorded ones kept, a key no section holds refused."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, one_cell

from tunegrid.cell_spec import SpecKeyError
from tunegrid.study.recorded import recorded_spec

OLD = REPO / "tests" / "data" / "result-a7de793-gemma3-tiny_fp16_bs8_nf4_s0.json"


def test_a_complete_spec_reads_as_it_is():
    spec = one_cell(train={"loss": "chunked"}, axes={"optimizer": "adamw-8bit"})
    assert recorded_spec(spec).to_json() == spec


def test_an_old_result_s_spec_takes_the_neutral_axes_and_the_schema_s_defaults():
    raw = json.loads(OLD.read_text())["cell"]
    assert "loss" not in raw["train"] and "attention" not in raw["axes"] and "plan" in raw
    spec = recorded_spec(raw)
    assert spec.axes.attention == "sdpa" and spec.axes.optimizer == "adamw" and spec.axes.nodes == 1
    assert spec.train.loss == "full" and spec.train.loss_chunk_tokens == 256 and spec.lora.loftq_bits == 0
    assert spec.debug.slow_link["rank"] == -1 and spec.distributed.hang_window_s == 0
    assert spec.cell_id == raw["cell_id"] and spec.train.seq_len == raw["train"]["seq_len"]  # as recorded
    assert spec.axes.quant == "nf4" and spec.model.name == raw["model"]["name"]


def test_a_section_missing_and_the_model_s_name_come_from_the_schema_and_the_axis():
    spec = one_cell()
    del spec["data"], spec["model"]["name"], spec["train"]["loss"]
    read = recorded_spec(spec, "s")
    assert read.data.loss_on == "response" and read.data.packing is True
    assert read.model.name == "gemma3-hot" and read.train.loss == "full"


def test_a_key_no_section_holds_is_still_refused():
    spec = one_cell()
    spec["train"]["surprise"] = 1
    with pytest.raises(SpecKeyError, match="surprise"):
        recorded_spec(spec)
