"""Which of torch's CPU kernels a cell trains with, decided before it trains (the estimate and the worker read it).

Light module: no torch (the plan rules read it in the Snakemake process).
"""

from __future__ import annotations

from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.meanings import precision_row


def routed_experts(config: dict[str, Any]) -> int:
    """The number of routed experts of a model's config (0: a dense model)."""
    config = config.get("text_config") or config
    return int(next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)), 0))


def cpu_onednn_matmul(capabilities: dict[str, Any]) -> dict[str, bool]:
    """Whether torch hands this host's CPU matmuls in bf16 and in fp16 to oneDNN, from the probe's record.

    The probe asks torch what it checks itself (`cpu_onednn_matmul`, tunegrid.prepare.environment:
    torch.ops.mkldnn._is_mkldnn_fp16_supported, true where the CPU has AVX512-FP16 or AMX-FP16, and
    _is_mkldnn_bf16_supported, true on AVX512 whether bf16 is native or emulated there). A record from before it
    asked is read by the CPU's ISA flags: a dtype `native` in its `cpu_precision` (or, where the record kept only
    the flags, what they give): the same answer for fp16 and, for bf16, only the hosts where oneDNN runs it
    natively. An empty record (no probe) says neither."""
    recorded = capabilities.get("cpu_onednn_matmul")
    if isinstance(recorded, dict) and all(isinstance(recorded.get(k), bool) for k in ("bf16", "fp16")):
        return {"bf16": recorded["bf16"], "fp16": recorded["fp16"]}
    support = capabilities.get("cpu_precision")
    if not support and capabilities.get("device", "cpu") == "cpu":
        support = capabilities.get("precision")  # a CPU probe's `precision` is its CPU's
    if not support and isinstance(capabilities.get("cpu"), dict):
        from tunegrid.prepare.probes import cpu_precision_support  # standard library at import (no torch)

        support = cpu_precision_support(capabilities["cpu"].get("isa_flags") or [])
    return {name: (support or {}).get(name) == "native" for name in ("bf16", "fp16")}


def cpu_onednn_off(
    spec: CellSpec, config: dict[str, Any], device: str, onednn_matmul: dict[str, bool] | None = None
) -> str | None:
    """Why a cell trains with torch's oneDNN (mkldnn) kernels off, or None where it keeps them. `onednn_matmul`:
    the dtypes whose CPU matmuls torch hands to oneDNN on the host (cpu_onednn_matmul of its probe record; None:
    not known, fp16 taken as not).

    On CPU, torch runs bf16 matmuls through oneDNN, which builds a JIT kernel for every new shape and keeps
    it. Routed experts see a different number of tokens at every step, so each step brings new shapes, and the
    process grows by ~20-30 MiB a step for as long as it trains (qwen3moe-tiny, batch 8: 512 -> 991 MiB over 30
    steps on an AVX512-BF16 host; oneDNN's emulated bf16 on AVX512 without BF16 grows less, AVX2 hosts do not
    use it; benchmarks/onednn_bf16_growth.py). Without oneDNN the same loop is flat and its bf16 matmuls run
    torch's own kernels (fp32 accumulation, as oneDNN's), slower (~1.5x on that host): a memory figure that
    means something, and the time recorded.

    fp16 the same, where torch hands fp16 matmuls to oneDNN (a CPU with AVX512-FP16 or AMX-FP16): the experts'
    grouped matmul runs one product per expert (aten::mm.out, which tunegrid's fp16 kernels leave to torch), and
    oneDNN keeps a kernel for every token count (~0.7 MiB each): on a Xeon with AVX512-FP16 the default study's
    six qwen3moe-tiny fp16 cells grew at every step (~8 MiB a step at batch 2, 15-20 at batch 8), their estimate
    0.90-0.92 of their first step's peak and 0.39-0.59 of their last (tests/data/evidence-cpu-xeon-avx512fp16.json).
    Elsewhere torch's fp16 matmuls never reach oneDNN, and it stays on."""
    if device != "cpu" or not routed_experts(config):
        return None
    dtype = precision_row(spec.axes.precision).dtype
    if dtype == "bfloat16":
        return (
            "CPU bf16 with routed experts: oneDNN builds a kernel per token count an expert sees and keeps it, so "
            "the process would grow every step; torch's own bf16 kernels instead (flat memory, slower)"
        )
    if dtype == "float16" and (onednn_matmul or {}).get("fp16"):
        return (
            "CPU fp16 with routed experts on a CPU whose oneDNN runs fp16 (AVX512-FP16/AMX-FP16): oneDNN builds a "
            "kernel per token count an expert sees and keeps it, so the process would grow every step; torch's "
            "own fp16 kernels for the experts' products instead (no kernel kept per shape)"
        )
    return None


def cpu_fp16_matmul(spec: CellSpec, device: str) -> str | None:
    """Why a cell's fp16 matmuls run as fp32 products and sums over fp16 operands, rounded to fp16 once (the
    arithmetic of a GPU's fp16 GEMM; tunegrid.cell.nonfinite.fp16_matmul), or None where torch's own kernels run them.

    On a CPU, torch's fp16 matrix products accumulate in fp32 as well, but where an operand is used transposed
    (every backward through a linear layer) they run 19-65x slower than fp32 sums in blocks
    (benchmarks/cpu_fp16_matmul.py); a real model's fp16 step spent 99 % of its time there."""
    if device != "cpu" or precision_row(spec.axes.precision).dtype != "float16":
        return None
    return (
        "CPU fp16: matmuls multiply and sum fp16 operands in fp32 and round each result to fp16 once, as a GPU's "
        "fp16 GEMM does (torch's CPU fp16 kernels, same arithmetic, are 19-65x slower where an operand is transposed)"
    )
