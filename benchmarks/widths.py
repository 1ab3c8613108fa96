"""The model shapes the benchmarks train: real architectures' widths at fewer layers, synthetic weights."""

from __future__ import annotations

from typing import Any

GEMMA3_25M = {  # ~25M parameters: Gemma 3 text at width 512, 6 layers (CPU-sized)
    "vocab_size": 512,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "initializer_range": 0.02,
}


def gemma3_4b_width(layers: int, vocab_size: int = 262208) -> dict[str, Any]:
    """google/gemma-3-4b-it's text width (34 layers there); a small vocabulary keeps the logits out of the way."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
        "query_pre_attn_scalar": 256,
        "initializer_range": 0.02,
    }


def olmoe_width(layers: int) -> dict[str, Any]:
    """allenai/OLMoE-1B-7B-0924's width (16 layers there): 64 experts, 8 active per token."""
    return {
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "initializer_range": 0.02,
    }


def synthetic(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """A study's model entry for a synthetic checkpoint of this architecture and shape."""
    return {"source": "synthetic", "architecture": architecture, "seed": 0, "config": config}
