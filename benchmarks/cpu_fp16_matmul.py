#!/usr/bin/env python
"""CPU fp16 matrix products: torch's own kernels against tunegrid's (src/tunegrid/cell/nonfinite/fp16_matmul.py: fp32
sums over fp16 operands in bounded blocks, rounded once), on the shapes of a linear layer's forward and of its
backward (the gradient times the weight: the operand torch's fp16 kernels are slow with), at a real head's size
(Gemma 3 270M: hidden 640, an eighth of its 262,144-token vocabulary per product) and an attention projection's.
Each variant is timed in the same process, medians of --rounds, printed as a ratio (a CPU shares its cores);
beside it, each result's largest error against the fp64 product, in fp16 steps at the product's rms. Goal:
tunegrid's no slower than torch's on any shape, and no less accurate.

    python benchmarks/cpu_fp16_matmul.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe, machine_facts  # noqa: E402

SHAPES = {  # name: (rows, depth, cols) of rows x depth @ depth x cols
    "head forward (48 tokens)": (48, 640, 32768),
    "head backward, input gradient": (48, 32768, 640),
    "q_proj forward (48 tokens)": (48, 640, 1024),
    "q_proj backward, input gradient": (48, 1024, 640),
}


def timed(left, right, rounds: int) -> float:
    left @ right
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        left @ right
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def error(got, exact) -> float:
    """The largest error against the fp64 product, in fp16 steps at the product's rms."""
    import torch

    scale = float(exact.square().mean().sqrt())
    return float((got.double() - exact).abs().max()) / (torch.finfo(torch.float16).eps * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    from tunegrid.cell.nonfinite import fp16_matmul

    torch.set_num_threads(args.threads)
    print(describe(machine_facts("cpu")))
    print(f"{'shape':<34}{'torch time / tunegrid time':>28}{'err torch':>12}{'err tunegrid':>14}")
    for name, (rows, depth, cols) in SHAPES.items():
        torch.manual_seed(0)
        left = torch.randn(rows, depth).half()
        right = torch.randn(cols, depth).half().t() if "forward" in name else torch.randn(depth, cols).half()
        theirs = timed(left, right, args.rounds)
        reference = left @ right
        fp16_matmul.install()
        ours = timed(left, right, args.rounds)
        result = left @ right
        fp16_matmul.uninstall()
        exact = left.double() @ right.double()
        print(f"{name:<34}{theirs / ours:>28.2f}{error(reference, exact):>12.2f}{error(result, exact):>14.2f}")


if __name__ == "__main__":
    main()
