"""Analytic peak-memory estimate of one cell, before it trains, from the checkpoint and the cell alone.

Reads tensor shapes from the safetensors headers (no weights loaded, no torch) and the model's config.json.
Components: runtime (what the training process holds beyond its tensors, measured by the probe on the machine
that trains: on CPU the process before a model plus a step's framework overhead, on CUDA the cuBLAS
workspaces; nothing here is fitted to one host), weights by storage (NF4 ≈ 0.5 B/param plus double-quantized
block constants; everything bitsandbytes leaves alone at its own dtype — the MoE experts!), LoRA params with
their grads and the optimizer's states, activations kept for backward, and the logits/loss buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict

from tunegrid.cell_spec import CellSpec, LoraSpec, TrainSpec
from tunegrid.contract import MemoryComponents, MemoryEstimate
from tunegrid.meanings import QUANT_ROWS, PrecisionRow, QuantRow, precision_row, quant_row
from tunegrid.prepare.activation_peaks import saved_activations
from tunegrid.prepare.checkpoint_headers import checkpoint_facts, numel_of, tensor_shapes  # noqa: F401 (re-exported)
from tunegrid.prepare.cpu_kernels import routed_experts
from tunegrid.prepare.load_peaks import (
    cast_load_peak,
    fused_expert_bytes,
    fused_expert_parameters,
    int8_quantize_bytes,
    largest_layer_experts,
    largest_read_at_once,
    offloaded_weight_bytes,
)
from tunegrid.prepare.weight_inventory import WeightInventory, weight_inventory
from tunegrid.runtime.workers import SPAWNED
from tunegrid.study.stacks import BASE_STACK_MEMORY, StackMemory
from tunegrid.vocabulary import Quant

# How nf4-experts quantizes the expert parameters. "load": each is quantized as it is read, one expert at
# a time where the checkpoint stores experts apart, so only one full-precision tensor exists at once.
# "post_load": after transformers has loaded them at their storage dtype (the path the recorded H100
# cells ran), so the load holds the experts at full width before they shrink.
EXPERTS_QUANTIZED_AT = "load"


def nf4_bytes(numel: int) -> float:
    """An NF4 tensor of `numel` values: packed 4-bit + uint8 absmax + fp32 second level."""
    return QUANT_ROWS[Quant.NF4].quantized_bytes([numel])


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


class DeviceConstants(TypedDict):
    """The probe's measured constants an estimate takes, by estimate_from_shapes' names for them."""

    runtime: int  # what the worker holds beyond its tensors
    step_overhead: int  # a step's framework overhead (on CUDA, the cuBLAS workspaces)
    device: str  # the device the cell trains on: the memory the estimate is of
    worker: str  # the worker's path (spawned / forked) whose constant `runtime` is


def device_constants(
    capabilities: dict[str, Any], precision: str, worker: str = SPAWNED, *, device: str
) -> DeviceConstants:
    """The probe's measured constants for a cell in this precision that trains on `device` (the plan's:
    runtime.devices.training_device) and whose worker takes this path (spawned, or forked by the warm worker).
    On CPU: what a worker of that path holds at its peak beyond its tensors (`worker_runtime_bytes`, a micro cell
    run through the real worker: tunegrid.run.calibrate); a probe record from before it measured that gives the
    process before a model plus a small MLP step's framework overhead instead. On CUDA: the cuBLAS workspaces (0
    where the probe did not measure them). A probe measures its own device: a CPU cell beside a GPU the probe
    measured (gpus_per_rank 0) takes none of the GPU's constants."""
    arithmetic = str(precision_row(precision).arithmetic)
    paths = capabilities.get("worker_runtime_bytes") or {}
    at_work = (paths.get(worker) if isinstance(paths.get(worker), dict) else {}).get(arithmetic)
    if capabilities.get("device", "cpu") != device:
        return DeviceConstants(runtime=0, step_overhead=0, device=device, worker=worker)
    if device == "cpu" and at_work:
        return DeviceConstants(runtime=int(at_work), step_overhead=0, device=device, worker=worker)
    overhead = (capabilities.get("step_overhead_bytes") or {}).get(arithmetic) or 0
    runtime = int(capabilities.get("runtime_baseline_bytes") or 0)
    return DeviceConstants(runtime=runtime, step_overhead=int(overhead), device=device, worker=worker)


def estimate_cell(
    spec: CellSpec,
    model_dir: str | Path,
    runtime: int = 0,
    device: str = "cpu",
    step_overhead: int = 0,
    worker: str = SPAWNED,
    stack: StackMemory = BASE_STACK_MEMORY,
) -> MemoryEstimate:
    config, shapes, facts = checkpoint_facts(model_dir)
    return estimate_from_shapes(spec, config, shapes, runtime, device, step_overhead, worker, stack=stack, **facts)


# bitsandbytes' 8-bit optimizers keep fp32 states for tensors under min_8bit_size elements (its default)
MIN_8BIT_SIZE = 4096
BLOCKWISE = 256  # elements per absmax of the blockwise 8-bit states


def optimizer_state_bytes(numels: Iterable[int], optimizer: str) -> int:
    """Bytes of the optimizer's state for trainable tensors of these sizes: AdamW's two fp32 moments, or
    bitsandbytes' two 8-bit moments plus one fp32 absmax per 256 elements for each (fp32 moments under 4096
    elements). Paging moves the 8-bit state, it does not shrink it."""
    if optimizer == "adamw":
        return sum(8 * n for n in numels)
    return sum(2 * (n + 4 * -(-n // BLOCKWISE)) if n >= MIN_8BIT_SIZE else 8 * n for n in numels)


def _logits(train: TrainSpec, tokens: int, vocab: int, hidden: int, act: int) -> int:
    """The logits' buffers: fp32 logits, their log-softmax and its gradient. With train.loss chunked
    (cell/memory/chunked_loss.py), one chunk's at a time (rebuilt in backward), beside the loss tokens' rows of the
    final hidden states that the chunks are cut from."""
    if train.loss != "chunked":
        return tokens * vocab * 4 * 3
    chunk = min(tokens, train.loss_chunk_tokens)
    return chunk * vocab * 4 * 3 + tokens * hidden * act


def _step_tensors(
    spec: CellSpec, config: dict[str, Any], device: str, row: PrecisionRow, cast_numel: int
) -> tuple[float, float, int]:
    """(activations kept for backward on the device, activations offloaded to host memory, the logits' buffers).
    `cast_numel`: elements of the frozen matmul weights autocast casts to the compute dtype (the head aside)."""
    train = spec.train
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    tokens = spec.axes.batch_size * train.seq_len  # the micro-batch: accumulated ones hold no activations
    act = row.bytes_per_value
    activations, offloaded = saved_activations(spec, config, device, act)
    logits = _logits(train, tokens, vocab, hidden, act)
    chunked = train.loss == "chunked"
    # Weights stored wider than autocast computes (fp16-mixed): autograd keeps each matmul's cast copy, the head's
    # too, for the input's gradient until the backward (Gemma 3 270M: 268M values, 536 MB in fp16); a chunked
    # loss casts the head afresh for each chunk and keeps none of them
    if row.autocast and (compute := 2 if row.dtype in ("float16", "bfloat16") else 4) < act:
        activations += (cast_numel + vocab * hidden * (not chunked)) * compute
        logits += vocab * hidden * compute * chunked
    return activations, offloaded, logits


def _dequantized_copies(
    shapes: dict[str, list[int]], tensors: WeightInventory, quant: QuantRow, act: int, checkpointed: bool, device: str
) -> tuple[int, int]:
    """(full-width expert weights kept for backward, the dequantized copies alive at the step's peak), in bytes.

    bitsandbytes dequantizes a 4-bit Linear's weight for each matmul and keeps none of it: its MatMul4Bit saves the
    packed weight and dequantizes it again for the input's gradient, on CPU (0.50: gemm_4bit's default kernel, a
    dequantized copy then a matmul) as on CUDA. One weight's copy lives at a time (measured, Gemma 3 270M nf4 fp32
    on the 2-core EPYC: the step peaks 1,984 MiB, where every layer's copies kept would add 383 MiB). The experts'
    forward builds a full-width weight where they are NF4 (dequantized) or carry LoRA (base + delta): the grouped
    matmul keeps it for the input's gradient, so without checkpointing every MoE layer's copy lives until
    backward; with it, one layer's at a time (rebuilt in backward)."""
    materialized = quant.experts_quantized or tensors.adapted_experts > 0
    kept = 0
    if materialized and not checkpointed:
        kept = sum(numel_of(shapes[name]) for name in tensors.expert_names) * act
    # int8-experts dequantize a layer's experts to fp32 once per forward (its cache), beside the casts kept above
    width = quant.experts_dequantized_bytes or 0
    layer = largest_layer_experts(shapes, tensors.expert_names)
    experts_fp32 = layer * width if width != act else 0
    experts_numel = layer if materialized and checkpointed else 0
    if device == "cpu":  # beside the logits (a CPU step holds both at its peak)
        return kept, (tensors.largest_quantized + experts_numel) * act + experts_fp32
    return kept, max(tensors.largest_quantized * act, experts_numel * act, experts_fp32)


def _load_peak(
    config: dict[str, Any],
    shapes: dict[str, list[int]],
    tensors: WeightInventory,
    quant: QuantRow,
    storage: int,
    device: str,
    beside: tuple[int, int],
    experts_quantized_at: str,
    largest_on_disk: tuple[int, int],
) -> float:
    """The load's peak: the weights loaded so far and the most a load holds at once besides, with `beside` (the
    runtime, the tokenizer) held all along. Experts quantized after the load exist at full width until then."""
    runtime, tokenizer_bytes = beside
    streamed = quant.experts_quantized and not quant.experts_after_load and experts_quantized_at == "load"
    at_load = tensors.weights + (0 if streamed else tensors.experts_full - tensors.experts_final)
    expert_names = tensors.expert_names
    if streamed:
        # the checkpoint is read into private memory (no mapped pages) and every tensor to quantize is
        # quantized as it arrives, an expert at a time where the experts are stored apart
        read = largest_read_at_once(shapes, expert_names, tensors.quantized_names, routed_experts(config))
        return runtime + at_load + read * storage + tokenizer_bytes
    # the checkpoint is read tensor by tensor into private memory (pread, no mapped pages), quantized as it
    # arrives where bitsandbytes replaces the layer; fusing per-expert tensors into a 3-D parameter holds the
    # parts and the whole at once
    weights_at_load = at_load + fused_expert_bytes(shapes, expert_names, storage)
    if quant.experts_after_load:  # int8-experts: all at full width, the largest being quantized
        fused = max(map(numel_of, fused_expert_parameters(shapes, expert_names).values()), default=0)
        weights_at_load = max(weights_at_load, at_load + int8_quantize_bytes(fused, device))
    _, on_disk = largest_on_disk
    if on_disk and on_disk != storage:
        cast = cast_load_peak(tensors.kept_at_storage, on_disk, storage)
        weights_at_load = max(weights_at_load, cast)
    return runtime + tokenizer_bytes + weights_at_load


def _weights_on_device(tensors: WeightInventory, train: TrainSpec, device: str) -> tuple[int, int]:
    """(the weights on the device from the first step, the weights in host memory). Weight offloading
    (cell/memory/weight_offload.py): the load put every weight on the device; from the first step each decoder layer's
    live in host memory and come to a GPU one layer at a time. On CPU nothing moves."""
    on = train.weight_offloading and device != "cpu"
    offloaded = offloaded_weight_bytes(tensors.offloadable) if on else 0
    return int(tensors.weights) - offloaded, offloaded


def _not_modelled(row: PrecisionRow, lora: LoraSpec, device: str) -> str | None:
    """What this model leaves out, said where it applies rather than fitted. (The cases that grew step by step,
    CPU bf16 with routed experts and CPU fp16 with them where oneDNN runs fp16, train without oneDNN: the plan's
    kernels, prepare.cpu_kernels.cpu_onednn_off; the estimate is of a cell that trains with them.)"""
    left_out = []
    if row.fp32_islands and device != "cpu":
        # which modules become islands is measured when the cell starts (train.fp32_islands: auto); an island's
        # weights grow to fp32 and its activations are fp32 (H100, Gemma 3 270M, 8 of 18 layers: +146 MiB, 0.86 of
        # the peak without them). On a CPU the checkpoint's cast load is the peak and covers them.
        left_out.append("fp32 islands: their fp32 weights and activations (chosen when the cell starts)")
    if lora.loftq_bits:  # peft's, after the load, one weight at a time: transient, not measured here
        left_out.append("LoftQ's initialization (an adapted weight's fp32 copies, its round trip and SVD, in turn)")
    return "; ".join(left_out) or None


def estimate_from_shapes(
    spec: CellSpec,
    config: dict[str, Any],
    shapes: dict[str, list[int]],
    runtime: int,
    device: str = "cpu",
    step_overhead: int = 0,
    worker: str = SPAWNED,
    experts_quantized_at: str = EXPERTS_QUANTIZED_AT,
    tokenizer_bytes: int = 0,
    largest_on_disk: tuple[int, int] = (0, 0),
    checkpoint_bytes: int = 0,
    stack: StackMemory = BASE_STACK_MEMORY,
) -> MemoryEstimate:
    """The peak of one rank that trains on `device`, its worker on `worker`'s path (`runtime`, `step_overhead`:
    device_constants'). `tokenizer_bytes`: the model's tokenizer in memory (the checkpoint's manifest measured it),
    held beside everything else from the load on. `largest_on_disk`: elements and bytes per element of the
    checkpoint's largest tensor; where its disk dtype is not the storage dtype, every tensor is taken to be cast
    as it loads (`load_peaks.cast_load_peak`). `checkpoint_bytes`: the safetensors files' size. `stack`: what the
    cell's library stack changes (tunegrid.study.stacks.StackMemory): its imports' runtime, experts as nn.Linear
    and a load through a mapping of the files on transformers 4.x."""
    config = _text_config(config)
    axes, train = spec.axes, spec.train
    # The tokenizer and a checkpoint's read and cast copies live in host memory: they are part of a CPU cell's
    # peak, never of a GPU's (measured on an H100, Gemma 3 270M from GGUF, fp16-residual: load peak 514 MiB for
    # 511 MiB of fp16 weights, where the CPU's load model gives 1.3 GiB)
    if device != "cpu":
        tokenizer_bytes, largest_on_disk, checkpoint_bytes = 0, (0, 0), 0
    else:
        runtime += stack.runtime_extra_bytes
    row, quant = precision_row(axes.precision), quant_row(axes.quant)
    storage = row.bytes_per_value
    tensors = weight_inventory(config, shapes, quant, storage, spec.lora, stack.fused_experts)
    activations, offloaded, logits = _step_tensors(spec, config, device, row, tensors.cast_numel)
    checkpointed = train.gradient_checkpointing
    kept_experts, dequant = _dequantized_copies(shapes, tensors, quant, storage, checkpointed, device)
    beside = (runtime, tokenizer_bytes)
    load = _load_peak(config, shapes, tensors, quant, storage, device, beside, experts_quantized_at, largest_on_disk)
    if stack.mapped_load and device == "cpu":
        # transformers 4.x reads through a mapping of the files: every page it read stays resident beside the
        # parameters made from it until the load ends (cell.load.model.own_memory copies them out, then it closes)
        load = runtime + tokenizer_bytes + tensors.weights + checkpoint_bytes
    transient = logits + dequant if device == "cpu" else max(logits, dequant)
    weights, weights_offloaded = _weights_on_device(tensors, train, device)
    lora_bytes = tensors.adapter_params * 4 * 2  # fp32 params and their grads
    optimizer_bytes = optimizer_state_bytes(tensors.adapter_tensors, axes.optimizer)
    held = (runtime, step_overhead, tokenizer_bytes, weights, lora_bytes, optimizer_bytes, activations, kept_experts)
    step = sum(held) + transient
    return MemoryEstimate(
        worker=worker,
        estimate_bytes=int(max(load, step)),
        stage="load" if load > step else "step",
        load_bytes=int(load),
        step_bytes=int(step),
        components=MemoryComponents(
            runtime=int(runtime + step_overhead),
            tokenizer=int(tokenizer_bytes),
            weights=int(weights),
            lora_params_grads=int(lora_bytes),
            optimizer_state=int(optimizer_bytes),
            activations=int(activations),
            activations_offloaded_to_host=int(offloaded),
            weights_offloaded_to_host=int(weights_offloaded),
            experts_kept_for_backward=int(kept_experts),
            logits=int(logits),
            dequant_buffer=int(dequant),
        ),
        not_modelled=_not_modelled(row, spec.lora, device),
    )
