"""LoRA on fused MoE expert parameters that are held NF4 under bitsandbytes' parametrization.

peft's ParamWrapper adds its adapter to a ≥3-D parameter as one more parametrization on the owning
module: W + scaling * lhs @ rhs, read when the experts' forward reads the parameter. Over bitsandbytes'
Bnb4bitParametrization (whose forward dequantizes, without grad) that is exactly LoRA over the 4-bit base,
and autograd reaches only the adapter factors. peft 0.21 does not get there on its own when the parameter
is already parametrized:

- target_parameters match a parametrized module only by its full name, never by suffix, so
  `mlp.experts.down_proj` adapts nothing (peft only warns that no parameter was matched):
  `expand_targets` adds the full names;
- its single-adapter factor proxy is never taken off again when another parametrization precedes it
  (the removal looks for its other proxy class); the next forward then reads a parameter that requires
  grad and copies that flag onto the packed uint8 storage: "only Tensors of floating point dtype can
  require gradients" on the second step (in the first backward under activation checkpointing);
- with two adapted parameters on one module (nested wrappers) the inner wrapper reads its parameter
  inside the outer one's parametrize.cached() before adding its proxy, so the un-adapted value is
  cached and the inner adapter gets no gradient.

`QuantizedExpertWrapper` replaces the activation step, adding and removing its proxy by identity without
reading the parameter. Two adapted tensors on one module nest in the order peft gives an unparametrized
module (declaration order), not its sorted full-name order, so the saved adapter has the same keys on a
4-bit and on a full-precision base (`nest_in_declared_order`).

Memory: the dequantized tensor exists while the experts' forward runs (bitsandbytes' forward hooks scope
its cache to it) and, without activation checkpointing, where autograd keeps it for that layer's backward
(as for experts without adapters); with activation checkpointing it is dequantized again in the backward instead.
The packed 4-bit storage never requires grad and no full-precision copy of it outlives the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn


def _quant_state(module: nn.Module, name: str) -> Any:
    """The bitsandbytes quant state `name` is dequantized with on `module`, or None."""
    plists = getattr(module, "parametrizations", {})
    if name not in plists:
        return None
    plist = plists[name]
    return next((p.quant_state for p in plist if hasattr(p, "quant_state")), None)


def expand_targets(model: nn.Module, target_parameters: list[str]) -> list[str]:
    """`target_parameters` plus the full name of every 4-bit parametrized tensor one of them names by suffix
    (peft's suffix match skips parametrized modules)."""
    found = []
    for module_name, module in model.named_modules():
        for name in getattr(module, "parametrizations", {}):
            full = f"{module_name}.{name}" if module_name else name
            if _quant_state(module, name) is not None and any(
                full == t or full.endswith(f".{t}") for t in target_parameters
            ):
                found.append(full)
    return list(target_parameters) + sorted(set(found) - set(target_parameters))


class _FactorsOverQuantized(nn.Module):
    """W + sum of scaling * lhs @ rhs, in W's dtype: the fold peft's _LoraFactorsProxy does, for any number
    of active adapters."""

    def __init__(self, factors: list[tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        super().__init__()
        self.factors = factors

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # a parametrization may not change the dtype: fold in W's dtype, autocast off (as peft does)
        with torch.autocast(device_type=weight.device.type, enabled=False):
            for lhs, rhs, scaling in self.factors:
                weight = torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=scaling)
        return weight


class QuantizedExpertWrapper(ParamWrapper):
    """peft's ParamWrapper over a 4-bit parametrized ≥3-D parameter (see the module docstring)."""

    def get_delta_factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        # peft's own reshape, without reading the parameter for its dtype (a full dequantization each time)
        weight_a = self.lora_A[adapter_name].weight
        weight_b = self.lora_B[adapter_name].weight
        weight_a = weight_a.reshape(self.num_experts, -1, weight_a.shape[-1])  # (experts, rank, in)
        weight_b = weight_b.reshape(weight_b.shape[0], -1, self.num_experts).permute(2, 0, 1)  # (experts, out, rank)
        if not self._did_swap_in_out_features:  # stored (experts, in, out)
            return weight_a.transpose(-2, -1), weight_b.transpose(-2, -1), self.scaling[adapter_name]
        return weight_b, weight_a, self.scaling[adapter_name]

    @contextmanager
    def _activate_lora(self, active_adapters: list[str]) -> Iterator[None]:
        adapters = [a for a in active_adapters or [] if a in self.lora_A]
        if not adapters:
            yield
            return
        plist = self.get_base_layer().parametrizations[self.parameter_name]
        proxy = _FactorsOverQuantized([self.get_delta_factors(a) for a in adapters])
        plist.append(proxy)
        try:
            yield
        finally:
            for index in reversed(range(len(plist))):
                if plist[index] is proxy:
                    del plist[index]
                    break

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise ValueError(
            f"cannot merge a LoRA adapter into the 4-bit expert tensor {self.parameter_name!r}: "
            "load the base model in full precision (quant: none) to merge the saved adapter"
        )


def adopt_quantized_experts(model: nn.Module) -> list[str]:
    """Turn every peft ParamWrapper whose parameter is 4-bit parametrized into a QuantizedExpertWrapper;
    returns the adapted parameters' names."""
    adopted = []
    for name, module in model.named_modules():
        if type(module) is ParamWrapper and _quant_state(module.get_base_layer(), module.parameter_name) is not None:
            if module._param_ndim != 3:
                raise ValueError(
                    f"lora.target_parameters: {name}.{module.parameter_name} is a 4-bit "
                    f"{module._param_ndim}-D parameter; only 3-D fused expert tensors train over a 4-bit base"
                )
            module.__class__ = QuantizedExpertWrapper
            adopted.append(f"{name}.{module.parameter_name}")
    return adopted


def _declared_order(model: nn.Module) -> dict[str, list[str]]:
    """Each module's own parameter names in declaration order (the order peft's suffix match walks), read
    from a copy of the model on the meta device (a parametrized module no longer lists them)."""
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    return {name: [n for n, _ in m.named_parameters(recurse=False)] for name, m in skeleton.named_modules()}


def nest_in_declared_order(model: nn.Module) -> int:
    """Reorder nested ParamWrappers on a 4-bit module so the innermost adapts the first-declared tensor,
    as peft nests them on a full-precision module; returns how many modules were reordered.

    The wrappers are one class with one structure; what differs is their per-tensor state (parameter
    name, features, adapters), so the states are permuted and the base_layer links put back.
    """
    chains, wrapped = [], set()
    for name, module in model.named_modules():  # outer wrappers come before the ones they wrap
        if (
            isinstance(module, ParamWrapper)
            and isinstance(module.base_layer, ParamWrapper)
            and id(module) not in wrapped
        ):
            chain = [module]
            while isinstance(chain[-1].base_layer, ParamWrapper):
                chain.append(chain[-1].base_layer)
                wrapped.add(id(chain[-1]))
            chains.append((name, chain))
    chains = [(n, c) for n, c in chains if _quant_state(c[-1].base_layer, c[-1].parameter_name) is not None]
    if not chains:
        return 0
    order = _declared_order(model)
    reordered = 0
    for name, chain in chains:
        declared = order.get(name, [])
        if not all(w.parameter_name in declared for w in chain):
            continue  # a module the copy does not have: peft's own order stands
        inner_first = sorted(reversed(chain), key=lambda w: declared.index(w.parameter_name))
        wanted = list(reversed(inner_first))  # outermost first, as `chain`
        if wanted == chain:
            continue
        base = chain[-1].base_layer
        states = [dict(w.__dict__) for w in wanted]
        for wrapper, state in zip(chain, states, strict=True):
            wrapper.__dict__.clear()
            wrapper.__dict__.update(state)
        for outer, inner in zip(chain, [*chain[1:], base], strict=True):
            outer._modules["base_layer"] = inner
        reordered += 1
    return reordered
