#!/usr/bin/env python
"""Memory fixes against the plain setting, measured in one run: the peak and tokens/s of bitsandbytes' 8-bit
AdamW and paged 8-bit AdamW, activation checkpointing, 8-bit AdamW with checkpointing, and half the micro-batch
with twice the accumulation (the same effective batch), each divided by the plain setting's (torch AdamW,
activations kept, the study's micro-batch).

The model, data, adapter and steps are a study's (default configs/memory-fixes-cpu.yaml: a synthetic Llama at
width 1024, LoRA r 128 on every linear layer; --study configs/memory-fixes-oom-cpu.yaml: the out-of-memory study's
model, measured without its budget). Each setting trains as a whole cell (tunegrid's worker: load, adapt, the steps) in
a fresh process of its own, so one setting's memory is never another's peak; the settings run interleaved, round
after round, and each figure is the median over the rounds, so a host whose load changes during the run moves
every setting alike. tokens/s is the median over a cell's steps after the first (warm-up); the peak is the
cell's whole-process peak (CPU: VmHWM; CUDA: the allocator's peak).

    python benchmarks/memory_fixes.py                 # CPU: ~7 minutes a round on 2 cores
    python benchmarks/memory_fixes.py --rounds 3 --study configs/memory-fixes-oom-cpu.yaml

Writes results/benchmarks/memory_fixes.json with the machine facts (machine.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu must hide the GPUs before torch is imported
    DEVICE = device_from_argv()

from machine import absolute_times, add_device_argument, describe, machine_facts, write_results  # noqa: E402

DEFAULT_STUDY = REPO / "configs" / "memory-fixes-cpu.yaml"
# setting -> the axes it changes from the plain cell (torch AdamW, no checkpointing, the study's batch)
SETTINGS = {
    "plain": {},
    "adamw-8bit": {"optimizer": "adamw-8bit"},
    "paged-adamw-8bit": {"optimizer": "paged-adamw-8bit"},
    "activation checkpointing": {"activation_checkpointing": True},
    "adamw-8bit + activation checkpointing": {"optimizer": "adamw-8bit", "activation_checkpointing": True},
    "half micro-batch with grad_accum 2": {"half_batch": True},
}


def _spec(setting: str, study_file: str) -> dict:
    """The setting's cell of the study, with no memory budget (a benchmark measures, it does not cap)."""
    from tunegrid.study.config import cell_spec, expand_cells, load_study

    study = load_study(Path(study_file))
    change = dict(SETTINGS[setting])
    grid = study["grid"]
    batch = grid["batch_size"][0]
    half = change.pop("half_batch", False)
    # the study's first micro-batch, unaccumulated; or half of it, accumulated twice (the same effective batch)
    grid.update(batch_size=[batch // 2], grad_accum=[2]) if half else grid.update(batch_size=[batch], grad_accum=[1])
    grid.update({"optimizer": ["adamw"], "activation_checkpointing": [False]} | {k: [v] for k, v in change.items()})
    return cell_spec(study, expand_cells(study)[0])


def measure(setting: str, study_file: str, work: str, out: multiprocessing.Queue) -> None:
    """One setting as a whole cell in this (fresh) process."""
    from tunegrid.cell.train import run_worker
    from tunegrid.contract import CellJob
    from tunegrid.prepare.cell_plan import make_contract

    spec = _spec(setting, study_file)
    model = spec.model.name
    run = Path(work) / f"{spec.cell_id}-{len(list(Path(work).glob(spec.cell_id + '-*')))}"
    job = CellJob(
        model_dir=str(Path(work) / model), data_path=str(Path(work) / "train.jsonl"), run_dir=str(run), result_path=""
    )
    run_worker(make_contract(spec, job, warm_worker=False, capabilities={}))  # planned as the cell_plan rule plans it
    facts = json.loads((run / "worker.json").read_text())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out.put(
        {
            "setting": setting,
            "cell": spec.cell_id,
            "outcome": facts["outcome"],
            "peak_bytes": facts["memory"]["peak_bytes"],
            "tokens_per_s": statistics.median(line["tokens_per_s"] for line in lines[1:]),
            "optimizer_state_bytes": (facts.get("optimizer") or {}).get("state_bytes"),
            "final_loss": lines[-1]["loss"],
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every setting, interleaved")
    parser.add_argument("--study", type=Path, default=DEFAULT_STUDY, help="the study whose model and steps to use")
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help="comma-separated settings to measure (plain is always measured: every ratio is against it)",
    )
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks"), help="folder of the JSON")
    args = parser.parse_args()
    chosen = ["plain", *(s.strip() for s in args.settings.split(",") if s.strip() and s.strip() != "plain")]
    unknown = [setting for setting in chosen if setting not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts, write_dataset
    from tunegrid.study.config import load_study

    facts = machine_facts(DEVICE)
    study = load_study(args.study)
    model = study["grid"]["model"][0]
    work = Path(tempfile.mkdtemp(prefix="tunegrid-memory-fixes-"))
    write_dataset(work / "train.jsonl", study["data"]["examples"], 0)
    texts = list(corpus_texts(read_dataset(work / "train.jsonl")))
    produce_checkpoint(copy.deepcopy(study["models"][model]), texts, work / model)
    spawn = multiprocessing.get_context("spawn")
    runs: dict[str, list[dict]] = {setting: [] for setting in chosen}
    for round_no in range(args.rounds):
        for setting in chosen:
            queue = spawn.Queue()
            child = spawn.Process(target=measure, args=(setting, str(args.study.resolve()), str(work), queue))
            child.start()
            child.join()
            if queue.empty():
                raise SystemExit(f"{setting}: the measuring process ended without a result (exit {child.exitcode})")
            runs[setting].append(queue.get())
            print(f"round {round_no + 1}/{args.rounds}: {setting} done", flush=True)
    plain_peak = statistics.median(r["peak_bytes"] for r in runs["plain"])
    plain_speed = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    rows = []
    for setting, measured in runs.items():
        peak = statistics.median(r["peak_bytes"] for r in measured)
        speed = statistics.median(r["tokens_per_s"] for r in measured)
        rows.append(
            {
                "setting": setting,
                "cell": measured[0]["cell"],
                "outcomes": sorted({r["outcome"] for r in measured}),
                "rounds": len(measured),
                "optimizer_state_bytes": measured[0]["optimizer_state_bytes"],
                "peak_bytes": peak,
                "tokens_per_s": speed,
                "final_loss": measured[0]["final_loss"],
                "final_loss_minus_plain": measured[0]["final_loss"] - runs["plain"][0]["final_loss"],
                "peak_ratio": peak / plain_peak,
                "peak_ratio_per_round": [r["peak_bytes"] / p["peak_bytes"] for r, p in zip(measured, runs["plain"])],
                "tokens_per_s_ratio": speed / plain_speed,
                "tokens_per_s_ratio_per_round": [
                    r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(measured, runs["plain"])
                ],
            }
        )
    print(describe(facts))
    print(f"{args.study.name}, {args.rounds} interleaved rounds, medians")
    for row in rows:
        absolute = (
            f"peak {row['peak_bytes'] / 2**20:.0f} MiB, {row['tokens_per_s']:.0f} tok/s, "
            if absolute_times(facts)
            else ""
        )
        state = row["optimizer_state_bytes"]
        print(
            f"{row['setting']:>38}: {'/'.join(row['outcomes'])}, optimizer state "
            f"{state / 2**20 if state else 0:.1f} MiB, final loss - plain {row['final_loss_minus_plain']:+.2e}, "
            f"{absolute}peak / plain {row['peak_ratio']:.3f}, tokens/s / plain {row['tokens_per_s_ratio']:.2f} "
            f"(per round {', '.join(f'{x:.2f}' for x in row['tokens_per_s_ratio_per_round'])})"
        )
    facts["study"] = args.study.name
    print(f"wrote {write_results('memory_fixes', facts, rows, args.out)}")


if __name__ == "__main__":
    main()
