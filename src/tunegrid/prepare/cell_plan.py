"""The `cell_plan` rule's job: a cell's contract (tunegrid.contract.CellContract) made and written once, as
results/<study>/plans/<cell_id>.json: its spec, its plan (target, budget, the memory estimate of each path its
worker may take and the verdict, the kernels, the liveness limits, the job's host memory) and its job's files.

Every decision of a plan is made here and nowhere else: the supervisor and the worker read the file, plan.csv is
the union of the files (a house test holds it: tests/house/test_contract.py).

The `finetune` rule takes the contract as input and its `mem_mb` from it. Snakemake evaluates a resource function
again when the job is scheduled, with every input present; before the contract exists (`snakemake -n` on a study
whose probe has not run) the request is the floor, and `mem_mb_for_job` says so.

Light module: no torch (the Snakefile reads it at parse time; the rule reads file headers only, ~0.2 s a cell).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import CellContract, CellJob, CellKernels, CellPlan, MemoryEstimate
from tunegrid.runtime.files import read_json
from tunegrid.runtime.workers import SPAWNED, planned_worker
from tunegrid.study.stacks import BASE_STACK_MEMORY, StackMemory, read_stack_record, stack_memory

# The job's request is the estimate with room to spare: the estimate models the tensors and the probe's
# measured constants, not the allocator's fragmentation or the loader's transient copies.
MEM_SAFETY_FACTOR = 1.5
# No rank asks for less: a Python process with torch, transformers and peft imported holds ~0.5-0.7 GiB
# before it loads a model (the probe's runtime baseline on the 2-core CPU host).
MEM_FLOOR_MB_PER_RANK = 1024


def job_mem_mb(estimate_bytes: int, world_size: int, override_mb: int = 0) -> int:
    """The job's host memory in MB: `hardware.mem_mb` where set, else each rank's estimate x MEM_SAFETY_FACTOR,
    at least MEM_FLOOR_MB_PER_RANK per rank. On a GPU the estimate is of the device; the host stages the same
    weights through its memory while loading, so it stands for the host's need too."""
    if override_mb:
        return int(override_mb)
    per_rank = max(MEM_FLOOR_MB_PER_RANK, math.ceil(estimate_bytes * MEM_SAFETY_FACTOR / 2**20))
    return per_rank * world_size


def host_mem_mb(estimate: MemoryEstimate, world_size: int) -> int:
    """The job's host memory for this estimate: the estimate's peak, and the activations and weights offloaded from
    a GPU (train.activation_offloading, train.weight_offloading), which live in the host's memory besides."""
    return job_mem_mb(estimate.estimate_bytes + estimate.components.in_host_memory(), world_size)


def trains(contract_file: str | Path | None) -> bool:
    """Whether the cell's contract says it trains: an `unsupported` or `predicted_oom` cell's job only writes
    its result, so it asks the scheduler for one core and no GPU (asked for what no node has, it would wait
    in the queue for ever). Before the contract exists (a dry run), it does."""
    if contract_file is None or not Path(contract_file).is_file():
        return True
    try:
        return CellContract.read(contract_file).plan.estimate().verdict == "run"
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return True


def mem_mb_for_job(contract_file: str | Path | None, hardware: dict[str, Any], world_size: int) -> int:
    """The `finetune` job's `mem_mb`: from its contract; before that exists (a dry run on a study not yet
    planned), or where it is of another schema (the rule makes it again), the floor, MEM_FLOOR_MB_PER_RANK per
    rank, or the `hardware.mem_mb` override."""
    override = int(hardware.get("mem_mb") or 0)
    if contract_file is None or not Path(contract_file).is_file():
        return job_mem_mb(0, world_size, override)
    try:
        plan = CellContract.read(contract_file).plan
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return job_mem_mb(0, world_size, override)
    return override or plan.mem_mb


def _estimate(
    spec: CellSpec, model_dir: Path, capabilities: dict[str, Any], device: str, worker: str, target: Any
) -> MemoryEstimate:
    """One path's estimate, for the device the cell trains on, with the verdict it leads to."""
    from tunegrid.prepare.memory_estimate import device_constants, estimate_cell
    from tunegrid.targets import cluster_shortfall, feasibility, gpu_shortfall, needs_cuda

    precision = spec.axes.precision
    constants = device_constants(capabilities, precision, worker, device=device)
    estimate = estimate_cell(spec, model_dir, **constants, stack=_stack_memory(spec))
    verdict = feasibility(precision, target, spec.hardware, estimate.charge_bytes(device)) if target else None
    verdict = verdict or gpu_shortfall(spec, capabilities) or needs_cuda(spec, device)
    verdict = verdict or cluster_shortfall(spec, capabilities)
    return replace(estimate, verdict=str(verdict[0]), reason=str(verdict[1])) if verdict else estimate


def _stack_memory(spec: CellSpec) -> StackMemory:
    """What the cell's library stack changes in its estimate, from the stack's record (the base: nothing)."""
    if spec.stack is None or not spec.stack.folder:
        return BASE_STACK_MEMORY
    return stack_memory(read_stack_record(spec.stack.folder))


def _kernels(spec: CellSpec, model_dir: Path, capabilities: dict[str, Any], device: str) -> CellKernels:
    """The kernels the cell's ranks train with, on the device they train on."""
    from tunegrid.prepare.cpu_kernels import cpu_fp16_matmul, cpu_onednn_matmul, cpu_onednn_off

    config = json.loads((model_dir / "config.json").read_text())
    return CellKernels(
        cpu_onednn_off=cpu_onednn_off(spec, config, device, cpu_onednn_matmul(capabilities)),
        cpu_fp16_matmul=cpu_fp16_matmul(spec, device),
    )


def plan_cell(cell: CellSpec, model_dir: Path, capabilities: dict[str, Any], warm_worker: bool) -> CellPlan:
    """The cell's plan: the device it trains on, its target, budget, estimates (of each path its worker may take:
    the supervisor spawns a worker the warm worker does not fork), kernels and liveness limits. `warm_worker`: the
    run forks its cells from a warm worker (a local run of a study with execution.warm_worker); the planned path
    and the job's memory follow it."""
    from tunegrid.prepare.liveness import cell_liveness
    from tunegrid.runtime.devices import training_device
    from tunegrid.targets import resolve_target

    hardware = cell.hardware
    device = training_device(hardware.gpus_per_rank, capabilities)
    target = resolve_target(hardware, capabilities) if capabilities else None
    enforced = bool(target) and (target.name != "native" or bool(hardware.memory_budget_gb))
    stack_python = cell.stack.python if cell.stack is not None else ""  # "": the base stack
    worker = planned_worker(device, warm_worker, cell.axes.nodes, stack_python)
    # every path the worker may take: the planned one, spawned, and forked wherever a warm worker could fork it
    paths = dict.fromkeys([worker, SPAWNED, planned_worker(device, True, cell.axes.nodes, stack_python)])
    estimates = {path: _estimate(cell, model_dir, capabilities, device, path, target) for path in paths}
    world = cell.axes.world_size
    return CellPlan(
        cell_id=cell.cell_id,
        world_size=world,
        target=target.name if target else None,
        budget_bytes=target.memory_bytes if enforced and target else None,
        device=device,
        worker=worker,
        estimates=estimates,
        kernels=_kernels(cell, model_dir, capabilities, device),
        liveness=cell_liveness(cell, model_dir, capabilities),
        mem_mb=host_mem_mb(estimates[worker], world // cell.axes.nodes),  # a node's ranks
    )


def make_contract(
    spec: CellSpec, job: CellJob, warm_worker: bool, capabilities: dict[str, Any] | None = None
) -> CellContract:
    """The contract of one cell: its spec, its plan and its job. The capabilities are the job's probe record
    (`job.capabilities_path`) unless given; none: no target, no budget, the estimate without measured constants."""
    if capabilities is None:
        capabilities = read_json(job.capabilities_path) if job.capabilities_path else {}
    return CellContract(spec=spec, plan=plan_cell(spec, Path(job.model_dir), capabilities, warm_worker), job=job)


def write_contract(
    spec: CellSpec,
    job: CellJob,
    out: str | Path,
    warm_worker: bool,
    capabilities: dict[str, Any] | None = None,
) -> CellContract:
    """`tunegrid cell-plan`: the cell's contract, made and written to `out`."""
    contract = make_contract(spec, job, warm_worker, capabilities)
    contract.write(out)
    return contract


def warm_worker_of(study: dict[str, Any]) -> bool:
    """Whether a local run of this (resolved) study forks its cells from a warm worker."""
    return bool((study.get("execution") or {}).get("warm_worker", True))
