"""Named hardware targets: run a grid 'as if on a T4' on whatever machine is at hand.

A target sets the memory budget and the native-precision facts (from the vendors' data sheets:
bf16 and tf32 tensor cores arrive with compute capability 8.0). `native` means the machine itself,
as the probe recorded it. Light module: no torch (the `cell_plan` rule decides feasibility before training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunegrid.plans import precision_plan
from tunegrid.runtime import devices
from tunegrid.vocabulary import Outcome

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    memory_bytes: int | None
    compute_capability: str | None
    precision: dict[str, str]  # fp32/bf16/fp16/tf32 -> native | emulated | absent


# What one process can allocate, not the size on the box: the device's total capacity as CUDA reports it
# to a process (cudaMemGetInfo's total, the "total capacity" in PyTorch's out-of-memory messages; ECC
# and driver reservations already taken off), minus the CUDA context every process holds. The context
# is the difference between total and free at the probe's start on an H100 (85,017,493,504 -
# 84,465,090,560 bytes, tests/data/capabilities-h100.json); the capacities are the figures PyTorch
# prints for each card (T4 14.74 GiB, L4 22.16 GiB, A100-40GB 39.39 GiB) and, for the H100, the probe's.
CUDA_CONTEXT_BYTES = 85_017_493_504 - 84_465_090_560


def cuda_precision_support(capability: tuple[int, int]) -> dict[str, str]:
    """The one table of GPU precision support, for named targets and for the probe alike: fp16 arithmetic
    at full rate from compute capability 5.3, bf16 and tf32 tensor cores from 8.0 (earlier cards run bf16
    only through emulation, though torch.cuda.is_bf16_supported() says True on a T4)."""
    cc = capability[0] + capability[1] / 10
    return {
        "fp32": "native",
        "bf16": "native" if cc >= 8.0 else "emulated",
        "fp16": "native" if cc >= 5.3 else "emulated",
        "tf32": "native" if cc >= 8.0 else "absent",
    }


def _cuda(name: str, capacity_bytes: int, cc: str) -> Target:
    major, minor = (int(part) for part in cc.split("."))
    return Target(
        name=name,
        memory_bytes=capacity_bytes - CUDA_CONTEXT_BYTES,
        compute_capability=cc,
        precision=cuda_precision_support((major, minor)),
    )


TARGETS: dict[str, Target] = {
    "t4": _cuda("t4", int(14.74 * GIB), "7.5"),  # sold as 16 GB
    "l4": _cuda("l4", int(22.16 * GIB), "8.9"),  # sold as 24 GB
    "a100-40g": _cuda("a100-40g", int(39.39 * GIB), "8.0"),
    "h100-80g": _cuda("h100-80g", 85_017_493_504, "9.0"),  # 79.18 GiB, measured by the probe
}


def resolve_target(hardware: dict[str, Any], capabilities: dict[str, Any]) -> Target:
    """The study's target, with an explicit memory_budget_gb overriding the target's memory."""
    if hardware["target"] == "native":
        gpus = capabilities.get("gpus") or []
        memory = gpus[0]["total_bytes"] if gpus else None
        target = Target(
            name="native",
            memory_bytes=memory,
            compute_capability=gpus[0]["compute_capability"] if gpus else None,
            precision=dict(capabilities["precision"]),
        )
    else:
        target = TARGETS[hardware["target"]]
    if hardware["memory_budget_gb"]:
        target = Target(
            name=target.name,
            memory_bytes=int(hardware["memory_budget_gb"] * GIB),
            compute_capability=target.compute_capability,
            precision=target.precision,
        )
    return target


def feasibility(
    precision: str, target: Target, hardware: dict[str, Any], estimate_bytes: int | None
) -> tuple[str, str] | None:
    """(outcome, reason) for a cell that should not train here, or None when it should."""
    support = target.precision.get(precision_plan(precision).arithmetic, "absent")
    if support == "absent":
        return Outcome.UNSUPPORTED, f"{precision} is absent on target {target.name}"
    if support == "emulated" and hardware["refuse_emulated"]:
        return Outcome.UNSUPPORTED, (
            f"{precision} is only emulated on target {target.name} (compute capability "
            f"{target.compute_capability or 'n/a'}); hardware.refuse_emulated is on"
        )
    if (
        hardware["predicted_oom"] == "skip"
        and estimate_bytes is not None
        and target.memory_bytes is not None
        and estimate_bytes > target.memory_bytes * hardware["oom_margin"]
    ):
        return Outcome.PREDICTED_OOM, (
            f"estimated peak {estimate_bytes / GIB:.2f} GiB exceeds the {target.memory_bytes / GIB:.2f} GiB "
            f"budget of {target.name} x margin {hardware['oom_margin']}"
        )
    return None


def cluster_shortfall(spec: dict[str, Any], capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before submission when no partition of the cluster has a node with the cores and GPUs the
    cell's job asks for: every rank of a cell runs on one node, inside one job (world_size x train.threads
    cores, world_size x gpus_per_rank GPUs). Submitted, such a job would wait in the queue for ever
    (PartitionConfig); the probe recorded the cluster's partitions when it ran as a cluster job."""
    recorded = (capabilities.get("cluster") or {}).get("partitions")
    if not recorded:
        return None
    partitions = [p for p in recorded if p.get("up")]
    world = int(spec["axes"].get("world_size", 1))
    cpus = world * int(spec["train"]["threads"])
    gpus = devices.cell_gpus(spec["hardware"], world, capabilities)  # what the job asks for (`gpu`)
    if any(p["cpus_per_node"] >= cpus and p["gpus_per_node"] >= gpus for p in partitions):
        return None
    offered = "; ".join(
        f"{p['name']}: {p['nodes']} node(s) of {p['cpus_per_node']} CPUs, {p['gpus_per_node']} GPUs" for p in partitions
    )
    return (
        Outcome.UNSUPPORTED,
        f"needs {cpus} CPUs and {gpus} GPUs on one node (all {world} ranks of a cell run in one job, "
        f"train.threads {spec['train']['threads']} each); no partition that is up has such a node "
        f"({offered or 'none is up'})",
    )


def needs_cuda(spec: dict[str, Any], capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before launch for a cell that would train on the CPU with a setting that runs on CUDA only:
    peft's LoftQ initialization (lora.loftq_bits), whose loftq_init moves each weight to "cuda"."""
    if not spec["lora"].get("loftq_bits"):
        return None
    if capabilities.get("device") == "cuda" and devices.gpus_per_rank(spec["hardware"], capabilities) > 0:
        return None
    return (
        Outcome.UNSUPPORTED,
        "lora.loftq_bits: peft's LoftQ initialization runs on CUDA only; this cell trains on the CPU",
    )


def gpu_shortfall(spec: dict[str, Any], capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before launch when the cell needs more GPUs than it has (a rank without its own GPU fails
    at set-up with "invalid device ordinal"; a launch would only prove it).

    Locally that is the GPUs the probe found on the machine. A probe that ran as a cluster job saw only the
    GPUs granted to its own job (one rank's): there the count is what the cell's own job was granted, known only
    once that job runs (the supervisor asks then), and outside a cluster job (the `cell_plan` rule on the
    submitting host) nothing is decided."""
    world = spec["axes"].get("world_size", 1)
    per_rank = devices.gpus_per_rank(spec["hardware"], capabilities)
    needed = world * per_rank
    if capabilities.get("device") != "cuda":
        return None
    if capabilities.get("cluster_job"):
        if not devices.placed_by_cluster():
            return None
        present, where = devices.visible_gpu_count(), "granted to this job"
    else:
        present, where = len(capabilities.get("gpus") or []), "present on this machine"
    if needed <= present:
        return None
    return (
        Outcome.UNSUPPORTED,
        f"needs {needed} GPUs (world_size {world} x gpus_per_rank {per_rank}), {present} {where}",
    )
