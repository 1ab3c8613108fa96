"""Quantization coverage audit: what a 4-bit load really quantized, and where LoRA really attached.

In transformers v5 MoE experts are fused 3-D nn.Parameters that bitsandbytes' 4-bit loading skips
(it only replaces nn.Linear). Everything here is found structurally (parameter rank, module classes,
the model's own output-embedding accessor), for any architecture, with no list of model or parameter names.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

DEFAULT_FLAG_BYTES = 64 * 2**20  # a 2-D tensor this large left unquantized is worth a line too
FOUR_BIT_TYPES = frozenset({"nf4", "fp4"})  # bitsandbytes' QuantState.quant_type of a 4-bit tensor


def _int8_scale(module: Any, storage: Any) -> Any | None:
    """The per-row scale (SCB) of a bitsandbytes 8-bit weight, None for any other tensor. Structural: an
    Int8Params storage, its scale on the parameter or, once a forward has run, on the layer's state; or the
    row statistics of an int8 tensor held under a row-wise parametrization (int8-experts, cell/experts/int8.py)."""
    if type(storage).__name__ != "Int8Params":
        for plist in getattr(module, "parametrizations", {}).values():
            if plist.original is storage and getattr(plist[0], "row_stats", None) is not None:
                return plist[0].row_stats
        return None
    scale = getattr(storage, "SCB", None)
    return scale if scale is not None else getattr(getattr(module, "state", None), "SCB", None)


def _tensor_bytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def quant_state_bytes(state: Any) -> int:
    """Bytes of a bitsandbytes QuantState: block absmax (double-quantized or not) plus its code."""
    total = _tensor_bytes(state.absmax) + _tensor_bytes(state.code)
    if getattr(state, "nested", False) and state.state2 is not None:
        total += _tensor_bytes(state.state2.absmax) + _tensor_bytes(state.state2.code) + _tensor_bytes(state.offset)
    return total


def _role(
    name: str, module: Any, ndim: int, expert_modules: set[int], router_parents: set[str], output_embeddings: Any
) -> str:
    import torch

    if ".lora_" in name:
        return "lora"
    if id(module) in expert_modules or ndim >= 3:
        return "experts"
    if isinstance(module, torch.nn.Embedding) or module is output_embeddings:
        return "embeddings_head"
    if "norm" in type(module).__name__.lower():
        return "norms"
    parent, attribute = name.rsplit(".", 2)[:2] if name.count(".") >= 2 else ("", "")
    # The router is the block's module that picks experts: `gate`/`router` (an nn.Linear, or a TopKRouter
    # holding its own weight). Other gates of the block are not routers: Qwen2-MoE's shared_expert_gate
    # scales the shared expert's output.
    if parent in router_parents and (attribute in ("gate", "router") or "router" in type(module).__name__.lower()):
        return "router"
    return "other"


def _logical_params(model: Any) -> list[tuple[str, Any, str, Any, Any]]:
    """(logical name, owning module, param name, storage tensor, quant_state or None) for every parameter.

    A parametrized parameter (bitsandbytes' replace_parameter_4bit) is reported under its logical name,
    with the packed `original` as storage; its shape comes from the quant state, so nothing is dequantized.
    """
    entries = []
    for module_name, module in model.named_modules():
        if type(module).__name__ == "ParametrizationList" or module_name.endswith(".parametrizations"):
            continue
        parametrizations = getattr(module, "parametrizations", None)
        if parametrizations is not None:
            for param_name, plist in parametrizations.items():
                state = getattr(plist[0], "quant_state", None)
                full = f"{module_name}.{param_name}" if module_name else param_name
                entries.append((full, module, param_name, plist.original, state))
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            entries.append((full, module, param_name, param, getattr(param, "quant_state", None)))
    return entries


def audit_model(model: Any, *, quantization_requested: bool, flag_bytes: int = DEFAULT_FLAG_BYTES) -> dict[str, Any]:
    entries = _logical_params(model)
    expert_modules = {
        id(m) for _, m, _, t, s in entries if (tuple(s.shape) if s is not None else tuple(t.shape)).__len__() >= 3
    }
    router_parents = set()
    for name, module in model.named_modules():
        if id(module) in expert_modules and "." in name:
            router_parents.add(name.rsplit(".", 1)[0])
    get_out = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_out() if callable(get_out) else None

    params, by_dtype, by_role = [], defaultdict(int), defaultdict(int)
    flagged = []
    for name, module, _param_name, storage, state in entries:
        int8_scale = _int8_scale(module, storage)
        quantized = state is not None or int8_scale is not None or type(storage).__name__ == "Int8Params"
        shape = list(state.shape) if state is not None else list(storage.shape)
        stored = _tensor_bytes(storage) + (quant_state_bytes(state) if state is not None else 0)
        stored += _tensor_bytes(int8_scale) if int8_scale is not None else 0
        # a 4-bit tensor by its quant type (nf4); an 8-bit one by its storage (int8), as any other
        named = getattr(state, "quant_type", None) if state is not None else None
        dtype = str(named) if named else str(storage.dtype).removeprefix("torch.")
        role = _role(name, module, len(shape), expert_modules, router_parents, output_embeddings)
        entry = {
            "name": name,
            "shape": shape,
            "dtype": dtype,
            "bytes": stored,
            "quantized": quantized,
            "trainable": bool(storage.requires_grad),
            "module_class": type(module).__name__,
            "role": role,
        }
        params.append(entry)
        by_dtype[dtype] += stored
        by_role[role] += stored
        if quantization_requested and not quantized and role != "lora" and (len(shape) >= 3 or stored >= flag_bytes):
            why = "≥3-D parameter left in full precision" if len(shape) >= 3 else "large tensor left in full precision"
            flagged.append({"name": name, "shape": shape, "dtype": dtype, "bytes": stored, "role": role, "why": why})
    total = sum(by_dtype.values())
    flagged_bytes = sum(f["bytes"] for f in flagged)
    return {
        "total_bytes": total,
        "by_dtype": dict(by_dtype),
        "by_role": dict(by_role),
        "quantized_bytes": sum(p["bytes"] for p in params if p["quantized"]),
        "flagged": flagged,
        "flagged_bytes": flagged_bytes,
        "flagged_share": flagged_bytes / total if total else 0.0,
        "params": params,
    }


def growth(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a preparation step did to memory (prepare_model_for_kbit_training upcasts to fp32)."""
    dtypes = set(before["by_dtype"]) | set(after["by_dtype"])
    return {
        "bytes_before": before["total_bytes"],
        "bytes_after": after["total_bytes"],
        "grew_bytes": after["total_bytes"] - before["total_bytes"],
        "by_dtype_change": {d: after["by_dtype"].get(d, 0) - before["by_dtype"].get(d, 0) for d in sorted(dtypes)},
    }


def lora_attachment(model: Any, target_modules: list[str], target_parameters: list[str]) -> dict[str, Any]:
    """Targets requested versus adapters peft actually created (peft warns about none of the misses)."""
    lora_modules = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and len(getattr(m, "lora_A", {}))]
    modules = {
        t: sum(1 for n, m in lora_modules if n.endswith("." + t) and not hasattr(m, "parameter_name"))
        for t in target_modules
    }
    parameters = {}
    for target in target_parameters:
        owner, _, param = target.rpartition(".")
        parameters[target] = sum(
            1
            for n, m in lora_modules
            if getattr(m, "parameter_name", None) == param and (not owner or f".{owner}" in f".{n}")
        )
    unmatched = [t for t, count in {**modules, **parameters}.items() if count == 0]
    # peft may put adapters on fused expert parameters nobody listed (its v4->v5 conversion turns
    # gate_proj/up_proj/down_proj into expert target_parameters on some MoE families): say so.
    parameter_adapters: dict[str, int] = defaultdict(int)
    for _, module in lora_modules:
        if hasattr(module, "parameter_name"):
            parameter_adapters[module.parameter_name] += 1
    implicit = sorted(set(parameter_adapters) - {t.rpartition(".")[2] for t in target_parameters})
    trains, by_role = what_trains(model, lora_modules, target_modules, target_parameters)
    return {
        "target_modules": modules,
        "target_parameters": parameters,
        "parameter_adapters": dict(parameter_adapters),
        "implicit_parameter_adapters": implicit,
        "unmatched": unmatched,
        "trains": trains,
        "trainable_params_by_role": by_role,
    }


def _adapter_base(module: Any) -> tuple[str, str, int]:
    """(base dtype, "nf4" for a 4-bit base; the adapted tensor's name; its rank) of one LoRA layer."""
    base = module.get_base_layer()
    name = getattr(module, "parameter_name", "weight")
    plists = getattr(base, "parametrizations", {})
    if name in plists:
        state = getattr(plists[name][0], "quant_state", None)
        storage = plists[name].original
    else:
        storage = base._parameters[name]
        state = getattr(storage, "quant_state", None)
    shape = state.shape if state is not None else storage.shape
    if state is not None:
        return str(getattr(state, "quant_type", "4bit")), name, len(shape)
    return str(storage.dtype).removeprefix("torch."), name, len(shape)


def what_trains(
    model: Any, lora_modules: list[tuple[str, Any]], target_modules: list[str], target_parameters: list[str]
) -> tuple[dict[str, Any], dict[str, int]]:
    """Per LoRA target: its adapters, the dtype of the base they train over (nf4 = 4-bit) and their trainable
    parameters; and trainable parameters by role (experts: ≥3-D fused tensors; attention: layers of a module
    whose class is an attention; other)."""
    classes = {name: type(m).__name__.lower() for name, m in model.named_modules()}
    trains: dict[str, Any] = {}
    by_role: dict[str, int] = {"experts": 0, "attention": 0, "other": 0}
    for name, module in lora_modules:
        dtype, tensor, rank = _adapter_base(module)
        owner = name.replace(".base_layer", "")
        if hasattr(module, "parameter_name"):
            target = next(
                (
                    t
                    for t in target_parameters
                    if t.rpartition(".")[2] == tensor and f".{t.rpartition('.')[0]}" in f".{owner}"
                ),
                tensor,  # put there by peft's conversion of MoE module names, not by a listed target
            )
        else:
            target = next((t for t in target_modules if owner.endswith("." + t) or owner == t), owner)
        parent = classes.get(name.rsplit(".", 1)[0], "")
        role = "experts" if rank >= 3 else "attention" if "attention" in parent else "other"
        count = sum(p.numel() for key in ("lora_A", "lora_B") for p in getattr(module, key).parameters())
        entry = trains.setdefault(target, {"role": role, "adapters": 0, "base": {}, "trainable_params": 0})
        entry["adapters"] += 1
        entry["base"][dtype] = entry["base"].get(dtype, 0) + 1
        entry["trainable_params"] += count
        by_role[role] += count
    for entry in trains.values():
        entry["base_4bit"] = set(entry["base"]) <= FOUR_BIT_TYPES
    return trains, by_role


def quantize_experts_post_load(model: Any) -> dict[str, Any]:
    """NF4-quantize every ≥3-D parameter a 4-bit load left in full precision, with bitsandbytes' own API.

    After a plain 4-bit load this is the whole expert quantization (the load peak then holds the experts in
    full precision); after experts/quant.py's load it finds nothing left. Trainable parameters are never
    touched. A tensor that already carries a LoRA adapter (peft's ParamWrapper) is quantized too, and its
    wrapper made to train over the 4-bit base (experts/lora.py); `kept_for_lora` lists any adapted expert
    tensor still in full precision afterwards, so that memory cost would be visible.
    """
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from tunegrid.cell.experts.lora import adopt_quantized_experts

    changed = []
    for module_name, module in list(model.named_modules()):
        for param_name, param in list(module.named_parameters(recurse=False)):
            if param.dim() < 3 or param.requires_grad or getattr(param, "quant_state", None) is not None:
                continue
            before = _tensor_bytes(param)
            replace_parameter_4bit(module, param_name, quant_type="nf4", compress_statistics=True)
            plist = module.parametrizations[param_name]
            after = _tensor_bytes(plist.original) + quant_state_bytes(plist[0].quant_state)
            changed.append(
                {
                    "name": f"{module_name}.{param_name}",
                    "shape": list(param.shape),
                    "bytes_before": before,
                    "bytes_after": after,
                }
            )
    adopt_quantized_experts(model)
    kept = [
        {"name": f"{name}.{m.parameter_name}", "bytes": _tensor_bytes(m.get_param()), "why": "has a LoRA adapter"}
        for name, m in model.named_modules()
        if hasattr(m, "parameter_name")
        and hasattr(m, "get_base_layer")
        and m.parameter_name not in getattr(m.get_base_layer(), "parametrizations", {})
        and m.get_param().dim() >= 3
    ]
    return {"changed": changed, "kept_for_lora": kept}


def summarize(audit: dict[str, Any]) -> dict[str, Any]:
    """The audit without its per-parameter table: what result.json and MLflow carry."""
    return {k: v for k, v in audit.items() if k != "params"}


def disable_cpu_inference_packing(model: Any) -> int:
    """Stop bitsandbytes from ever repacking this model's 4-bit linears into its CPU inference layout.

    On a CPU with AVX512-BF16, bitsandbytes' Linear4bit.forward converts its weight, in place and for
    good, to a packed layout (`quant_state.packing_format_for_cpu`) the first time it runs in eval mode on
    an input that does not require grad -- e.g. a reference forward under no_grad. Every later call,
    training included, then goes through `gemv_4bit`, which has no backward: the gradient through the
    frozen base weight is lost (or an in-place bias add fails). The decision reads the per-layer flag
    `support_avx512bf16_for_cpu` (set from the CPU at construction); clearing it keeps the trainable
    layout on every host. Returns how many layers were guarded.
    """
    from bitsandbytes.nn import Linear4bit

    guarded = 0
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
            guarded += 1
    return guarded


def inference_packed_layers(model: Any) -> list[str]:
    """Parameters whose quant state is in bitsandbytes' inference-only CPU layout (no backward through it)."""
    return [
        name
        for name, _m, _p, _t, state in _logical_params(model)
        if state is not None and getattr(state, "packing_format_for_cpu", False)
    ]


def require_trainable_layout(model: Any) -> None:
    """Refuse to train a model any of whose 4-bit weights bitsandbytes repacked for inference.

    The conversion is not undone: its inverse re-quantizes block constants that were cast to bf16, so the
    weights would differ from the ones loaded. A cell with such a layer fails with the layer names.
    """
    packed = inference_packed_layers(model)
    if packed:
        raise RuntimeError(
            f"{len(packed)} 4-bit weights are in bitsandbytes' inference-only CPU layout (packing_format_for_cpu), "
            f"which has no backward, e.g. {packed[0]}; refusing to train with wrong gradients"
        )
