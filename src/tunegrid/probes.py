"""Hardware capability record: which dtypes run natively here, memory, and a matmul micro-benchmark.

Native support comes from facts (compute capability, CPU ISA flags), not optimistic flags:
torch.cuda.is_bf16_supported() says True on a T4 through emulation.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPU_FP16_FLAGS = ("avx512_fp16", "amx_fp16")


def cpu_inventory() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    mem_total = 0
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    relevant = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma", "f16c")))
    return {"model": model, "cores": os.cpu_count(), "ram_bytes": mem_total, "isa_flags": relevant}


def cpu_precision_support(flags: list[str]) -> dict[str, str]:
    flag_set = set(flags)
    return {
        "fp32": "native",
        "bf16": "native" if flag_set & set(CPU_BF16_FLAGS) else "emulated",
        "fp16": "native" if flag_set & set(CPU_FP16_FLAGS) else "emulated",
        "tf32": "absent",
    }


def cuda_precision_support(capability: tuple[int, int]) -> dict[str, str]:
    cc = capability[0] + capability[1] / 10
    return {
        "fp32": "native",
        "bf16": "native" if cc >= 8.0 else "emulated",
        "fp16": "native" if cc >= 5.3 else "emulated",
        "tf32": "native" if cc >= 8.0 else "absent",
    }


def gpu_inventory() -> list[dict[str, Any]]:
    import torch

    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        capability = (props.major, props.minor)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "total_bytes": int(total),
                "free_bytes": int(free),
                "precision": cuda_precision_support(capability),
                "bf16_supported_flag_with_emulation": bool(torch.cuda.is_bf16_supported(including_emulation=True)),
            }
        )
    return gpus


def matmul_tflops(device: str, dtype_name: str, size: int, budget_s: float) -> float | None:
    """Median TFLOP/s of square matmuls after a warm-up, within a time budget."""
    import torch

    dtype = getattr(torch, dtype_name)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        torch.matmul(a, b)  # warm-up
        times, deadline = [], time.perf_counter() + budget_s
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 50):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.matmul(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if time.perf_counter() > deadline and len(times) >= 3:
                break
    except (RuntimeError, TypeError):
        return None
    return 2 * size**3 / statistics.median(times) / 1e12


def probe(budget_s: float = 20.0) -> dict[str, Any]:
    import torch

    started = time.perf_counter()
    cpu = cpu_inventory()
    on_cuda = torch.cuda.is_available()
    gpus = gpu_inventory() if on_cuda else []
    device = "cuda" if on_cuda else "cpu"
    size = 4096 if on_cuda else 512
    dtypes = ("float32", "bfloat16", "float16")
    per_dtype = budget_s / (2 * len(dtypes))
    record = {
        "device": device,
        "cpu": cpu,
        "cpu_precision": cpu_precision_support(cpu["isa_flags"]),
        "gpus": gpus,
        "precision": gpus[0]["precision"] if gpus else cpu_precision_support(cpu["isa_flags"]),
        "matmul_tflops": {name: matmul_tflops(device, name, size, per_dtype) for name in dtypes},
        "matmul_size": size,
        "torch_threads": torch.get_num_threads(),
    }
    record["probe_seconds"] = time.perf_counter() - started
    return record
