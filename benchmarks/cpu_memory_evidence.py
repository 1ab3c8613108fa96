#!/usr/bin/env python
"""Record a finished CPU study's memory evidence and print its estimate / measured ratios.

For every cell of the study (results/<study>/runs/*/result.json) it keeps the spec, the measured peaks (each
step's too, from the cell's metrics.jsonl), the worker path the cell took and the estimate it recorded, beside
the plan's estimate for the same cell (results/<study>/plans/<cell_id>.json, and plan.csv where the study made
one) and the probe's constants; per run the commit and the day the study ran (its env/environment.json and
results). The tests `tests/prepare/test_cpu_memory_evidence.py` and `test_cpu_onednn_fp16_evidence.py` replay
the estimate against these recordings. A run on a simulated host says so in `--host` (e.g. ONEDNN_MAX_CPU_ISA=AVX2:
oneDNN's kernels of a host without AVX512-BF16; the environment variables in effect are recorded). `--study` may
be a study's results folder copied from another host (the same layout).

    python benchmarks/cpu_memory_evidence.py --study results/default --host "this host" \
        [--out tests/data/evidence-cpu-default-study.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SIMULATION_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
PROBE_KEYS = (
    "device",
    "cpu",
    "cpu_precision",
    "cpu_onednn_matmul",  # absent from a probe record made before it was recorded
    "runtime_baseline_bytes",
    "step_overhead_bytes",
    "worker_runtime_bytes",
)
SPEC_KEYS = ("cell_id", "axes", "lora")
PEAK_KEYS = ("peak_bytes", "load_peak_bytes", "first_step_peak_bytes", "steady_peak_bytes")
TRAIN_KEYS = ("seq_len", "gradient_checkpointing", "steps")  # what the estimate reads, and the run's length


def planned_estimate(path: Path) -> int | None:
    """The planned path's estimate in a cell's contract (plans/<cell_id>.json); a plan file from before the
    contract held it at its top level."""
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    if "plan" not in raw:
        return raw["estimate_bytes"]
    plan = raw["plan"]
    return plan["estimates"][plan["worker"]]["estimate_bytes"]


def step_peaks(run_dir: Path) -> list[int] | None:
    """The peak of each step the cell recorded (metrics.jsonl's mem_peak_bytes), None without the file."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [int(row["mem_peak_bytes"]) for row in rows if row.get("mem_peak_bytes") is not None]


def checkpoint_record(folder: Path) -> dict:
    """A model's checkpoint, where it is still there: the tensors' shapes as its headers hold them (a MoE's experts
    one tensor per expert, as transformers 4.x loads them) and the files' size (what a 4.x load maps)."""
    from tunegrid.prepare.checkpoint_headers import checkpoint_facts

    if not list(folder.glob("*.safetensors")):
        return {}
    _, shapes, facts = checkpoint_facts(folder)
    return {"shapes": shapes, "bytes": facts["checkpoint_bytes"]}


def stack_record(spec: dict, study: Path) -> dict:
    """For a cell on a library stack, what the stack changed in its estimate (tunegrid.study.stacks.StackMemory),
    from the stack's record beside the study."""
    from dataclasses import asdict

    from tunegrid.study.stacks import read_stack_record, stack_memory

    if not spec.get("stack"):
        return {}
    return {"stack_memory": asdict(stack_memory(read_stack_record(study / "stacks" / spec["stack"]["name"])))}


def record(study: Path, host: str) -> dict:
    from tunegrid.runtime.files import read_json

    probe = read_json(study / "probe" / "capabilities.json")
    plan_csv = study / "plan.csv"
    planned = (
        {row["cell_id"]: int(row["estimate_bytes"]) for row in csv.DictReader(plan_csv.open())}
        if plan_csv.exists()
        else {}
    )
    cells, models, checkpoints = [], {}, {}
    for path in sorted(study.glob("runs/*/result.json")):
        result = read_json(path)
        spec, memory = result["cell"], result["memory"]
        models[spec["model"]["name"]] = {key: spec["model"][key] for key in ("architecture", "config")}
        checkpoints[spec["model"]["name"]] = checkpoint_record(study / "models" / spec["model"]["name"])
        plan_file = study / "plans" / f"{result['cell_id']}.json"
        cells.append(
            {
                "spec": {
                    **{key: spec[key] for key in SPEC_KEYS},
                    "train": {key: spec["train"][key] for key in TRAIN_KEYS},
                },
                **stack_record(spec, study),
                "outcome": result["outcome"],
                **{
                    key: memory.get(key)
                    for key in ("peak_bytes", "load_peak_bytes", "first_step_peak_bytes", "steady_peak_bytes")
                },
                "estimate_bytes": memory.get("estimate_bytes"),
                "estimate_worker": memory.get("estimate_worker"),
                "cpu_onednn_off": memory.get("cpu_onednn_off"),
                "step_peak_bytes": step_peaks(path.parent),
                "cell_plan_estimate_bytes": planned_estimate(plan_file),
                "plan_csv_estimate_bytes": planned.get(result["cell_id"]),
                "wall_s": result.get("wall_s"),
            }
        )
    environment = study / "env" / "environment.json"
    env = read_json(environment) if environment.exists() else {}
    if env.get("torch", {}).get("version"):
        torch_version = env["torch"]["version"]
    else:  # a study without its environment record: recorded where it ran
        import torch

        torch_version = torch.__version__
    started = [read_json(p).get("started_at") for p in sorted(study.glob("runs/*/result.json"))]
    started = [t for t in started if t]
    return {
        "host": host,
        "recorded_on": f"{probe['cpu']['model']} CPU, {probe['cpu']['cores']} cores, torch {torch_version}",
        "commit": env.get("git_sha"),
        "recorded_at": time.strftime("%Y-%m-%d", time.gmtime(min(started))) if started else None,
        "environment": {name: os.environ[name] for name in SIMULATION_ENV if name in os.environ},
        "probe": {key: probe[key] for key in PROBE_KEYS if key in probe},  # a key the probe did not record: absent
        "models": models,  # the cells' models (by the name in their axes): architecture and config
        "checkpoints": {name: found for name, found in checkpoints.items() if found},  # by model, where still there
        "cells": cells,
    }


def summary(run: dict) -> str:
    ratios = [c["estimate_bytes"] / c["peak_bytes"] for c in run["cells"] if c["outcome"] == "ok" and c["peak_bytes"]]
    within = sum(0.9 <= r <= 1.1 for r in ratios)
    workers = sorted({c["estimate_worker"] for c in run["cells"] if c["outcome"] == "ok"})
    return (
        f"{run['host']} ({', '.join(workers)}): {within} of {len(ratios)} ok cells in 0.9-1.1 "
        f"({100 * within / max(len(ratios), 1):.0f} %), min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
        f"max {max(ratios):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", type=Path, default=Path("results/default"))
    parser.add_argument("--host", required=True, help="what host this is, e.g. 'AVX512-BF16' or 'simulated AVX2'")
    parser.add_argument("--out", type=Path, help="append the run to this evidence file")
    args = parser.parse_args()
    run = record(args.study, args.host)
    print(summary(run))
    for cell in run["cells"]:
        if cell["outcome"] == "ok":
            ratio = cell["estimate_bytes"] / cell["peak_bytes"]
            print(f"  {cell['spec']['cell_id']:48s} {cell['estimate_worker']:8s} {ratio:.3f}")
    if args.out:
        evidence = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
        evidence["runs"] = [r for r in evidence["runs"] if r["host"] != run["host"]] + [run]
        args.out.write_text(json.dumps(evidence, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
