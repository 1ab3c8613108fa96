"""The probe's calibration (tunegrid.run.calibrate) kept in tunegrid's cache (tunegrid.runtime.cache), so that a
machine measures it once per software stack rather than once per study.

What a worker holds at its peak beyond its tensors depends on the code it runs and the machine's kernels, not
on the study or on how busy the host is: the same Python, packages and tunegrid code on the same CPU, with the
same allocator and thread settings, start and grow the same. The calibration costs a spawned micro cell and three
forked ones (~8 CPU-s on a 2-core AMD EPYC), paid by every study's probe; with the cache, by the first.

    <cache>/calibration/<key>.json   {"identity": what the key is the hash of, "worker_runtime_bytes": ...}

(`worker_runtime_bytes` there also holds the runtime baseline of a fresh process, for a probe that is not one.)

The identity: the Python and the versions of the libraries a worker imports, a hash of tunegrid's own source, the
CPU (model, ISA flags, cores) and torch's thread count, and the environment variables that change a process's
resident set (allocator and thread settings). Any change there is another key, measured afresh. Only a whole
calibration is kept (both worker paths, every arithmetic). The probe's record says which it was (`cache`: hit,
filled, or off); TUNEGRID_CACHE=off measures every time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tunegrid
from tunegrid.prepare.stacks import fresh_runtime_baseline_bytes
from tunegrid.run.calibrate import ARITHMETICS
from tunegrid.runtime.cache import cache_root, warn
from tunegrid.runtime.files import write_json
from tunegrid.runtime.workers import FORKED, SPAWNED

# Bump when the calibration's micro cell or what it subtracts changes in a way the source hash would not show.
FORMAT = 2  # 2: an entry holds the runtime baseline too
# what a worker imports and runs: their code decides what it maps and allocates
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "tokenizers", "numpy")
# what changes a process's resident set or its kernels' scratch memory without changing any code
ENVIRONMENT = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "LD_PRELOAD",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
)
PACKAGE_DIR = Path(tunegrid.__file__).resolve().parent


def identity(cpu: dict[str, Any], torch_threads: int) -> dict[str, Any]:
    """Everything the calibration depends on; the entry's key is its hash."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "format": FORMAT,
        "python": sys.version,
        "platform": platform.platform(),
        "versions": versions,
        "tunegrid_source": source_digest(),
        "cpu": {key: cpu.get(key) for key in ("model", "isa_flags", "cores")},
        "torch_threads": torch_threads,
        "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ},
    }


def source_digest(package: Path = PACKAGE_DIR) -> str:
    """A hash of tunegrid's own source files: what a micro cell runs besides the libraries."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def whole(calibration: dict[str, Any]) -> bool:
    """Both worker paths measured for every arithmetic: a calibration worth keeping (a part that failed is
    measured again next time, never kept)."""
    return all(
        isinstance(calibration.get(path), dict) and all(calibration[path].get(a) for a in ARITHMETICS)
        for path in (SPAWNED, FORKED)
    )


def calibrated(measure: Callable[[], dict[str, Any]], cpu: dict[str, Any], torch_threads: int) -> dict[str, Any]:
    """The calibration for this machine and stack: from the cache where it holds one, else `measure()`d (and kept
    when whole). The result carries `cache`: hit, filled, not kept, or off."""
    root = cache_root()
    if root is None:
        return {**measure(), "cache": "off"}
    which = identity(cpu, torch_threads)
    key = hashlib.sha256(json.dumps(which, sort_keys=True).encode()).hexdigest()[:32]
    path = root / "calibration" / f"{key}.json"
    try:
        entry = json.loads(path.read_text())
        if entry.get("identity") == which and whole(entry.get("worker_runtime_bytes") or {}):
            return {**entry["worker_runtime_bytes"], "cache": "hit"}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError) as exc:  # unreadable, or not our JSON: measured and written again
        warn(f"entry {path} cannot be read ({type(exc).__name__}); measuring afresh")
    measured = measure()
    if not whole(measured):
        return {**measured, "cache": "not kept"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"identity": which, "worker_runtime_bytes": measured})  # atomic: racing probes agree
    except OSError as exc:  # a read-only or full cache: the probe goes on
        warn(f"cannot write {path} ({type(exc).__name__}: {exc})")
        return {**measured, "cache": "not kept"}
    return {**measured, "cache": "filled"}


BASELINE = "runtime_baseline_bytes"  # kept in a cache entry beside the calibration, out of the record's copy of it


def probe_record(budget_s: float, world_sizes: list[int]) -> dict[str, Any]:
    """The probe's record as the `probe` rule writes it: the machine's facts and benchmarks, and on a CPU the
    calibration (from the cache where it holds one). A calibration that fails is recorded as such; the estimate
    then falls back to the probe's older constants, the runtime baseline among them.

    The baseline is a fresh process's resident set with the training stack imported. A probe in a process of its
    own measures it first; one forked by the invocation's warm worker (tunegrid.run.warm_jobs), or called by a
    process that holds the stack already, is not such a process, so there it comes with the calibration: from the
    cache, or measured in a fresh process when the calibration is."""
    from tunegrid.prepare.probes import probe
    from tunegrid.run.calibrate import worker_runtime_bytes

    fresh = "torch" not in sys.modules  # nothing imported yet: this process's own resident set is the baseline
    record = probe(budget_s=budget_s, world_sizes=world_sizes, measure_baseline=fresh)
    if record["device"] != "cpu":  # on CUDA the estimate's constants are the allocator's (cuBLAS workspaces)
        return record
    measured_here = record[BASELINE]

    def measure() -> dict[str, Any]:
        return {**worker_runtime_bytes(), BASELINE: measured_here or fresh_runtime_baseline_bytes()}

    try:
        calibration = calibrated(measure, record["cpu"], record["torch_threads"])
        baseline = calibration.pop(BASELINE, None)
        record["worker_runtime_bytes"] = calibration
    except Exception as exc:  # noqa: BLE001 — a probe that cannot calibrate says so; the estimate falls back
        record["worker_runtime_bytes"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        baseline = None
    if measured_here is None:
        record[BASELINE] = baseline or fresh_runtime_baseline_bytes()
    return record
