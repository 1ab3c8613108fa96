"""Memory: the per-step peak meter (CUDA allocator stats, or VmHWM on CPU) and the per-cell budget.

Light at import (torch only inside the calls that need it), so the probe and the warm worker measure
with the same meter the training loop uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class MemoryMeter:
    """Peak memory per step: CUDA allocator stats on GPU; VmHWM (reset via clear_refs) on CPU."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.can_reset_hwm = _CLEAR_REFS.exists()

    def reset(self) -> None:
        if self.device_type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.can_reset_hwm:
            try:
                _CLEAR_REFS.write_text("5")  # 5 = reset the peak RSS (VmHWM) to the current RSS
            except OSError:
                self.can_reset_hwm = False

    def peak_bytes(self) -> int:
        if self.device_type == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated())
        return _proc_status_kib("VmHWM") * 1024

    def reserved_peak_bytes(self) -> int | None:
        """CUDA: the caching allocator's reserved high-water mark, which is what the memory budget caps (the
        allocated peak above can stay under the budget while a cell runs out of it). None on CPU."""
        if self.device_type != "cuda":
            return None
        import torch

        return int(torch.cuda.max_memory_reserved())

    def current_bytes(self) -> int:
        if self.device_type == "cuda":
            import torch

            return int(torch.cuda.memory_allocated())
        return _proc_status_kib("VmRSS") * 1024


def _proc_status_kib(field: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def apply_memory_budget(device_type: str, budget_bytes: int, device_index: int | None = None) -> dict[str, Any]:
    """Make allocations beyond the budget really fail, so out-of-memory is measured, not guessed.

    CUDA: the caching allocator's per-process fraction of the device this process trains on; it caps the
    memory the allocator reserves (its cached blocks included), so an out-of-memory cell's record carries the
    reserved peak beside the allocated one. CPU: RLIMIT_AS set to the address space in use now plus the budget
    (the runtime already mapped is not charged; what the cell allocates is).
    """
    if device_type == "cuda":
        import torch

        index = torch.cuda.current_device() if device_index is None else device_index
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, budget_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        return {
            "mechanism": "torch.cuda.set_per_process_memory_fraction",
            "fraction": fraction,
            "device": index,
            "caps": "reserved",
        }
    import resource

    arenas = _keep_malloc_arenas()
    mapped = map_large_blocks()
    in_use = _proc_status_kib("VmSize") * 1024
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = in_use + budget_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return {
        "mechanism": "RLIMIT_AS",
        "address_space_at_start": in_use,
        "limit": limit,
        "malloc_arenas": arenas,
        "large_blocks": mapped,
    }


def address_space_added(enforcement: dict[str, Any]) -> int | None:
    """Under a CPU budget, the most address space the cell added above its start (VmPeak less the start): the
    figure the budget caps, so a record says how far each cell stood from it."""
    start = enforcement.get("address_space_at_start")
    peak = _proc_status_kib("VmPeak") * 1024
    return peak - start if start is not None and peak else None


def keep_one_malloc_arena(budget_bytes: int | None) -> str | None:
    """Under a budget, called as the worker starts (before any thread of its own): every later thread shares the
    main arena, so no 64 MiB arena is reserved before the budget's start is read (one that was would be room the
    cell then fills uncharged, and whether a thread had made one depends on timing)."""
    return _keep_malloc_arenas() if budget_bytes else None


M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 256 * 1024


def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def map_large_blocks() -> str:
    """Every block of 256 KiB or more its own mapping, returned when freed: set by every CPU cell, budget or not.
    glibc otherwise raises its mapping threshold as blocks are freed (up to 32 MiB), after which tensors of that
    size are carved from the heap and their memory is kept after they are freed; how much depends on the order of
    frees across threads and on what lies between them (a 4-bit layer's dequantized weight, made and freed at every
    matmul between the activations autograd keeps, left ~100 MiB of holes in a 135M model's step). A fixed
    threshold ends that: the peak, and a budget's charge, follow the tensors alive, which is what the estimate
    counts."""
    libc = _libc()
    if libc is None:
        return "not glibc: as the allocator maps them"
    if libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES) != 1:
        return "mallopt refused: as glibc maps them"
    return f"M_MMAP_THRESHOLD={LARGE_BLOCK_BYTES}"


# transformers' switch for its checkpoint reader's worker threads (core_model_loading): set, the loading thread reads
# one tensor at a time
SYNC_LOAD_ENV = "HF_DEACTIVATE_ASYNC_LOAD"


def read_checkpoint_in_order() -> str:
    """Set by every CPU cell before its load: transformers otherwise reads tensors ahead in up to 4 worker threads,
    and whether the next tensors' read and cast copies exist beside the one being set at the load's peak depends
    on thread timing (Gemma 3 270M, fp32 on disk into fp16, read while the 336 MB embedding is set: load peaks
    between 1.81 and 2.09 GB over runs of the same cell on one host). Read in order, the load's peak is what the
    estimate counts (tunegrid.prepare.load_peaks.cast_load_peak): the weights loaded so far, one tensor's read and
    its cast. A load that quantizes on the fly reads so already (transformers' own rule)."""
    import os

    os.environ[SYNC_LOAD_ENV] = "1"
    return f"{SYNC_LOAD_ENV}=1"


def _keep_malloc_arenas() -> str:
    """Under an address-space budget, no new glibc malloc arenas: each reserves 64 MiB of address space at once,
    and whether a thread gets one depends on lock contention at that moment (thread timing, host load), so the
    same cell would fit or not from run to run. With M_ARENA_MAX 1, threads share the arenas already made instead
    of reserving new ones, and the charge is what the cell allocates."""
    libc = _libc()
    if libc is None:
        return "not glibc: arenas as the allocator makes them"
    return "M_ARENA_MAX=1" if libc.mallopt(M_ARENA_MAX, 1) == 1 else "mallopt refused: arenas as glibc makes them"


def runtime_baseline_bytes() -> int:
    """Resident memory of a process holding the training stack, before any model: the calibrated
    constant of the memory estimate on CPU (on CUDA the allocator's peak excludes it)."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig  # noqa: F401

    return MemoryMeter("cpu").current_bytes()
