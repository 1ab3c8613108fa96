"""MoE QLoRA: the audit finds the fused experts a 4-bit load leaves in full precision, and nf4-experts fixes it."""

from __future__ import annotations

import pytest
from conftest import one_cell, run_in_process

from tunegrid.runtime.files import read_json

ATTENTION_ONLY = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _cell(checkpoints, dataset_path, tmp_path, *, model, quant, precision="fp32", lora=None):
    spec = one_cell(model=model, precision=precision, quant=quant, lora=lora or ATTENTION_ONLY)
    run_dir = tmp_path / spec["cell_id"]
    return run_in_process(spec, checkpoints, dataset_path, run_dir), read_json(run_dir / "audit.json")


@pytest.mark.parametrize("model", ["qwen3moe-tiny", "olmoe-tiny"])
def test_plain_4bit_leaves_experts_in_full_precision_and_nf4_experts_fixes_it(
    checkpoints, dataset_path, tmp_path, model
):
    plain, plain_audit = _cell(checkpoints, dataset_path, tmp_path, model=model, quant="nf4")
    fixed, fixed_audit = _cell(checkpoints, dataset_path, tmp_path, model=model, quant="nf4-experts")
    assert plain["outcome"] == "ok" and fixed["outcome"] == "ok", (plain["reason"], fixed["reason"])

    loaded = plain_audit["after_load"]
    flagged = loaded["flagged"]
    assert flagged and all(len(f["shape"]) == 3 and f["role"] == "experts" and f["dtype"] == "float32" for f in flagged)
    assert {f["name"].rsplit(".", 1)[1] for f in flagged} == {"gate_up_proj", "down_proj"}
    assert loaded["flagged_share"] > 0.3  # the experts are most of what stayed unquantized
    assert loaded["by_role"]["experts"] == loaded["flagged_bytes"]

    after = fixed_audit["after_adapters"]
    assert after["flagged"] == []
    experts = [p for p in after["params"] if p["role"] == "experts" and len(p["shape"]) == 3]
    assert experts and all(p["quantized"] and p["dtype"] == "nf4" for p in experts)
    shrink = loaded["by_role"]["experts"] / after["by_role"]["experts"]
    assert 5.5 < shrink < 8.0  # fp32 -> NF4 with double-quantized block constants: about 7x
    assert after["total_bytes"] < plain_audit["after_adapters"]["total_bytes"]
    change = fixed_audit["expert_quantization"]
    assert change["order"] == "at_load" and len(change["changed"]) == 4 and change["changed_after_load"] == []


def test_dense_model_has_no_flagged_expert_tensors(checkpoints, dataset_path, tmp_path):
    facts, audit = _cell(checkpoints, dataset_path, tmp_path, model="gemma3-hot", quant="nf4")
    assert audit["after_load"]["flagged"] == []
    assert "experts" not in audit["after_load"]["by_role"]
    assert audit["after_load"]["quantized_bytes"] > 0


def test_lora_request_that_matches_nothing_is_reported(checkpoints, dataset_path, tmp_path):
    lora = {"target_modules": ["q_proj", "fc1"]}  # OLMoE has no fc1
    facts, audit = _cell(checkpoints, dataset_path, tmp_path, model="olmoe-tiny", quant="nf4", lora=lora)
    assert facts["outcome"] == "ok"
    assert audit["lora"]["unmatched"] == ["fc1"]
    assert audit["lora"]["target_modules"]["q_proj"] == 2
    assert facts["quant_audit"]["lora"]["unmatched"] == ["fc1"]


def test_expert_params_with_lora_are_nf4_and_the_audit_says_what_trains(checkpoints, dataset_path, tmp_path):
    one = {"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.down_proj"]}
    facts, audit = _cell(checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", quant="nf4-experts", lora=one)
    assert facts["outcome"] == "ok", facts["reason"]
    change = audit["expert_quantization"]
    assert len(change["changed"]) == 4 and change["changed_after_load"] == [] and change["kept_for_lora"] == []
    assert audit["after_adapters"]["flagged"] == []
    lora = audit["lora"]
    assert lora["target_parameters"]["mlp.experts.down_proj"] == 2
    experts = lora["trains"]["mlp.experts.down_proj"]
    assert experts["role"] == "experts" and experts["base"] == {"nf4": 2} and experts["base_4bit"]
    attention = lora["trains"]["q_proj"]
    assert attention["role"] == "attention" and attention["base"] == {"nf4": 2} and attention["base_4bit"]
    # r=8 (the schema's default): down_proj [E=4, hidden 64, moe 32] -> A (32, 8E), B (8E, 64) per layer;
    # q_proj 64 -> 64 (2 heads x 32) -> A (64, 8), B (8, 64) per layer
    assert experts["trainable_params"] == 2 * (32 * 32 + 32 * 64)
    assert attention["trainable_params"] == 2 * (64 * 8 + 8 * 64)
    assert lora["trainable_params_by_role"] == {
        "experts": experts["trainable_params"],
        "attention": attention["trainable_params"],
        "other": 0,
    }
    assert facts["params"]["trainable"] == experts["trainable_params"] + attention["trainable_params"]
    assert facts["quant_audit"]["lora"]["trains"] == lora["trains"]


def test_peft_converting_mlp_names_into_expert_adapters_is_reported(checkpoints, dataset_path, tmp_path):
    mlp_names = {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]}
    facts, audit = _cell(checkpoints, dataset_path, tmp_path, model="qwen3moe-tiny", quant="nf4", lora=mlp_names)
    assert facts["outcome"] == "ok"
    assert set(audit["lora"]["implicit_parameter_adapters"]) == {"gate_up_proj", "down_proj"}


def test_prepare_kbit_training_growth_is_detected(checkpoints, dataset_path, tmp_path):
    facts, audit = _cell(
        checkpoints,
        dataset_path,
        tmp_path,
        model="qwen3moe-tiny",
        quant="nf4",
        precision="bf16",
        lora={"prepare_kbit_training": True},
    )
    growth = audit["prepare_kbit_training"]
    assert growth["grew_bytes"] > 0
    assert growth["by_dtype_change"]["float32"] > 0 and growth["by_dtype_change"]["bfloat16"] < 0


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_audit_roles_name_the_router_not_the_shared_expert_gate(model_type):
    """Qwen2-MoE's block holds two gates: `gate` routes tokens to experts, `shared_expert_gate` scales the
    shared expert. Only the first is the router."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunegrid.cell.load.quant_audit import audit_model

    config = AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    roles = {p["name"]: p["role"] for p in audit_model(model, quantization_requested=False)["params"]}
    assert roles["model.layers.0.mlp.gate.weight"] == "router"
    assert [n for n, r in roles.items() if r == "router"] == ["model.layers.0.mlp.gate.weight"]
    if model_type == "qwen2_moe":
        assert roles["model.layers.0.mlp.shared_expert_gate.weight"] == "other"
        assert roles["model.layers.0.mlp.shared_expert.gate_proj.weight"] == "other"
