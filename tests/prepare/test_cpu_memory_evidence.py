"""The memory estimate replayed against the default study's peaks recorded on CPU hosts.

`data/evidence-cpu-default-study.json` holds whole runs of the default study (`snakemake all`), each recorded
with `benchmarks/cpu_memory_evidence.py`: every cell's spec and measured peaks (VmHWM), the worker path it took
(forked by the warm worker, or spawned), the estimate its result.json and its plan recorded, and the probe's
constants of that run. The runs: this project's 2-core AMD EPYC host (AVX512-BF16), once forked and once
spawned, and the same host restricted to AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2: what
oneDNN and ATen dispatch to on a host without AVX512-BF16; the probe of that run measured under the same
restriction), forked for the whole study and spawned for 8 of its cells (run by the supervisor, no plan
files). The test rebuilds each model on the meta device and estimates each cell with its run's probe record, as
the planner does, so a change to the estimate is checked against every recorded cell in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import meta_model_shapes, recorded_run

from tunegrid.cell_spec import CellSpec
from tunegrid.prepare.memory_estimate import device_constants, estimate_from_shapes
from tunegrid.study.stacks import BASE_STACK_MEMORY, StackMemory

DATA = Path(__file__).resolve().parents[1] / "data"


def _runs(name: str) -> dict[str, dict]:
    return {run["host"]: recorded_run(run) for run in json.loads((DATA / name).read_text())["runs"]}


DEFAULT = _runs("evidence-cpu-default-study.json")
# configs/memory-fixes-cpu.yaml: torch/8-bit AdamW x activation checkpointing at a width where both matter
FIXES = _runs("evidence-cpu-memory-fixes.json")
# configs/moe-stacks-cpu.yaml: a MoE on transformers 5.23 and, through a library stack, on 4.57.6
STACKS = _runs("evidence-cpu-moe-stacks.json")
RUNS = (
    {f"default: {host}": run for host, run in DEFAULT.items()}
    | {f"memory-fixes: {h}": r for h, r in FIXES.items()}
    | {f"moe-stacks: {h}": r for h, r in STACKS.items()}
)


def _ratios(run: dict) -> dict[str, float]:
    ratios = {}
    for cell in run["cells"]:
        if cell["outcome"] != "ok":
            continue
        spec, name = cell["spec"], cell["spec"]["axes"]["model"]
        config, shapes = meta_model_shapes(run["models"][name])
        # the checkpoint's own headers where recorded (a MoE's experts one tensor each, as 4.x loads them)
        checkpoint = (run.get("checkpoints") or {}).get(name) or {}
        shapes = checkpoint.get("shapes") or shapes
        constants = device_constants(run["probe"], spec["axes"]["precision"], cell["estimate_worker"], device="cpu")
        stack = StackMemory(**cell["stack_memory"]) if "stack_memory" in cell else BASE_STACK_MEMORY
        estimate = estimate_from_shapes(
            CellSpec.from_json(spec),
            config,
            shapes,
            **constants,
            checkpoint_bytes=checkpoint.get("bytes", 0),
            stack=stack,
        )
        ratios[spec["cell_id"]] = estimate.estimate_bytes / cell["peak_bytes"]
    return ratios


def test_the_evidence_covers_both_paths_and_a_host_without_avx512_bf16():
    """Both worker paths on this host and on the simulated one; whole studies, but for the simulated spawned run
    (8 representative cells: both models, every precision, both batch sizes, each quantization)."""
    covered = set()
    for run in DEFAULT.values():
        ok = [cell for cell in run["cells"] if cell["outcome"] == "ok"]
        simulated = bool(run["environment"].get("ONEDNN_MAX_CPU_ISA"))
        assert len(ok) >= (8 if simulated else 42), run["host"]
        covered |= {(simulated, cell["estimate_worker"]) for cell in ok}
    assert covered == {(False, "forked"), (False, "spawned"), (True, "forked"), (True, "spawned")}


def test_the_memory_fixes_peaks_fall_and_the_estimate_follows_them():
    """Each fix below the plain cell, and the estimate in band for every cell (checkpointing on CPU included)."""
    for run in FIXES.values():
        peaks = {cell["spec"]["cell_id"]: cell["peak_bytes"] for cell in run["cells"] if cell["outcome"] == "ok"}
        plain = next(peak for cell_id, peak in peaks.items() if cell_id.endswith("_s0"))
        assert len(peaks) == 4 and all(peak < plain for cell_id, peak in peaks.items() if not cell_id.endswith("_s0"))
        assert all(0.9 <= ratio <= 1.1 for ratio in _ratios(run).values()), _ratios(run)


@pytest.mark.parametrize("host", sorted(RUNS))
def test_estimate_is_within_ten_percent_for_nine_in_ten_ok_cells(host):
    ratios = _ratios(RUNS[host])
    inside = [cell for cell, ratio in ratios.items() if 0.9 <= ratio <= 1.1]
    outside = {cell: round(ratio, 3) for cell, ratio in ratios.items() if not 0.9 <= ratio <= 1.1}
    assert len(inside) >= 0.9 * len(ratios), outside
    assert min(ratios.values()) >= 0.85, outside


@pytest.mark.parametrize("host", sorted(RUNS))
def test_the_plan_and_the_result_recorded_the_same_estimate(host):
    """plan.csv, the cell's plan file and result.json: one estimate per cell, for the path the cell took."""
    for cell in RUNS[host]["cells"]:
        planned = {cell["cell_plan_estimate_bytes"], cell["plan_csv_estimate_bytes"]} - {None}
        assert planned <= {cell["estimate_bytes"]}, cell["spec"]["cell_id"]
    if "8 cells" not in host:  # a snakemake run plans every cell (plan.csv where `snakemake plan` ran too)
        assert all(cell["cell_plan_estimate_bytes"] for cell in RUNS[host]["cells"])
    if "8 cells" not in host and host.startswith("default"):  # `snakemake plan` ran after each default study
        assert all(cell["plan_csv_estimate_bytes"] for cell in RUNS[host]["cells"])


def test_no_cell_grows_step_by_step():
    """CPU bf16 with routed experts trained with oneDNN off: its steady peak (steps 1-29) is its first step's, as
    its fp32 twin's is (on the AVX512-BF16 host it grew 446 -> 1006 MiB over 30 steps with oneDNN on)."""
    for run in RUNS.values():
        for cell in run["cells"]:
            if cell["outcome"] == "ok" and cell["cpu_onednn_off"]:
                assert cell["spec"]["axes"]["precision"] == "bf16"
                assert cell["steady_peak_bytes"] <= 1.05 * cell["first_step_peak_bytes"], cell["spec"]["cell_id"]


def test_a_stack_on_transformers_4_is_estimated_with_its_loader_and_its_imports():
    """transformers 4.57.6 through a library stack: its load maps the checkpoint's files (their pages at the load's
    peak beside the parameters) and bitsandbytes quantizes each expert's nn.Linear; its imports hold more than the
    base's. Without those, the 4.x cells read 0.79 (none) and 0.85 (nf4) of their peak."""
    for run in STACKS.values():
        ratios = _ratios(run)
        on_v4 = {cell: ratio for cell, ratio in ratios.items() if cell.endswith("_stack-transformers-v4")}
        assert len(on_v4) == 2 and all(0.9 <= ratio <= 1.1 for ratio in on_v4.values()), on_v4
        for cell in run["cells"]:
            if cell["spec"]["cell_id"] in on_v4:
                assert cell["stack_memory"]["mapped_load"] and not cell["stack_memory"]["fused_experts"]
                assert cell["stack_memory"]["runtime_extra_bytes"] > 0
        # the same cells as the base estimated them (the stack's record not read): the miss the issue measured
        plain = {}
        for cell in run["cells"]:
            if cell["spec"]["cell_id"] in on_v4:
                base_cell = {key: value for key, value in cell.items() if key != "stack_memory"}
                plain.update(_ratios({**run, "cells": [base_cell]}))
        assert all(ratio < 0.9 for cell, ratio in plain.items() if "_none_" in cell), plain
