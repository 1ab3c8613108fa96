"""Named hardware targets: run a grid 'as if on a T4' on whatever machine is at hand.

A target sets the memory budget, the native-precision facts (from the vendors' data sheets: bf16 and tf32
tensor cores arrive with compute capability 8.0) and the data sheet's peak rates and memory bandwidth, from
which `modelled_step` models a step's work on the target: its matmul FLOPs at the peak rate of the arithmetic
each runs in, plus the bytes it moves at the memory bandwidth (the band it is validated to: `modelled_step`).
`native` means the machine itself, as the probe recorded it. Light module: no torch (the `cell_plan` rule decides
feasibility before training).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tunegrid.cell_spec import CellSpec, HardwareSpec
from tunegrid.meanings import precision_row
from tunegrid.runtime import devices
from tunegrid.vocabulary import Outcome

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    memory_bytes: int | None
    compute_capability: str | None
    precision: dict[str, str]  # fp32/bf16/fp16/tf32 -> native | emulated | absent
    # the data sheet's dense peak TFLOP/s per arithmetic (no sparsity), and its memory bandwidth; empty / None for
    # the machine itself (its own cells are measured)
    peak_tflops: dict[str, float] = field(default_factory=dict)
    bandwidth_gbs: float | None = None


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


def _cuda(name: str, capacity_bytes: int, cc: str, peak_tflops: dict[str, float], bandwidth_gbs: float) -> Target:
    major, minor = (int(part) for part in cc.split("."))
    return Target(
        name=name,
        memory_bytes=capacity_bytes - CUDA_CONTEXT_BYTES,
        compute_capability=cc,
        precision=cuda_precision_support((major, minor)),
        peak_tflops=peak_tflops,
        bandwidth_gbs=bandwidth_gbs,
    )


# Peak rates and bandwidths from NVIDIA's data sheets, dense (the sheets' tensor-core figures "with sparsity"
# halved): the T4 Tensor Core GPU data sheet (fp32 8.1, mixed-precision fp16 65 TFLOP/s, GDDR6 320 GB/s; no bf16
# unit: bf16 is emulated), the L4 data sheet (fp32 30.3, tf32 120 and fp16/bf16 242 with sparsity, 300 GB/s),
# the A100 40GB data sheet (fp32 19.5, tf32 156, fp16/bf16 312, HBM2 1,555 GB/s) and the H100 SXM data sheet
# (fp32 67, tf32 989 and fp16/bf16 1,979 with sparsity, HBM3 3.35 TB/s). fp32 cells run at the fp32 rate:
# PyTorch keeps tf32 off for matmuls unless asked, and tunegrid does not ask.
TARGETS: dict[str, Target] = {
    "t4": _cuda("t4", int(14.74 * GIB), "7.5", {"fp32": 8.1, "fp16": 65.0}, 320.0),  # sold as 16 GB
    "l4": _cuda(
        "l4", int(22.16 * GIB), "8.9", {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0}, 300.0
    ),  # sold as 24 GB
    "a100-40g": _cuda(
        "a100-40g", int(39.39 * GIB), "8.0", {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, 1555.0
    ),
    "h100-80g": _cuda(  # 79.18 GiB, measured by the probe
        "h100-80g", 85_017_493_504, "9.0", {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}, 3350.0
    ),
}


def resolve_target(hardware: HardwareSpec, capabilities: dict[str, Any]) -> Target:
    """The study's target, with an explicit memory_budget_gb overriding the target's memory."""
    if hardware.target == "native":
        gpus = capabilities.get("gpus") or []
        memory = gpus[0]["total_bytes"] if gpus else None
        target = Target(
            name="native",
            memory_bytes=memory,
            compute_capability=gpus[0]["compute_capability"] if gpus else None,
            precision=dict(capabilities["precision"]),
        )
    else:
        target = TARGETS[hardware.target]
    if hardware.memory_budget_gb:
        target = replace(target, memory_bytes=int(hardware.memory_budget_gb * GIB))
    return target


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one optimizer step of a cell asks of the hardware, from its plan: its matmul FLOPs (the liveness
    limits' step_flops), the share of them run in fp32 islands, the arithmetic the rest runs in, and the bytes it
    moves through memory."""

    precision: str
    arithmetic: str
    flops: float
    fp32_share: float  # of the FLOPs, in fp32 islands (approximated by the islands' share of the weights)
    bytes_moved: float

    @classmethod
    def of(
        cls,
        precision: str,
        step_flops: float,
        components: dict[str, int],
        widened_bytes: int = 0,
        *,
        checkpointing: bool,
    ) -> StepWork:
        """A cell's work from its plan: `step_flops` the liveness limits' (an upper bound: every step counted as if
        it recomputed its forward), of which the step does `matmul_share(checkpointing)`; `components` its memory
        estimate's (weights in the dtype they are stored in), `widened_bytes` what its fp32 islands' weights grew by
        (result.json's fp32_islands).

        Bytes moved: the weights read in the forward and the backward pass; stored wider than they compute (as
        fp16-mixed's fp32 master weights), the forward reads them once, writes the cast copy and reads it, and the
        backward reads the copy autograd kept; the activations and the logits written in the forward and read in
        the backward; the adapters' parameters and gradients and the optimizer state read and written once."""
        row = precision_row(precision)
        weights = float(components.get("weights", 0)) + widened_bytes
        cast = weights * _dtype_bytes(row.dtype) / _dtype_bytes(row.storage_dtype) if row.storage else 0.0
        moved = weights + 3 * cast if row.storage else 2 * weights
        moved += 2 * sum(float(components.get(k, 0)) for k in ("activations", "logits", "lora_params_grads"))
        moved += 2 * float(components.get("optimizer_state", 0))
        # an island's weights grew from 2 to 4 bytes a value: its parameters' share of the weights stored
        share = min(1.0, widened_bytes / weights) if widened_bytes and weights else 0.0
        flops = step_flops * matmul_share(checkpointing)
        arithmetic = str(row.arithmetic)
        return cls(precision=precision, arithmetic=arithmetic, flops=flops, fp32_share=share, bytes_moved=moved)


@dataclass(frozen=True, kw_only=True)
class ModelledStep:
    target: str
    seconds: float
    compute_s: float
    memory_s: float

    def text(self) -> str:
        return (
            f"{self.seconds * 1e3:.3g} ms/step modelled on {self.target} (compute {self.compute_s * 1e3:.3g} ms "
            f"+ memory {self.memory_s * 1e3:.3g} ms)"
        )


def modelled_step(target: Target, work: StepWork) -> ModelledStep | None:
    """A step's time on `target` from its data sheet: each FLOP at the peak rate of its arithmetic (the fp32 islands'
    share at the fp32 rate) plus the bytes moved at the memory bandwidth, added (no overlap: conservative). None
    where the target has no data sheet (the machine itself) or does not run the arithmetic natively (an emulated
    one has no data-sheet rate).

    It is the step's work, without kernel launches and Python. Validated band, replayed against an H100's recorded
    steps (tests/prepare/test_step_model_evidence.py; the table in docs/measurements.md): modelled / measured is at
    most 1 on every cell (a floor), and at least e / (1 + e), e being the probe's measured matmul rate over the data
    sheet's, where the modelled step outlasts the steps that machine took on launches and Python alone. Shorter
    steps are launch-bound: there it is a floor only, and neither their times nor their settings' order follow it."""
    fast = target.peak_tflops.get(work.arithmetic)
    fp32 = target.peak_tflops.get("fp32")
    if not fast or not fp32 or not target.bandwidth_gbs or target.precision.get(work.arithmetic) != "native":
        return None
    compute = work.flops * (1 - work.fp32_share) / (fast * 1e12) + work.flops * work.fp32_share / (fp32 * 1e12)
    memory = work.bytes_moved / (target.bandwidth_gbs * 1e9)
    return ModelledStep(target=target.name, seconds=compute + memory, compute_s=compute, memory_s=memory)


def modelled_step_s(
    target: str | None,
    precision: str,
    step_flops: float | None,
    components: dict[str, int] | None,
    widened: int = 0,
    *,
    checkpointing: bool,
) -> float | None:
    """A cell's step time on its named target, from its plan (None on the machine itself, or without the plan's
    FLOPs and estimate): what the summary records and the doctor orders its candidates by; a floor, and a
    wall-clock estimate only where the work outlasts the launches (`modelled_step`)."""
    card = TARGETS.get(str(target))
    if card is None or not step_flops or not components:
        return None
    work = StepWork.of(precision, float(step_flops), components, widened, checkpointing=checkpointing)
    modelled = modelled_step(card, work)
    return modelled.seconds if modelled else None


# A LoRA step's matmul FLOPs per frozen weight and token: the forward's 2 and the input gradients' 2 (a frozen weight
# gets no gradient of its own), and where it checkpoints the forward once more. The liveness limits count the last
# case for every cell (their bound), so a step's own work is this share of theirs.
FLOPS_PER_WEIGHT_TOKEN_BOUND = 6


def matmul_share(checkpointing: bool) -> float:
    """The share of the liveness limits' step FLOPs a step computes, with or without activation checkpointing."""
    return (4 + (2 if checkpointing else 0)) / FLOPS_PER_WEIGHT_TOKEN_BOUND


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def feasibility(
    precision: str, target: Target, hardware: HardwareSpec, charge_bytes: int | None
) -> tuple[str, str] | None:
    """(outcome, reason) for a cell that should not train here, or None when it should. `charge_bytes` is what its
    estimate charges the budget (contract.MemoryEstimate.charge_bytes: on a CPU, without the runtime already mapped
    when the budget starts)."""
    support = target.precision.get(precision_row(precision).arithmetic, "absent")
    if support == "absent":
        return Outcome.UNSUPPORTED, f"{precision} is absent on target {target.name}"
    if support == "emulated" and hardware.refuse_emulated:
        return Outcome.UNSUPPORTED, (
            f"{precision} is only emulated on target {target.name} (compute capability "
            f"{target.compute_capability or 'n/a'}); hardware.refuse_emulated is on"
        )
    if (
        hardware.predicted_oom == "skip"
        and charge_bytes is not None
        and target.memory_bytes is not None
        and charge_bytes > target.memory_bytes * hardware.oom_margin
    ):
        return Outcome.PREDICTED_OOM, (
            f"estimated charge {charge_bytes / GIB:.2f} GiB exceeds the {target.memory_bytes / GIB:.2f} GiB "
            f"budget of {target.name} x margin {hardware.oom_margin}"
        )
    return None


def cluster_shortfall(spec: CellSpec, capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before submission when no partition of the cluster has a node with the cores and GPUs the
    cell's job asks for: every rank of a cell runs on one node, inside one job (world_size x train.threads
    cores, world_size x gpus_per_rank GPUs). Submitted, such a job would wait in the queue for ever
    (PartitionConfig); the probe recorded the cluster's partitions when it ran as a cluster job."""
    recorded = (capabilities.get("cluster") or {}).get("partitions")
    if not recorded:
        return None
    partitions = [p for p in recorded if p.get("up")]
    world, nodes = spec.axes.world_size, spec.axes.nodes
    cpus = world // nodes * spec.train.threads  # on each node: its share of the ranks
    gpus = devices.cell_gpus(spec.hardware.gpus_per_rank, world // nodes, capabilities)
    if any(p["cpus_per_node"] >= cpus and p["gpus_per_node"] >= gpus and p["nodes"] >= nodes for p in partitions):
        return None
    offered = "; ".join(
        f"{p['name']}: {p['nodes']} node(s) of {p['cpus_per_node']} CPUs, {p['gpus_per_node']} GPUs" for p in partitions
    )
    where = "on one node" if nodes == 1 else f"on each of {nodes} nodes"
    return (
        Outcome.UNSUPPORTED,
        f"needs {cpus} CPUs and {gpus} GPUs {where} (all {world} ranks of a cell run in one job, "
        f"train.threads {spec.train.threads} each); no partition that is up has such "
        f"{'a node' if nodes == 1 else 'nodes'} ({offered or 'none is up'})",
    )


def needs_cuda(spec: CellSpec, device: str) -> tuple[str, str] | None:
    """`unsupported` before launch for a cell that trains on the CPU (`device`, the plan's) with a setting that runs
    on CUDA only: peft's LoftQ initialization (lora.loftq_bits), whose loftq_init moves each weight to "cuda"."""
    if not spec.lora.loftq_bits or device == "cuda":
        return None
    return (
        Outcome.UNSUPPORTED,
        "lora.loftq_bits: peft's LoftQ initialization runs on CUDA only; this cell trains on the CPU",
    )


def gpu_shortfall(spec: CellSpec, capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before launch when the cell needs more GPUs than it has (a rank without its own GPU fails
    at set-up with "invalid device ordinal"; a launch would only prove it).

    Locally that is the GPUs the probe found on the machine. A probe that ran as a cluster job saw only the
    GPUs granted to its own job (one rank's): there the count is what the cell's own job was granted, known only
    once that job runs (the supervisor asks then), and outside a cluster job (the `cell_plan` rule on the
    submitting host) nothing is decided."""
    world = spec.axes.world_size
    per_rank = devices.gpus_per_rank(spec.hardware.gpus_per_rank, capabilities)
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
