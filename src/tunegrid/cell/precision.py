"""The one place where dtype decisions live: precision name -> storage dtype, autocast, GradScaler.

Why an explicit plan: HF Trainer with fp16=True on CPU silently trains in fp32. Here the plan says what
it chose and why, and the run records the dtypes actually seen so a mismatch is visible.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp16-islands": "float16"}


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    precision: str
    device_type: str
    compute_dtype: str  # what autocast computes matmuls in (bitsandbytes' compute dtype too)
    storage_dtype: str  # frozen base weights that are not quantized
    adapter_dtype: str  # trainable LoRA params: always fp32 masters
    autocast: bool
    grad_scaler: bool
    reason: str
    fp32_islands: bool = False  # the modules that overflow fp16 compute and return fp32 (cell/islands.py)

    def torch_dtype(self, which: str = "compute") -> Any:
        import torch

        return getattr(torch, getattr(self, f"{which}_dtype"))

    def describe(self) -> str:
        return (
            f"precision={self.precision} on {self.device_type}: compute {self.compute_dtype}, base weights "
            f"{self.storage_dtype}, adapters {self.adapter_dtype}, autocast={'on' if self.autocast else 'off'}, "
            f"GradScaler={'on' if self.grad_scaler else 'off'}{', fp32 islands' if self.fp32_islands else ''} "
            f"({self.reason})"
        )


def plan_precision(precision: str, device_type: str) -> PrecisionPlan:
    if precision not in DTYPE_NAMES:
        raise ValueError(f"precision {precision!r}: choose one of {sorted(DTYPE_NAMES)}")
    dtype = DTYPE_NAMES[precision]
    if precision == "fp32":
        reason = "full precision, nothing to scale"
    elif precision == "bf16":
        reason = "bf16 has fp32's exponent range, so no loss scaling is needed"
    elif precision == "fp16":
        reason = "fp16 overflows past 65504 and underflows small grads: dynamic loss scaling"
    else:
        reason = (
            "fp16 matmuls with dynamic loss scaling; the modules whose activations near 65504 compute and return "
            "fp32, so the residual stream they feed stays fp32"
        )
    return PrecisionPlan(
        precision=precision,
        device_type=device_type,
        compute_dtype=dtype,
        storage_dtype=dtype,
        adapter_dtype="float32",
        autocast=precision != "fp32",
        grad_scaler=dtype == "float16",
        reason=reason,
        fp32_islands=precision == "fp16-islands",
    )


def autocast_context(plan: PrecisionPlan) -> contextlib.AbstractContextManager[Any]:
    import torch

    if not plan.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=plan.device_type, dtype=plan.torch_dtype("compute"))


def make_grad_scaler(plan: PrecisionPlan) -> Any | None:
    import torch

    return torch.amp.GradScaler(plan.device_type) if plan.grad_scaler else None
