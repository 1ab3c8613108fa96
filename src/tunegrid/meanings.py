"""What each precision and each quantization means, one row per value (PRECISION_ROWS, QUANT_ROWS): the loader,
the adapter record, the audit, the memory estimate, the plots and the recommender read these rows and compare no
names.

A new precision or quantization is a member of its enum in tunegrid.vocabulary, a row here, and its
effect where it acts (for a quantization: the loader's branch if bitsandbytes needs another config).

Light module: standard library only (the estimate and the report read it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunegrid.vocabulary import Precision, Quant


@dataclass(frozen=True, kw_only=True)
class PrecisionRow:
    """One compute precision: its dtype (what autocast computes matmuls in), the dtype the weights that are not
    quantized are stored in (`storage`, the compute dtype unless a row says otherwise), autocast, loss scaling,
    and where the recommender ranks it as a fix for a non-finite cell."""

    precision: Precision
    dtype: str  # torch dtype name
    bytes_per_value: int  # of a stored weight that is not quantized
    autocast: bool
    grad_scaler: bool
    reason: str
    nan_fix_rank: int  # lower is proposed first where a twin in it ran ok
    # the hardware arithmetic its matmuls run in: what a target's native/emulated support and the probe's
    # per-precision constants are read for
    arithmetic: Precision
    # the modules whose activations near fp16's range compute and return fp32 (cell/nonfinite/islands.py)
    fp32_islands: bool = False
    # the dtype weights that are not quantized are stored in; None: the compute dtype
    storage: str | None = None
    # the residual stream (the decoder layers' inputs and outputs) held in fp32 from the embeddings on: each
    # block's additions are promoted to fp32 while its matmuls stay in the compute dtype (cell/load/model.py)
    residual_fp32: bool = False

    @property
    def storage_dtype(self) -> str:
        return self.storage or self.dtype


PRECISION_ROWS: dict[Precision, PrecisionRow] = {
    row.precision: row
    for row in (
        PrecisionRow(
            precision=Precision.FP32,
            dtype="float32",
            bytes_per_value=4,
            autocast=False,
            grad_scaler=False,
            reason="full precision, nothing to scale",
            nan_fix_rank=2,
            arithmetic=Precision.FP32,
        ),
        PrecisionRow(
            precision=Precision.BF16,
            dtype="bfloat16",
            bytes_per_value=2,
            autocast=True,
            grad_scaler=False,
            reason="bf16 has fp32's exponent range, so no loss scaling is needed",
            nan_fix_rank=0,
            arithmetic=Precision.BF16,
        ),
        PrecisionRow(
            precision=Precision.FP16,
            dtype="float16",
            bytes_per_value=2,
            autocast=True,
            grad_scaler=True,
            reason="fp16 overflows past 65504 and underflows small grads: dynamic loss scaling",
            nan_fix_rank=3,
            arithmetic=Precision.FP16,
        ),
        PrecisionRow(
            precision=Precision.FP16_ISLANDS,
            dtype="float16",
            bytes_per_value=2,  # the islands' few modules in fp32 are not counted
            autocast=True,
            grad_scaler=True,
            reason=(
                "fp16 matmuls with dynamic loss scaling; the modules whose activations near 65504 compute and "
                "return fp32, so the residual stream they feed stays fp32"
            ),
            nan_fix_rank=1,
            arithmetic=Precision.FP16,
            fp32_islands=True,
        ),
        PrecisionRow(
            precision=Precision.FP16_MIXED,
            dtype="float16",
            storage="float32",
            bytes_per_value=4,
            autocast=True,
            grad_scaler=True,
            reason=(
                "fp16 matmuls under autocast over fp32-stored weights (mixed precision with fp32 master weights): "
                "the embeddings, norms and residual additions stay fp32"
            ),
            nan_fix_rank=1,
            arithmetic=Precision.FP16,
        ),
        PrecisionRow(
            precision=Precision.FP16_RESIDUAL,
            dtype="float16",
            bytes_per_value=2,
            autocast=True,
            grad_scaler=True,
            reason=(
                "fp16 weights and matmuls with dynamic loss scaling; the residual stream is kept in fp32 from the "
                "embeddings on, so a sum past 65504 between the layers stays finite"
            ),
            nan_fix_rank=1,
            arithmetic=Precision.FP16,
            residual_fp32=True,
        ),
    )
}

NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one absmax per 64 values
DQ_BLOCK = 256  # double quantization: the block absmax values are themselves quantized in blocks of 256


@dataclass(frozen=True, kw_only=True)
class QuantRow:
    """One base-weight quantization.

    `bnb`: BitsAndBytesConfig's arguments (the compute dtype goes in `compute_dtype_arg`, by name); None: no
    bitsandbytes. `record_key`: where an adapter's base_model.json keeps them. `experts_quantized`: the fused
    >=3-D MoE experts are quantized too (as the checkpoint is read). `bytes_per_param`: storage of one
    quantized weight value, block or row statistics besides (`block`, `row_scale_bytes`). `audit_dtype`: how
    the audit names a quantized tensor's storage. `memory_fix_rank`: the recommender's order among
    quantizations offered for an out-of-memory cell (None: not a memory fix).
    """

    quant: Quant
    bits: int | None
    bnb: dict[str, Any] | None
    compute_dtype_arg: str | None
    record_key: str | None
    experts_quantized: bool
    bytes_per_param: float
    block: int | None  # values per absmax (double-quantized in DQ_BLOCK blocks)
    row_scale_bytes: int  # per output row (LLM.int8's fp32 scale)
    audit_dtype: str | None
    memory_fix_rank: int | None
    # experts quantized once the load is done (every expert at full width until then), not as they are read
    experts_after_load: bool = False
    # bytes per value a quantized expert is dequantized to on use (None: the precision's storage dtype)
    experts_dequantized_bytes: int | None = None

    @property
    def quantizes(self) -> bool:
        return self.bits is not None

    def quantized_bytes(self, shape: list[int]) -> float:
        """Bytes a weight of this shape takes once quantized, statistics included."""
        numel = 1
        for dim in shape:
            numel *= dim
        stats = 0.0
        if self.block:
            blocks = numel / self.block
            stats = blocks + (blocks / DQ_BLOCK) * 4  # uint8 absmax + fp32 second level
        if self.row_scale_bytes and shape:  # one per row over the last dim (an expert tensor's rows: E x out)
            stats += numel // shape[-1] * self.row_scale_bytes
        return numel * self.bytes_per_param + stats

    def bnb_settings(self, compute_dtype: Any) -> dict[str, Any]:
        """BitsAndBytesConfig's arguments with this compute dtype (a torch dtype to load, its name to record)."""
        settings = dict(self.bnb or {})
        if self.compute_dtype_arg:
            settings[self.compute_dtype_arg] = compute_dtype
        return settings


_NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}

QUANT_ROWS: dict[Quant, QuantRow] = {
    row.quant: row
    for row in (
        QuantRow(
            quant=Quant.NONE,
            bits=None,
            bnb=None,
            compute_dtype_arg=None,
            record_key=None,
            experts_quantized=False,
            bytes_per_param=0.0,
            block=None,
            row_scale_bytes=0,
            audit_dtype=None,
            memory_fix_rank=None,
        ),
        QuantRow(
            quant=Quant.NF4,
            bits=4,
            bnb=_NF4,
            compute_dtype_arg="bnb_4bit_compute_dtype",
            record_key="bnb_4bit",
            experts_quantized=False,  # bitsandbytes replaces nn.Linear only
            bytes_per_param=0.5,
            block=NF4_BLOCK,
            row_scale_bytes=0,
            audit_dtype="nf4",
            memory_fix_rank=1,
        ),
        QuantRow(
            quant=Quant.NF4_EXPERTS,
            bits=4,
            bnb=_NF4,
            compute_dtype_arg="bnb_4bit_compute_dtype",
            record_key="bnb_4bit",
            experts_quantized=True,
            bytes_per_param=0.5,
            block=NF4_BLOCK,
            row_scale_bytes=0,
            audit_dtype="nf4",
            memory_fix_rank=0,
        ),
        QuantRow(
            quant=Quant.INT8,
            bits=8,
            bnb={"load_in_8bit": True},  # LLM.int8: no compute dtype (matmuls in fp16 with outliers split)
            compute_dtype_arg=None,
            record_key="bnb_8bit",
            experts_quantized=False,  # bitsandbytes replaces nn.Linear only
            bytes_per_param=1.0,
            block=None,
            row_scale_bytes=4,  # SCB: one fp32 absmax per output row
            audit_dtype="int8",
            memory_fix_rank=2,
        ),
        QuantRow(
            quant=Quant.INT8_EXPERTS,
            bits=8,
            bnb={"load_in_8bit": True},
            compute_dtype_arg=None,
            record_key="bnb_8bit",
            experts_quantized=True,  # row-wise int8 (bitsandbytes' int8_vectorwise_quant) under a parametrization
            bytes_per_param=1.0,
            block=None,
            row_scale_bytes=4,  # one fp32 absmax per row over the last dim
            audit_dtype="int8",
            memory_fix_rank=None,  # the recipe's own setting, carried; not offered as a fix
            experts_after_load=True,
            experts_dequantized_bytes=4,  # int8_vectorwise_dequant returns fp32
        ),
    )
}


def memory_fix_quants() -> list[Quant]:
    """Quantizations the recommender offers an out-of-memory cell, most preferred first."""
    ranked = [p for p in QUANT_ROWS.values() if p.memory_fix_rank is not None]
    return [p.quant for p in sorted(ranked, key=lambda p: p.memory_fix_rank or 0)]


def precision_row(precision: str) -> PrecisionRow:
    return PRECISION_ROWS[Precision(precision)]


def quant_row(quant: str) -> QuantRow:
    return QUANT_ROWS[Quant(quant)]
