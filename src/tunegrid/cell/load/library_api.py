"""The library APIs a cell's code calls that not every version of those libraries has.

A cell may run on a library stack (tunegrid.study.stacks) with another transformers or peft than the one
tunegrid was written against. Before it loads anything, the worker checks that every API the cell will call
exists in the versions it runs on; one that does not ends the cell `unsupported`, naming the package, its
version and the API (never `error`: the cell's settings are fine, this stack cannot run them). A missing API
that slips past the table (an ImportError or a module's missing attribute raised from inside a library) is
read the same way by `missing_api_of`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.meanings import quant_row

# the packages whose missing APIs are this stack's, not tunegrid's (their import names)
LIBRARIES = ("transformers", "peft", "bitsandbytes", "accelerate", "tokenizers", "huggingface_hub", "torch")
DISTRIBUTIONS = {"huggingface_hub": "huggingface-hub"}


class MissingLibraryApi(Exception):
    """The library version this cell runs on lacks an API the cell needs."""


def _always(spec: CellSpec) -> bool:
    return True


def _quantizes(spec: CellSpec) -> bool:
    return quant_row(spec.axes.quant).quantizes


def _experts_quantized(spec: CellSpec) -> bool:
    """nf4-experts: quantized inside transformers' loader."""
    row = quant_row(spec.axes.quant)
    return row.experts_quantized and not row.experts_after_load


def _experts_after_load(spec: CellSpec) -> bool:
    return quant_row(spec.axes.quant).experts_after_load


def _targets_parameters(spec: CellSpec) -> bool:
    return bool(spec.lora.target_parameters)


def _offloads_weights(spec: CellSpec) -> bool:
    return spec.train.weight_offloading


@dataclass(frozen=True)
class Api:
    module: str
    attribute: str  # dotted below the module ("" for the module itself)
    needed_for: str
    applies: Callable[[CellSpec], bool] = _always


APIS: tuple[Api, ...] = (
    Api("transformers", "AutoModelForCausalLM", "loading the model"),
    Api("transformers", "AutoTokenizer", "loading the tokenizer"),
    Api("transformers", "get_scheduler", "the learning-rate schedule"),
    Api("transformers", "BitsAndBytesConfig", "a bitsandbytes load", _quantizes),
    Api("peft", "get_peft_model", "attaching LoRA"),
    Api("peft", "LoraConfig.target_parameters", "LoRA on parameters (lora.target_parameters)", _targets_parameters),
    Api(
        "bitsandbytes.functional",
        "int8_vectorwise_quant",
        "int8-experts (row-wise int8 of the expert tensors)",
        _experts_after_load,
    ),
    Api(
        "torch._C",
        "_current_graph_task_id",
        "weight offloading (it tells the forward activation checkpointing reruns in the backward)",
        _offloads_weights,
    ),
    Api(
        "transformers.core_model_loading",
        "ConversionOps",
        "nf4-experts (its quantizer runs inside transformers' v5 weight conversion, on fused 3-D experts)",
        _experts_quantized,
    ),
    Api(
        "transformers.quantizers.quantizer_bnb_4bit",
        "Bnb4BitHfQuantizer.param_needs_quantization",
        "nf4-experts (the 4-bit quantizer it extends)",
        _experts_quantized,
    ),
)


def version_of(module: str) -> str:
    top = module.split(".")[0]
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(top, top))
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _import(module: str) -> Any:
    return importlib.import_module(module)


def _found(api: Api) -> bool:
    try:
        target: Any = _import(api.module)
        for part in filter(None, api.attribute.split(".")):
            target = getattr(target, part)  # a lazy module raises ImportError where the object cannot load
    except (ImportError, AttributeError):
        return False
    return True


def missing_api(spec: CellSpec) -> str | None:
    """One sentence naming the first API this cell needs that its libraries lack; None when all are there."""
    for api in APIS:
        if api.applies(spec) and not _found(api):
            name = f"{api.module}.{api.attribute}" if api.attribute else api.module
            top = api.module.split(".")[0]
            return f"{top} {version_of(api.module)} lacks {name}, which {api.needed_for} needs"
    return None


def require_apis(spec: CellSpec) -> None:
    missing = missing_api(spec)
    if missing is not None:
        raise MissingLibraryApi(missing)


_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
_CANNOT_IMPORT = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


def missing_api_of(exc: BaseException) -> str | None:
    """The missing API an exception stands for, when a library (not tunegrid) lacks it; else None."""
    if isinstance(exc, MissingLibraryApi):
        return str(exc)
    text = str(exc)
    if isinstance(exc, ImportError):
        found = _CANNOT_IMPORT.search(text)
        module, name = (found.group(2), found.group(1)) if found else (exc.name or "", "")
    elif isinstance(exc, AttributeError) and (found := _NO_ATTRIBUTE.search(text)):
        module, name = found.group(1), found.group(2)
    else:
        return None
    if module.split(".")[0] not in LIBRARIES:
        return None
    api = f"{module}.{name}" if name else module
    return f"{module.split('.')[0]} {version_of(module)} lacks {api}"


def has_v5_loading() -> bool:
    """transformers' v5 loader (weight conversion ops, fused MoE experts); absent in 4.x."""
    return importlib.util.find_spec("transformers.core_model_loading") is not None
