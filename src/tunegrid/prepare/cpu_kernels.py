"""Which of torch's CPU kernels a cell trains with, decided before it trains (the estimate and the worker read it).

Light module: no torch (the plan rules read it in the Snakemake process).
"""

from __future__ import annotations

from typing import Any

from tunegrid.plans import precision_plan


def routed_experts(config: dict[str, Any]) -> int:
    """The number of routed experts of a model's config (0: a dense model)."""
    config = config.get("text_config") or config
    return int(next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)), 0))


def cpu_onednn_off(spec: dict[str, Any], config: dict[str, Any], device: str) -> str | None:
    """Why a cell trains with torch's oneDNN (mkldnn) kernels off, or None where it keeps them.

    On CPU, torch runs bf16 matmuls through oneDNN, which builds a JIT kernel for every new shape and keeps
    it. Routed experts see a different number of tokens at every step, so each step brings new shapes, and the
    process grows by ~20-30 MiB a step for as long as it trains (qwen3moe-tiny, batch 8: 512 -> 991 MiB over 30
    steps on an AVX512-BF16 host; oneDNN's emulated bf16 on AVX512 without BF16 grows less, AVX2 hosts do not
    use it; benchmarks/onednn_bf16_growth.py). Without oneDNN the same loop is flat and its bf16 matmuls run
    torch's own kernels (fp32 accumulation, as oneDNN's), slower (~1.5x on that host): a memory figure that
    means something, and the time recorded."""
    if device != "cpu" or precision_plan(spec["axes"]["precision"]).dtype != "bfloat16":
        return None
    if not routed_experts(config):
        return None
    return (
        "CPU bf16 with routed experts: oneDNN builds a kernel per token count an expert sees and keeps it, so the "
        "process would grow every step; torch's own bf16 kernels instead (flat memory, slower)"
    )


def cpu_fp16_matmul(spec: dict[str, Any], device: str) -> str | None:
    """Why a cell's fp16 matmuls run as fp32 products and sums over fp16 operands, rounded to fp16 once (the
    arithmetic of a GPU's fp16 GEMM; tunegrid.cell.fp16_matmul), or None where torch's own kernels run them.

    On a CPU, torch's fp16 matrix products accumulate in fp32 as well, but where an operand is used transposed
    (every backward through a linear layer) they run 19-65x slower than fp32 sums in blocks
    (benchmarks/cpu_fp16_matmul.py); a real model's fp16 step spent 99 % of its time there."""
    if device != "cpu" or precision_plan(spec["axes"]["precision"]).dtype != "float16":
        return None
    return (
        "CPU fp16: matmuls multiply and sum fp16 operands in fp32 and round each result to fp16 once, as a GPU's "
        "fp16 GEMM does (torch's CPU fp16 kernels, same arithmetic, are 19-65x slower where an operand is transposed)"
    )
