"""Nothing changes silently: each difference a hand check of public recipes found between a recipe and its study
is carried (the study does what the tool does) or is a row of the header by key, on a small recipe written here
from the tools' documented behaviour (axolotl 0.18.0, TRL 1.16.0, Transformers 5.23.0, peft)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunegrid.recipes.fidelity import check_fidelity
from tunegrid.recipes.importer import import_recipe
from tunegrid.study.config import resolve_study

PAIR = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
TEXT = {"text": "Once upon a time there was a tiny model."}
AXOLOTL = {"base_model": "org/some-model", "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "sequence_len": 256,
           "micro_batch_size": 2, "learning_rate": 2e-4, "max_steps": 20, "lora_target_modules": ["q_proj"],
           "datasets": [{"path": "pairs.jsonl", "type": "alpaca"}]}  # fmt: skip
TRL = {"model_name_or_path": "llama", "dataset_name": "chat.jsonl", "use_peft": True, "max_length": 256,
       "lora_target_modules": ["q_proj", "v_proj"], "max_steps": 20}  # fmt: skip


@pytest.fixture
def here(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "pairs.jsonl").write_text(json.dumps(PAIR) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps(TEXT) + "\n")
    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    for name, model_type in (("llama", "llama"), ("phi3", "phi3")):  # a checkpoint's config.json, read at import
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _import(here: Path, raw: dict, **base):
    (here / "r.yaml").write_text(yaml.safe_dump(raw))
    study, recipe, header = import_recipe({"recipe": "r.yaml", "failure": "all", **base})
    study = resolve_study(study)
    assert check_fidelity(recipe, study) == [], "every difference is a row"
    return study, recipe, "\n".join(header)


def test_padding_to_the_batchs_longest_sequence_is_a_row(here):
    _, recipe, header = _import(here, AXOLOTL)  # axolotl: no sample_packing, no pad_to_sequence_len
    assert "longest sequence (rounded up to a multiple of 64)" in recipe.differs["pad_to_sequence_len"]
    assert "  pad_to_sequence_len: unset" in header
    _, recipe, _ = _import(here, {**AXOLOTL, "pad_to_sequence_len": False})
    assert recipe.differs["pad_to_sequence_len"].startswith("false")
    for packed in ({"sample_packing": True}, {"pad_to_sequence_len": True}):  # rows of sequence_len: as a cell's
        _, recipe, _ = _import(here, {**AXOLOTL, **packed})
        assert "pad_to_sequence_len" not in recipe.differs
    _, recipe, _ = _import(here, TRL)  # TRL without packing: its collator pads to the batch's longest
    assert "pads each batch to its longest example" in recipe.differs["packing"]
    _, recipe, _ = _import(here, {**TRL, "packing": True})
    assert "packing" not in recipe.differs and recipe.settings["data.packing"] is True


def test_a_completion_dataset_that_axolotl_splits_into_chunks_is_a_row(here):
    study, recipe, header = _import(here, {**AXOLOTL, "datasets": [{"path": "text.jsonl", "type": "completion"}]})
    assert study["data"]["fields"] == {"text": "text"} and study["data"]["loss_on"] == "all"
    assert "chunks of sequence_len tokens" in recipe.differs["datasets.0.type"]


def test_trl_without_target_modules_adapts_pefts_default_for_the_model_type(here):
    raw = {k: v for k, v in TRL.items() if k != "lora_target_modules"}
    study, recipe, header = _import(here, raw)
    assert study["lora"]["target_modules"] == ["q_proj", "v_proj"], "peft's default for llama"
    assert "lora_target_modules" not in recipe.differs and "model type 'llama'" in header
    _, recipe, _ = _import(here, {**raw, "model_name_or_path": "phi3"})  # peft has no default for it
    assert "none for model type 'phi3'" in recipe.differs["lora_target_modules"]
    _, recipe, _ = _import(here, {**raw, "model_name_or_path": "org/not-fetched"})
    assert "not on this machine" in recipe.differs["lora_target_modules"]


def test_a_warmup_share_rounds_as_each_tool_rounds_it(here, tmp_path):
    from transformers import TrainingArguments

    expected = TrainingArguments(str(tmp_path / "out"), warmup_steps=0.1, use_cpu=True).get_warmup_steps(45)
    study, _, _ = _import(here, {**TRL, "warmup_ratio": 0.1, "max_steps": 45})
    assert study["train"]["warmup_steps"] == expected == 5, "transformers rounds 4.5 steps up"
    study, _, _ = _import(here, {**AXOLOTL, "warmup_ratio": 0.1, "max_steps": 45})
    assert study["train"]["warmup_steps"] == 4, "axolotl computes int(warmup_ratio * total)"
    # axolotl's trainer builder raises one warmup step to two: its default 3 % of 50 steps, or one given
    for raw in ({**AXOLOTL, "max_steps": 50}, {**AXOLOTL, "warmup_steps": 1}):
        study, recipe, _ = _import(here, raw)
        assert study["train"]["warmup_steps"] == 2 and any("raises to two" in note for note in recipe.notes)


@pytest.mark.parametrize("bf16", [False, None])
def test_axolotls_bfloat16_trains_in_bf16(here, bf16):
    raw = {**AXOLOTL, "bfloat16": True, **({"bf16": bf16} if bf16 is not None else {})}
    study, recipe, header = _import(here, raw)
    assert study["grid"]["precision"][0] == "bf16" and "bfloat16" in recipe.origin["grid.precision"]
    _, recipe, _ = _import(here, {**AXOLOTL, "float16": True})  # fp16 storage without mixed precision
    assert "without mixed precision" in recipe.differs["float16"]


@pytest.mark.parametrize("key", ["use_liger", "use_liger_kernel"])
def test_trls_liger_switches_are_the_chunked_loss(here, key):
    study, recipe, _ = _import(here, {**TRL, key: True})
    assert study["train"]["loss"] == "chunked" and key in recipe.origin["train.loss"]


def test_the_datasets_a_users_file_replaces_are_rows(here):
    entries = [{"path": "org/a", "type": "alpaca", "split": "train"}, {"path": "org/b", "type": "alpaca"},
               {"path": "org/c", "type": "alpaca"}]  # fmt: skip
    _, recipe, header = _import(here, {**AXOLOTL, "datasets": entries}, dataset="pairs.jsonl")
    assert {"datasets.1", "datasets.2"} <= set(recipe.differs) and "--dataset" in recipe.differs["datasets.2"]
    assert "datasets.0.split" in recipe.not_carried
    trl = {**{k: v for k, v in TRL.items() if k != "dataset_name"}, "datasets": [{"path": "org/a"}]}
    study, recipe, _ = _import(here, trl, dataset="chat.jsonl")
    assert study["data"]["path"].endswith("chat.jsonl") and "datasets.0" in recipe.differs


def test_every_key_of_a_dataset_entry_is_a_row(here):
    entry = {"path": "pairs.jsonl", "type": "alpaca", "ds_type": "json", "split": "train", "field_prompt": "p",
             "field_completion": "c", "train_on_split": "train"}  # fmt: skip
    _, recipe, header = _import(here, {**AXOLOTL, "datasets": [entry]})
    assert "datasets.0.ds_type" in recipe.origin["data.source"] and "datasets.0.split" in recipe.not_carried
    assert "preference" in recipe.not_carried["datasets.0.field_prompt"]
    assert "ignored" in recipe.not_carried["datasets.0.train_on_split"]
    _, recipe, _ = _import(here, {**AXOLOTL, "datasets": [{**entry, "split": "train[:10%]"}]})
    assert "every record" in recipe.differs["datasets.0.split"]
    hub = {**TRL, "dataset_name": "org/chats", "dataset_train_split": "train_sft", "dataset_config": "default"}
    study, recipe, header = _import(here, hub)  # `default` is the configuration tunegrid reads
    assert study["data"]["split"] == "train_sft" and 'dataset_train_split -> data.split = "train_sft"' in header
    assert "default configuration" in recipe.not_carried["dataset_config"]
    local = {**{k: v for k, v in TRL.items() if k != "dataset_name"},
             "datasets": [{"path": "json", "data_files": "chat.jsonl", "split": "train"}]}  # fmt: skip
    _, recipe, _ = _import(here, local)  # `path` names the builder that reads the file
    assert "datasets.0.path" in recipe.origin["data.source"] and "datasets.0.split" in recipe.not_carried


def test_added_tokens_differ_and_adams_defaults_do_not(here):
    raw = {**AXOLOTL, "tokens": ["<tool>"], "special_tokens": {"pad_token": "<pad>"}, "adam_beta1": 0.9,
           "adam_beta2": 0.999, "adam_epsilon": 1e-8}  # fmt: skip
    _, recipe, _ = _import(here, raw)
    assert "resizes the input embeddings" in recipe.differs["tokens"] and "special_tokens" in recipe.differs
    assert not {"adam_beta1", "adam_beta2", "adam_epsilon"} & set(recipe.differs)
    assert "torch AdamW's own value" in recipe.not_carried["adam_epsilon"]
    _, recipe, _ = _import(here, {**AXOLOTL, "adam_beta2": 0.95})
    assert "adam_beta2" in recipe.differs


def test_alpaca_instruct_without_its_system_prompt_is_laid_out_as_axolotl_does(here):
    study, _, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "pairs.jsonl",
                                                          "type": "alpaca_instruct.load_no_prompt"}]})  # fmt: skip
    from tunegrid.study.prompts import study_text

    text = study_text(study["data"], PAIR)  # axolotl's UnpromptedPrompter: the instruct turn, no system line
    assert text == "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 2\n\n### Response:\n4"
