"""The one place where dtype decisions live: precision name -> storage dtype, autocast, GradScaler.

Why an explicit precision setup (PrecisionSetup: a precision's row of tunegrid.meanings as the cell applies it on
its device, recorded as result.json's `precision_plan`): HF Trainer with fp16=True on CPU silently trains in fp32.
Here the precision setup says what it chose and why, and the run records the dtypes actually seen so a mismatch is
visible.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from tunegrid.meanings import PRECISION_ROWS
from tunegrid.vocabulary import PRECISIONS


@dataclass(frozen=True, kw_only=True)
class PrecisionSetup:
    precision: str
    device_type: str
    compute_dtype: str  # what autocast computes matmuls in (bitsandbytes' compute dtype too)
    storage_dtype: str  # frozen base weights that are not quantized
    adapter_dtype: str  # trainable LoRA params: always fp32 masters
    autocast: bool
    grad_scaler: bool
    reason: str
    fp32_islands: bool = False  # the modules that overflow fp16 compute and return fp32 (cell/nonfinite/islands.py)
    residual_fp32: bool = False  # the residual stream held in fp32 from the embeddings on (cell/load/model.py)

    def torch_dtype(self, which: str = "compute") -> Any:
        import torch

        return getattr(torch, getattr(self, f"{which}_dtype"))

    def describe(self) -> str:
        return (
            f"precision={self.precision} on {self.device_type}: compute {self.compute_dtype}, base weights "
            f"{self.storage_dtype}, adapters {self.adapter_dtype}, autocast={'on' if self.autocast else 'off'}, "
            f"GradScaler={'on' if self.grad_scaler else 'off'}{', fp32 islands' if self.fp32_islands else ''}"
            f"{', residual stream fp32' if self.residual_fp32 else ''} "
            f"({self.reason})"
        )


def precision_setup(precision: str, device_type: str) -> PrecisionSetup:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {sorted(PRECISIONS)}")
    row = PRECISION_ROWS[precision]  # type: ignore[index]  # a StrEnum key equals its name
    return PrecisionSetup(
        precision=precision,
        device_type=device_type,
        compute_dtype=row.dtype,
        storage_dtype=row.storage_dtype,
        adapter_dtype="float32",
        autocast=row.autocast,
        grad_scaler=row.grad_scaler,
        reason=row.reason,
        fp32_islands=row.fp32_islands,
        residual_fp32=row.residual_fp32,
    )


def autocast_context(precision: PrecisionSetup) -> contextlib.AbstractContextManager[Any]:
    import torch

    if not precision.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=precision.device_type, dtype=precision.torch_dtype("compute"))


def make_grad_scaler(precision: PrecisionSetup, init_scale: float = 65536.0) -> Any | None:
    import torch

    return torch.amp.GradScaler(precision.device_type, init_scale=init_scale) if precision.grad_scaler else None
