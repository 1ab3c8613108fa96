"""Named hardware targets: run a grid 'as if on a T4' on whatever machine is at hand.

A target sets the memory budget and the native-precision facts (from the vendors' data sheets:
bf16 and tf32 tensor cores arrive with compute capability 8.0). `native` means the machine itself,
as the probe recorded it. Light module: no torch (the supervisor decides feasibility before training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    memory_bytes: int | None
    compute_capability: str | None
    precision: dict[str, str]  # fp32/bf16/fp16/tf32 -> native | emulated | absent


def _cuda(name: str, gib: int, cc: str) -> Target:
    major = float(cc)
    return Target(
        name=name,
        memory_bytes=gib * GIB,
        compute_capability=cc,
        precision={
            "fp32": "native",
            "bf16": "native" if major >= 8.0 else "emulated",
            "fp16": "native",
            "tf32": "native" if major >= 8.0 else "absent",
        },
    )


TARGETS: dict[str, Target] = {
    "t4": _cuda("t4", 16, "7.5"),
    "l4": _cuda("l4", 24, "8.9"),
    "a100-40g": _cuda("a100-40g", 40, "8.0"),
    "h100-80g": _cuda("h100-80g", 80, "9.0"),
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
    support = target.precision.get(precision, "absent")
    if support == "absent":
        return "unsupported", f"{precision} is absent on target {target.name}"
    if support == "emulated" and hardware["refuse_emulated"]:
        return "unsupported", (
            f"{precision} is only emulated on target {target.name} (compute capability "
            f"{target.compute_capability or 'n/a'}); hardware.refuse_emulated is on"
        )
    if (
        hardware["predicted_oom"] == "skip"
        and estimate_bytes is not None
        and target.memory_bytes is not None
        and estimate_bytes > target.memory_bytes * hardware["oom_margin"]
    ):
        return "predicted_oom", (
            f"estimated peak {estimate_bytes / GIB:.2f} GiB exceeds the {target.memory_bytes / GIB:.2f} GiB "
            f"budget of {target.name} x margin {hardware['oom_margin']}"
        )
    return None
