"""The shapes of a checkpoint's MoE experts as transformers builds them (fused 3-D parameters, the largest layer's),
and what loading a checkpoint holds at once, beside the weights it has loaded so far: the parts and the whole of a
fused expert tensor, the largest full-precision tensor a quantizing load reads, and a checkpoint cast to another
dtype as it loads; and what weight offloading moves to host memory once the model is loaded. Read by the memory
estimate (prepare.memory_estimate).

Light module: no torch (names and shapes from the safetensors headers).
"""

from __future__ import annotations

import re
from collections.abc import Set

from tunegrid.prepare.checkpoint_headers import numel_of

LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.\d+\.")  # a decoder layer's tensors (model.layers.N.…)


def expert_group(name: str, shape: list[int]) -> str:
    """The module holding an expert tensor: the fused parameter's parent, or for per-expert checkpoint
    tensors (layers.N.mlp.experts.M.proj.weight) the experts module above the expert index."""
    parts = name.split(".")
    if len(shape) >= 3:
        return ".".join(parts[:-1])
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: digits[-1]])


# Mixtral's checkpoints (and its kin's: MiniMax, PhiMoE) keep each expert as w1 (gate), w3 (up) and w2 (down)
# under `block_sparse_moe`; transformers' weight conversion loads them as mlp.experts.gate_up_proj and
# mlp.experts.down_proj, the names `lora.target_parameters` is written in
MIXTRAL_MOE = "block_sparse_moe"
MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def fused_expert_parameters(shapes: dict[str, list[int]], expert_names: Set[str]) -> dict[str, list[int]]:
    """The 3-D expert parameters transformers builds at load, by name (what `lora.target_parameters` names):
    a fused checkpoint tensor as it is (GPT-OSS's [experts, in, out], transposed, beside its 2-D biases, which
    get no adapter), or one layer's per-expert tensors of one shape stacked, projections that share the shape
    concatenated (gate_proj + up_proj -> gate_up_proj [experts, 2 x out, in]; Mixtral's w1 + w3 the same)."""
    fused: dict[str, list[int]] = {}
    groups: dict[tuple[str, tuple[int, ...]], dict[str, int]] = {}
    for name in expert_names:
        shape = shapes[name]
        if len(shape) >= 3:
            fused[name.removesuffix(".weight")] = shape
            continue
        parts = name.split(".")
        index = max(i for i, part in enumerate(parts) if part.isdigit())
        group, stem = ".".join(parts[:index]), parts[index + 1]
        if f".{MIXTRAL_MOE}." in f".{group}.":  # Mixtral's checkpoint names, as transformers loads them
            group = group.replace(MIXTRAL_MOE, "mlp")
            stem = MIXTRAL_EXPERTS.get(stem, stem)
        stems = groups.setdefault((group, tuple(shape)), {})
        stems[stem] = stems.get(stem, 0) + 1
    for (group, shape), stems in groups.items():
        experts = max(stems.values())
        joined = "_".join(sorted(stem.removesuffix("_proj") for stem in stems)) + "_proj"
        fused[f"{group}.{joined}"] = [experts, len(stems) * shape[0], *shape[1:]]
    return fused


def largest_layer_numel(shapes: dict[str, list[int]], names: Set[str]) -> int:
    """Elements of `names` in the layer (the name up to its first index) that holds the most of them."""
    layers: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
        layers[".".join(parts[: index + 1])] = layers.get(".".join(parts[: index + 1]), 0) + numel_of(shapes[name])
    return max(layers.values(), default=0)


def largest_layer_experts(shapes: dict[str, list[int]], expert_names: Set[str]) -> int:
    """Elements of the largest experts module: what dequantizing one MoE layer's experts materializes."""
    layers: dict[str, int] = {}
    for name in expert_names:
        group = expert_group(name, shapes[name])
        layers[group] = layers.get(group, 0) + numel_of(shapes[name])
    return max(layers.values(), default=0)


def fused_expert_bytes(shapes: dict[str, list[int]], expert_names: Set[str], storage: int) -> int:
    """The largest fused expert tensor transformers builds while loading: per-expert checkpoint tensors
    of one layer that share a shape are concatenated into one 3-D parameter (gate and up together)."""
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    for name in expert_names:
        shape = shapes[name]
        key = (name if len(shape) >= 3 else expert_group(name, shape), tuple(shape))
        groups[key] = groups.get(key, 0) + numel_of(shape) * storage
    return max(groups.values(), default=0)


def largest_read_at_once(
    shapes: dict[str, list[int]], expert_names: Set[str], quantized: Set[str], experts: int
) -> int:
    """Elements of the largest full-precision tensor a load that quantizes as it reads holds at once: a
    tensor that gets quantized, where a fused expert tensor assembled from per-expert checkpoint tensors
    counts one expert's share (it is fused and quantized expert by expert)."""
    largest = max((numel_of(shapes[name]) for name in quantized - expert_names), default=0)
    fused: dict[tuple[str, tuple[int, ...]], int] = {}
    for name in expert_names & quantized:
        shape = shapes[name]
        if len(shape) >= 3:
            largest = max(largest, numel_of(shape))
        else:
            key = (expert_group(name, shape), tuple(shape))
            fused[key] = fused.get(key, 0) + numel_of(shape)
    return max([largest] + [total // max(experts, 1) for total in fused.values()])


def load_order_key(name: str) -> tuple[tuple[int, int | str, int], ...]:
    """The order transformers v5 loads a state dict in: names split at dots, indices numerically (its
    dot_natural_key), so `lm_head` comes before `model.embed_tokens`, which comes before `model.layers.0`."""
    parts: list[tuple[int, int | str, int]] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part), 0))
        else:
            text = part.rstrip("0123456789")
            parts.append((1, text, int(part[len(text) :]) if part != text else -1))
    return tuple(parts)


def cast_load_peak(kept_at_storage: dict[str, int], on_disk: int, storage: int) -> int:
    """The weights' peak while a checkpoint stored in another dtype loads on a CPU: each tensor is read whole at
    its disk dtype and cast (the cast becomes its parameter), one at a time in the loading thread
    (tunegrid.runtime.memory.read_checkpoint_in_order), while the parameters loaded before it are held and those
    after it are not allocated yet (the model is built empty). Gemma 3 270M nf4, fp32 into bf16, on the 2-core
    EPYC: 948 MiB above runtime and tokenizer as the embedding (167.8M values, loaded first) arrives, this 960."""
    peak = loaded = 0
    for name in sorted(kept_at_storage, key=load_order_key):
        at_storage = kept_at_storage[name]
        peak = max(peak, loaded + at_storage // storage * on_disk + at_storage)
        loaded += at_storage
    return max(peak, loaded)


def offloaded_weight_bytes(weight_bytes: dict[str, float]) -> int:
    """What weight offloading keeps in host memory during a step: every decoder layer's weights (`weight_bytes` by
    checkpoint name; the outermost layers.N / h.N / blocks.N is the layer) but the largest layer's, which is the
    most the device holds at once. Tensors outside the layers (embeddings, head, final norm) stay on the device."""
    layers: dict[str, float] = {}
    for name, size in weight_bytes.items():
        found = LAYER.search(name)
        if found:
            layers[name[: found.end()]] = layers.get(name[: found.end()], 0.0) + size
    return int(sum(layers.values()) - max(layers.values(), default=0.0))


def int8_quantize_bytes(largest_expert_numel: int, device: str) -> int:
    """What quantizing the largest fused expert tensor row-wise to int8 holds beside the loaded weights
    (int8-experts, cell/experts/int8.py): its fp16 copy and the int8 result; on CPU bitsandbytes' op also builds
    the scaled product and its rounding in fp32 (2 + 4 + 4 bytes per value at once; its CUDA kernel, 2 + 1)."""
    return largest_expert_numel * (10 if device == "cpu" else 3)
