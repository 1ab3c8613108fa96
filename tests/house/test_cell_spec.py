"""The cell's spec holds what the schema says, section by section: each CellSpec section's fields are the schema's
keys for it (tunegrid.cell_spec), every default filled once from the schema or the axis table when the spec is made,
and a misspelt key fails where the spec is read, naming the key and its section."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest
from conftest import one_cell

from tunegrid.cell_spec import SECTIONS, CellSpec, ModelSpec, SpecKeyError, StackRef
from tunegrid.study.config import cell_spec, expand_cells, load_schema, resolve_study
from tunegrid.vocabulary import axis_table

# a section's keys the spec leaves out of the schema's, and why
NOT_IN_THE_SPEC = {"hardware": {"mem_mb"}}  # the job's host-memory request: changing it re-runs no cell


def _schema_keys(section: str) -> dict[str, dict]:
    properties = load_schema()["properties"]
    if section == "model":
        return properties["models"]["additionalProperties"]["properties"]
    return properties[section]["properties"]


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_each_section_holds_the_schemas_keys(section):
    named = {f.name for f in fields(SECTIONS[section])} - ({"name"} if SECTIONS[section] is ModelSpec else set())
    assert named == set(_schema_keys(section)) - NOT_IN_THE_SPEC.get(section, set())
    assert all(f.default is MISSING is f.default_factory for f in fields(SECTIONS[section])), "a default in code"


def test_the_spec_of_an_empty_study_holds_the_schemas_defaults():
    study = resolve_study({"study": "s", "models": {"m": {"source": "synthetic"}}, "grid": {"model": ["m"]}})
    spec = cell_spec(study, expand_cells(study)[0])
    for section in SECTIONS:
        typed = getattr(spec, section)
        for key, schema in _schema_keys(section).items():
            nested = "properties" in schema  # an object's default: its own keys' defaults, filled one level down
            if "default" in schema and hasattr(typed, key) and not nested:
                assert getattr(typed, key) == schema["default"], f"{section}.{key}"
    assert spec.axes.axes() == {a.name: a.default[0] if a.default else study["grid"][a.name][0] for a in axis_table()}


def test_the_spec_reads_back_as_it_was_written():
    raw = one_cell()
    assert CellSpec.from_json(raw).to_json() == raw
    stacked = {**raw, "stack": StackRef(name="s", pins={"peft": "0.1"}, key="k", folder="f", python="p").to_json()}
    assert CellSpec.from_json(stacked).to_json() == stacked


def test_a_misspelt_key_fails_when_the_spec_is_read_naming_it_and_its_section():
    raw = one_cell()
    with pytest.raises(SpecKeyError, match=r"'train'.*seq_lenn"):
        CellSpec.from_json({**raw, "train": {**raw["train"], "seq_lenn": 8}})
    with pytest.raises(SpecKeyError, match=r"'lora'.*missing.*'r'"):
        CellSpec.from_json({**raw, "lora": {k: v for k, v in raw["lora"].items() if k != "r"}})
    with pytest.raises(SpecKeyError, match=r"'axes'.*batchsize"):
        CellSpec.from_json({**raw, "axes": {**raw["axes"], "batchsize": 2}})
    with pytest.raises(SpecKeyError, match=r"unknown.*trian"):
        CellSpec.from_json({**raw, "trian": {}})


def test_an_axis_a_spec_lacks_reads_as_its_neutral_value():
    raw = one_cell()
    older = {**raw, "axes": {k: v for k, v in raw["axes"].items() if k not in ("world_size", "grad_accum")}}
    axes = CellSpec.from_json(older).axes
    assert (axes.world_size, axes.grad_accum) == (1, 1)  # the axis table's neutral values
