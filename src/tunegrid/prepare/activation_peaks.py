"""What a training step keeps for backward: the saved activations of one rank's micro-batch, per device and
setting (checkpointing, activation offloading, the attention kernel). Part of the memory estimate
(memory_estimate.py), which adds the weights, adapters, optimizer state, logits and transients around it."""

from __future__ import annotations

from typing import Any

from tunegrid.cell_spec import CellSpec


def saved_activations(spec: CellSpec, config: dict[str, Any], device: str, act: int) -> tuple[float, float]:
    """(activations kept on the device at the step's peak, activations offloaded to host memory), in bytes;
    `act` is the bytes of one stored activation value."""
    axes, train = spec.axes, spec.train
    hidden = int(config["hidden_size"])
    batch, seq = axes.batch_size, train.seq_len  # the micro-batch: accumulated ones hold no activations
    tokens = batch * seq
    layers = int(config.get("num_hidden_layers", 1))
    heads = int(config.get("num_attention_heads", 1))
    experts_per_token = int(config.get("num_experts_per_tok") or 1)
    intermediate = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 4 * hidden)
    # Saved for backward per token and layer, in units of hidden and intermediate width (norms in and
    # out, q/k/v/o, gated-MLP gate/up/act/product), fitted on this project's CPU runs (benchmarks/). CUDA keeps
    # less (no oneDNN reorders; a frozen matmul keeps no input for a weight gradient): fitted on the H100 cells of
    # tests/data (the tiny models, the MoE widths, real Gemma 3 270M and SmolLM2), estimate/measured 0.99-1.04.
    per_hidden, per_intermediate = (24, 7) if device == "cpu" else (12, 4)
    # Attention: the CPU kernels keep the seq x seq probabilities (and their dropout mask); CUDA's SDPA kernels
    # (flash, memory-efficient) keep only an fp32 log-sum-exp per query (torch's meta registrations of
    # _scaled_dot_product_{flash,efficient}_attention); eager attention keeps the probabilities on any device
    kernel = axes.attention
    kernel = kernel if kernel != "sdpa" else spec.model.attn_implementation or "sdpa"  # "": transformers' default, sdpa
    probabilities = device == "cpu" or kernel == "eager"
    attention = batch * heads * seq * seq * act * 2 if probabilities else batch * heads * seq * 4
    per_layer = tokens * (per_hidden * hidden + per_intermediate * intermediate * experts_per_token) * act + attention
    if train.gradient_checkpointing:
        # Each checkpointed layer keeps its input (torch's non-reentrant checkpoint, as the cell enables it); at
        # backward one layer's activations are rebuilt. On CPU the forward's working set of a layer (the same
        # tensors, built and freed without being saved) stays in the process's heap beside the rebuilt ones:
        # measured 2-core EPYC, Llama width 1024 r 128 fp32, 2 x 256 tokens: 2 layers +226 MiB (this: 226), 4
        # layers, configs/memory-fixes-cpu.yaml, peaks 0.94 of this (1 layer's worth: 0.84). The CUDA allocator
        # reuses those blocks for the rebuilt layer.
        activations = layers * tokens * hidden * act + per_layer * (2 if device == "cpu" else 1)
    else:
        activations = layers * per_layer
    # offloaded (cell/memory/activation_offload.py): saved tensors live in host memory, the device holds one layer's;
    # on CPU the same
    kept = per_layer + tokens * hidden * act * train.gradient_checkpointing
    offloaded = max(0, activations - kept) if train.activation_offloading and device != "cpu" else 0
    activations -= offloaded
    return activations, offloaded
