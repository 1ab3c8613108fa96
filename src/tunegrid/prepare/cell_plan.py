"""A cell's plan as a file (results/<study>/plans/<cell_id>.json): what the `cell_plan` rule decided before the
cell trains (target, budget, memory estimate, verdict) and the host memory its job asks the scheduler for.

The `finetune` rule takes the plan as input and its `mem_mb` from it. Snakemake evaluates a resource function
again when the job is scheduled, with every input present; before the plan exists (`snakemake -n` on a study
whose probe has not run) the request is the floor, and `mem_mb_for_job` says so.

Light module: standard library only (the Snakefile reads it at parse time).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

# The job's request is the estimate with room to spare: the estimate models the tensors and the probe's
# measured constants, not the allocator's fragmentation or the loader's transient copies.
MEM_SAFETY_FACTOR = 1.5
# No rank asks for less: a Python process with torch, transformers and peft imported holds ~0.5-0.7 GiB
# before it loads a model (the probe's runtime baseline on the 2-core CPU host).
MEM_FLOOR_MB_PER_RANK = 1024


@dataclass(frozen=True)
class CellPlan:
    cell_id: str
    world_size: int
    target: str | None  # the hardware target the cell is judged against (None: no probe record)
    budget_bytes: int | None  # the memory budget enforced while training (None: none)
    estimate_bytes: int  # the estimated peak of one rank
    estimate_stage: str  # the stage (load / step) the estimated peak is reached in
    estimate_device: str  # cpu / cuda: the memory the estimate is of
    verdict: str  # run, or the outcome decided without training (unsupported, predicted_oom)
    reason: str  # why, for a verdict other than run
    mem_mb: int  # the host memory the cell's job asks for, all ranks (job_mem_mb; hardware.mem_mb replaces it)
    # spawned / forked (tunegrid.workers): the worker path the estimate's runtime constant is for; result.json
    # records the path taken and its estimate (equal to this one where the cell took this path). Last, with a
    # default: a plan written before it named the path was a spawned worker's estimate
    worker: str = "spawned"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1) + "\n"

    @classmethod
    def read(cls, path: str | Path) -> CellPlan:
        raw = {"worker": "spawned", **json.loads(Path(path).read_text())}  # a plan from before it named the path
        return cls(**{f.name: raw[f.name] for f in fields(cls)})


def job_mem_mb(estimate_bytes: int, world_size: int, override_mb: int = 0) -> int:
    """The job's host memory in MB: `hardware.mem_mb` where set, else each rank's estimate x MEM_SAFETY_FACTOR,
    at least MEM_FLOOR_MB_PER_RANK per rank. On a GPU the estimate is of the device; the host stages the same
    weights through its memory while loading, so it stands for the host's need too."""
    if override_mb:
        return int(override_mb)
    per_rank = max(MEM_FLOOR_MB_PER_RANK, math.ceil(estimate_bytes * MEM_SAFETY_FACTOR / 2**20))
    return per_rank * world_size


def mem_mb_for_job(plan_file: str | Path | None, hardware: dict[str, Any], world_size: int) -> int:
    """The `finetune` job's `mem_mb`: from its plan file; before that exists (a dry run on a study not yet
    planned) the floor, MEM_FLOOR_MB_PER_RANK per rank, or the `hardware.mem_mb` override."""
    override = int(hardware.get("mem_mb") or 0)
    if plan_file is None or not Path(plan_file).is_file():
        return job_mem_mb(0, world_size, override)
    plan = CellPlan.read(plan_file)
    return job_mem_mb(plan.estimate_bytes, plan.world_size, override)


def cell_plan(spec: dict[str, Any], planned: dict[str, Any], device: str) -> CellPlan:
    """The typed plan of one cell from `prepare.plan.plan_cell`'s answer; `device`: the probe's."""
    verdict = planned["verdict"] or ("run", "")
    estimate = planned["estimate"]
    world = int(spec["axes"].get("world_size", 1))
    return CellPlan(
        cell_id=spec["cell_id"],
        world_size=world,
        target=planned["target"],
        budget_bytes=planned["budget_bytes"],
        estimate_bytes=int(estimate["estimate_bytes"]),
        estimate_stage=str(estimate["stage"]),
        estimate_device=device,
        worker=str(estimate["worker"]),
        verdict=str(verdict[0]),
        reason=str(verdict[1]),
        mem_mb=job_mem_mb(int(estimate["estimate_bytes"]), world),
    )


def write_cell_plan(
    study_file: str | Path,
    cell_id: str,
    model_dir: str | Path,
    capabilities_file: str | Path,
    out: str | Path,
    local: bool = True,
) -> CellPlan:
    """`tunegrid cell-plan --study-file --cell`: a cell of a resolved study, planned. `local`: the cells run on
    this machine (a local Snakemake run, which forks them where the study keeps a warm worker), not as cluster
    jobs (each worker spawned)."""
    from tunegrid.runtime.files import read_json
    from tunegrid.study.config import study_cell_spec

    spec = study_cell_spec(study_file, cell_id)
    return write_spec_plan(spec, model_dir, capabilities_file, out, local and warm_worker_of(read_json(study_file)))


def write_spec_plan(
    spec: dict[str, Any], model_dir: str | Path, capabilities_file: str | Path, out: str | Path, warm_worker: bool
) -> CellPlan:
    """The `cell_plan` rule's job (`tunegrid cell-plan --spec-file`: file headers only, no torch). `warm_worker`:
    the run forks its cells from a warm worker (a local run of a study with execution.warm_worker)."""
    from tunegrid.prepare.plan import plan_cell
    from tunegrid.runtime.files import atomic_write_text, read_json
    from tunegrid.runtime.workers import planned_worker

    capabilities = read_json(capabilities_file)
    device = capabilities.get("device", "cpu")
    worker = planned_worker(spec, device, warm_worker)
    planned = cell_plan(spec, plan_cell(spec, Path(model_dir), capabilities, worker), device)
    atomic_write_text(out, planned.to_json())
    return planned


def warm_worker_of(study: dict[str, Any]) -> bool:
    """Whether a local run of this (resolved) study forks its cells from a warm worker."""
    return bool((study.get("execution") or {}).get("warm_worker", True))
