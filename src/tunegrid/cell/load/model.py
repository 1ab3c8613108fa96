"""The model of a cell: load it at the planned precision and quantization (a failed load named by the
exception that caused it), and attach LoRA.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec, LoraSpec
from tunegrid.contract import CellKernels
from tunegrid.meanings import quant_row

# transformers catches an exception raised while converting a checkpoint tensor, loads the rest, and then
# raises a RuntimeError that only points at its logged report; the report holds the original exception
# config.json keys transformers v5 writes under new names that 4.x reads under the old ones (else it takes its
# default: 128 experts for a 32-expert Qwen3-MoE)
V5_CONFIG_RENAMES = {"num_local_experts": "num_experts"}
REPORT_LOGGER = "transformers"  # the library logger its modules log through (the report: modeling_utils)
EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$", re.MULTILINE)


def load_model(model_dir: Path, spec: CellSpec, precision: Any, kernels: CellKernels, device: Any) -> Any:
    """The cell's model at its precision (a tunegrid.cell.loop.precision.PrecisionSetup), with the kernels its plan
    chose."""
    from transformers import BitsAndBytesConfig

    use_cpu_kernels(kernels, device)

    kwargs: dict[str, Any] = {
        "dtype": precision.torch_dtype("storage"),
        "use_safetensors": True,  # never a pickle
        "trust_remote_code": spec.model.trust_remote_code,  # off unless pinned hub + opt-in
    }
    kwargs.update(spec.model.config_overrides)  # the recipe's model_config (config.json values)
    # the attention kernel: the grid's attention axis where it leaves the default, else the recipe's own
    attention = spec.axes.attention
    if attention != "sdpa" or spec.model.attn_implementation:
        kwargs["attn_implementation"] = attention if attention != "sdpa" else spec.model.attn_implementation
    quant = quant_row(spec.axes.quant)
    bnb = quant.bnb_settings(precision.torch_dtype("compute"))
    if device.type == "cuda":
        kwargs["device_map"] = {"": device.index or 0}
    if quant.experts_quantized and not quant.experts_after_load:  # quantized as read: never all at full width
        # transformers v5's loader (cell.load.library_api checked it is there)
        from tunegrid.cell.experts import quant as expert_quant

        kwargs["quantization_config"] = expert_quant.load_config(bnb)
    elif quant.quantizes:  # bitsandbytes replaces nn.Linear (4-bit or 8-bit as the row's settings say)
        kwargs["quantization_config"] = BitsAndBytesConfig(**bnb)
    # every quantization reads the checkpoint the same way (pread, no mapping), so what differs between
    # their load peaks is what each keeps in full precision
    with conversion_errors_named():
        model = load_causal_lm(model_dir, kwargs)
    if quant.experts_after_load:  # int8-experts: the 8-bit load replaced nn.Linear; the experts now, where they are
        from tunegrid.cell.experts.int8 import quantize_experts

        quantize_experts(model)
    if quant.quantizes:
        from tunegrid.cell.load.quant_audit import disable_cpu_inference_packing

        # before any forward: an eval-mode no_grad forward on an AVX512-BF16 CPU would repack the
        # 4-bit weights into a layout without backward, for good (see disable_cpu_inference_packing)
        disable_cpu_inference_packing(model)
    if device.type != "cuda":
        model.to(device)
        hand_back_freed_heap()  # the load's freed read and cast buffers would stay in every step's peak
    if precision.residual_fp32:
        keep_residual_fp32(model)
    return model


def load_causal_lm(model_dir: Path, kwargs: dict[str, Any]) -> Any:
    """from_pretrained, on transformers v5 through experts/quant.py (the checkpoint read without a mapping,
    cell.load.checkpoint_reader; the nf4-experts quantizer registered). On 4.x (a library stack) transformers' own
    reader: 4.57 cannot take the unread tensors as a state_dict, so its load maps the safetensors files and their
    pages count in its load peak (not in its step peaks: the files are closed by then)."""
    from tunegrid.cell.load.library_api import has_v5_loading

    if has_v5_loading():
        from tunegrid.cell.experts import quant as expert_quant

        return expert_quant.load_causal_lm(model_dir, kwargs)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=bool(kwargs.get("trust_remote_code")))
    written = json.loads((Path(model_dir) / "config.json").read_text())
    for v5_name, v4_name in V5_CONFIG_RENAMES.items():
        if v5_name in written and hasattr(config, v4_name) and v5_name not in getattr(config, "attribute_map", {}):
            setattr(config, v4_name, written[v5_name])
    loading = (
        "dtype",
        "use_safetensors",
        "trust_remote_code",
        "attn_implementation",
        "quantization_config",
        "device_map",
    )
    for key in [k for k in kwargs if k not in loading and hasattr(config, k)]:  # a recipe's config.json values:
        setattr(config, key, kwargs.pop(key))  # with a config given, 4.x would not apply them itself
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, **kwargs)
    own_memory(model)
    return model


def own_memory(model: Any) -> None:
    """After a 4.x load: the full-precision tensors copied out of the mapped checkpoint files (4.x leaves them
    views of the mapping, which keeps every page it read resident, counted in RSS for the whole run) and the
    heap pages the load freed handed back (glibc keeps them otherwise). The v5 path reads without a mapping."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and param.is_floating_point():
                    param.data = param.data.clone()
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.clone()
    hand_back_freed_heap()


def hand_back_freed_heap() -> None:
    """Return to the OS the heap pages a load freed (glibc keeps them resident otherwise, counted in the process's
    RSS for the whole run). A checkpoint cast as it loads frees its read buffers: measured on Gemma 3 270M read
    from fp32 into fp16, 163 MB handed back (SmolLM2-135M: 62 MB), which each step's peak carried before."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim this way
        pass


def load_tokenizer(model_dir: Path, trust_remote_code: bool) -> Any:
    """The checkpoint's tokenizer. One saved by transformers v5 names its class TokenizersBackend, which 4.x
    (a library stack) lacks; its tokenizer.json, saved beside, is what 4.x's fast tokenizer reads."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "TokenizersBackend" not in str(exc) or not (Path(model_dir) / "tokenizer.json").exists():
            raise
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)


def keep_residual_fp32(model: Any) -> None:
    """The residual stream in fp32 from the embeddings on, while the weights stay in their storage dtype.

    Why this is enough: the stream starts as the embeddings' output, and a decoder block adds its attention and
    MLP outputs to the stream it was given, so an fp32 stream stays fp32 by type promotion (fp32 + fp16 is fp32).
    The norms return their input's dtype, so their outputs stay fp32 too; under autocast each matmul still casts
    its normalized input to the compute dtype. A sum of layer outputs past 65504 (real Gemma 3's stream reaches
    1.6x that while no single module's output does) then never exists in fp16. vLLM keeps Gemma's residual in
    fp32 under fp16 for the same reason.
    """
    import torch

    def widen(_module: Any, _inputs: Any, output: Any) -> Any:
        return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output

    model.get_input_embeddings().register_forward_hook(widen)


def use_cpu_kernels(kernels: CellKernels, device: Any) -> None:
    """torch's oneDNN kernels on or off for this cell, and fp16 matmuls with fp32 sums in tunegrid's blocks, as
    its plan says (the `cell_plan` rule decided it: tunegrid.prepare.cpu_kernels; oneDNN off for CPU bf16 with
    routed experts, and fp16 with them where oneDNN runs fp16; the fp16 matmuls for every CPU fp16 cell). Set on
    a CPU for the process: a worker trains one cell."""
    import torch

    if device.type == "cpu":
        torch.backends.mkldnn.enabled = kernels.cpu_onednn_off is None
    if device.type == "cpu" and kernels.cpu_fp16_matmul:
        from tunegrid.cell.nonfinite.fp16_matmul import install

        install()


def bnb_settings(spec: CellSpec, precision: Any) -> dict[str, Any]:
    """BitsAndBytesConfig's arguments for the cell's quantization (its row of the quantization table), the compute
    dtype by name (as an adapter's record keeps them); empty for a cell without quantization."""
    return quant_row(spec.axes.quant).bnb_settings(precision.compute_dtype)


@contextlib.contextmanager
def conversion_errors_named() -> Iterator[None]:
    """Re-raise transformers' "issues during automatic conversion" RuntimeError with the first exception
    its report logged (e.g. an allocator's "can't allocate memory"), so the failure is classified by it."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    report = logging.getLogger(REPORT_LOGGER)
    report.addHandler(handler)
    try:
        yield
    except RuntimeError as exc:
        found = EXCEPTION_LINE.search("\n".join(records))
        if found is None or "conversion" not in str(exc):
            raise
        raise RuntimeError(f"converting a checkpoint tensor: {found.group(1)}: {found.group(2)}") from exc
    finally:
        report.removeHandler(handler)


def loftq_arguments(lora: LoraSpec, model: Any) -> dict[str, Any]:
    """LoraConfig's LoftQ arguments where lora.loftq_bits asks for it (peft's loftq_init computes on CUDA only)."""
    if not lora.loftq_bits:
        return {}
    from peft import LoftQConfig

    if next(model.parameters()).device.type != "cuda":
        raise RuntimeError("peft's LoftQ initialization runs on CUDA only (its loftq_init moves each weight there)")
    return {"init_lora_weights": "loftq", "loftq_config": LoftQConfig(lora.loftq_bits, lora.loftq_iter)}


def attach_lora(model: Any, spec: CellSpec) -> Any:
    """peft's LoRA; adapters on 4-bit (nf4-experts) expert tensors train over the NF4 base (cell/experts/lora.py)."""
    from peft import LoraConfig, get_peft_model

    from tunegrid.cell.experts.lora import adopt_quantized_experts, expand_targets, nest_in_declared_order
    from tunegrid.cell.load.library_api import has_v5_loading

    lora = spec.lora
    if spec.train.gradient_checkpointing:
        set_activation_checkpointing(model, True)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # peft's own all-linear (every linear layer but the output head) when the import could not resolve it
        # a string is a regex peft full-matches against each module's name (lora.target_regex)
        target_modules=lora.target_regex
        or ("all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules) or None),
        target_parameters=list(lora.target_parameters) or None,
        modules_to_save=list(lora.modules_to_save) or None,
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        task_type="CAUSAL_LM",
        **loftq_arguments(lora, model),
    )
    if has_v5_loading():  # on transformers 4.x (a library stack) experts are modules: nothing to rename
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
        from transformers.conversion_mapping import get_model_conversion_mapping

        # peft's own v4->v5 renaming (expert gate/up/down_proj modules -> fused target_parameters) first, as
        # get_peft_model would (it is idempotent), so that the 4-bit experts it names are expanded too
        convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    if config.target_parameters:
        config.target_parameters = expand_targets(model, sorted(config.target_parameters))
    adapted = get_peft_model(model, config)
    nest_in_declared_order(adapted.base_model.model)
    adopt_quantized_experts(adapted)
    return adapted


def set_activation_checkpointing(model: Any, on: bool) -> None:
    """Activation checkpointing on (non-reentrant, so LoRA on a frozen base gets its gradients) or off.

    transformers renamed gradient_checkpointing_* to activation_checkpointing_* in v5 and warns on the old
    names; the old ones stay the fallback for a v5 release before the rename.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
