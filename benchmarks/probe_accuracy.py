#!/usr/bin/env python
"""How close the probe's figures are to what the device can do: the probe's matmul TFLOP/s and copy
bandwidth vs the same measured with plain torch at a large size (8192^3 matmuls, 1 GiB copies on a GPU;
1024^3 and 256 MiB on a CPU, native dtypes only), in the same run. Goal: probe / reference >= 0.95.

The probe must be quick (it runs before every study), so it measures at a smaller size under a time
budget; this benchmark says what that costs in accuracy.

    python benchmarks/probe_accuracy.py [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import absolute_times, add_device_argument, describe, machine_facts, write_results  # noqa: E402

from tunegrid.prepare.probes import matmul_tflops, memory_bandwidth_gbs, probe  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")


def timed(fn, device: str, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of fn() over repeats, synchronised on a GPU."""
    import torch

    fn()  # warm-up: kernel selection, allocation
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def reference_tflops(device: str, dtype_name: str, size: int) -> float | None:
    import torch

    dtype = getattr(torch, dtype_name)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        seconds = timed(lambda: torch.matmul(a, b), device, repeats=20 if device == "cuda" else 3)
    except (RuntimeError, TypeError):
        return None
    return 2 * size**3 / seconds / 1e12


def reference_copy_gbs(device: str, nbytes: int) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=20 if device == "cuda" else 5)
    return 2 * nbytes / seconds / 1e9  # read + write, as the probe counts it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--budget-s", type=float, default=30.0, help="the probe's own time budget (as in a study)")
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks"), help="folder of the JSON")
    args = parser.parse_args()
    facts = machine_facts(DEVICE)
    on_gpu = DEVICE == "cuda"
    size, copy_bytes = (8192, 2**30) if on_gpu else (1024, 256 * 2**20)

    record = probe(budget_s=args.budget_s, world_sizes=[])  # exactly what the probe rule records
    rows = []
    native = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    for name in DTYPES:
        if record["precision"].get(native[name]) != "native":
            continue  # an emulated dtype on a CPU takes minutes at the reference size and says nothing
        probed = record["matmul_tflops"].get(name)
        reference = reference_tflops(DEVICE, name, size)
        rows.append(
            {
                "measure": f"matmul {name} TFLOP/s",
                "probe": probed,
                "probe_size": record["matmul_size"],
                "reference": reference,
                "reference_size": size,
                "ratio": probed / reference if probed and reference else None,
            }
        )
    # the probe's own function at the reference size too: separates "size too small" from "method"
    first = rows[0]["measure"].split()[1]
    same_size = matmul_tflops(DEVICE, first, size, budget_s=5.0)
    rows.append(
        {
            "measure": f"matmul {first} TFLOP/s, probe's method at the reference size",
            "probe": same_size,
            "probe_size": size,
            "reference": rows[0]["reference"],
            "reference_size": size,
            "ratio": same_size / rows[0]["reference"] if same_size and rows[0]["reference"] else None,
        }
    )
    probed_copy = record["memory_bandwidth_gbs"] or memory_bandwidth_gbs(DEVICE, 2.0)
    reference_copy = reference_copy_gbs(DEVICE, copy_bytes)
    rows.append(
        {
            "measure": "copy GB/s",
            "probe": probed_copy,
            "reference": reference_copy,
            "reference_size": copy_bytes,
            "ratio": probed_copy / reference_copy if probed_copy else None,
        }
    )

    write_results("probe_accuracy", facts, rows, args.out)
    print(describe(facts))
    for row in rows:
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "n/a"
        figures = (
            f" probe {row['probe']:.1f} vs reference {row['reference']:.1f}"
            if absolute_times(facts) and row["probe"] and row["reference"]
            else ""
        )
        print(f"{row['measure']}:{figures} probe/reference = {ratio} (goal >= 0.95)")


if __name__ == "__main__":
    main()
