"""Hardware capability record: which dtypes run natively here, memory, and a matmul micro-benchmark.

Native support comes from facts (compute capability, CPU ISA flags), not optimistic flags:
torch.cuda.is_bf16_supported() says True on a T4 through emulation.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tunegrid.runtime.memory import runtime_baseline_bytes
from tunegrid.targets import cuda_precision_support

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


def step_overhead_bytes(device: str) -> dict[str, int]:
    """What one training step holds beyond its own tensors, per precision: the device constant the
    memory estimate adds to a cell's tensors. On CUDA, the cuBLAS workspaces that stay allocated once
    the forward's thread and autograd's thread have each run a matmul (32 MiB each on Hopper with
    torch's defaults); on CPU, the autograd engine, allocator arenas and oneDNN scratch (larger where
    bf16/fp16 matmuls go through AMX). Measured with a small MLP step under autocast, as cells train.
    Run it before any other benchmark: on CUDA the workspaces it measures are created only once."""
    import torch

    from tunegrid.runtime.memory import MemoryMeter

    meter = MemoryMeter(device)
    width, tokens, depth = 256, 512, 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(tokens, width, device=device)
    params = sum(p.numel() for p in model.parameters())
    # the step's own tensors at its peak: params, grads, two AdamW moments, the input, saved activations
    own = 4 * (4 * params + batch.numel() + 2 * depth * tokens * width)
    if device == "cuda":
        torch.cuda.synchronize()
    base = meter.current_bytes()
    measured: dict[str, int] = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        meter.reset()
        try:
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(batch).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
        except RuntimeError:  # a precision this device cannot run: no constant, the estimate uses 0
            continue
        if device == "cuda":
            torch.cuda.synchronize()
            measured[name] = max(0, meter.current_bytes() - base - 4 * 3 * params)  # workspaces persist
        else:
            measured[name] = max(0, meter.peak_bytes() - base - own)
    return measured


def memory_bandwidth_gbs(device: str, budget_s: float) -> float | None:
    """Median device-memory copy bandwidth (read + write bytes per second)."""
    import torch

    numel = (256 if device == "cuda" else 32) * 2**20 // 4
    try:
        src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)
    except RuntimeError:
        return None
    times, deadline = [], time.perf_counter() + budget_s
    dst.copy_(src)
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 30):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * numel * 4 / statistics.median(times) / 1e9


def _allreduce_rank(rank: int, world: int, port: int, backend: str, sizes: list[int], out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(tensor)
        times = []
        for _ in range(5):
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            if backend == "nccl":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        algbw = size / statistics.median(times) / 1e9
        rows.append(
            {
                "bytes": size,
                "time_s": statistics.median(times),
                "algbw_gbs": algbw,
                "busbw_gbs": algbw * 2 * (world - 1) / world,
            }
        )  # nccl-tests' definition
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def allreduce_busbw(world_sizes: list[int], on_cuda: bool, gpu_count: int) -> dict[str, Any]:
    """All-reduce bus bandwidth per world size: gloo over loopback on CPU, NCCL across GPUs."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    backend = "nccl" if on_cuda else "gloo"
    sizes = [2**20, 8 * 2**20] if not on_cuda else [2**20, 64 * 2**20, 256 * 2**20]
    results: dict[str, Any] = {"backend": backend}
    for world in world_sizes:
        if on_cuda and world > gpu_count:
            results[str(world)] = {"skipped": f"needs {world} GPUs, {gpu_count} present"}
            continue
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rows.json")
            try:
                mp.start_processes(
                    _allreduce_rank, args=(world, port, backend, sizes, out), nprocs=world, start_method="spawn"
                )
                results[str(world)] = {"sizes": __import__("json").loads(Path(out).read_text())}
            except Exception as exc:  # a probe that cannot run a collective says so; it does not fail the study
                results[str(world)] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return results


def driver_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def probe(
    budget_s: float = 30.0, world_sizes: list[int] | None = None, measure_baseline: bool = True
) -> dict[str, Any]:
    """The machine's facts and benchmarks. `measure_baseline`: this process is a fresh one, whose resident set is the
    runtime baseline (else `runtime_baseline_bytes` is None here, for the caller to fill: calibration_cache)."""
    import torch

    from tunegrid.prepare.cluster import slurm_partitions
    from tunegrid.prepare.environment import bitsandbytes_backend, cpu_onednn_matmul
    from tunegrid.runtime.devices import placed_by_cluster

    started = time.perf_counter()
    baseline = runtime_baseline_bytes() if measure_baseline else None  # first, before the benchmarks allocate
    cpu = cpu_inventory()
    on_cuda = torch.cuda.is_available()
    gpus = gpu_inventory() if on_cuda else []
    device = "cuda" if on_cuda else "cpu"
    overhead = step_overhead_bytes(device)  # before the benchmarks create the workspaces it measures
    size = 8192 if on_cuda else 512  # at 4096^3 an H100 reads ~10 % under its bf16 peak; 8192^3 takes ~1.4 ms there
    dtypes = ("float32", "bfloat16", "float16")
    per_dtype = budget_s / (4 * len(dtypes))
    record = {
        "device": device,
        "cpu": cpu,
        "cpu_precision": cpu_precision_support(cpu["isa_flags"]),
        "cpu_onednn_matmul": cpu_onednn_matmul(),  # the dtypes whose CPU matmuls go to oneDNN (a CUDA host's too)
        "gpus": gpus,
        # in a cluster job `gpus` are the GPUs granted to the probe's own job, not a node's or another job's
        "cluster_job": placed_by_cluster(),
        "cluster": {"scheduler": "slurm", "partitions": slurm_partitions()} if placed_by_cluster() else None,
        "precision": gpus[0]["precision"] if gpus else cpu_precision_support(cpu["isa_flags"]),
        "matmul_tflops": {name: matmul_tflops(device, name, size, per_dtype) for name in dtypes},
        "matmul_size": size,
        "memory_bandwidth_gbs": memory_bandwidth_gbs(device, budget_s / 8),
        "allreduce": allreduce_busbw(world_sizes or [], on_cuda, len(gpus)),
        "torch_threads": torch.get_num_threads(),
        "runtime_baseline_bytes": baseline if not on_cuda else 0,
        "step_overhead_bytes": overhead,
        "bitsandbytes": bitsandbytes_backend(),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if on_cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_cuda else None,
            "driver": driver_version() if on_cuda else None,
        },
        "p2p": [
            [i == j or torch.cuda.can_device_access_peer(i, j) for j in range(len(gpus))] for i in range(len(gpus))
        ],
    }
    record["probe_seconds"] = time.perf_counter() - started
    return record


# The first load also imports the tokenizer's code (which every worker's calibrated runtime already holds); the
# second load's growth is the tokenizer's own data.
TOKENIZER_FOOTPRINT = """
import sys
from transformers import AutoTokenizer

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

first = AutoTokenizer.from_pretrained(sys.argv[1])
before = resident()
second = AutoTokenizer.from_pretrained(sys.argv[1])
print(resident() - before)
"""


SMALL_TOKENIZER_BYTES = 2**20  # tokenizer files on disk below which the footprint is not measured


def tokenizer_resident_bytes(model_dir: Path) -> int | None:
    """What the model's tokenizer holds in memory once loaded, measured in a fresh process: a cell holds it beside
    the model for all its life, and a real one is large (Gemma 3's 262k-entry tokenizer: ~340 MB resident for a
    33 MB tokenizer.json), which a worker's calibrated runtime, measured with a tiny one, does not include. None
    where /proc is absent, the folder has no tokenizer, or its files are under SMALL_TOKENIZER_BYTES: a tokenizer
    that small is the calibration's own size (a synthetic model's 22 kB tokenizer.json holds ~150 kB), and the
    fresh process that measures it costs seconds of CPU per checkpoint."""
    files = list(Path(model_dir).glob("tokenizer*"))
    if not Path("/proc/self/status").exists() or not files:
        return None
    if sum(path.stat().st_size for path in files) < SMALL_TOKENIZER_BYTES:
        return None
    done = subprocess.run(
        [sys.executable, "-c", TOKENIZER_FOOTPRINT, str(model_dir)], capture_output=True, text=True, timeout=600
    )
    lines = done.stdout.strip().splitlines()
    return max(0, int(lines[-1])) if done.returncode == 0 and lines and lines[-1].lstrip("-").isdigit() else None
