"""A cell's contract: everything decided about one cell before it trains, in one typed file per cell
(results/<study>/plans/<cell_id>.json), made once by the `cell_plan` rule (tunegrid.prepare.cell_plan).

- `spec` (CellSpec, tunegrid.cell_spec): the cell's resolved spec, typed section by section (axes, model, train,
  lora, data, debug, hardware, distributed, stack);
- `plan` (CellPlan): the target and memory budget, the memory estimate of each path the cell's worker may take
  with the verdict it leads to, the path planned, the kernels it trains with (oneDNN on or off), the liveness
  limits and the host memory its job asks for;
- `job` (CellJob): the files its `finetune` job reads and writes.

The supervisor (tunegrid.run.supervisor) and the worker (tunegrid.cell.train) read this file and decide nothing
it already says; plan.csv is the union of these files. "Plan" in this package means this, the contract's plan.

Light module: standard library only (the Snakefile reads it at parse time).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.runtime.files import atomic_write_text

# The version of the file's shape: a file of another version is refused (the cell_plan rule makes it again).
CONTRACT_SCHEMA = 1


def _typed(cls: type, raw: dict[str, Any], what: str) -> Any:
    """`cls` from a dict with exactly its fields (no key dropped silently)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{what} has keys no {cls.__name__} field holds: {unknown}")
    return cls(**raw)


@dataclass(frozen=True, kw_only=True)
class LivenessLimits:
    """The limits a cell runs under, and what they were derived from (tunegrid.prepare.liveness decides them;
    result.json's timeout diagnosis keeps them)."""

    heartbeat_timeout_s: float  # the longest silence allowed (no heartbeat, no step recorded)
    time_limit_s: float  # the wall-clock limit of the whole cell
    predicted_step_s: float | None  # the step's matmul work over the probe's rate (None: no rate measured)
    step_flops: float
    rate_tflops: float | None
    margin: float  # how many times the predicted (or measured) work a limit allows
    extra_steps: int  # steps' worth of work beyond the training steps (replay, calibration, reference forward)
    basis: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class MemoryComponents:
    """What one rank's estimated peak is made of, in bytes (tunegrid.prepare.memory_estimate); result.json keeps
    them as memory.estimate_components. A component a cell does not have is 0."""

    runtime: int = 0  # the probe's measured constants: the worker beyond its tensors, and the step's overhead
    tokenizer: int = 0  # held in host memory from the load on: part of a CPU cell's peak only
    weights: int = 0  # as loaded (quantized where the quant quantizes), less those offloaded to the host
    lora_params_grads: int = 0  # the trained parameters in fp32 and their gradients
    optimizer_state: int = 0
    activations: int = 0  # kept for backward on the device, the cast copies of autocast's weights among them
    activations_offloaded_to_host: int = 0  # train.activation_offloading: in host memory, beside the device's peak
    weights_offloaded_to_host: int = 0  # train.weight_offloading: the decoder layers' weights, in host memory
    experts_kept_for_backward: int = 0  # full-width expert weights the grouped matmul keeps (no checkpointing)
    logits: int = 0  # the logits and the loss's buffers (one chunk's, with a chunked loss)
    dequant_buffer: int = 0  # a 4-bit weight's (or a layer's experts') dequantized copy while it multiplies

    def in_host_memory(self) -> int:
        """What the cell keeps in host memory beside the device's peak (nothing on a CPU: nothing is offloaded)."""
        return self.activations_offloaded_to_host + self.weights_offloaded_to_host

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """The estimated peak of one rank whose worker takes `worker`'s path (tunegrid.prepare.memory_estimate makes
    it), and the verdict the plan finds it leads to: `run`, or the outcome decided without training (unsupported,
    predicted_oom)."""

    worker: str  # spawned / forked (tunegrid.runtime.workers): the path whose runtime constant the estimate took
    estimate_bytes: int  # the peak: the larger of the load's and the step's
    stage: str  # load / step: where the peak is reached
    load_bytes: int
    step_bytes: int
    components: MemoryComponents
    not_modelled: str | None = None  # what the estimate leaves out, where it applies
    verdict: str = "run"
    reason: str = ""  # why, for a verdict other than run

    def charge_bytes(self, device: str) -> int:
        """What the estimate says the cell charges its budget on `device`. On a CPU the budget caps the address
        space the cell adds above its worker's start (tunegrid.runtime.memory), which the runtime is already mapped
        in: the estimate less its runtime term. On CUDA the allocator's cap covers every tensor: the whole
        estimate."""
        return self.estimate_bytes - (self.components.runtime if device == "cpu" else 0)

    def record(self) -> dict[str, Any]:
        """The estimate as result.json's `cell.plan.estimate` keeps it (without the verdict)."""
        return {k: v for k, v in asdict(self).items() if k not in ("verdict", "reason")}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MemoryEstimate:
        values = {**raw, "components": _typed(MemoryComponents, raw["components"], "the estimate's components")}
        return _typed(cls, values, "an estimate")


@dataclass(frozen=True, kw_only=True)
class CellKernels:
    """Which kernels the cell's worker trains with (tunegrid.prepare.cpu_kernels decides)."""

    cpu_onednn_off: str | None = None  # why torch's oneDNN kernels are off; None: on
    cpu_fp16_matmul: str | None = None  # why fp16 matmuls run with fp32 sums in tunegrid's blocks; None: torch's


@dataclass(frozen=True, kw_only=True)
class CellPlan:
    cell_id: str
    world_size: int
    target: str | None  # the hardware target the cell is judged against (None: no probe record)
    budget_bytes: int | None  # the memory budget enforced while training (None: none)
    device: str  # cpu / cuda: the device the ranks train on (runtime.devices.training_device), the estimates' memory
    worker: str  # the path the worker is planned to take (tunegrid.runtime.workers.planned_worker)
    # the estimate of each path the worker may take: spawned, and forked where a warm worker could fork it (the
    # supervisor spawns a worker the warm worker does not fork); result.json records the path taken and its estimate
    estimates: dict[str, MemoryEstimate]
    kernels: CellKernels
    liveness: LivenessLimits
    mem_mb: int  # the host memory the cell's job asks for, all ranks (job_mem_mb; hardware.mem_mb replaces it)

    def estimate(self, worker: str | None = None) -> MemoryEstimate:
        """The estimate for the path `worker` (the planned path's where None or not planned)."""
        return self.estimates.get(worker or self.worker) or self.estimates[self.worker]

    def charge_bytes(self, worker: str | None = None) -> int:
        """What the estimate for `worker`'s path charges the budget (MemoryEstimate.charge_bytes)."""
        return self.estimate(worker).charge_bytes(self.device)

    def row(self) -> dict[str, Any]:
        """The cell's line of plan.csv (and what the doctor's out-of-memory choice reads)."""
        planned = self.estimate()
        return {
            "target": self.target,
            "budget_bytes": self.budget_bytes,
            "estimate_bytes": planned.estimate_bytes,
            "charge_bytes": self.charge_bytes(),
            "estimate_stage": planned.stage,
            "estimate_worker": planned.worker,
            "verdict": planned.verdict,
            "reason": planned.reason,
        }

    def record(self, worker: str | None = None) -> dict[str, Any]:
        """The plan as the cell ran it (`worker`: the path taken): result.json's `cell.plan` and the MLflow
        run's params."""
        return {
            "target": self.target,
            "budget_bytes": self.budget_bytes,
            # the kernels beside the estimate they bear on (oneDNN's kept shapes, fp16 products' fp32 blocks)
            "estimate": {**self.estimate(worker).record(), **asdict(self.kernels)},
            "liveness": self.liveness.as_dict(),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CellPlan:
        values = dict(raw)
        values["estimates"] = {k: MemoryEstimate.from_json(v) for k, v in raw["estimates"].items()}
        values["kernels"] = _typed(CellKernels, raw["kernels"], "the kernels")
        values["liveness"] = _typed(LivenessLimits, raw["liveness"], "the liveness limits")
        return _typed(cls, values, "a plan")


@dataclass(frozen=True, kw_only=True)
class CellJob:
    """The files the cell's `finetune` job reads and writes (paths as the workflow names them)."""

    model_dir: str
    data_path: str
    run_dir: str
    result_path: str
    capabilities_path: str | None = None  # the probe's record (None: no probe, no target)
    tracking_path: str | None = None  # tracking.json (None: no MLflow)
    log_path: str | None = None  # the job's log, attached to the MLflow run
    snakemake_job: str = ""  # the rule and its output, recorded as a run tag

    @property
    def run(self) -> Path:
        return Path(self.run_dir)


@dataclass(frozen=True, kw_only=True)
class CellContract:
    spec: CellSpec
    plan: CellPlan
    job: CellJob
    schema_version: int = field(default=CONTRACT_SCHEMA)

    @property
    def cell_id(self) -> str:
        return self.spec.cell_id

    def to_json(self) -> str:
        raw = {
            "spec": self.spec.to_json(),
            "plan": asdict(self.plan),
            "job": asdict(self.job),
            "schema_version": self.schema_version,
        }
        return json.dumps(raw, sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CellContract:
        version = raw.get("schema_version")
        if version != CONTRACT_SCHEMA:
            raise ValueError(f"a cell contract of schema {version!r}; this version reads {CONTRACT_SCHEMA}")
        values = dict(raw)
        values["spec"] = CellSpec.from_json(raw["spec"])
        values["plan"] = CellPlan.from_json(raw["plan"])
        values["job"] = _typed(CellJob, raw["job"], "the job")
        return _typed(cls, values, "a cell contract")

    @classmethod
    def read(cls, path: str | Path) -> CellContract:
        return cls.from_json(json.loads(Path(path).read_text()))

    def write(self, path: str | Path) -> None:
        atomic_write_text(path, self.to_json())
