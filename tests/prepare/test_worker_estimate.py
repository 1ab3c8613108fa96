"""The estimate takes the runtime of the worker path the cell takes (spawned, or forked by the warm worker), the
plan names that path, and result.json carries the same estimate: plan.csv and result.json agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_cell

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import CellContract
from tunegrid.prepare.cell_plan import MEM_FLOOR_MB_PER_RANK, job_mem_mb, mem_mb_for_job, write_contract
from tunegrid.prepare.memory_estimate import device_constants
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
    cpu = {"device": "cpu", "worker": FORKED}
    assert device_constants(CAPABILITIES, "bf16", FORKED, device="cpu") == {
        "runtime": 408 * MIB,
        "step_overhead": 0,
        **cpu,
    }
    assert device_constants(CAPABILITIES, "fp16-islands", SPAWNED, device="cpu")["runtime"] == 460 * MIB  # fp16's
    # a probe record from before the calibration: the process before a model plus the small step's overhead
    old = {k: v for k, v in CAPABILITIES.items() if k != "worker_runtime_bytes"}
    assert device_constants(old, "fp32", FORKED, device="cpu") == {
        "runtime": 430 * MIB,
        "step_overhead": 8 * MIB,
        **cpu,
    }
    # and so does a probe whose calibration failed (it records why instead of failing the study)
    failed = {**old, "worker_runtime_bytes": {"error": "OSError: no space left on device"}}
    assert device_constants(failed, "fp32", FORKED, device="cpu") == device_constants(old, "fp32", FORKED, device="cpu")
    # on CUDA the allocator's figures stand, whatever a CPU calibration said
    cuda = {**CAPABILITIES, "device": "cuda", "runtime_baseline_bytes": 0}
    assert device_constants(cuda, "fp32", FORKED, device="cuda")["runtime"] == 0
    # a CPU cell beside the GPU that probe measured (gpus_per_rank 0): none of the GPU's constants
    assert device_constants(cuda, "fp32", SPAWNED, device="cpu") == {
        "runtime": 0,
        "step_overhead": 0,
        "device": "cpu",
        "worker": SPAWNED,
    }


def test_only_a_local_cpu_cell_with_a_warm_worker_is_forked_each_of_its_ranks_too():
    # (device, warm_worker, nodes, the stack's interpreter): a cell's ranks, however many, on one node, base stack
    assert planned_worker("cpu", True, 1, "") == FORKED  # one child of the warm worker per rank
    assert planned_worker("cpu", False, 1, "") == SPAWNED  # execution.warm_worker off, or a cluster job
    assert planned_worker("cuda", True, 1, "") == SPAWNED  # the warm worker never serves beside a GPU
    assert planned_worker("cpu", True, 2, "") == SPAWNED  # each rank a SLURM step on its node
    assert planned_worker("cpu", True, 1, "results/stacks/k/bin/python") == SPAWNED  # the warm worker has the base's


def test_the_plan_names_the_path_and_holds_the_estimate_of_each_path_the_worker_may_take(checkpoints, tmp_path):
    from tunegrid.contract import CellJob

    spec = one_cell()
    job = CellJob(model_dir=str(checkpoints["gemma3-hot"]), data_path="d", run_dir="r", result_path="r/result.json")
    contracts = {
        warm: write_contract(CellSpec.from_json(spec), job, tmp_path / f"{warm}.json", warm, capabilities=CAPABILITIES)
        for warm in (True, False)
    }
    local, cluster = contracts[True].plan, contracts[False].plan
    assert local.worker == FORKED and cluster.worker == SPAWNED  # a cluster job spawns its worker
    assert cluster.estimate().estimate_bytes - local.estimate().estimate_bytes == (458 - 384) * MIB
    # either plan holds both paths: a worker the warm worker does not fork is spawned, with the spawned estimate
    assert local.estimates == cluster.estimates and set(local.estimates) == {FORKED, SPAWNED}
    assert local.estimate(SPAWNED) == cluster.estimate() and local.estimate(FORKED).worker == FORKED
    # the job asks for the planned path's memory
    assert (local.mem_mb, cluster.mem_mb) == (job_mem_mb(local.estimate().estimate_bytes, 1), cluster.mem_mb)
    assert CellContract.read(tmp_path / "True.json") == contracts[True]
    # a distributed cell's ranks take the same paths, each rank's estimate per path; its job asks for every rank's
    two_ranks = CellSpec.from_json(one_cell(world=2))
    two = write_contract(two_ranks, job, tmp_path / "two.json", True, capabilities=CAPABILITIES)
    assert two.plan.worker == FORKED and set(two.plan.estimates) == {FORKED, SPAWNED}
    assert two.plan.mem_mb == job_mem_mb(two.plan.estimate().estimate_bytes, 2)


def test_a_plan_of_another_schema_is_not_read_and_its_job_asks_for_the_floor(tmp_path):
    path = Path(tmp_path / "old.json")
    raw = {"cell_id": "c", "estimate_bytes": 10 * 2**30, "world_size": 1, "verdict": "run", "worker": SPAWNED}
    path.write_text(json.dumps(raw))  # a plan file from before the contract (no schema_version)
    with pytest.raises(ValueError, match="schema"):
        CellContract.read(path)
    assert mem_mb_for_job(path, {}, 1) == MEM_FLOOR_MB_PER_RANK
