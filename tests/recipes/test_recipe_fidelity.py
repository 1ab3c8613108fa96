"""What a public recipe says survives the import: small recipes written from axolotl's and TRL's documentation
(their config references), one per defect found importing the public example configs as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tunegrid.meanings import PRECISION_ROWS
from tunegrid.recipes.core import RecipeError, tool_value
from tunegrid.recipes.importer import import_recipe
from tunegrid.study.config import expand_cells, resolve_study

CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
AXOLOTL = {  # axolotl's documented minimal LoRA config (docs/config-reference), on a hub model and dataset
    "base_model": "org/some-model", "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
    "lora_target_modules": ["q_proj", "v_proj"], "sequence_len": 1024, "micro_batch_size": 4,
    "gradient_accumulation_steps": 2, "num_epochs": 1, "learning_rate": 2e-4, "optimizer": "adamw_torch_fused",
    "bf16": True, "datasets": [{"path": "org/some-chats", "type": "chat_template"}],
}  # fmt: skip
TRL = {  # `trl sft --config` (TRL's sft docs): ModelConfig + ScriptArguments + SFTConfig keys, flat
    "model_name_or_path": "org/some-model", "dataset_name": "org/some-chats", "use_peft": True,
    "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 2e-4, "max_length": 1024,
    "per_device_train_batch_size": 4,
}  # fmt: skip


@pytest.fixture
def here(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(SHAREGPT) + "\n")
    neox = tmp_path / "neox"
    neox.mkdir()
    config = {"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
              "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}  # fmt: skip
    (neox / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _import(here: Path, raw: dict, name: str = "r.yaml", **base):
    (here / name).write_text(yaml.safe_dump(raw))
    study, recipe, header = import_recipe({"recipe": name, "failure": base.pop("failure", "all"), **base})
    return resolve_study(study), recipe, "\n".join(header)


def test_unpinned_hub_model_and_dataset_import_as_they_are(here):
    study, recipe, header = _import(here, AXOLOTL)
    model = study["models"]["some-model"]
    assert (model["source"], model["repo_id"], model["revision"], model["ref"]) == ("hub", "org/some-model", "", "main")
    assert (study["data"]["source"], study["data"]["revision"], study["data"]["ref"]) == ("hub", "", "main")
    assert "Not pinned" in header and "base_model: main" in header
    study, _, header = _import(here, TRL, "t.yaml")
    assert study["data"]["repo_id"] == "org/some-chats" and study["data"]["fields"] == {"messages": "messages"}


def test_alignment_handbook_dataset_mixture_imports_its_first_dataset(here):
    mixture = {"datasets": [{"id": "org/chats", "config": "default", "split": "train_sft", "columns": ["messages"]},
                            {"id": "org/chats", "split": "test_sft", "columns": ["messages"]}]}  # fmt: skip
    raw = {**{k: v for k, v in TRL.items() if k != "dataset_name"}, "dataset_mixture": mixture}
    study, recipe, header = _import(here, raw)
    assert (study["data"]["repo_id"], study["data"]["split"]) == ("org/chats", "train_sft")
    assert "dataset_mixture.datasets.1" in recipe.differs


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({**AXOLOTL, "rl": "dpo"}, "rl"),
        ({**AXOLOTL, "adapter": None}, "adapter"),
        ({**AXOLOTL, "reward_model": True}, "reward_model"),
        ({**AXOLOTL, "pretraining_dataset": [{"path": "org/text"}]}, "pretraining_dataset"),
        ({**TRL, "beta": 0.1, "max_prompt_length": 512}, "beta"),
        ({**TRL, "num_generations": 8}, "num_generations"),
        ({k: v for k, v in TRL.items() if k != "use_peft"}, "use_peft"),
    ],
)
def test_recipes_of_another_kind_are_refused_naming_what_makes_them_so(here, raw, key):
    with pytest.raises(RecipeError) as caught:
        _import(here, raw)
    assert f"recipe key {key!r}" in str(caught.value) and "LoRA/QLoRA" in str(caught.value)
    assert "--as-sft" in str(caught.value)


def test_as_sft_turns_a_dpo_recipe_into_the_sft_study_and_says_what_changed(here):
    study, recipe, header = _import(here, {**AXOLOTL, "rl": "dpo", "rl_beta": 0.1}, as_sft=True)
    assert "Changed to the SFT study" in header and "rl: a dpo run" in header and "rl_beta" in header


def test_trl_max_seq_length_is_the_sequence_length(here):
    raw = {k: v for k, v in TRL.items() if k != "max_length"}
    study, _, _ = _import(here, {**raw, "max_seq_length": 2048})
    assert study["train"]["seq_len"] == 2048


@pytest.mark.parametrize(
    "extra",
    [{"gptq": True, "gptq_groupsize": 128}, {"peft": {"loftq_config": {"loftq_bits": 4}}, "load_in_4bit": True},
     {"model_quantization_config": "Mxfp4Config"}],
)  # fmt: skip
def test_gptq_bases_and_loftq_over_a_4_bit_base_are_refused_never_dropped(here, extra):
    with pytest.raises(RecipeError) as caught:
        _import(here, {**AXOLOTL, **extra})
    named = next(iter(extra))
    assert f"recipe key '{named}" in str(caught.value)


def test_loftq_is_carried_as_peft_initializes_it_and_the_grid_keeps_the_base_unquantized(here):
    # axolotl's LoftQ example (examples/llama-2/loftq.yml, docs/config-reference): adapter lora with
    # peft.loftq_config.loftq_bits, which axolotl hands to peft's LoftQConfig with init_lora_weights: loftq
    study, recipe, header = _import(here, {**AXOLOTL, "peft": {"loftq_config": {"loftq_bits": 4}}}, failure="oom")
    assert study["lora"]["loftq_bits"] == 4 and "peft.loftq_config.loftq_bits -> lora.loftq_bits = 4" in header
    assert study["grid"]["quant"] == ["none"] and "no quantization (LoftQ" in header
    assert any("CUDA only" in note for note in recipe.notes)
    with pytest.raises(RecipeError, match="recipe key 'peft.loftq_config.loftq_bits': 3"):
        _import(here, {**AXOLOTL, "peft": {"loftq_config": {"loftq_bits": 3}}})


def test_lora_target_linear_is_resolved_against_the_checkpoints_own_modules(here):
    raw = {k: v for k, v in AXOLOTL.items() if k != "lora_target_modules"}
    study, _, _ = _import(here, {**raw, "base_model": "neox", "lora_target_linear": True})
    assert study["lora"]["target_modules"] == ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]
    study, _, header = _import(here, {**raw, "lora_target_linear": True})  # hub id, not fetched: peft resolves
    assert study["lora"]["target_modules"] == ["all-linear"]


def test_dataset_sub_keys_are_carried_or_listed(here):
    entry = {"path": "sharegpt.jsonl", "type": "chat_template", "field_messages": "conversations",
             "message_field_role": "from", "message_field_content": "value", "drop_system_message": True}  # fmt: skip
    study, recipe, header = _import(here, {**AXOLOTL, "datasets": [entry]})
    assert study["data"]["fields"] == {"messages": "conversations", "role": "from", "content": "value"}
    assert "datasets.0.drop_system_message" in recipe.not_carried
    from tunegrid.prepare.datasets_io import load_records

    assert load_records(study["data"]) == [CHAT]  # ShareGPT's human/gpt read as user/assistant


def test_every_key_is_in_one_place_and_memory_keys_are_never_waved_through(here):
    raw = {**AXOLOTL, "attn_implementation": "flash_attention_2", "wandb_project": "x", "val_set_size": 0.05,
           "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"], "liger_rms_norm": True,
           "some_future_key": 1, "tf32": True, "strict": False}  # fmt: skip
    study, recipe, header = _import(here, raw)
    assert study["models"]["some-model"]["attn_implementation"] == "flash_attention_2"
    assert "plugins: CutCrossEntropyPlugin" not in recipe.differs and "liger_rms_norm" in recipe.differs
    assert study["train"]["loss"] == "chunked"  # Cut Cross Entropy: the chunked loss (test_recipe_loss_keys.py)
    assert "logging" in recipe.not_carried["wandb_project"] and "evaluation" in recipe.not_carried["val_set_size"]
    assert "some_future_key" in recipe.unknown
    carried = {key for keys in recipe.origin.values() for key in keys if key in raw}
    places = [carried, set(recipe.not_carried), set(recipe.differs), set(recipe.unknown)]
    assert all(not (a & b) for i, a in enumerate(places) for b in places[i + 1 :]), places
    assert set(raw) <= set().union(*places) | {"plugins"}, "every key in one place"
    assert "tf32" in recipe.differs and "config" in recipe.not_carried["strict"]
    with pytest.raises(RecipeError, match="activation_offloading"):
        _import(here, {**AXOLOTL, "gradient_checkpointing": True, "activation_offloading": "disk"})


def test_a_typo_of_a_carried_key_is_refused_naming_the_key_it_resembles(here):
    raw = {k: v for k, v in AXOLOTL.items() if k != "learning_rate"}
    with pytest.raises(RecipeError, match="'lerning_rate'.*'learning_rate'"):
        _import(here, {**raw, "lerning_rate": 3e-4})


def test_warmup_and_epochs_follow_each_tools_documented_defaults(here):
    study, recipe, _ = _import(here, {**TRL, "warmup_ratio": 0.1, "max_steps": 40})
    assert study["train"]["warmup_steps"] == 4 and "warmup_ratio" in recipe.origin["train.warmup_steps"]
    study, recipe, _ = _import(here, {**AXOLOTL, "max_steps": 200})  # axolotl: 3 % of the steps, at most 100
    assert study["train"]["warmup_steps"] == 6
    study, _, _ = _import(here, {k: v for k, v in AXOLOTL.items() if k != "sequence_len"})
    assert study["train"]["seq_len"] == 512, "axolotl's documented sequence_len default"
    _, recipe, _ = _import(here, AXOLOTL)
    assert "50 steps" in recipe.not_carried["num_epochs"] and "400 sequences" in recipe.not_carried["num_epochs"]


def test_export_writes_every_key_the_fix_changes_in_the_tools_terms():
    assert tool_value("axolotl", "precision", "fp32") == {"bf16": False, "fp16": False, "bfloat16": False,
                                                          "float16": False}  # fmt: skip
    assert tool_value("trl", "quant", "nf4")["use_peft"] is True


@pytest.mark.parametrize("tool", ["axolotl", "trl"])
@pytest.mark.parametrize("precision", ["fp16-islands", "fp16-residual"])
def test_a_fix_no_tool_key_says_is_not_exported_as_the_tools_plain_fp16(tool, precision):
    # both train fp16 matmuls; written as the tool's fp16 they would be the failing setting again
    with pytest.raises(ValueError, match=f"precision {precision} .* is not a setting of a {tool} config"):
        tool_value(tool, "precision", precision)


@pytest.mark.parametrize(
    ("text", "key"),
    [("max_steps: .inf", "max_steps"), ("micro_batch_size: .inf", "micro_batch_size"),
     ("warmup_steps: 1e400", "warmup_steps"), ("max_steps: twelve", "max_steps"),
     ("sequence_len: 500000", "sequence_len")],
)  # fmt: skip
def test_hostile_numbers_are_refused_naming_the_recipes_key(here, text, key):
    base = {k: v for k, v in AXOLOTL.items() if k != key}
    (here / "h.yaml").write_text(yaml.safe_dump(base) + text + "\n")
    with pytest.raises(RecipeError) as caught:
        import_recipe({"recipe": "h.yaml", "failure": "all"})
    assert f"recipe key {key!r}" in str(caught.value)


def test_trl_max_length_beyond_what_tunegrid_runs_names_max_length(here):
    with pytest.raises(RecipeError, match="recipe key 'max_length'"):
        _import(here, {**TRL, "max_length": 65536})


def test_the_grid_keeps_the_recipes_effective_batch_and_tries_every_fp16_fix(here):
    study, _, _ = _import(here, {**AXOLOTL, "bf16": False, "fp16": True})
    cells = expand_cells(study)
    assert {c.batch_size * c.grad_accum for c in cells} == {8}
    fp16_rows = {str(r.precision) for r in PRECISION_ROWS.values() if r.arithmetic == "fp16"}
    assert fp16_rows <= {c.precision for c in cells} and len(fp16_rows) > 1


def test_peft_options_model_config_and_hub_data_files_are_carried(here):
    raw = {**AXOLOTL, "lora_modules_to_save": ["embed_tokens", "lm_head"], "peft_use_rslora": True,
           "model_config": {"output_router_logits": True}}  # fmt: skip
    raw["datasets"] = [{"path": "org/data", "type": "chat_template", "data_files": ["train/part-0.jsonl"]}]
    study, recipe, _ = _import(here, raw)
    assert study["lora"]["modules_to_save"] == ["embed_tokens", "lm_head"] and study["lora"]["use_rslora"] is True
    assert study["models"]["some-model"]["config_overrides"] == {"output_router_logits": True}
    assert study["data"]["data_files"] == ["train/part-0.jsonl"]
    with pytest.raises(RecipeError, match="recipe key 'model_config'"):
        _import(here, {**AXOLOTL, "model_config": {"rope_scaling": {"type": "linear"}}})


def test_a_recipe_adapting_only_expert_parameters_gets_no_module_adapters(here):
    raw = {k: v for k, v in AXOLOTL.items() if k != "lora_target_modules"}
    study, _, _ = _import(here, {**raw, "lora_target_parameters": ["mlp.experts.gate_up_proj"]})
    assert study["lora"]["target_modules"] == [] and study["lora"]["target_parameters"] == ["mlp.experts.gate_up_proj"]
    _, recipe, _ = _import(here, raw)  # no targets at all: peft's per-architecture default; said, not silent
    assert "lora_target_modules" in recipe.differs
