"""Analytic peak-memory estimate of one cell, before it trains, from the checkpoint and the cell alone.

Reads tensor shapes from the safetensors headers (no weights loaded, no torch) and the model's
config.json. Components: runtime (a calibrated constant: what the training process holds before the
model loads, measured by the probe), weights by storage (NF4 ≈ 0.5 B/param plus double-quantized block
constants; everything bitsandbytes leaves alone at its own dtype — the MoE experts!), LoRA params with
their grads and AdamW states, activations kept for backward, and the logits/loss buffers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NF4_BLOCK = 64
DQ_BLOCK = 256  # double quantization: the block absmax values are themselves quantized in blocks of 256
# Calibrated on this project's CPU runs (2026-11, torch 2.13): what a training process holds beyond the
# probe's runtime baseline once it has trained a step (autograd engine, oneDNN scratch, tokenizer, data),
# independent of model size at these scales. Only added where the runtime is counted (CPU).
CPU_FRAMEWORK_OVERHEAD_BYTES = 32 * 2**20


def tensor_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


def nf4_bytes(numel: int) -> float:
    blocks = numel / NF4_BLOCK
    return numel / 2 + blocks + (blocks / DQ_BLOCK) * 4  # packed 4-bit + uint8 absmax + fp32 second level


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def estimate_cell(spec: dict[str, Any], model_dir: str | Path, runtime_bytes: int, device: str = "cpu") -> dict[str, Any]:
    config = _text_config(json.loads((Path(model_dir) / "config.json").read_text()))
    shapes = tensor_shapes(model_dir)
    axes, lora, train = spec["axes"], spec["lora"], spec["train"]
    storage = DTYPE_BYTES[axes["precision"]]
    vocab = int(config["vocab_size"])
    hidden = int(config["hidden_size"])

    weights = 0.0
    full_width = 0.0  # the same weights at their storage dtype, as they exist while loading
    quantized_numel = 0
    lora_params = 0
    largest_dequant = 0
    # Checkpoints keep MoE experts per expert on disk (layers.N.mlp.experts.M.*); transformers v5 fuses
    # them into 3-D parameters at load, which bitsandbytes' 4-bit load then skips. So an expert is a
    # tensor nested under two indices in a model whose config has experts, or one that is already ≥3-D.
    moe = any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    for name, shape in shapes.items():
        numel = _numel(shape)
        # token embeddings and the LM head ([vocab, hidden], outside the indexed layers) stay unquantized
        embedding = len(shape) == 2 and shape[0] == vocab and not any(part.isdigit() for part in name.split("."))
        expert = len(shape) >= 3 or (moe and sum(part.isdigit() for part in name.split(".")) >= 2)
        if expert:
            quantized = axes["quant"] == "nf4-experts"
        else:
            quantized = axes["quant"] != "none" and not embedding and len(shape) == 2 and name.endswith(".weight")
        full_width += numel * storage
        if quantized:
            weights += nf4_bytes(numel)
            quantized_numel += numel
            largest_dequant = max(largest_dequant, numel)
        else:
            weights += numel * storage
        module = name.removesuffix(".weight")
        if len(shape) == 2 and not embedding and not expert and any(module.endswith("." + t) for t in lora["target_modules"]):
            lora_params += lora["r"] * (shape[0] + shape[1])
    # LoRA: fp32 params + grads + AdamW's two moments
    lora_bytes = lora_params * 4 * 4

    batch, seq = axes["batch_size"], train["seq_len"]
    tokens = batch * seq
    act = DTYPE_BYTES[axes["precision"]]
    layers = int(config.get("num_hidden_layers", 1))
    heads = int(config.get("num_attention_heads", 1))
    experts_per_token = int(config.get("num_experts_per_tok") or 1)
    intermediate = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 4 * hidden)
    # Saved for backward per token and layer, in units of hidden and intermediate width (norms in and
    # out, q/k/v/o, gated-MLP gate/up/act/product), fitted on this project's CPU runs (benchmarks/).
    per_layer = tokens * (24 * hidden + 7 * intermediate * experts_per_token) * act + batch * heads * seq * seq * act * 2
    if train["gradient_checkpointing"]:
        activations = layers * tokens * hidden * act + per_layer  # layer inputs kept, one layer recomputed
    else:
        activations = layers * per_layer
    logits = tokens * vocab * 4 * 3  # fp32 logits, log-softmax and its gradient
    # bitsandbytes dequantizes a 4-bit weight for each matmul; its CPU path keeps those copies for backward.
    dequant = quantized_numel * act if device == "cpu" else largest_dequant * act
    if runtime_bytes:
        runtime_bytes += CPU_FRAMEWORK_OVERHEAD_BYTES
    file_bytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    # Loading: safetensors pages are mapped (counted in RSS on CPU) while the tensors are materialized at
    # their storage dtype, and a 4-bit load holds both those and the quantized result.
    load = runtime_bytes + (0.5 * file_bytes if device == "cpu" else 0) + full_width + (weights if quantized_numel else 0)
    train_peak = runtime_bytes + weights + lora_bytes + activations + logits + dequant
    total = max(load, train_peak)
    return {
        "estimate_bytes": int(total),
        "stage": "load" if load > train_peak else "step",
        "load_bytes": int(load),
        "step_bytes": int(train_peak),
        "components": {
            "runtime": int(runtime_bytes),
            "weights": int(weights),
            "lora_params_grads_optimizer": int(lora_bytes),
            "activations": int(activations),
            "logits": int(logits),
            "dequant_buffer": int(dequant),
        },
    }
