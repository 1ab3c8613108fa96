"""NF4 quantization of an expert tensor one expert at a time, bit-identical to bitsandbytes' quantize_4bit
of the whole, and its installation under bitsandbytes' parametrization."""

from __future__ import annotations

from typing import Any

NF4 = {"quant_type": "nf4", "compress_statistics": True}  # the same call the post-load path makes


BLOCKSIZE = 64  # bitsandbytes' default, which the post-load path uses


def quantize_per_expert(value: Any) -> tuple[Any, Any]:
    """bitsandbytes' NF4 quantization of `value` (double-quantized statistics), run one expert at a time.

    Its CPU kernel holds temporaries of about 1.5x its input; per expert they are 1/E of that. The first
    level is blockwise over the flattened tensor, so slices whose size is a whole number of blocks give
    the very bytes and block maxima of one call; the second level (statistics of all blocks) then runs once
    on the whole, as quantize_4bit does: the result is bit-identical to quantize_4bit(value).
    """
    import torch
    from bitsandbytes import functional as F

    per_expert = value[0].numel() if value.dim() >= 3 else 0
    if not per_expert or per_expert % (2 * BLOCKSIZE):
        return F.quantize_4bit(value, blocksize=BLOCKSIZE, **NF4)
    packed = torch.empty((value.numel() // 2, 1), dtype=torch.uint8, device=value.device)
    block_max = torch.empty(value.numel() // BLOCKSIZE, dtype=torch.float32, device=value.device)
    for index, expert in enumerate(value):
        quantize_expert_into(expert, index, packed, block_max)
    return packed, finish_state(block_max, value.shape, value.dtype, value.device)


def quantize_expert_into(expert: Any, index: int, packed: Any, block_max: Any) -> None:
    """The first NF4 level of expert `index` (its bytes and block maxima), written into its slice of the
    whole tensor's `packed` bytes and `block_max`; its size must be a whole number of 2 * BLOCKSIZE."""
    import torch

    out, maxima = torch.ops.bitsandbytes.quantize_4bit.default(expert, BLOCKSIZE, NF4["quant_type"], torch.uint8)
    packed[index * out.shape[0] : (index + 1) * out.shape[0]].copy_(out)
    block_max[index * maxima.numel() : (index + 1) * maxima.numel()].copy_(maxima.view(-1))


def finish_state(block_max: Any, shape: Any, dtype: Any, device: Any) -> Any:
    """The quantization state of a tensor whose first level is `block_max`: the second level (statistics
    of all blocks, double quantization) runs once on the whole, as quantize_4bit does."""
    from bitsandbytes import functional as F

    offset = block_max.mean()
    qabsmax, state2 = F.quantize_blockwise(block_max - offset, blocksize=256)
    return F.QuantState(
        absmax=qabsmax,
        shape=shape,
        dtype=dtype,
        blocksize=BLOCKSIZE,
        code=F.get_4bit_type(NF4["quant_type"], device=device),
        quant_type=NF4["quant_type"],
        offset=offset,
        state2=state2,
    )


def install_quantized(module: Any, name: str, data: Any, state: Any) -> None:
    """Put NF4 `data` with its `state` in place of module.<name>, as replace_parameter_4bit leaves it."""
    import torch
    from bitsandbytes.nn.parametrize import replace_parameter_4bit_prequantized

    setattr(module, name, torch.nn.Parameter(data, requires_grad=False))
    replace_parameter_4bit_prequantized(module, name, state.as_dict(packed=True), data.device)
    # transformers re-initializes whatever is not marked; a random init of the dequantized view is a wasted
    # full-precision temporary (the result is discarded, but the peak is not)
    module.parametrizations[name].original._is_hf_initialized = True
    # its init functions check that mark on the tensor they are given, and reading a parametrized name
    # dequantizes it first: only a module marked as a whole is skipped before that read. A module whose
    # other tensors are still to be loaded is not marked here, and its init dequantizes once (correct, costlier)
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    tensors += [plist.original for plist in module.parametrizations.values()]
    if all(getattr(tensor, "_is_hf_initialized", False) for tensor in tensors):
        module._is_hf_initialized = True
