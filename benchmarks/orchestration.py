#!/usr/bin/env python
"""Orchestration, DAG-scale and tracking costs, each measured against its baseline in this one run.

1. Orchestration: wall time of one cell through `snakemake` (supervisor + MLflow run + the rule's
   process) / the same training run alone (`tunegrid worker`, no Snakemake, no MLflow). Goal <= 1.15.
   Also the rule's command alone (so Snakemake's share and the supervisor's are apart), the dry run of
   the same invocation (Snakemake's start, parse, DAG and exit), and the fixed cost in seconds.
   Grid: an 8-cell grid through Snakemake with the warm worker / with every worker spawned afresh.
2. DAG scale: `snakemake -n` wall time on studies of 100, 1,000 and 10,000 cells (goal <= 10 s at 1,000).
3. Tracking: metric points per second into the default sqlite store from 1 and from 8 concurrent
   writers; and the per-step time the training loop spends on logging (one metrics.jsonl line; MLflow
   calls happen in the supervisor, never in the loop) as a share of the step time (goal <= 1 %).

    python benchmarks/orchestration.py            # all parts; writes results/benchmarks/orchestration.json
    python benchmarks/orchestration.py grid       # one part: orchestration | grid | dag_scale | tracking
    python benchmarks/orchestration.py orchestration --device cuda   # the cell trains on the GPU

The machine facts (GPU, driver, CUDA, versions) are written beside the figures (machine.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import device_from_argv  # noqa: E402

if __name__ == "__main__":  # --device cpu hides the GPUs from this process and every Snakemake job it starts
    DEVICE = device_from_argv()

import yaml  # noqa: E402
from conftest import make_study  # noqa: E402

from tunegrid.outcome import METRIC_KEYS  # noqa: E402
from tunegrid.runtime.files import JsonlAppender, read_json, read_jsonl  # noqa: E402
from tunegrid.track.store import init_experiment  # noqa: E402
from tunegrid.track.tracking import CellRun  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


def snakemake(workdir: Path, config: Path, *args: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            *args,
            "--config",
            f"study={config}",
        ],
        check=True,
        capture_output=True,
        env=ENV,
    )
    return time.perf_counter() - started


def _children_cpu_s() -> float:
    """CPU seconds of the children this process has waited for (a Snakemake run and everything it waited for:
    its jobs, and the warm processes with every worker and job they forked)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=ENV)
    return time.perf_counter() - started


def orchestration(root: Path, repeats: int = 3) -> dict:
    """One cell three ways, interleaved so drift hits all alike: through Snakemake (supervisor, MLflow
    run, parent run), the rule's own command alone (supervisor + MLflow, no Snakemake), the worker alone.
    Plus Snakemake's fixed part: the same invocation as a dry run (start, parse, DAG, exit)."""
    grid = {"model": ["qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["nf4"], "seed": [0]}
    config = root / "orch.yaml"
    config.write_text(yaml.safe_dump(make_study(study="orch", grid=grid, train={"steps": 30, "seq_len": 64})))
    snakemake(root, config, "all", "--cores", "2")  # checkpoint, probe, store: not part of the comparison
    cell = "qwen3moe-tiny_fp32_bs2_nf4_s0"
    result = root / "results" / "orch" / "runs" / cell / "result.json"
    target = str(result.relative_to(root))  # the cell's own job only: not the sync/summary/report after it
    through, rule_alone, alone, dry = [], [], [], []
    for _ in range(repeats):
        through.append(snakemake(root, config, target, "--cores", "2", "--forcerun", target))
        dry.append(snakemake(root, config, target, "--cores", "2", "--forcerun", target, "-n"))
        # the command the rule ran, as the supervisor recorded it (without the shell's log redirection)
        command = shlex.split(read_json(result)["command"])
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=ENV, cwd=root)
        rule_alone.append(time.perf_counter() - started)
        # the cell's contract, its run folder moved aside: the worker alone trains the same cell elsewhere
        contract = json.loads((root / "results" / "orch" / "plans" / f"{cell}.json").read_text())
        contract["job"]["run_dir"] = str(root / "alone")
        alone_contract = root / "alone.contract.json"
        alone_contract.write_text(json.dumps(contract))
        alone.append(
            _timed([sys.executable, str(REPO / "scripts" / "tunegrid.py"), "worker", "--contract", str(alone_contract)])
        )
    t, r, w, d = (statistics.median(x) for x in (through, rule_alone, alone, dry))
    fixed = t - w
    return {
        "snakemake_cell_s": t,
        "rule_command_alone_s": r,
        "worker_alone_s": w,
        "snakemake_dry_run_s": d,
        "ratio": t / w,
        "ratio_snakemake_only": t / r,
        "fixed_overhead_s": fixed,
        "fixed_parts_s": {
            "snakemake_start_parse_dag_exit": d,
            "supervisor_and_mlflow": r - w,
            "snakemake_job_handling": t - r - d,
        },
        # the cell length (worker alone) from which the fixed cost is within the 15 % goal
        "cell_s_for_goal": fixed / 0.15,
        "cell_wall_s_in_result": read_json(result)["wall_s"],
        "median_step_s": statistics.median(r["step_time_s"] for r in read_jsonl(result.parent / "metrics.jsonl")),
    }


def grid(root: Path, repeats: int = 2) -> dict:
    """An 8-cell grid through Snakemake on 2 cores, the cells forced to re-run: with the warm processes (each
    worker forked by the warm worker, each supervisor and tracking job by the warm supervisor, their imports done)
    and without (each worker spawned, each job importing for itself), interleaved; wall and CPU seconds."""
    study = make_study(
        study="grid",
        grid={
            "model": ["qwen3moe-tiny", "gemma3-hot"],
            "precision": ["fp32"],
            "batch_size": [2],
            "quant": ["none", "nf4"],
            "seed": [0, 1],
        },
        train={"steps": 30, "seq_len": 64},
    )
    configs = {}
    for name, enabled in (("warm", True), ("cold", False)):
        configs[name] = root / f"grid-{name}.yaml"
        configs[name].write_text(yaml.safe_dump({**study, "execution": {"warm_worker": enabled}}))
    workdir = root / "grid"
    snakemake(workdir, configs["warm"], "all", "--cores", "2")  # checkpoints, probe, store
    targets = [
        str(p.relative_to(workdir)) for p in sorted((workdir / "results" / "grid" / "runs").glob("*/result.json"))
    ]
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    cpu: dict[str, list[float]] = {"warm": [], "cold": []}
    for _ in range(repeats):
        for name in ("warm", "cold"):
            before = _children_cpu_s()
            times[name].append(snakemake(workdir, configs[name], *targets, "--cores", "2", "--forcerun", *targets))
            cpu[name].append(_children_cpu_s() - before)
    warm_s, cold_s = (statistics.median(times[k]) for k in ("warm", "cold"))
    warm_cpu_s, cold_cpu_s = (statistics.median(cpu[k]) for k in ("warm", "cold"))
    return {
        "cells": len(targets),
        "warm_s": warm_s,
        "cold_s": cold_s,
        "cold_over_warm": cold_s / warm_s,
        "warm_cpu_s": warm_cpu_s,
        "cold_cpu_s": cold_cpu_s,
        "cold_over_warm_cpu": cold_cpu_s / warm_cpu_s,
    }


def dag_scale(root: Path) -> dict:
    out = {}
    for cells in (100, 1000, 10000):
        grid = {
            "model": ["gemma3-hot"],
            "precision": ["fp32", "bf16"],
            "batch_size": [2, 4],
            "quant": ["none", "nf4", "nf4-experts"],
            "seed": list(range(cells // 12 + 1)),
        }
        config = root / f"dag{cells}.yaml"
        config.write_text(yaml.safe_dump(make_study(study=f"dag{cells}", grid=grid)))
        n = 12 * len(grid["seed"])
        out[str(n)] = snakemake(root / f"dag{cells}", config, "all", "-n", "--cores", "8", "--quiet", "all")
    return out


def _writer(uri: str, experiment_id: str, index: int, steps: int, queue) -> None:  # type: ignore[no-untyped-def]
    run = CellRun(uri, experiment_id)
    run.start(f"bench-{index}", {}, {})
    batch, started = [], time.perf_counter()
    for step in range(steps):
        batch.append({"step": step, "time": time.time(), **{k: float(step) for k in METRIC_KEYS}})
        if len(batch) == 10:
            run.log_records(batch)
            batch = []
    run.log_records(batch)
    queue.put((run.sent_points, time.perf_counter() - started, len(run.errors)))


def tracking(root: Path, steps: int = 500) -> dict:
    out = {}
    for writers in (1, 8):
        uri = f"sqlite:///{root / f'track{writers}.db'}"
        experiment_id = init_experiment(uri, "bench", root / "art")
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(uri, experiment_id, i, steps, queue)) for i in range(writers)]
        started = time.perf_counter()
        for proc in procs:
            proc.start()
        reports = [queue.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join()
        wall = time.perf_counter() - started
        points = sum(r[0] for r in reports)
        out[f"writers_{writers}"] = {
            "points": points,
            "wall_s": wall,
            "points_per_s": points / wall,
            "errors": sum(r[2] for r in reports),
        }
    appender = JsonlAppender(root / "m.jsonl")
    record = {"step": 1, "time": time.time(), **{k: 1.0 for k in METRIC_KEYS}}
    samples = []
    for _ in range(2000):
        t = time.perf_counter()
        appender.write(record)
        samples.append(time.perf_counter() - t)
    appender.close()
    out["loop_log_cost_s"] = statistics.median(samples)
    return out


PARTS = ("orchestration", "grid", "dag_scale", "tracking")


def main() -> None:
    import argparse

    from machine import add_device_argument, describe, machine_facts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"any of {list(PARTS)} (default: all)")
    add_device_argument(parser)
    only = parser.parse_args().parts or list(PARTS)  # e.g. `orchestration` or `grid` to run one part
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        sys.exit(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for part in PARTS:
            if part in only:
                results[part] = globals()[part](root)
    if "tracking" in results and "orchestration" in results:
        results["tracking"]["loop_log_share_of_step"] = (
            results["tracking"]["loop_log_cost_s"] / results["orchestration"]["median_step_s"]
        )
    out_dir = REPO / "results" / "benchmarks"
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts(DEVICE)
    (out_dir / "orchestration.json").write_text(json.dumps({"machine": facts, **results}, indent=2))
    print(describe(facts))
    if "dag_scale" in results:
        print("DAG scale (snakemake -n):", ", ".join(f"{n} cells {s:.1f} s" for n, s in results["dag_scale"].items()))
    t = results.get("tracking")
    if t:
        share = (
            f" = {t['loop_log_share_of_step']:.4%} of a {results['orchestration']['median_step_s'] * 1e3:.1f} ms step "
            "(goal <= 1 %)"
            if "loop_log_share_of_step" in t
            else ""
        )
        print(
            f"tracking: 1 writer {t['writers_1']['points_per_s']:.0f} points/s, 8 writers "
            f"{t['writers_8']['points_per_s']:.0f} points/s "
            f"({t['writers_8']['errors']} errors); loop logging {t['loop_log_cost_s'] * 1e6:.1f} us per step{share}"
        )
    g = results.get("grid")
    if g:
        print(
            f"grid of {g['cells']} cells on 2 cores: no warm processes {g['cold_s']:.1f} s / warm processes "
            f"{g['warm_s']:.1f} s = {g['cold_over_warm']:.2f}x; CPU {g['cold_cpu_s']:.1f} s / {g['warm_cpu_s']:.1f} s "
            f"= {g['cold_over_warm_cpu']:.2f}x"
        )
    o = results.get("orchestration")
    if o:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in o["fixed_parts_s"].items())
        print(f"orchestration fixed cost per cell {o['fixed_overhead_s']:.2f} s: {parts}")
        print(
            f"orchestration: snakemake cell {o['snakemake_cell_s']:.2f} s / rule command alone "
            f"{o['rule_command_alone_s']:.2f} s "
            f"= {o['ratio_snakemake_only']:.3f} (Snakemake alone)"
        )
        print(
            f"orchestration: snakemake cell {o['snakemake_cell_s']:.2f} s / worker alone {o['worker_alone_s']:.2f} s "
            f"= {o['ratio']:.3f} "
            f"(goal <= 1.15; met by cells from {o['cell_s_for_goal']:.0f} s)"
        )


if __name__ == "__main__":
    main()
