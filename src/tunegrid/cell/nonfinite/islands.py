"""fp16 with fp32 islands: the modules whose activations exceed fp16's range compute and return fp32, every
other matmul stays fp16 under autocast with a GradScaler.

Why: on a GPU without native bf16 (a T4), fp32 runs at a fraction of fp16's speed and doubles the activations,
so the fix practitioners adopt keeps fp16 and widens only where the values are (transformers'
`_keep_in_fp32_modules` at load time, Unsloth's Gemma 3 upcasts). An island's output is fp32, so the residual
addition that receives it is promoted to fp32 by torch's type promotion, and the stream stays fp32 from there
(norms return their input's dtype; the next fp16 matmul is fed a normalized input).

Which modules: `train.fp32_islands: auto` measures them before step 0. A calibration forward of a few of the
cell's own batches (no optimizer step, no gradient, the RNG put back) runs in fp32: autocast off and every
module's own low-precision weights widened to fp32 for its own forward only, so no fp32 copy of the model ever
exists. The headroom meter reads every module's output and every leaf module's input max-abs at real tokens; an island
is a module over `train.island_threshold` x 65504 none of whose descendants is over (the innermost module where the
range is exceeded; a block whose residual stream exceeds it with no module inside over becomes one whole), and a
matmul fed an input over it (autocast would cast that input to fp16). Or a list of name patterns. Islands
are chosen by the same names on every rank (the maxima are all-reduced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tunegrid.cell.loop.instrument import FP16_MAX, HeadroomMeter
from tunegrid.cell_spec import TrainSpec
from tunegrid.outcome import PEFT_PREFIX, module_name

# A peft LoRA layer's own parts: an island among them is the LoRA layer itself (its output is what flows on)
LORA_PARTS = ("base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B")


class IslandError(ValueError):
    """A study's fp32_islands that cannot be applied to this model (a pattern matched no module)."""


def plain_name(name: str) -> str:
    """A module's name without peft's wrapper prefix, as a user reads it in the model's own modules."""
    return module_name(name)


def unit_name(name: str) -> str:
    """The module an island is placed on: a part of a LoRA layer (its base layer, an adapter) is the layer."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part in LORA_PARTS:
            return ".".join(parts[:index])
    return name


def innermost_over(maxima: dict[str, float], threshold_abs: float) -> list[str]:
    """The modules over the threshold none of whose descendants is: where the range is first exceeded."""
    over = {unit_name(name) for name, value in maxima.items() if value > threshold_abs and unit_name(name)}
    return sorted(name for name in over if not any(other.startswith(name + ".") for other in over))


def outermost(names: list[str]) -> list[str]:
    """Names without the descendants of another name in the list (an island already holds its children)."""
    return sorted(n for n in set(names) if not any(n.startswith(o + ".") for o in names if o != n))


def matching_modules(model: Any, patterns: list[str]) -> list[str]:
    """The modules whose plain name matches a pattern (fnmatch); a pattern that matches none is an error."""
    names = sorted({unit_name(plain_name(n)) for n, _ in model.named_modules() if n} - {""})
    chosen = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            deep = [n for n in names if n.count(".") >= 3] or names
            raise IslandError(
                f"train.fp32_islands pattern {pattern!r} matches no module; use a glob such as '*.mlp.down_proj' "
                f"over names like {', '.join(deep[:2])}"
            )
        chosen += hits
    return outermost(chosen)


def _widen(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    if isinstance(value, tuple):
        return tuple(_widen(v) for v in value)
    if isinstance(value, list):
        return [_widen(v) for v in value]
    return value


def _set_compute_fp32(module: Any) -> None:
    """bitsandbytes' 4-bit linear casts its input to its compute dtype: fp32 dequantizes its weight to fp32."""
    import torch

    if hasattr(module, "compute_dtype") and hasattr(getattr(module, "weight", None), "quant_state"):
        module.compute_dtype = torch.float32
        module.compute_type_is_set = True


def make_island(module: Any, device_type: str) -> int:
    """Turn `module` into an fp32 island in place: its frozen low-precision weights stored in fp32 (trainable
    adapters already are), 4-bit layers computing in fp32, and its forward run with autocast off on fp32
    inputs, so it returns fp32. Returns the bytes its weights grew by."""
    import torch

    grown = 0
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            grown += param.numel() * (4 - param.element_size())
            param.data = param.data.float()
    for sub in module.modules():
        _set_compute_fp32(sub)
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, enabled=False):
            return inner(*_widen(args), **{k: _widen(v) for k, v in kwargs.items()})

    module.forward = forward
    module._tunegrid_fp32_island = True
    return grown


@contextlib.contextmanager
def fp32_forward(model: Any) -> Iterator[None]:
    """The model's forward in fp32 without an fp32 copy of it: each module's own low-precision weights and
    buffers are widened just before its forward and put back after it (4-bit layers compute in fp32)."""
    import torch

    def owned(module: Any) -> list[tuple[str, Any]]:
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        return [(n, t) for n, t in tensors if t.is_floating_point() and t.dtype != torch.float32]

    stashed: dict[int, list[tuple[Any, Any]]] = {}

    def before(module: Any, _args: Any) -> None:
        kept = [(tensor, tensor.data) for _, tensor in owned(module)]
        for tensor, data in kept:
            tensor.data = data.float()
        if hasattr(module, "compute_dtype") and hasattr(getattr(module, "weight", None), "quant_state"):
            kept.append((module, ("compute_dtype", module.compute_dtype, module.compute_type_is_set)))
            _set_compute_fp32(module)
        stashed[id(module)] = kept

    def after(module: Any, _args: Any, _output: Any) -> None:
        for holder, data in stashed.pop(id(module), []):
            if isinstance(data, tuple):
                holder.compute_dtype, holder.compute_type_is_set = data[1], data[2]
            else:
                holder.data = data

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class IslandCalibration:
    """What the calibration measured: every module's activation max-abs at real tokens (plain names, all ranks'
    maximum) over the first `batches` optimizer steps' micro-batches, computed in fp32."""

    batches: int
    maxima: dict[str, float]  # every module's output
    input_maxima: dict[str, float] = dataclasses.field(default_factory=dict)  # every matmul's input


def islands_over(calibration: IslandCalibration, threshold_abs: float) -> list[str]:
    """The islands a calibration calls for: the innermost modules whose output is over the threshold (where the
    range is first exceeded; a whole layer where only its residual sum is), and every matmul fed an input over it
    that no such island holds already. A matmul whose own output stays in range can still be fed more than fp16
    holds (a projection reading an island's fp32 output): under autocast its input would be cast to fp16 before
    it runs, so it must compute in fp32 too."""
    chosen = innermost_over(calibration.maxima, threshold_abs)
    fed = innermost_over(calibration.input_maxima, threshold_abs)
    held = [name for name in fed if not any(name == c or name.startswith(c + ".") for c in chosen)]
    return outermost(chosen + held)


def calibrate(model: Any, stream: Any, device: Any, distributed: bool, batches: int) -> IslandCalibration:
    """Every module's activation max-abs at real tokens over the first `batches` optimizer steps' micro-batches,
    in fp32 (see fp32_forward), without a gradient or an optimizer step; the RNG is put back so the training
    that follows is the one a cell without calibration runs. All-reduced (max) across ranks."""
    import torch

    meter = HeadroomMeter(top=10)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with torch.no_grad(), fp32_forward(model), meter.attached(model):
            for step in range(batches):
                masks = stream.real_positions(step)
                for micro, real in zip(stream.micro_batches(step), masks, strict=True):
                    meter.real = real.to(device)
                    model(**{k: v.to(device) for k, v in micro.items()})
                meter.collect(step)
    maxima = {plain_name(name): value for name, value in meter.worst_seen.items() if name}
    # a matmul's input is what autocast casts down (a norm computes in fp32 whatever it is fed)
    matmuls = {name for name, module in model.named_modules() if is_matmul(module)}
    inputs = {plain_name(name): value for name, value in meter.worst_input_seen.items() if name in matmuls}
    if distributed:
        maxima, inputs = (all_ranks_max(measured, device) for measured in (maxima, inputs))
    return IslandCalibration(batches=batches, maxima=maxima, input_maxima=inputs)


def is_matmul(module: Any) -> bool:
    """A leaf module whose forward multiplies by a matrix (a linear layer, 4-bit or not): autocast runs it in the
    compute dtype and casts its input down first."""
    weight = getattr(module, "weight", None)
    return not any(True for _ in module.children()) and getattr(weight, "dim", lambda: 0)() >= 2


def all_ranks_max(maxima: dict[str, float], device: Any) -> dict[str, float]:
    """Each module's maximum over every rank (the same names on every rank: they run the same model)."""
    import torch
    import torch.distributed as dist

    names = sorted(maxima)
    values = torch.tensor([maxima[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(names, values.tolist(), strict=True))


def place_fp32_islands(model: Any, stream: Any, device: Any, distributed: bool, train: TrainSpec) -> dict[str, Any]:
    """Choose the islands (measured by a calibration, or named by patterns) and make them, before the first step.
    Returns the record result.json keeps (`fp32_islands`)."""
    wanted = train.fp32_islands
    threshold = train.island_threshold * FP16_MAX
    record: dict[str, Any] = {"mode": "auto" if wanted == "auto" else "patterns"}
    if wanted == "auto":
        calibration = calibrate(model, stream, device, distributed, train.island_calibration_batches)
        maxima = {**calibration.maxima}
        for name, value in calibration.input_maxima.items():  # an island fed past the threshold shows its input
            if value > maxima.get(name, 0.0):
                maxima[name] = value
        chosen = islands_over(calibration, threshold)
        record.update(
            threshold=train.island_threshold,
            threshold_abs=threshold,
            calibration={"batches": calibration.batches, "compute": "float32", "positions": "real"},
            measured_top=[
                {"module": n, "max_abs": v, "ratio_to_fp16_max": v / FP16_MAX}
                for n, v in sorted(maxima.items(), key=lambda item: -item[1])[:8]
            ],
        )
    else:
        maxima = {}
        chosen = matching_modules(model, list(wanted))
        record["patterns"] = list(wanted)
    modules = dict(model.named_modules())
    grown = 0
    for name in chosen:
        module = modules.get(PEFT_PREFIX + name, modules.get(name))
        grown += make_island(module, device.type)
    record["modules"] = [
        {"module": n, "max_abs": maxima.get(n), "ratio_to_fp16_max": maxima[n] / FP16_MAX if n in maxima else None}
        for n in chosen
    ]
    record["weights_widened_bytes"] = grown
    print(f"fp32 islands ({record['mode']}): {', '.join(chosen) or 'none over the threshold'}", flush=True)
    return record
