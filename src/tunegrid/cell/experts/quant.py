"""NF4 quantization of fused MoE expert parameters while the checkpoint is read.

bitsandbytes' 4-bit load replaces nn.Linear only; transformers v5 keeps MoE experts as fused ≥3-D
nn.Parameters, so a plain 4-bit load holds them in full precision. Quantizing them after the load
still needs the full-precision model once, at the load peak. Here the quantizer transformers already
calls per target tensor (right after its weight conversion has fused the per-expert checkpoint
tensors into one parameter) also quantizes every ≥3-D parameter, on the target device, and the
full-precision tensor is dropped before the next one is read; where the checkpoint stores experts apart,
the fusing itself runs one expert at a time (experts/stream.py), so not even one fused full-precision
tensor exists. Experts are found by rank, not by name:
any MoE family, stored [E, out, in] or [E, in, out], with or without biases (biases are < 3-D and stay).

Every expert tensor is quantized, those that will carry a LoRA adapter too: the adapters train over the
NF4 base (cell/experts/lora.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.integrations.bitsandbytes import Bnb4bitQuantize
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from tunegrid.cell.experts.nf4 import install_quantized, quantize_per_expert
from tunegrid.cell.experts.stream import stream_expert_merges
from tunegrid.cell.load.checkpoint_reader import unread_state_dict

QUANT_METHOD = "bitsandbytes_nf4_experts"


class ExpertNF4Config(BitsAndBytesConfig):
    """bitsandbytes' 4-bit config, plus: quantize ≥3-D parameters at load."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.quant_method = QUANT_METHOD  # selects ExpertNF4Quantizer in transformers' quantizer registry


def _is_expert_param(model: Any, param_name: str) -> bool:
    module, name = get_module_from_name(model, param_name)
    param = getattr(module, "_parameters", {}).get(name)
    return param is not None and param.dim() >= 3 and param.is_floating_point()


class ExpertNF4Quantizer(Bnb4BitHfQuantizer):
    """bitsandbytes' 4-bit quantizer that also claims the ≥3-D parameters, so transformers hands them over
    one at a time, already fused, and sizes its device warm-up allocation at 4 bits for them too."""

    quantization_config: ExpertNF4Config

    def is_expert(self, model: Any, param_name: str) -> bool:
        return _is_expert_param(model, param_name)

    def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
        return super().param_needs_quantization(model, param_name, **kwargs) or self.is_expert(model, param_name)

    def get_quantize_ops(self) -> ConversionOps:
        return QuantizeExpertsOnLoad(self)

    def update_weight_conversions(self, weight_conversions: list[Any], model: Any) -> list[Any]:
        return stream_expert_merges(super().update_weight_conversions(weight_conversions, model))


def quantize_into(module: Any, name: str, value: Any) -> None:
    """Install `value` as module.<name>, NF4-quantized under bitsandbytes' parametrization (as
    replace_parameter_4bit leaves it), without holding more than one expert's quantization temporaries."""

    data, state = quantize_per_expert(value)
    install_quantized(module, name, data, state)


class QuantizeExpertsOnLoad(ConversionOps):
    """The quantization step of one target tensor: experts are quantized in place on their module and
    leave the loader's hands; nn.Linear weights go to bitsandbytes' own op; anything else passes through."""

    def __init__(self, hf_quantizer: ExpertNF4Quantizer) -> None:
        self.hf_quantizer = hf_quantizer
        self.linear = Bnb4bitQuantize(hf_quantizer)

    def convert(
        self, input_dict: dict[str, Any], model: Any = None, missing_keys: set[str] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        linear, passed = {}, {}
        for name in list(input_dict):
            value = input_dict.pop(name)  # no reference kept here once the tensor is quantized
            value = value[0] if isinstance(value, list) else value
            if self.hf_quantizer.is_expert(model, name):
                module, attr = get_module_from_name(model, name)
                quantize_into(module, attr, value)
                del value
                if missing_keys is not None:
                    missing_keys.discard(name)
            elif Bnb4BitHfQuantizer.param_needs_quantization(self.hf_quantizer, model, name):
                linear[name] = value
            else:
                passed[name] = value
        if linear:
            passed.update(self.linear.convert(linear, model=model, missing_keys=missing_keys, **kwargs))
        return passed


def register() -> None:
    """Make QUANT_METHOD known to transformers' quantizer registry (idempotent)."""
    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(QUANT_METHOD, ExpertNF4Config)
    AUTO_QUANTIZER_MAPPING.setdefault(QUANT_METHOD, ExpertNF4Quantizer)


def load_causal_lm(model_dir: Path, kwargs: dict[str, Any]) -> Any:
    """from_pretrained with the checkpoint read through `unread_state_dict`; architectures with remote code
    (not in transformers' own registry) are read from the folder as usual."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    trust = bool(kwargs.get("trust_remote_code"))
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust)
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping or getattr(config, "auto_map", None):
        return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model_class = mapping[type(config)]
    rest = {k: v for k, v in kwargs.items() if k not in ("use_safetensors", "trust_remote_code")}
    model = model_class.from_pretrained(None, config=config, state_dict=unread_state_dict(model_dir), **rest)
    # from_pretrained(None) names the model "None"; peft's save would then look up a hub repo of that name
    model.name_or_path = model.config.name_or_path = str(model_dir)
    return model


def quantized_at_load(model: Any) -> list[dict[str, Any]]:
    """The ≥3-D parameters held NF4 under a bitsandbytes parametrization, with their stored bytes."""
    from tunegrid.cell.load.quant_audit import quant_state_bytes

    found = []
    for module_name, module in model.named_modules():
        for name, plist in getattr(module, "parametrizations", {}).items():
            state = getattr(plist[0], "quant_state", None)
            if state is not None and len(state.shape) >= 3:
                stored = plist.original.numel() * plist.original.element_size() + quant_state_bytes(state)
                found.append({"name": f"{module_name}.{name}", "shape": list(state.shape), "bytes_after": stored})
    return found


def load_config(bnb_kwargs: dict[str, Any]) -> ExpertNF4Config:
    """The quantization config of an nf4-experts load: bitsandbytes' 4-bit settings, every expert NF4."""
    return ExpertNF4Config(**bnb_kwargs)
