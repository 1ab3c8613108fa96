"""A checkpoint's tensors as one cell loads and adapts them, from their names and shapes: the bytes each holds once
loaded (NF4 ≈ 0.5 B/param plus double-quantized block constants; everything bitsandbytes leaves alone at its own
dtype — the MoE experts!), which ones are experts and which are quantized, and the tensors LoRA trains. Read by
the memory estimate (prepare.memory_estimate), which turns it into the cell's peak.

Light module: no torch (names and shapes from the safetensors headers).
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from tunegrid.cell_spec import LoraSpec
from tunegrid.meanings import QuantRow
from tunegrid.prepare.checkpoint_headers import numel_of
from tunegrid.prepare.cpu_kernels import routed_experts
from tunegrid.prepare.load_peaks import fused_expert_parameters


@dataclass(frozen=True, kw_only=True)
class WeightInventory:
    """What a checkpoint's tensors come to in one cell, by what the estimate reads of them."""

    weights: float  # bytes of every tensor once loaded: quantized where the quant quantizes it, else at storage dtype
    experts_full: float  # the experts' bytes at the storage dtype (as a load that quantizes after it holds them)
    experts_final: float  # the experts' bytes as they end up, quantized where the quant quantizes them
    expert_names: frozenset[str]
    quantized_names: frozenset[str]
    kept_at_storage: dict[str, int]  # each tensor that keeps the storage dtype: the bytes it holds once loaded
    offloadable: dict[str, float]  # each tensor: the bytes train.weight_offloading moves (packed, where quantized)
    cast_numel: int  # elements of frozen matmul weights at the storage dtype, which autocast casts (the head aside)
    largest_quantized: int  # elements of the largest quantized weight: its dequantized copy while it multiplies
    adapter_tensors: tuple[int, ...]  # elements of each tensor trained: LoRA's A and B, modules_to_save's copies
    adapted_experts: int  # elements of the fused expert parameters with LoRA on them (lora.target_parameters)

    @property
    def adapter_params(self) -> int:
        return sum(self.adapter_tensors)


def _tensor_kind(name: str, shape: list[int], vocab: int, moe: bool) -> tuple[bool, bool]:
    """(an embedding or the LM head, an expert). Token embeddings and the head are [vocab, hidden] outside the
    indexed layers, and stay unquantized. Checkpoints keep MoE experts per expert on disk
    (layers.N.mlp.experts.M.*); transformers v5 fuses them into 3-D parameters at load, which bitsandbytes' 4-bit
    load then skips. So an expert is a tensor nested under two indices in a model whose config has experts, or
    one that is already ≥3-D."""
    indices = sum(part.isdigit() for part in name.split("."))
    embedding = len(shape) == 2 and shape[0] == vocab and indices == 0
    return embedding, len(shape) >= 3 or (moe and indices >= 2)


def _adapter_tensors(name: str, shape: list[int], lora: LoraSpec, regex: re.Pattern[str], linear: bool) -> list[int]:
    """Elements of each tensor LoRA trains for one checkpoint tensor: A and B where the adapter targets its
    module (a linear layer's 2-D weight outside the embeddings and experts), and the whole, in fp32, where
    modules_to_save trains it in full."""
    module = name.removesuffix(".weight")
    all_linear = list(lora.target_modules) == ["all-linear"]  # peft resolves it: every linear but the head
    targeted = all_linear or any(module.endswith("." + t) for t in lora.target_modules) or regex.fullmatch(module)
    found = []
    if linear and targeted and not (all_linear and module.endswith("lm_head")):  # all-linear leaves the head
        found += [lora.r * shape[1], shape[0] * lora.r]  # lora_A, lora_B
    if any(module == m or module.endswith("." + m) for m in lora.modules_to_save):
        found.append(numel_of(shape))
    return found


def _expert_adapter_tensors(
    shapes: dict[str, list[int]], expert_names: Set[str], lora: LoraSpec
) -> tuple[list[int], int]:
    """LoRA on fused expert parameters (lora.target_parameters): peft's ParamWrapper over an [experts, in, out]
    parameter, r x experts rows of A and columns of B. Returns their tensors' elements and the elements of the
    parameters they adapt."""
    targets = lora.target_parameters
    found: list[int] = []
    adapted = 0
    for name, shape in fused_expert_parameters(shapes, expert_names).items():
        if any(name == t or name.endswith("." + t) for t in targets):
            found += [lora.r * shape[0] * shape[1], lora.r * shape[0] * shape[2]]
            adapted += numel_of(shape)
    return found, adapted


def weight_inventory(
    config: dict[str, Any],
    shapes: dict[str, list[int]],
    quant: QuantRow,
    storage: int,
    lora: LoraSpec,
    fused_experts: bool = True,
) -> WeightInventory:
    """The checkpoint's tensors (`shapes`, of a model whose text config is `config`) loaded with `quant` at
    `storage` bytes a value and adapted as `lora` says. `fused_experts`: transformers builds a MoE layer's experts as
    fused 3-D parameters (5.x); else (4.x) each expert is an nn.Linear, quantized and adapted as any linear layer."""
    vocab = int(config["vocab_size"])
    moe = routed_experts(config) > 0 and fused_experts
    regex = re.compile(lora.target_regex or "(?!)")  # peft full-matches a string against module names
    weights, experts_full, experts_final = 0.0, 0.0, 0.0
    cast_numel, largest_quantized = 0, 0
    expert_names: set[str] = set()
    quantized_names: set[str] = set()
    kept_at_storage: dict[str, int] = {}
    offloadable: dict[str, float] = {}
    adapters: list[int] = []
    for name, shape in shapes.items():
        numel = numel_of(shape)
        embedding, expert = _tensor_kind(name, shape, vocab, moe)
        matmul = len(shape) == 2 and not embedding and name.endswith(".weight")
        quantized = quant.experts_quantized if expert else quant.quantizes and matmul
        if expert:
            expert_names.add(name)
            experts_full += numel * storage
            experts_final += quant.quantized_bytes(shape) if quantized else numel * storage
        if quantized:
            weights += quant.quantized_bytes(shape)
            quantized_names.add(name)
            largest_quantized = max(largest_quantized, numel)
            offloadable[name] = numel * quant.bytes_per_param  # the packed bytes; the statistics stay
        else:
            weights += numel * storage
            offloadable[name] = numel * storage
            kept_at_storage[name] = numel * storage
            cast_numel += numel if matmul else 0
        adapters += _adapter_tensors(name, shape, lora, regex, linear=len(shape) == 2 and not embedding and not expert)
    expert_adapters, adapted_experts = _expert_adapter_tensors(shapes, expert_names, lora)
    return WeightInventory(
        weights=weights,
        experts_full=experts_full,
        experts_final=experts_final,
        expert_names=frozenset(expert_names),
        quantized_names=frozenset(quantized_names),
        kept_at_storage=kept_at_storage,
        offloadable=offloadable,
        cast_numel=cast_numel,
        largest_quantized=largest_quantized,
        adapter_tensors=tuple(adapters + expert_adapters),
        adapted_experts=adapted_experts,
    )
