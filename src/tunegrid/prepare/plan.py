"""Before a cell trains: its target, memory budget and estimate, and whether it should train at all.

Decided from files (the probe record, the checkpoint's safetensors headers) with no torch, by the
supervisor before launch and by the `plan` rule for the whole grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunegrid.vocabulary import Outcome


def plan_cell(
    spec: dict[str, Any], model_dir: Path, capabilities: dict[str, Any], worker: str = "spawned"
) -> dict[str, Any]:
    """Before training: the target, its memory budget, the memory estimate and whether to train at all.
    `worker`: the path the cell's worker takes (tunegrid.workers.planned_worker), whose runtime it counts."""
    from tunegrid.prepare.liveness import cell_liveness
    from tunegrid.prepare.memory_estimate import device_constants, estimate_cell
    from tunegrid.targets import feasibility, resolve_target

    hardware = spec["hardware"]
    target = resolve_target(hardware, capabilities) if capabilities else None
    estimate = estimate_cell(spec, model_dir, **device_constants(capabilities, spec["axes"]["precision"], worker))
    estimate["worker"] = worker  # the estimate's runtime constant is this path's
    enforced = bool(target) and (target.name != "native" or bool(hardware["memory_budget_gb"]))
    verdict = feasibility(spec["axes"]["precision"], target, hardware, estimate["estimate_bytes"]) if target else None
    verdict = verdict or gpu_shortfall(spec, capabilities)
    return {
        "target": target.name if target else None,
        "budget_bytes": target.memory_bytes if enforced and target else None,
        "estimate": estimate,
        "verdict": verdict,
        "liveness": cell_liveness(spec, model_dir, capabilities).as_dict(),
    }


def gpu_shortfall(spec: dict[str, Any], capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before launch when the cell needs more GPUs than it has (a rank without its own GPU fails
    at set-up with "invalid device ordinal"; a launch would only prove it).

    Locally that is the GPUs the probe found on the machine. A probe that ran as a cluster job saw only the
    GPUs granted to its own job (one rank's): there the count is what the cell's own job was granted, and
    outside a cluster job (the `plan` rule on the submitting host) nothing is decided."""
    from tunegrid.runtime.devices import gpus_per_rank, placed_by_cluster, visible_gpu_count

    world = spec["axes"].get("world_size", 1)
    per_rank = gpus_per_rank(spec["hardware"], capabilities)
    needed = world * per_rank
    if capabilities.get("device") != "cuda":
        return None
    if capabilities.get("cluster_job"):
        if not placed_by_cluster():
            return None
        present, where = visible_gpu_count(), "granted to this job"
    else:
        present, where = len(capabilities.get("gpus") or []), "present on this machine"
    if needed <= present:
        return None
    return (
        Outcome.UNSUPPORTED,
        f"needs {needed} GPUs (world_size {world} x gpus_per_rank {per_rank}), {present} {where}",
    )
