"""Analytic peak-memory estimate of one cell, before it trains, from the checkpoint and the cell alone.

Reads tensor shapes from the safetensors headers (no weights loaded, no torch) and the model's config.json.
Components: runtime (what the training process holds beyond its tensors, measured by the probe on the machine
that trains: on CPU the process before a model plus a step's framework overhead, on CUDA the cuBLAS
workspaces; nothing here is fitted to one host), weights by storage (NF4 ≈ 0.5 B/param plus double-quantized
block constants; everything bitsandbytes leaves alone at its own dtype — the MoE experts!), LoRA params with
their grads and the optimizer's states, activations kept for backward, and the logits/loss buffers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tunegrid.plans import QUANT_PLANS, precision_plan, quant_plan
from tunegrid.prepare.activation_peaks import saved_activations
from tunegrid.prepare.checkpoint_headers import checkpoint_facts, numel_of, tensor_shapes  # noqa: F401 (re-exported)
from tunegrid.prepare.cpu_kernels import cpu_onednn_matmul, cpu_onednn_off
from tunegrid.prepare.load_peaks import (
    cast_load_peak,
    fused_expert_bytes,
    fused_expert_parameters,
    int8_quantize_bytes,
    largest_layer_experts,
    largest_read_at_once,
    offloaded_weight_bytes,
)
from tunegrid.vocabulary import LOSS_CHUNK_TOKENS, Quant

# How nf4-experts quantizes the expert parameters. "load": each is quantized as it is read, one expert at
# a time where the checkpoint stores experts apart, so only one full-precision tensor exists at once.
# "post_load": after transformers has loaded them at their storage dtype (the path the recorded H100
# cells ran), so the load holds the experts at full width before they shrink.
EXPERTS_QUANTIZED_AT = "load"


def nf4_bytes(numel: int) -> float:
    """An NF4 tensor of `numel` values: packed 4-bit + uint8 absmax + fp32 second level."""
    return QUANT_PLANS[Quant.NF4].quantized_bytes([numel])


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def device_constants(capabilities: dict[str, Any], precision: str, worker: str = "spawned") -> dict[str, Any]:
    """The probe's measured constants for a cell in this precision whose worker takes this path (spawned, or
    forked by the warm worker). On CPU: what a worker of that path holds at its peak beyond its tensors
    (`worker_runtime_bytes`, a micro cell run through the real worker: tunegrid.run.calibrate); a probe
    record from before it measured that gives the process before a model plus a small MLP step's framework
    overhead instead. On CUDA: the cuBLAS workspaces (0 where the probe did not measure them). And the host's
    CPU matmul dtypes that go to oneDNN (cpu_onednn_matmul: the kernels the estimate assumes, cpu_onednn_off)."""
    arithmetic = str(precision_plan(precision).arithmetic)
    paths = capabilities.get("worker_runtime_bytes") or {}
    at_work = (paths.get(worker) if isinstance(paths.get(worker), dict) else {}).get(arithmetic)
    onednn = {"cpu_onednn_matmul": cpu_onednn_matmul(capabilities)}
    if capabilities.get("device", "cpu") == "cpu" and at_work:
        return {"runtime": int(at_work), "step_overhead": 0, "device": "cpu", **onednn}
    overhead = (capabilities.get("step_overhead_bytes") or {}).get(arithmetic) or 0
    return {
        "runtime": int(capabilities.get("runtime_baseline_bytes") or 0),
        "step_overhead": int(overhead),
        "device": capabilities.get("device", "cpu"),
        **onednn,
    }


def estimate_cell(
    spec: dict[str, Any],
    model_dir: str | Path,
    runtime: int = 0,
    device: str = "cpu",
    step_overhead: int = 0,
    cpu_onednn_matmul: dict[str, bool] | None = None,
) -> dict[str, Any]:
    config, shapes, facts = checkpoint_facts(model_dir)
    facts["cpu_onednn_matmul"] = cpu_onednn_matmul
    return estimate_from_shapes(spec, config, shapes, runtime, device, step_overhead, **facts)


# bitsandbytes' 8-bit optimizers keep fp32 states for tensors under min_8bit_size elements (its default)
MIN_8BIT_SIZE = 4096
BLOCKWISE = 256  # elements per absmax of the blockwise 8-bit states


def optimizer_state_bytes(numels: list[int], optimizer: str) -> int:
    """Bytes of the optimizer's state for trainable tensors of these sizes: AdamW's two fp32 moments, or
    bitsandbytes' two 8-bit moments plus one fp32 absmax per 256 elements for each (fp32 moments under 4096
    elements). Paging moves the 8-bit state, it does not shrink it."""
    if optimizer == "adamw":
        return sum(8 * n for n in numels)
    return sum(2 * (n + 4 * -(-n // BLOCKWISE)) if n >= MIN_8BIT_SIZE else 8 * n for n in numels)


def estimate_from_shapes(
    spec: dict[str, Any],
    config: dict[str, Any],
    shapes: dict[str, list[int]],
    runtime: int,
    device: str = "cpu",
    step_overhead: int = 0,
    experts_quantized_at: str = EXPERTS_QUANTIZED_AT,
    tokenizer_bytes: int = 0,
    largest_on_disk: tuple[int, int] = (0, 0),
    cpu_onednn_matmul: dict[str, bool] | None = None,
) -> dict[str, Any]:
    """The peak of one rank. `tokenizer_bytes`: the model's tokenizer in memory (the checkpoint's manifest
    measured it), held beside everything else from the load on. `largest_on_disk`: elements and bytes per element
    of the checkpoint's largest tensor; where its disk dtype is not the storage dtype, every tensor is taken to
    be cast as it loads (`load_peaks.cast_load_peak`). `cpu_onednn_matmul`: device_constants' (cpu_onednn_off)."""
    config = _text_config(config)
    axes, lora, train = spec["axes"], spec["lora"], spec["train"]
    # The tokenizer and a checkpoint's read and cast copies live in host memory: they are part of a CPU cell's
    # peak, never of a GPU's (measured on an H100, Gemma 3 270M from GGUF, fp16-residual: load peak 514 MiB for
    # 511 MiB of fp16 weights, where the CPU's load model gives 1.3 GiB)
    if device != "cpu":
        tokenizer_bytes, largest_on_disk = 0, (0, 0)
    row = precision_plan(axes["precision"])
    storage = row.bytes_per_value
    cast_numel = 0  # frozen matmul weights autocast casts to the compute dtype (the head: below)
    quant = quant_plan(axes["quant"])
    vocab = int(config["vocab_size"])
    hidden = int(config["hidden_size"])

    weights = 0.0
    lora_params = 0
    lora_tensors: list[int] = []
    all_linear = list(lora["target_modules"]) == ["all-linear"]  # peft resolves it: every linear but the head
    regex = re.compile(lora.get("target_regex") or "(?!)")  # peft full-matches a string against module names
    saved = list(lora.get("modules_to_save") or [])
    largest_dequant = 0
    expert_names: set[str] = set()
    quantized_names: set[str] = set()
    kept_at_storage: dict[str, int] = {}  # tensors that keep the storage dtype: bytes each holds once loaded
    experts_full = 0.0  # expert bytes at storage dtype, and as they end up after quantization
    experts_final = 0.0
    adapted_experts = 0  # elements of expert parameters with LoRA on them (target_parameters)
    offloadable: dict[str, float] = {}  # train.weight_offloading: bytes each decoder layer's weights move
    # Checkpoints keep MoE experts per expert on disk (layers.N.mlp.experts.M.*); transformers v5 fuses
    # them into 3-D parameters at load, which bitsandbytes' 4-bit load then skips. So an expert is a
    # tensor nested under two indices in a model whose config has experts, or one that is already ≥3-D.
    moe = any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    for name, shape in shapes.items():
        numel = numel_of(shape)
        # token embeddings and the LM head ([vocab, hidden], outside the indexed layers) stay unquantized
        embedding = len(shape) == 2 and shape[0] == vocab and not any(part.isdigit() for part in name.split("."))
        expert = len(shape) >= 3 or (moe and sum(part.isdigit() for part in name.split(".")) >= 2)
        if expert:
            quantized = quant.experts_quantized
            expert_names.add(name)
            experts_full += numel * storage
            experts_final += quant.quantized_bytes(shape) if quantized else numel * storage
        else:
            quantized = quant.quantizes and not embedding and len(shape) == 2 and name.endswith(".weight")
        if quantized:
            weights += quant.quantized_bytes(shape)
            quantized_names.add(name)
            largest_dequant = max(largest_dequant, numel)
            offloadable[name] = numel * quant.bytes_per_param  # the packed bytes; the statistics stay
        else:
            weights += numel * storage
            offloadable[name] = numel * storage
            kept_at_storage[name] = numel * storage
            cast_numel += numel if len(shape) == 2 and not embedding and name.endswith(".weight") else 0
        module = name.removesuffix(".weight")
        if (
            len(shape) == 2
            and not embedding
            and not expert
            and (all_linear or any(module.endswith("." + t) for t in lora["target_modules"]) or regex.fullmatch(module))
            and not (all_linear and module.endswith("lm_head"))  # peft's all-linear leaves the output head
        ):
            lora_params += lora["r"] * (shape[0] + shape[1])
            lora_tensors += [lora["r"] * shape[1], shape[0] * lora["r"]]  # lora_A, lora_B
        if any(module == m or module.endswith("." + m) for m in saved):  # trained in full: an fp32 copy + grads
            lora_params += numel
            lora_tensors.append(numel)

    targets = lora.get("target_parameters") or []
    for name, shape in fused_expert_parameters(shapes, expert_names).items():
        if any(name == t or name.endswith("." + t) for t in targets):
            # peft's ParamWrapper over a fused [experts, in, out] parameter: r x experts rows of A, columns of B
            lora_params += lora["r"] * shape[0] * (shape[1] + shape[2])
            lora_tensors += [lora["r"] * shape[0] * shape[1], lora["r"] * shape[0] * shape[2]]
            adapted_experts += numel_of(shape)
    # LoRA: fp32 params + grads, and the optimizer's state for them
    lora_bytes = lora_params * 4 * 2
    optimizer_bytes = optimizer_state_bytes(lora_tensors, axes.get("optimizer", "adamw"))

    batch, seq = axes["batch_size"], train["seq_len"]  # the micro-batch: accumulated ones hold no activations
    tokens = batch * seq
    act = storage
    activations, offloaded = saved_activations(spec, config, device, act)
    logits = tokens * vocab * 4 * 3  # fp32 logits, log-softmax and its gradient
    # train.loss chunked (cell/chunked_loss.py): one chunk's logits at a time (rebuilt in backward), beside the
    # loss tokens' rows of the final hidden states that the chunks are cut from
    chunked = train.get("loss", "full") == "chunked"
    if chunked:
        chunk = min(tokens, int(train.get("loss_chunk_tokens", LOSS_CHUNK_TOKENS)))
        logits = chunk * vocab * 4 * 3 + tokens * hidden * act
    # Weights stored wider than autocast computes (fp16-mixed): autograd keeps each matmul's cast copy, the head's
    # too, for the input's gradient until the backward (Gemma 3 270M: 268M values, 536 MB in fp16); a chunked
    # loss casts the head afresh for each chunk and keeps none of them
    if row.autocast and (compute := 2 if row.dtype in ("float16", "bfloat16") else 4) < storage:
        activations += (cast_numel + vocab * hidden * (not chunked)) * compute
        logits += vocab * hidden * compute * chunked
    # bitsandbytes dequantizes a 4-bit Linear's weight for each matmul and keeps none of it: its MatMul4Bit
    # saves the packed weight and dequantizes it again for the input's gradient, on CPU (0.50: gemm_4bit's default
    # kernel, a dequantized copy then a matmul) as on CUDA. One weight's copy lives at a time (measured, Gemma 3 270M
    # nf4 fp32 on the 2-core EPYC: the step peaks 1,984 MiB, where every layer's copies kept would add 383 MiB).
    # The experts' forward builds a full-width weight where they are NF4 (dequantized) or carry LoRA (base +
    # delta): the grouped matmul keeps it for the input's gradient, so without checkpointing every MoE layer's
    # copy lives until backward; with it, one layer's at a time (rebuilt in backward).
    checkpointed = bool(train["gradient_checkpointing"])
    materialized_experts = quant.experts_quantized or adapted_experts > 0
    kept_experts = 0
    if materialized_experts and not checkpointed:
        kept_experts = sum(numel_of(shapes[name]) for name in expert_names) * act
    # int8-experts dequantize a layer's experts to fp32 once per forward (its cache), beside the casts kept above
    width = quant.experts_dequantized_bytes or 0
    experts_fp32 = largest_layer_experts(shapes, expert_names) * width if width != act else 0
    experts_numel = largest_layer_experts(shapes, expert_names) if materialized_experts and checkpointed else 0
    if device == "cpu":  # beside the logits (a CPU step holds both at its peak)
        dequant = (largest_dequant + experts_numel) * act + experts_fp32
    else:
        dequant = max(largest_dequant * act, experts_numel * act, experts_fp32)
    # Loading. Experts quantized after the load exist at full width until then.
    streamed = quant.experts_quantized and not quant.experts_after_load and experts_quantized_at == "load"
    at_load = weights + (0 if streamed else experts_full - experts_final)
    if streamed:
        # the checkpoint is read into private memory (no mapped pages) and every tensor to quantize is
        # quantized as it arrives, an expert at a time where the experts are stored apart
        experts = int(
            config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 1
        )
        load = runtime + at_load + largest_read_at_once(shapes, expert_names, quantized_names, experts) * storage
        load += tokenizer_bytes
    else:
        # the checkpoint is read tensor by tensor into private memory (pread, no mapped pages), quantized
        # as it arrives where bitsandbytes replaces the layer; fusing per-expert tensors into a 3-D
        # parameter holds the parts and the whole at once
        weights_at_load = at_load + fused_expert_bytes(shapes, expert_names, storage)
        if quant.experts_after_load:  # int8-experts: all at full width, the largest being quantized
            fused = max(map(numel_of, fused_expert_parameters(shapes, expert_names).values()), default=0)
            weights_at_load = max(weights_at_load, at_load + int8_quantize_bytes(fused, device))
        numel, on_disk = largest_on_disk
        if on_disk and on_disk != storage:
            weights_at_load = max(weights_at_load, cast_load_peak(kept_at_storage, on_disk, storage, quant.quantizes))
        load = runtime + tokenizer_bytes + weights_at_load
    transient = logits + dequant if device == "cpu" else max(logits, dequant)
    # weight offloading (cell/weight_offload.py): the load put every weight on the device; from the first step each
    # decoder layer's live in host memory and come to a GPU one layer at a time. On CPU nothing moves.
    on = train.get("weight_offloading") and device != "cpu"
    weights_offloaded = offloaded_weight_bytes(offloadable) if on else 0
    weights = int(weights) - weights_offloaded
    held = (runtime, step_overhead, tokenizer_bytes, weights, lora_bytes, optimizer_bytes, activations, kept_experts)
    train_peak = sum(held) + transient
    total = max(load, train_peak)
    # What this model leaves out, said where it applies rather than fitted (the cases that grew step by step, CPU
    # bf16 with routed experts and CPU fp16 with them where oneDNN runs fp16, train without oneDNN: cpu_onednn_off)
    not_modelled = None
    if row.fp32_islands and device != "cpu":
        # which modules become islands is measured when the cell starts (train.fp32_islands: auto); an island's
        # weights grow to fp32 and its activations are fp32 (H100, Gemma 3 270M, 8 of 18 layers: +146 MiB, 0.86 of
        # the peak without them). On a CPU the checkpoint's cast load is the peak and covers them.
        not_modelled = "fp32 islands: their fp32 weights and activations (chosen when the cell starts)"
    if lora.get("loftq_bits"):  # peft's, after the load, one weight at a time: transient, not measured here
        loftq = "LoftQ's initialization (an adapted weight's fp32 copies, its round trip and SVD, in turn)"
        not_modelled = f"{not_modelled}; {loftq}" if not_modelled else loftq
    return {
        "not_modelled": not_modelled,
        "cpu_onednn_off": cpu_onednn_off(spec, config, device, cpu_onednn_matmul),
        "estimate_bytes": int(total),
        "stage": "load" if load > train_peak else "step",
        "load_bytes": int(load),
        "step_bytes": int(train_peak),
        "components": {
            "runtime": int(runtime + step_overhead),
            "tokenizer": int(tokenizer_bytes),
            "weights": int(weights),
            "lora_params_grads": int(lora_bytes),
            "optimizer_state": int(optimizer_bytes),
            "activations": int(activations),
            "activations_offloaded_to_host": int(offloaded),
            "weights_offloaded_to_host": int(weights_offloaded),
            "experts_kept_for_backward": int(kept_experts),
            "logits": int(logits),
            "dequant_buffer": int(dequant),
        },
    }
