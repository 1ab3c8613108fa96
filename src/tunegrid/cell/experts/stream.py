"""Expert tensors NF4-quantized one expert at a time as their checkpoint pieces are read.

A checkpoint that stores each expert apart (experts.<e>.gate_proj.weight, ...) is fused by transformers'
weight converters: every piece is read, stacked (MergeModulelist on dim 0), maybe concatenated or
transposed along the other dims, and only then handed to the quantizer. That holds all the pieces and
their fused result at once, twice the largest expert tensor in full precision. When the converter's
operations after the stack leave dim 0 alone, expert e of the fused tensor is those same operations run
on expert e's pieces alone, so each expert is read, fused, quantized into its slice of the NF4 bytes and
dropped: the full-precision tensor never exists. The bytes are those of quantizing the fused tensor
(the first NF4 level is blockwise per expert; the second runs once on all block maxima).

Which converters qualify is decided from the operation types and their dims, never from names; any
other converter, or a target kept in full precision, runs transformers' own conversion unchanged.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter
from transformers.quantizers.quantizers_utils import get_module_from_name

from tunegrid.cell.experts.nf4 import BLOCKSIZE, finish_state, install_quantized, quantize_expert_into


def _leaves_dim0(op: Any) -> bool:
    """True for an operation that, run on a stack of one expert, acts within that expert."""
    if isinstance(op, Concatenate):
        return op.dim >= 1
    if isinstance(op, Transpose):
        return min(op.dim0, op.dim1) >= 1 and not op.check_dims  # its check compares the whole shape
    return False


def streams_per_expert(operations: list[Any]) -> bool:
    return (
        bool(operations)
        and isinstance(operations[0], MergeModulelist)
        and operations[0].dim == 0
        and all(_leaves_dim0(op) for op in operations[1:])
    )


class ExpertStreamConverter(WeightConverter):
    """A WeightConverter that fuses and quantizes its target one expert at a time (see the module doc)."""

    __slots__ = ()

    def convert(
        self,
        layer_name: str,
        model: Any = None,
        config: Any = None,
        hf_quantizer: Any = None,
        loading_info: Any = None,
    ) -> dict[str, Any]:
        target = self._streamed_target(layer_name, model, hf_quantizer)
        if target is None:
            return super().convert(
                layer_name, model=model, config=config, hf_quantizer=hf_quantizer, loading_info=loading_info
            )
        module, attr, shape = target
        pending = {pattern: self.collected_tensors.pop(pattern) for pattern in list(self.collected_tensors)}
        packed = block_max = None
        dtype = device = None
        for index in range(shape[0]):
            pieces = {pattern: [_realize(jobs, index)] for pattern, jobs in pending.items()}
            for op in self.operations:
                pieces = op.convert(
                    pieces,
                    source_patterns=self.source_patterns,
                    target_patterns=self.target_patterns,
                    full_layer_name=layer_name,
                    model=model,
                    config=config,
                )
            (fused,) = pieces.values()
            expert = fused[0].contiguous()
            del pieces, fused
            if expert.shape != shape[1:]:
                raise ValueError(f"{layer_name}: expert {index} fused to {tuple(expert.shape)}, want {shape[1:]}")
            if packed is None:
                import torch

                dtype, device = expert.dtype, expert.device
                packed = torch.empty((shape.numel() // 2, 1), dtype=torch.uint8, device=device)
                block_max = torch.empty(shape.numel() // BLOCKSIZE, dtype=torch.float32, device=device)
            quantize_expert_into(expert, index, packed, block_max)
            del expert
        install_quantized(module, attr, packed, finish_state(block_max, shape, dtype, device))
        _return_freed_memory()
        if loading_info is not None:
            loading_info.missing_keys.discard(layer_name)
        return {}

    def _streamed_target(self, layer_name: str, model: Any, hf_quantizer: Any) -> tuple[Any, str, Any] | None:
        """(module, parameter name, shape) when `layer_name` is an expert tensor quantized at load whose
        pieces are one per expert and whose experts are whole numbers of NF4 byte-blocks; else None."""
        if hf_quantizer is None or self.quantization_operation is None or model is None:
            return None
        if not hasattr(hf_quantizer, "is_expert") or not streams_per_expert(self.operations):
            return None
        try:
            if not hf_quantizer.is_expert(model, layer_name):
                return None
        except AttributeError:  # a name that is not one parameter of the model
            return None
        module, attr = get_module_from_name(model, layer_name)
        shape = module._parameters[attr].shape
        if shape[1:].numel() % (2 * BLOCKSIZE):
            return None
        if any(len(jobs) != shape[0] for jobs in self.collected_tensors.values()):
            return None
        return module, attr, shape


def _return_freed_memory() -> None:
    """Hand the heap pages the freed expert pieces leave back to the system (glibc's malloc_trim). The
    pieces are a few MiB each, which glibc serves from its heap once its mmap threshold has risen, and
    keeps after they are freed: RSS would creep by what the heap's fragmentation holds, layer by layer."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim this way
        pass


def _realize(jobs: list[Any], index: int) -> Any:
    """Read piece `index` (a future or a deferred read) and drop the loader's handle on it."""
    job, jobs[index] = jobs[index], None
    return job.result() if isinstance(job, Future) else job()


def stream_expert_merges(conversions: list[Any]) -> list[Any]:
    """`conversions` with every expert-merging WeightConverter made an ExpertStreamConverter."""
    streamed = []
    for conversion in conversions:
        if type(conversion) is WeightConverter and streams_per_expert(conversion.operations):
            copy = ExpertStreamConverter(
                list(conversion._original_source_patterns),
                list(conversion._original_target_patterns),
                operations=list(conversion.operations),
                force_cpu=conversion.force_cpu,
            )
            copy.scope_prefix, copy.base_model_prefix = conversion.scope_prefix, conversion.base_model_prefix
            conversion = copy
        streamed.append(conversion)
    return streamed
