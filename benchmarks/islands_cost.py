#!/usr/bin/env python
"""The cost of fp16 with fp32 islands against plain fp16 and fp32: tokens/s and step peak memory of
tunegrid's own training step, same model, data, adapter and batch, in one run (each precision in a fresh
process of its own, so one's memory is not another's peak).

The model is Gemma 3 text (on a CPU at width 256, 4 layers; on a GPU Gemma 3 4B's width, 4 layers, nf4) with
its usual init, so plain fp16 trains too and the three are timed on the same work; the islands are the MLP
down projections, the modules the calibration picks on the default study's overflowing Gemma
(`train.fp32_islands: ["*.mlp.down_proj"]`). The calibration `auto` runs before step 0 is timed on its own.

    python benchmarks/islands_cost.py               # CPU (fp16 is emulated on most CPUs: read the ratios as such)
    python benchmarks/islands_cost.py --device cuda # GPU

Writes results/benchmarks/islands_cost.json with the machine facts (machine.py).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import absolute_times, add_device_argument, describe, machine_facts, write_results  # noqa: E402
from widths import GEMMA3_25M, gemma3_4b_width, synthetic  # noqa: E402

# Gemma 3 text at width 256, 4 layers (~4M parameters): a CPU without fp16 arithmetic emulates it, so the 25M
# shape of the other benchmarks takes minutes per fp16 step on 2 shared cores
GEMMA3_4M = {
    **GEMMA3_25M,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}
CASES = {  # model spec, batch, seq_len, quant, threads
    "cpu": (synthetic("gemma3_text", GEMMA3_4M), 4, 64, "none", 2),
    "cuda": (synthetic("gemma3_text", gemma3_4b_width(layers=4, vocab_size=32768)), 1, 2048, "nf4", 4),
}
PRECISIONS = ("fp16", "fp16-islands", "fp32")
STEPS = 10
ISLANDS = ["*.mlp.down_proj"]


def measure(precision: str, work: str, device: str, out: multiprocessing.Queue) -> None:
    """One precision in this (fresh) process: median step time after two warm-up steps, the largest step peak,
    and for fp16-islands the time of an `auto` calibration."""
    sys.path.insert(0, str(REPO / "src"))
    from nan_overhead import trainer_for

    from tunegrid.study.config import load_study

    model, batch, seq_len, quant, threads = CASES[device]
    study = load_study(REPO / "configs" / "config.yaml")
    study["train"].update(threads=threads, seq_len=seq_len, steps=STEPS, headroom_every=0, fp32_islands=ISLANDS)
    study["models"]["bench"] = copy.deepcopy(model)
    root = Path(work)
    trainer = trainer_for(
        study, "bench", root / "bench", root / "train.jsonl", root / precision, batch, precision, quant
    )
    trainer.place_fp32_islands()
    calibration_s = None
    if precision == "fp16-islands":
        from tunegrid.cell.nonfinite.islands import calibrate

        started = time.perf_counter()
        calibrate(trainer.model, trainer.stream, trainer.device, False, study["train"]["island_calibration_batches"])
        calibration_s = time.perf_counter() - started
    times, peaks = [], []
    for step in range(STEPS):
        rows = {k: v.to(trainer.device) for k, v in trainer.stream.batch(step).items()}
        result = trainer.optimizer_step.run(step, [rows])
        times.append(result.elapsed)
        peaks.append(result.peak or 0)
    out.put(
        {
            "precision": precision,
            "quant": quant,
            "batch_size": batch,
            "seq_len": seq_len,
            "step_s": statistics.median(times[2:]),
            "tokens_per_s": batch * seq_len / statistics.median(times[2:]),
            "peak_bytes": max(peaks[2:]),
            "finite_loss": result.loss == result.loss,
            "islands": [m["module"] for m in (trainer.facts.get("fp32_islands") or {}).get("modules", [])],
            "calibration_s": calibration_s,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.parse_args()
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts, write_dataset

    facts = machine_facts(DEVICE)
    work = Path(tempfile.mkdtemp(prefix="tunegrid-islands-"))
    write_dataset(work / "train.jsonl", 256, 0)
    produce_checkpoint(
        copy.deepcopy(CASES[DEVICE][0]), list(corpus_texts(read_dataset(work / "train.jsonl"))), work / "bench"
    )
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for precision in PRECISIONS:
        queue = spawn.Queue()
        child = spawn.Process(target=measure, args=(precision, str(work), DEVICE, queue))
        child.start()
        rows.append(queue.get())
        child.join()
    by = {row["precision"]: row for row in rows}
    for row in rows:
        row["tokens_per_s_vs_fp16"] = row["tokens_per_s"] / by["fp16"]["tokens_per_s"]
        row["peak_vs_fp16"] = row["peak_bytes"] / by["fp16"]["peak_bytes"]
        row["tokens_per_s_vs_fp32"] = row["tokens_per_s"] / by["fp32"]["tokens_per_s"]
        row["peak_vs_fp32"] = row["peak_bytes"] / by["fp32"]["peak_bytes"]
    write_results("islands_cost", facts, rows)
    print(describe(facts))
    for row in rows:
        absolute = (
            f"{row['tokens_per_s']:.0f} tok/s, peak {row['peak_bytes'] / 2**20:.0f} MiB, "
            if absolute_times(facts)
            else ""
        )
        print(
            f"{row['precision']:>13} {row['quant']} bs{row['batch_size']} seq{row['seq_len']}: {absolute}"
            f"tokens/s {row['tokens_per_s_vs_fp16']:.2f}x fp16, {row['tokens_per_s_vs_fp32']:.2f}x fp32; "
            f"peak {row['peak_vs_fp16']:.3f}x fp16, {row['peak_vs_fp32']:.3f}x fp32"
            + (
                f"; islands {', '.join(row['islands'])}; auto calibration {row['calibration_s']:.2f} s"
                if row["islands"]
                else ""
            )
        )


if __name__ == "__main__":
    main()
