"""lora.target_regex: a regular expression peft full-matches against each module's whole name (a recipe's
`lora_target_modules` given as a string), attached by the cell and counted by the estimate as the suffixes
it stands for would be."""

from __future__ import annotations

import re

from conftest import one_cell, one_cell_spec, ready_trainer

from tunegrid.cell_spec import CellSpec
from tunegrid.prepare.memory_estimate import estimate_cell

REGEX = r"model\.layers\.[\d]+\.mlp\.(up|down)_proj"


def test_the_cell_attaches_adapters_where_the_regex_matches_the_whole_name(checkpoints, dataset_path, tmp_path):
    spec = one_cell(lora={"target_modules": [], "target_regex": REGEX})
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path)
    adapted = [n for n, m in trainer.model.named_modules() if len(getattr(m, "lora_A", {}))]
    assert adapted and all(re.fullmatch(REGEX, n.removeprefix("base_model.model.")) for n in adapted), adapted
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"up_proj", "down_proj"}
    suffixes = one_cell_spec(lora={"target_modules": ["up_proj", "down_proj"]})
    by_regex = estimate_cell(CellSpec.from_json(spec), checkpoints["gemma3-hot"], 0).components.lora_params_grads
    assert by_regex == estimate_cell(suffixes, checkpoints["gemma3-hot"], 0).components.lora_params_grads > 0
