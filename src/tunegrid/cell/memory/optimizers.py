"""The optimizer axis: torch's AdamW, or bitsandbytes' own 8-bit AdamW without and with paging, and what each
cell's optimizer state really held (measured from the optimizer after training, beside the estimate's figure).

What bitsandbytes 0.50 does (bitsandbytes/optim/optimizer.py, Optimizer2State): AdamW8bit keeps both moments
blockwise-quantized to uint8 with one fp32 absmax per 256 elements, except for tensors under min_8bit_size
(4096) elements, which keep fp32 moments. PagedAdamW8bit allocates the state of tensors of 1e5 elements or
more in CUDA managed memory (cudaMallocManaged), which the driver pages out to host memory under GPU memory
pressure: it moves bytes off the GPU, it does not shrink them. On a CPU there is nothing to page to: bitsandbytes
warns and allocates ordinary tensors, so there paged-adamw-8bit trains exactly as adamw-8bit.
"""

from __future__ import annotations

import warnings
from typing import Any

BNB_CLASSES = {"adamw-8bit": "AdamW8bit", "paged-adamw-8bit": "PagedAdamW8bit"}
# not state per element: bitsandbytes' quantization maps (one per optimizer) and torch's step counters
SHARED_STATE = ("qmap1", "qmap2", "step")


def make_optimizer(params: list[Any], name: str, lr: float, weight_decay: float) -> Any:
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    # on a CPU bitsandbytes warns at the first step that paging falls back to ordinary memory; the cell's facts
    # say so once (`paging`), the worker's log need not
    warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    return getattr(bnb.optim, BNB_CLASSES[name])(params, lr=lr, weight_decay=weight_decay)


def optimizer_facts(optimizer: Any, name: str, device_type: str) -> dict[str, Any]:
    """The state the optimizer held: bytes, how many tensors kept 8-bit or fp32 moments, and paged bytes."""
    import torch

    tensors = [
        value
        for state in optimizer.state.values()
        for key, value in state.items()
        if torch.is_tensor(value) and key not in SHARED_STATE
    ]
    moments = [state.get("state1", state.get("exp_avg")) for state in optimizer.state.values()]
    paged = sum(t.nbytes for t in tensors if getattr(t, "is_paged", False))
    if name != "paged-adamw-8bit":
        paging = "none"
    elif device_type == "cpu":
        paging = "cpu: not paged (bitsandbytes allocates ordinary memory; nothing to page to)"
    else:
        paging = "cuda managed memory" if paged else "none of its tensors reached 1e5 elements (device memory)"
    return {
        "name": name,
        "class": type(optimizer).__module__ + "." + type(optimizer).__name__,
        "state_bytes": sum(t.nbytes for t in tensors),
        "paged_bytes": paged,
        "paging": paging,
        "tensors_8bit": sum(1 for m in moments if m is not None and m.dtype == torch.uint8),
        "tensors_fp32": sum(1 for m in moments if m is not None and m.dtype == torch.float32),
    }
