"""Recipes as they are shared: keys of any release of the tool, the dataset types in common use with the text
the tool builds (expected strings from axolotl's prompters and docs), missing local files named, what does not
change the failure set aside, and every difference a row of the header (recipes.fidelity)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunegrid.recipes.core import RecipeError
from tunegrid.recipes.fidelity import check_fidelity
from tunegrid.recipes.importer import import_recipe
from tunegrid.recipes.releases import axolotl_releases, misspelt, tool_keys
from tunegrid.study.config import resolve_study
from tunegrid.study.prompts import alpaca, custom, oasst, tool_text

AXOLOTL = {"base_model": "org/some-model", "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "sequence_len": 256,
           "micro_batch_size": 2, "learning_rate": 2e-4, "max_steps": 20, "lora_target_modules": ["q_proj"],
           "datasets": [{"path": "pairs.jsonl", "type": "alpaca"}]}  # fmt: skip
PAIR = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
SQL = {"question": "How many heads?", "context": "CREATE TABLE head (age INTEGER)", "answer": "SELECT COUNT(*)"}


@pytest.fixture
def here(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "pairs.jsonl").write_text(json.dumps(PAIR) + "\n")
    (tmp_path / "sql.jsonl").write_text(json.dumps(SQL) + "\n")
    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    chats = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(chats) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _import(here: Path, raw: dict, name: str = "r.yaml"):
    (here / name).write_text(yaml.safe_dump(raw))
    study, recipe, header = import_recipe({"recipe": name, "failure": "all"})
    return resolve_study(study), recipe, "\n".join(header)


def test_keys_of_other_axolotl_releases_are_known_and_hints_never_change_meaning():
    for key in ("base_model_config", "is_llama_derived_model", "is_mistral_derived_model", "pretraining_dataset",
                "optim_args"):  # fmt: skip
        assert axolotl_releases(key), key
    assert misspelt("lerning_rate", tool_keys("axolotl")) == "learning_rate"
    assert misspelt("use_lora", tool_keys("trl")) is None  # use_rslora is another scaling, not its spelling
    assert "max_seq_length" in tool_keys("trl") and "evaluation_strategy" in tool_keys("transformers")


def test_an_old_axolotl_recipe_imports_with_its_releases_keys_as_rows(here):
    raw = {**AXOLOTL, "base_model_config": "org/some-model", "is_llama_derived_model": True,
           "resume_from_checkpoint": True, "pad_to_sequence_len": True, "bf16": "auto", "fp16": True}  # fmt: skip
    study, recipe, header = _import(here, raw)
    assert "base_model_config" in recipe.not_carried and "is_llama_derived_model" in recipe.not_carried
    assert "resume_from_checkpoint" in recipe.not_carried and "pad_to_sequence_len" in header
    assert study["grid"]["precision"][0] == "fp16", "bf16: auto beside fp16: axolotl turns bf16 off"
    assert check_fidelity(recipe, study) == []


# axolotl's AlpacaPrompter (src/axolotl/prompters.py) and the docs' dataset formats page
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd the numbers."
                "\n\n### Input:\n2 and 2\n\n### Response:\n")  # fmt: skip
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\nAdd the numbers.\n\n### Response:\n")  # fmt: skip


def test_the_tools_text_per_dataset_type():
    assert alpaca().build(PAIR) == (ALPACA_INPUT, "4")
    assert alpaca().build({**PAIR, "input": ""}) == (ALPACA_NO_INPUT, "4")
    assert (
        alpaca("chatml")
        .build({**PAIR, "input": ""})[0]
        .endswith("<|im_start|>user\nAdd the numbers.<|im_end|>\n<|im_start|>assistant\n")
    )
    assert oasst().build({"INSTRUCTION": "Hi", "RESPONSE": "Hello"})[1] == "Hello"
    # the custom type (docs/dataset-formats/inst_tune: format / no_input_format / system_prompt)
    mapping = {"field_instruction": "question", "field_input": "context", "field_output": "answer",
               "system_prompt": "You write SQL.", "format": "[INST] {instruction}\n{input} [/INST]"}  # fmt: skip
    assert custom(mapping).build(SQL) == (
        "You write SQL.[INST] How many heads?\nCREATE TABLE head (age INTEGER) [/INST]",
        "SELECT COUNT(*)",
    )
    assert tool_text("completion", {"text": "raw"}) == ("", "raw")
    assert tool_text("chat_template", {"messages": []}) is None


def test_a_custom_type_trains_on_the_recipes_own_prompt(here):
    mapping = {"field_instruction": "question", "field_input": "context", "field_output": "answer",
               "format": "{instruction}\n{input}\n"}  # fmt: skip
    raw = {**AXOLOTL, "datasets": [{"path": "sql.jsonl", "type": mapping}]}
    study, recipe, header = _import(here, raw)
    assert study["data"]["layout"] == mapping and "datasets.0.type" not in recipe.differs
    # the one row run differently is the padding (no sample_packing: axolotl pads each batch to its longest)
    assert set(recipe.differs) == {"pad_to_sequence_len"} and check_fidelity(recipe, study) == []
    study["data"]["layout"] = {**mapping, "format": "{instruction} {input}"}  # a study that lays it out otherwise
    assert any("first record" in p for p in check_fidelity(recipe, study)), "a difference without a row is named"


@pytest.mark.parametrize("kind", ["alpaca", "alpaca:chatml", "alpaca:chat", "alpaca_chat"])
def test_an_alpaca_recipe_has_no_text_row_and_the_same_text(here, kind):
    study, recipe, header = _import(here, {**AXOLOTL, "datasets": [{"path": "pairs.jsonl", "type": kind}]})
    assert study["data"]["layout"] == kind and study["data"]["loss_on"] == "response"
    assert "datasets.0.type" not in recipe.differs and check_fidelity(recipe, study) == []


def test_sharegpt_oasst_and_text_types_are_read(here):
    study, recipe, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "sharegpt.jsonl", "type": "sharegpt:chat"}]})
    assert study["data"]["fields"] == {"messages": "conversations", "role": "from", "content": "value"}
    study, _, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "org/oasst", "type": "oasst"}]})
    assert study["data"]["layout"] == "oasst"
    study, _, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "org/text", "type": "text"}]})
    assert study["data"]["fields"] == {"text": "text"} and study["data"]["loss_on"] == "all"
    study, _, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "org/qa", "type": "context_qa.load_v2"}]})
    assert study["data"]["layout"] == "context_qa.load_v2"
    study, recipe, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "org/io", "type": "input_output"}]})
    assert study["data"]["layout"] == "input_output" and "BOS" in recipe.differs["datasets.0.type"]


def test_a_json_array_dataset_imports(here):
    (here / "pairs.json").write_text(json.dumps([PAIR, PAIR], indent=2))
    study, recipe, _ = _import(here, {**AXOLOTL, "datasets": [{"path": "pairs.json", "type": "alpaca"}]})
    assert study["data"]["source"] == "jsonl" and study["data"]["path"].endswith("pairs.json")
    assert check_fidelity(recipe, study) == []


def test_trl_text_records_and_prompt_completion_train_on_the_tools_text(here):
    (here / "text.jsonl").write_text(json.dumps({"content": "Once upon a time."}) + "\n")
    (here / "pc.jsonl").write_text(json.dumps({"prompt": "The sky is", "completion": " blue."}) + "\n")
    trl = {"model_name_or_path": "org/some-model", "use_peft": True, "lora_r": 8, "max_length": 256}
    study, recipe, _ = _import(here, {**trl, "dataset_name": "text.jsonl", "dataset_text_field": "content"})
    assert study["data"]["fields"] == {"text": "content"} and study["data"]["loss_on"] == "all"
    assert check_fidelity(recipe, study) == []
    study, recipe, _ = _import(here, {**trl, "dataset_name": "pc.jsonl"})
    assert study["data"]["layout"] == "prompt_completion" and check_fidelity(recipe, study) == []
    study, _, _ = _import(here, {**trl, "dataset_name": "org/stories", "dataset_text_field": "text"})
    assert study["data"]["fields"] == {"text": "text"} and study["data"]["loss_on"] == "all"


@pytest.mark.parametrize(
    ("raw", "key", "path", "flag"),
    [({**AXOLOTL, "datasets": [{"path": "../data/testdata.jsonl", "type": "completion"}]}, "datasets.0.path",
      "../data/testdata.jsonl", "--dataset"),
     ({**AXOLOTL, "datasets": [{"path": "data/train.jsonl", "type": "alpaca"}]}, "datasets.0.path",
      "data/train.jsonl", "--dataset"),
     ({**AXOLOTL, "base_model": "./curr-model"}, "base_model", "./curr-model", "--model")],
)  # fmt: skip
def test_a_missing_local_file_is_named_with_its_key_path_and_flag(here, raw, key, path, flag):
    with pytest.raises(RecipeError) as caught:
        _import(here, raw)
    text = str(caught.value)
    assert f"recipe key {key!r}" in text and repr(path) in text and flag in text and "is not there" in text
    assert "repo_id" not in text


def test_a_trl_script_config_reads_its_names_as_trl_keys(here):
    raw = {"model_name_or_path": "org/some-model", "dataset_id_or_path": "chat.jsonl", "use_lora": True,
           "lora_r": 16, "max_seq_len": 512, "per_device_train_batch_size": 2, "learning_rate": 1e-4}  # fmt: skip
    study, recipe, header = _import(here, raw)
    assert study["train"]["seq_len"] == 512 and study["data"]["path"].endswith("chat.jsonl")
    assert recipe.aliased == {"dataset_name": "dataset_id_or_path", "max_length": "max_seq_len", "use_peft": "use_lora"}
    assert "dataset_id_or_path -> dataset_name" in header and check_fidelity(recipe, study) == []


def test_another_format_is_refused_as_not_recognised(here):
    factory = {"model_name_or_path": "org/m", "stage": "sft", "finetuning_type": "lora", "lora_target": "all",
               "dataset": "alpaca_en", "template": "llama3", "cutoff_len": 1024}  # fmt: skip
    with pytest.raises(RecipeError, match="format not recognised: a LLaMA-Factory config"):
        _import(here, factory)
    with pytest.raises(RecipeError, match="format not recognised"):
        _import(here, {"model": {"name": "org/m"}, "training": {"lr": 1e-4}, "lora": {"r": 8}})


def test_a_warmup_longer_than_the_study_is_a_row(here):
    study, recipe, _ = _import(here, {**AXOLOTL, "warmup_steps": 100})
    assert study["train"]["warmup_steps"] == 20 and "warmup_steps" in recipe.differs
    assert check_fidelity(recipe, study) == []


@pytest.mark.parametrize(
    ("raw", "key"),
    [({**AXOLOTL, "datasets": [{"path": "org/corpus", "type": "pretrain"}]}, "datasets.0.type"),
     ({"output_dir": "./outputs/grpo_checkpoints", "learning_rate": 2e-5, "per_device_train_batch_size": 4,
       "remove_unused_columns": False}, "output_dir"),
     ({"model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "use_peft": True, "dataset_name": "chat.jsonl"},
      "model_name_or_path")],
)  # fmt: skip
def test_a_run_of_another_kind_is_refused_by_name(here, raw, key):
    with pytest.raises(RecipeError, match="is not LoRA/QLoRA SFT") as caught:
        _import(here, raw)
    assert f"recipe key {key!r}" in str(caught.value)


def test_the_users_dataset_keeps_the_recipes_type_and_mappings(here):
    mapping = {"field_instruction": "question", "field_input": "context", "field_output": "answer"}
    raw = {**AXOLOTL, "datasets": [{"path": "data/absent.jsonl", "type": mapping, "ds_type": "json"}]}
    (here / "r.yaml").write_text(yaml.safe_dump(raw))
    study, recipe, _ = import_recipe({"recipe": "r.yaml", "failure": "all", "dataset": "sql.jsonl"})
    assert study["data"]["layout"] == mapping and check_fidelity(recipe, resolve_study(study)) == []
