"""Row-wise int8 of fused MoE expert parameters (quant: int8-experts): axolotl's `quantize_moe_experts` with
`load_in_8bit` (axolotl 0.18, monkeypatch/moe_quant.py), once the 8-bit load has replaced the nn.Linear layers.

Each ≥3-D expert parameter (a parameter whose name says `expert`, as axolotl picks them) is cast to fp16 and
quantized with bitsandbytes' `int8_vectorwise_quant` (one fp32 absmax per row over the last dimension), stored
as int8 under a parametrization that dequantizes it on use with `int8_vectorwise_dequant`, which returns fp32;
the module's forward dequantizes once (torch's parametrization cache, held for its forward as axolotl's hooks
hold it). The tensor is flattened to rows first, as bitsandbytes' CUDA kernel reads a ≥3-D tensor and its CPU
op requires. axolotl quantizes each expert as the checkpoint is read onto a GPU; here they are quantized after
the load, so the load holds them at full width (the estimate says so). Adapters on int8 experts
(lora.target_parameters) are not trained: the study's check refuses them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import parametrize


class Int8RowwiseParametrization(torch.nn.Module):
    """Dequantizes int8 row-wise data on access (axolotl's Bnb8bitParametrization)."""

    def __init__(self, row_stats: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("row_stats", row_stats)

    @torch.no_grad()
    def forward(self, quantized: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import int8_vectorwise_dequant

        shape = quantized.shape
        return int8_vectorwise_dequant(quantized.reshape(-1, shape[-1]), self.row_stats).reshape(shape)


def _cache_during_forward(module: torch.nn.Module) -> None:
    """One dequantization per forward of `module` (however often its forward reads the parameter)."""
    if getattr(module, "_tunegrid_int8_cache", None) is not None:
        return
    module._tunegrid_int8_cache = []  # the open parametrize.cached() contexts, one per running forward

    def enter(mod: Any, _args: Any) -> None:
        context = parametrize.cached()
        context.__enter__()
        mod._tunegrid_int8_cache.append(context)

    def leave(mod: Any, _args: Any, _output: Any) -> None:
        mod._tunegrid_int8_cache.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def is_expert_parameter(name: str, param: torch.Tensor) -> bool:
    """axolotl's choice: a floating ≥3-D parameter whose name says expert (before any adapter is attached)."""
    return param.dim() >= 3 and param.is_floating_point() and "expert" in name.lower()


def quantize_experts(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Quantize every expert parameter of `model` in place; what changed, with its bytes before and after."""
    from bitsandbytes.functional import int8_vectorwise_quant

    changed = []
    for module_name, module in list(model.named_modules()):
        for param_name in [name for name, _ in module.named_parameters(recurse=False)]:
            param = module._parameters[param_name]  # no list of them kept: each full-width one goes once replaced
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param is None or not is_expert_parameter(full, param):
                continue
            shape = param.shape
            before = param.numel() * param.element_size()
            rows = param.data.reshape(-1, shape[-1]).to(torch.float16)
            data, row_stats, _ = int8_vectorwise_quant(rows)
            del rows
            setattr(module, param_name, torch.nn.Parameter(data.reshape(shape), requires_grad=False))
            del param
            parametrize.register_parametrization(module, param_name, Int8RowwiseParametrization(row_stats), unsafe=True)
            _cache_during_forward(module)
            after = data.numel() + row_stats.numel() * row_stats.element_size()
            changed.append({"name": full, "shape": list(shape), "bytes_before": before, "bytes_after": after})
    return changed


def quantized_experts(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The parameters held row-wise int8 under this module's parametrization, with their stored bytes."""
    found = []
    for module_name, module in model.named_modules():
        for name, plist in getattr(module, "parametrizations", {}).items():
            if isinstance(plist[0], Int8RowwiseParametrization):
                stats = plist[0].row_stats
                stored = plist.original.numel() + stats.numel() * stats.element_size()
                shape = list(plist.original.shape)
                found.append({"name": f"{module_name}.{name}", "shape": shape, "bytes_after": stored})
    return found
