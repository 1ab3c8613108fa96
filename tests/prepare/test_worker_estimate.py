"""The estimate takes the runtime of the worker path the cell takes (spawned, or forked by the warm worker), the
plan names that path, and result.json carries the same estimate: plan.csv and result.json agree."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import one_cell

from tunegrid.prepare.cell_plan import CellPlan, write_cell_plan
from tunegrid.prepare.memory_estimate import device_constants
from tunegrid.prepare.plan import plan_cell
from tunegrid.runtime.workers import FORKED, SPAWNED, planned_worker

MIB = 2**20
# what a probe measured on a CPU host (tunegrid.run.calibrate): a forked worker holds less than a spawned one
CAPABILITIES = {
    "device": "cpu",
    "gpus": [],
    "precision": {"fp32": "native", "bf16": "native", "fp16": "emulated", "tf32": "absent"},
    "runtime_baseline_bytes": 430 * MIB,
    "step_overhead_bytes": {"fp32": 8 * MIB, "bf16": 15 * MIB, "fp16": 18 * MIB},
    "worker_runtime_bytes": {
        SPAWNED: {"fp32": 458 * MIB, "bf16": 482 * MIB, "fp16": 460 * MIB},
        FORKED: {"fp32": 384 * MIB, "bf16": 408 * MIB, "fp16": 385 * MIB},
    },
}


def test_each_path_and_arithmetic_takes_its_own_measured_constant():
    assert device_constants(CAPABILITIES, "bf16", FORKED) == {"runtime": 408 * MIB, "step_overhead": 0, "device": "cpu"}
    assert device_constants(CAPABILITIES, "fp16-islands", SPAWNED)["runtime"] == 460 * MIB  # fp16 arithmetic
    # a probe record from before the calibration: the process before a model plus the small step's overhead
    old = {k: v for k, v in CAPABILITIES.items() if k != "worker_runtime_bytes"}
    assert device_constants(old, "fp32", FORKED) == {"runtime": 430 * MIB, "step_overhead": 8 * MIB, "device": "cpu"}
    # and so does a probe whose calibration failed (it records why instead of failing the study)
    failed = {**old, "worker_runtime_bytes": {"error": "OSError: no space left on device"}}
    assert device_constants(failed, "fp32", FORKED) == device_constants(old, "fp32", FORKED)
    # on CUDA the allocator's figures stand, whatever a CPU calibration said
    cuda = {**CAPABILITIES, "device": "cuda", "runtime_baseline_bytes": 0}
    assert device_constants(cuda, "fp32", FORKED)["runtime"] == 0


def test_only_a_local_one_rank_cpu_cell_with_a_warm_worker_is_forked():
    one, two = one_cell(), one_cell(world=2)
    assert planned_worker(one, "cpu", warm_worker=True) == FORKED
    assert planned_worker(one, "cpu", warm_worker=False) == SPAWNED  # execution.warm_worker off, or a cluster job
    assert planned_worker(two, "cpu", warm_worker=True) == SPAWNED  # ranks are spawned
    assert planned_worker(one, "cuda", warm_worker=True) == SPAWNED  # the warm worker never serves beside a GPU


def test_the_plan_names_the_path_and_its_estimate(checkpoints, tmp_path):
    from conftest import make_study

    from tunegrid.study.config import resolve_study

    study = resolve_study(make_study())
    study_file, capabilities = tmp_path / "study.json", tmp_path / "capabilities.json"
    study_file.write_text(json.dumps(study))
    capabilities.write_text(json.dumps(CAPABILITIES))
    spec = one_cell()
    plans = {
        local: write_cell_plan(
            study_file, spec["cell_id"], checkpoints["gemma3-hot"], capabilities, tmp_path / f"{local}.json", local
        )
        for local in (True, False)
    }
    assert plans[True].worker == FORKED and plans[False].worker == SPAWNED  # a cluster job spawns its worker
    assert plans[False].estimate_bytes - plans[True].estimate_bytes == (458 - 384) * MIB
    forked = plan_cell(spec, checkpoints["gemma3-hot"], CAPABILITIES, FORKED)["estimate"]
    assert plans[True].estimate_bytes == forked["estimate_bytes"] and forked["worker"] == FORKED
    assert CellPlan.read(tmp_path / "True.json") == plans[True]


def test_a_plan_written_before_it_named_the_path_still_reads(tmp_path):
    path = Path(tmp_path / "old.json")
    raw = {
        "budget_bytes": None,
        "cell_id": "c",
        "estimate_bytes": 1,
        "estimate_device": "cpu",
        "estimate_stage": "step",
        "mem_mb": 1024,
        "reason": "",
        "target": "native",
        "verdict": "run",
        "world_size": 1,
    }
    path.write_text(json.dumps(raw))
    assert CellPlan.read(path).worker == SPAWNED
