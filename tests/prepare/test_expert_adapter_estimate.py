"""The memory estimate counts the adapters the loader attaches on every expert layout a checkpoint comes in:
per-expert tensors (Qwen3-MoE's experts.M.gate_proj), Mixtral's block_sparse_moe.experts.M.w1/w2/w3, and
tensors fused on disk (GPT-OSS's transposed [experts, in, out], with biases beside them; OLMoE's per-expert
ones fused at load). Per family, the estimate's adapter bytes (fp32 params and grads) and AdamW state equal
what the loaded, adapted model holds."""

from __future__ import annotations

import copy

import pytest
from conftest import OLMOE, QWEN_MOE, SESSION_MODELS, one_cell, ready_trainer

from tunegrid.cell_spec import CellSpec
from tunegrid.prepare.memory_estimate import estimate_cell

SMALL = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "seed": 0}
FAMILIES = {
    "qwen3moe-tiny": QWEN_MOE,  # per-expert gate_proj/up_proj/down_proj on disk, fused at load
    "olmoe-tiny": OLMOE,
    "mixtral-tiny": {  # per-expert w1/w2/w3 under block_sparse_moe on disk
        "source": "synthetic",
        "architecture": "mixtral",
        "seed": 0,
        "config": {
            **{k: v for k, v in SMALL.items() if k != "seed"},
            "intermediate_size": 96,
            "num_key_value_heads": 1,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "initializer_range": 0.02,
        },
    },
    "gpt-oss-tiny": {  # fused and transposed on disk ([experts, in, out]), with per-expert biases
        "source": "synthetic",
        "architecture": "gpt_oss",
        "seed": 0,
        "config": {
            **{k: v for k, v in SMALL.items() if k != "seed"},
            "intermediate_size": 96,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["full_attention", "full_attention"],
            "initializer_range": 0.02,
        },
    },
}
LORA = {
    "r": 4,
    "alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory, dataset_path, checkpoints):
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts

    texts = list(corpus_texts(read_dataset(dataset_path)))
    root = tmp_path_factory.mktemp("families")
    built = {name: checkpoints[name] for name in FAMILIES if name in checkpoints}  # the session's: same spec, same data
    assert all(FAMILIES[name] is SESSION_MODELS[name] for name in built)
    for name, model in FAMILIES.items():
        if name not in built:
            produce_checkpoint(copy.deepcopy(model), texts, root / name)
            built[name] = root / name
    return built


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_estimate_counts_the_expert_adapters_the_loader_attaches(
    family, family_checkpoints, dataset_path, tmp_path
):
    spec = one_cell(model=family, models={family: FAMILIES[family]}, lora=LORA)
    trainer = ready_trainer(spec, family_checkpoints, dataset_path, tmp_path)
    expert_adapters = [p for n, p in trainer.trainable_named if ".experts." in n]
    assert expert_adapters, "the loader attached adapters to the experts"
    measured = sum(p.numel() * p.element_size() for _, p in trainer.trainable_named)
    estimate = estimate_cell(CellSpec.from_json(spec), family_checkpoints[family]).components
    assert estimate.lora_params_grads == 2 * measured  # params and their grads, fp32
    assert estimate.optimizer_state == 2 * measured  # AdamW's two fp32 moments per adapter element
