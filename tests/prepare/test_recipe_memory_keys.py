"""Recipe keys that change where a run keeps its tensors or which it trains, on recipes written from the tools'
documentation: axolotl's config reference (`activation_offloading: true | legacy | disk | hidden_states`,
`gradient_checkpointing: true | offload | offload_disk`, `unfrozen_parameters`, `lora_fan_in_fan_out`) and TRL's
SFTConfig (`activation_offloading: bool`)."""

from __future__ import annotations

import pytest
import yaml
from conftest import AXOLOTL_QLORA_RECIPE, TRL_PEFT_RECIPE

from tunegrid.recipes.core import RecipeError
from tunegrid.recipes.importer import import_recipe

AXOLOTL, TRL = AXOLOTL_QLORA_RECIPE, TRL_PEFT_RECIPE


def _import(tmp_path, raw: dict, **base):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    study, recipe, header = import_recipe({"recipe": str(path), "failure": "oom", **base})
    return study, recipe, "\n".join(header)


@pytest.mark.parametrize("value", [True, "legacy"])
def test_axolotl_activation_offloading_is_the_cells_offloading(tmp_path, value):
    study, recipe, header = _import(tmp_path, {**AXOLOTL, "activation_offloading": value})
    assert study["train"]["activation_offloading"] is True and study["train"]["gradient_checkpointing"] is True
    assert "activation_offloading -> train.activation_offloading = true" in header
    assert "activation_offloading" not in recipe.differs and "activation_offloading" not in recipe.not_carried


def test_gradient_checkpointing_offload_is_checkpointing_with_offloading(tmp_path):
    study, _, header = _import(tmp_path, {**AXOLOTL, "gradient_checkpointing": "offload"})
    assert study["train"]["gradient_checkpointing"] is True and study["train"]["activation_offloading"] is True
    assert "gradient_checkpointing -> train.activation_offloading = true" in header
    assert study["grid"].get("activation_checkpointing", [False]) == [False]  # the recipe checkpoints already


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"activation_offloading": "disk"}, "activation_offloading"),
        ({"activation_offloading": "hidden_states"}, "activation_offloading"),
        ({"gradient_checkpointing": "offload_disk"}, "gradient_checkpointing"),
    ],
)
def test_offloading_elsewhere_is_refused_naming_the_key(tmp_path, keys, named):
    with pytest.raises(RecipeError, match=f"recipe key '{named}'"):
        _import(tmp_path, {**AXOLOTL, **keys})
    _, recipe, _ = _import(tmp_path, {**AXOLOTL, **keys}, ignore=[named])
    assert named in recipe.ignored


def test_trl_activation_offloading_is_carried_and_a_transformers_file_has_no_such_key_to_carry(tmp_path):
    study, _, _ = _import(tmp_path, {**TRL, "activation_offloading": True})
    assert study["train"]["activation_offloading"] is True
    study, recipe, _ = _import(tmp_path, {**TRL, "activation_offloading": False})
    assert "activation_offloading" not in study["train"]
    raw = {"learning_rate": 1e-4, "per_device_train_batch_size": 2, "activation_offloading": True}
    with pytest.raises(RecipeError, match="recipe key 'activation_offloading': read as transformers"):
        _import(tmp_path, raw, model="org/m", dataset="org/d", seq_len=512, **{"from": "transformers"})
    study, _, _ = _import(tmp_path, {**raw, "use_peft": True}, model="org/m", dataset="org/d")  # read as TRL's
    assert study["train"]["activation_offloading"] is True


def test_fan_in_fan_out_is_accounted_as_peft_setting_it_from_the_layer():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"], fan_in_fan_out=True))
    assert model.peft_config["default"].fan_in_fan_out is False  # what the not-carried line says
    assert all(name.startswith("base_model.model.") for name, _ in model.named_parameters())  # unfrozen_parameters'


def test_fan_in_fan_out_is_not_carried_with_the_reason(tmp_path):
    _, recipe, header = _import(tmp_path, {**AXOLOTL, "lora_fan_in_fan_out": True})
    assert "lora_fan_in_fan_out" in recipe.not_carried and "peft sets fan_in_fan_out" in header


def test_unfrozen_parameters_are_refused_saying_what_axolotl_does_with_them(tmp_path):
    raw = {**AXOLOTL, "unfrozen_parameters": ["^model.language_model.*", "^lm_head.*"]}
    with pytest.raises(RecipeError, match=r"match no parameter of the adapted model.*trains nothing"):
        _import(tmp_path, raw)
    with pytest.raises(RecipeError, match=r"recipe key 'unfrozen_parameters'.*lora_modules_to_save"):
        _import(tmp_path, {**AXOLOTL, "unfrozen_parameters": ["base_model.model.lm_head.*"]})


def test_a_string_of_lora_target_modules_is_the_regex_peft_matches(tmp_path):
    regex = r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"
    raw = {k: v for k, v in AXOLOTL.items() if k != "lora_target_linear"}
    study, _, header = _import(tmp_path, {**raw, "lora_target_modules": regex})
    assert study["lora"]["target_regex"] == regex and study["lora"]["target_modules"] == []
    study, _, _ = _import(tmp_path, {**raw, "lora_target_modules": "q_proj"})  # one name: a suffix, as listed
    assert study["lora"]["target_modules"] == ["q_proj"] and "target_regex" not in study["lora"]
    study, _, _ = _import(tmp_path, {**AXOLOTL, "lora_target_modules": regex})  # with lora_target_linear
    assert study["lora"]["target_modules"] == ["all-linear"] and "target_regex" not in study["lora"]
    with pytest.raises(RecipeError, match="recipe key 'lora_target_modules'.*regular expression"):
        _import(tmp_path, {**raw, "lora_target_modules": "layers.(q|v_proj"})


def test_experts_quantized_in_8_bits_are_int8_experts_and_in_4_bits_nf4_experts(tmp_path):
    # axolotl's config reference: quantize_moe_experts quantizes MoE expert weights under load_in_4bit/load_in_8bit
    raw = {k: v for k, v in AXOLOTL.items() if k != "load_in_4bit"}
    study, recipe, header = _import(
        tmp_path, {**raw, "adapter": "lora", "load_in_8bit": True, "quantize_moe_experts": True}
    )
    assert study["grid"]["quant"][0] == "int8-experts" and "quantize_moe_experts -> grid.quant" in header
    assert "a higher load peak" in recipe.differs["quantize_moe_experts"]
    study, recipe, _ = _import(tmp_path, {**AXOLOTL, "quantize_moe_experts": True})
    assert study["grid"]["quant"][0] == "nf4-experts" and "quantize_moe_experts" not in recipe.differs
    with pytest.raises(RecipeError, match="recipe key 'quantize_moe_experts': .*loads neither"):
        _import(tmp_path, {**raw, "adapter": "lora", "quantize_moe_experts": True})


def test_fsdp_checkpointing_and_parameter_offloading_are_carried(tmp_path):
    # axolotl's FSDP2 config (docs/multi-gpu): fsdp_version 2 with an fsdp_config mapping
    raw = {**AXOLOTL, "gradient_checkpointing": False, "fsdp_version": 2,
           "fsdp_config": {"reshard_after_forward": True, "activation_checkpointing": True}}  # fmt: skip
    study, recipe, header = _import(tmp_path, raw)
    assert study["train"]["gradient_checkpointing"] is True and "fsdp_config" in recipe.differs
    assert "fsdp_config.activation_checkpointing -> train.gradient_checkpointing = true" in header
    assert "weight_offloading" not in study["train"]
    for key in ("offload_params", "fsdp_offload_params"):  # FSDP2's name, and FSDP1's as axolotl's examples write it
        config = {key: True, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
        study, recipe, header = _import(tmp_path, {**raw, "fsdp_config": config})
        assert study["train"]["weight_offloading"] is True
        assert f"fsdp_config.{key} -> train.weight_offloading = true" in header
        said = recipe.differs[f"fsdp_config.{key}"]
        assert "the adapters, their gradients and the optimizer state on the device" in said
        assert not any("cls_to_wrap" in name for name in recipe.differs), "a decoder layer is tunegrid's unit too"
    # TrainingArguments' option string (TRL's file)
    study, recipe, header = _import(tmp_path, {**TRL, "fsdp": "full_shard auto_wrap offload"})
    assert study["train"]["weight_offloading"] is True and "fsdp -> train.weight_offloading = true" in header
    with pytest.raises(RecipeError, match="recipe key 'fsdp_config.offload_params': 'yes'"):
        _import(tmp_path, {**raw, "fsdp_config": {"offload_params": "yes"}})


def test_fsdp_offloading_of_a_part_of_each_layer_says_how_the_peak_moves(tmp_path):
    # axolotl's Mixtral QLoRA FSDP example wraps the sparse MoE block, not the decoder layer
    config = {"fsdp_offload_params": True, "fsdp_transformer_layer_cls_to_wrap": "MixtralSparseMoeBlock"}
    study, recipe, _ = _import(tmp_path, {**AXOLOTL, "fsdp": ["full_shard", "auto_wrap"], "fsdp_config": config})
    assert study["train"]["weight_offloading"] is True
    said = recipe.differs["fsdp_config.fsdp_transformer_layer_cls_to_wrap"]
    assert "MixtralSparseMoeBlock" in said and "root unit" in said and "a lower peak here" in said


def test_qlora_without_double_quantization_is_said_to_run_differently(tmp_path):
    _, recipe, _ = _import(tmp_path, {**TRL, "load_in_4bit": True})  # ModelConfig's use_bnb_nested_quant: false
    assert "double-quantizes" in recipe.differs["use_bnb_nested_quant"]
    _, recipe, _ = _import(tmp_path, {**TRL, "load_in_4bit": True, "use_bnb_nested_quant": True})
    assert "use_bnb_nested_quant" not in recipe.differs


def test_a_completion_dataset_is_raw_text_trained_whole(tmp_path):
    # axolotl's dataset formats (docs/dataset-formats/pretraining): type completion, the text in `field` (text)
    raw = {**AXOLOTL, "datasets": [{"path": "org/some-text", "type": "completion"}]}
    study, _, _ = _import(tmp_path, raw)
    assert study["data"]["fields"] == {"text": "text"} and study["data"]["loss_on"] == "all"
    raw = {**AXOLOTL, "datasets": [{"path": "org/some-text", "type": "completion", "field": "content"}]}
    assert _import(tmp_path, raw)[0]["data"]["fields"] == {"text": "content"}
