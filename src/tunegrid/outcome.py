"""A cell's outcome, typed: one line of metrics.jsonl (StepMetrics), the diagnosis of a failure (Diagnosis, in
tunegrid.diagnosis) and result.json (CellResult); and the composition of result.json from what its worker wrote
(worker.json) or, where the worker could not say, from how it ended (a signal, an exit code, a supervisor verdict
such as a timeout). result.json, summary.csv, the MLflow tags and the report read these types.
"""

from __future__ import annotations

import dataclasses
import shlex
import signal
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from tunegrid.cell_spec import CellAxes, CellSpec, SpecKeyError
from tunegrid.diagnosis import Diagnosis, TimeoutDiagnosis
from tunegrid.runtime.files import read_json
from tunegrid.runtime.rundir import heartbeat_stage
from tunegrid.vocabulary import Outcome


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One line of metrics.jsonl: one optimizer step. Every field but `step` and `time` is an MLflow metric
    of the same name (METRIC_KEYS); a field that is None was not measured in that step and is not written."""

    step: int
    time: float
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    # the rank's time from the step's start to its last forward, before the backward joins the gradient
    # all-reduce (a straggler's own slowness, not its wait for others); None in lines from before it existed
    local_time_s: float | None = None
    mem_peak_bytes: int
    skipped_steps: int
    loss_scale: float | None = None  # fp16's GradScaler only
    fp16_headroom_max_ratio: float | None = None  # at the steps the headroom meter measured

    def as_record(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


METRIC_KEYS = tuple(f.name for f in fields(StepMetrics) if f.name not in ("step", "time"))


def _empty() -> dict[str, Any]:
    return {}


@dataclass(kw_only=True)
class CellResult:
    """result.json: what every consumer reads. Sections are the worker's facts as it wrote them; a file
    written before a field existed reads with that field's default.

    The file's `cell` holds two fields: the spec's JSON (`cell`, typed here) with the plan as a key beside its
    sections (`plan`), the shape specs had before the contract carried the plan. A spec an earlier version recorded
    reads with today's keys, those it predates at the values the cell ran at (tunegrid.study.recorded)."""

    cell_id: str
    cell: CellSpec  # the resolved spec the cell trained with
    # result.json's `cell.plan`: the plan as the cell ran it (CellPlan.record for its worker's path: target, budget,
    # estimate, liveness); a dict, not a CellPlan: the one path's record, and earlier versions wrote other keys in it
    plan: dict[str, Any] = field(default_factory=_empty)
    outcome: Outcome
    reason: str
    env: dict[str, Any] = field(default_factory=_empty)
    diagnosis: Diagnosis = field(default_factory=Diagnosis)
    memory: dict[str, Any] = field(default_factory=_empty)
    precision_in_effect: dict[str, Any] = field(default_factory=_empty)
    precision_plan: dict[str, Any] = field(default_factory=_empty)
    throughput: dict[str, Any] = field(default_factory=_empty)
    data: dict[str, Any] = field(default_factory=_empty)
    fp16_headroom: dict[str, Any] = field(default_factory=_empty)
    # fp16-islands: the modules that computed in fp32 (mode, threshold, each island's calibration max-abs, the
    # calibration's top modules); None for every other precision (cell/nonfinite/islands.py)
    fp32_islands: dict[str, Any] | None = None
    quant_audit: dict[str, Any] = field(default_factory=_empty)
    optimizer: dict[str, Any] = field(default_factory=_empty)  # what the optimizer held: class, state bytes, paging
    training: dict[str, Any] = field(default_factory=_empty)
    resumed_from_step: int | None = None
    # the resume state (train.checkpoint_every): every, applied, last_step, discarded; the key is kept from earlier
    # versions so their result.json files still read
    checkpoint: dict[str, Any] = field(default_factory=_empty)
    adapter: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=_empty)
    distributed: dict[str, Any] = field(default_factory=_empty)  # world size, backend, collective timeout
    ranks: list[dict[str, Any]] | None = None  # a distributed cell: each rank's exit and last step
    lora_sha256: str | None = None  # a distributed cell: the adapters every rank ended with
    stage: str | None = None  # the last stage the worker reached (load, step, adapter, ...)
    traceback: str | None = None
    worker_exit_code: int | None = None
    wall_s: float | None = None
    started_at: float | None = None  # epoch seconds: the cell's MLflow run spans exactly these
    ended_at: float | None = None
    command: str = ""
    attempts: list[dict[str, Any]] | None = None
    visible_devices: str | None = None  # the job's own GPUs ("" none, None as the cluster granted)
    tracking: dict[str, Any] | None = None
    # no key of its own: the file's `cell` where writing the completed spec back would change it (an earlier
    # version's, lacking keys), written back as it was, so reading and writing a result keeps what the run recorded
    recorded_cell: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    # the fields result.json's `cell` holds, not keys of their own
    IN_CELL: ClassVar[frozenset[str]] = frozenset({"plan", "recorded_cell"})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CellResult:
        """A result.json as written by any version: missing fields take their defaults; a key no field
        holds is an error (nothing is dropped silently)."""
        known = {f.name for f in fields(cls)} - cls.IN_CELL
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"result.json has keys no CellResult field holds: {unknown}")
        values = dict(data)
        values["outcome"] = Outcome(values["outcome"])
        values["diagnosis"] = Diagnosis.from_json(values.get("diagnosis"))
        values["cell"], values["plan"] = _read_cell(data["cell"])
        if {**values["cell"].to_json(), "plan": values["plan"]} != data["cell"]:
            values["recorded_cell"] = data["cell"]
        return cls(**values)

    # what a worker's facts (worker.json) fill directly; `rank` names the writer, `outcome`/`reason`/`wall_s`
    # and the rest are decided here
    FROM_WORKER: ClassVar[frozenset[str]] = frozenset(
        {
            "precision_in_effect",
            "precision_plan",
            "throughput",
            "data",
            "fp16_headroom",
            "fp32_islands",
            "quant_audit",
            "optimizer",
            "training",
            "resumed_from_step",
            "checkpoint",
            "adapter",
            "params",
            "distributed",
            "lora_sha256",
            "stage",
            "traceback",
        }
    )
    WORKER_FACTS: ClassVar[frozenset[str]] = FROM_WORKER | {
        "outcome",
        "reason",
        "diagnosis",
        "memory",
        "rank",
        "wall_s",
    }

    def to_json(self) -> dict[str, Any]:
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.IN_CELL}
        record["cell"] = self.cell_json()
        record["outcome"] = str(self.outcome)
        record["diagnosis"] = self.diagnosis.to_json()
        return record

    def cell_json(self) -> dict[str, Any]:
        """result.json's `cell`: the spec's JSON, key for key, with the plan (an earlier version's as it wrote it)."""
        if self.recorded_cell is not None:
            return self.recorded_cell
        return {**self.cell.to_json(), "plan": self.plan}

    @property
    def axes(self) -> CellAxes:
        return self.cell.axes


def _read_cell(raw: dict[str, Any]) -> tuple[CellSpec, dict[str, Any]]:
    """The spec and the plan of result.json's `cell`."""
    try:
        spec = CellSpec.from_json({k: v for k, v in raw.items() if k != "plan"})
    except SpecKeyError:  # an earlier version's spec, completed in the one place a spec is
        # imported here: the schema's defaults bring jsonschema, which a supervisor reading its own result never needs
        from tunegrid.study.recorded import recorded_spec

        spec = recorded_spec(raw)
    return spec, raw.get("plan") or {}


PEFT_PREFIX = "base_model.model."  # what peft's wrapper puts before each of the model's own module names


def module_name(name: str) -> str:
    """A module as the model itself names it (`model.layers.0.mlp.down_proj`), without peft's wrapper prefix:
    the one spelling every record, tag, summary column and report line uses, and the one a study's
    `debug.inject_nonfinite.module` and `fp32_islands` are written in."""
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def origin_label(fact: dict[str, Any] | None) -> str | None:
    """A traced non-finite origin's module, marked when no real token position of it was non-finite (its
    `at`: padding, or unlocated for a tensor without positions); one label for summary.csv and run tags."""
    if not fact:
        return None
    module = module_name(fact["module"])
    return f"{module} ({fact['at']})" if fact.get("at") in ("padding", "unlocated") else module


def infrastructure_fault(result: dict[str, Any]) -> bool:
    """A process that died without writing its facts (signal, lost rank): not a property of the cell's
    settings, so worth one more attempt. Exceptions the worker caught and classified are not retried."""
    if result["outcome"] != Outcome.ERROR or (result.get("diagnosis") or {}).get("rank_failure"):
        return False  # a rank that reported its own error fails the same way again
    if (result.get("diagnosis") or {}).get("rank_crash"):
        return True
    return result.get("worker_exit_code") not in (0, None) and not (
        result.get("training") or result.get("precision_plan")
    )


def compose_result(
    spec: CellSpec,
    plan: dict[str, Any],
    run_dir: Path,
    returncode: int | None,
    verdict: tuple[str, str] | None,
    started: float,
    command: list[str],
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """result.json for one attempt of the cell `spec` planned as `plan` (the plan as it ran: result.json's
    `cell.plan`); `env` is the supervisor's light environment record."""
    worker_path = run_dir / "worker.json"
    facts: dict[str, Any] = read_json(worker_path) if worker_path.exists() else {}
    if verdict is not None:  # decided by the supervisor: infeasible before training, or a timeout
        outcome, reason = verdict
        if outcome == Outcome.TIMEOUT:
            timeout = TimeoutDiagnosis(
                stage=facts.get("stage") or heartbeat_stage(run_dir),
                limit_s=spec.train.time_limit_s,
                heartbeat_timeout_s=spec.train.heartbeat_timeout_s,
                # the limits in effect: the study's raised to the cell's predicted work (see the reason)
                liveness=plan.get("liveness"),
            )
            facts["diagnosis"] = Diagnosis(timeout=timeout).to_json()
    elif facts:
        outcome, reason = facts["outcome"], facts["reason"]
    else:
        signame = signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None
        outcome = Outcome.ERROR
        reason = (
            f"worker killed by {signame}" + (" (the kernel's OOM killer sends SIGKILL)" if signame == "SIGKILL" else "")
            if signame
            else f"worker exited with code {returncode} before writing its facts"
        )
    env = dict(env or {})
    env["device"] = (facts.get("precision_plan") or {}).get("device_type", "")
    unknown = sorted(set(facts) - CellResult.WORKER_FACTS)
    if unknown:  # a fact the worker writes must have a field to land in, never be dropped
        raise ValueError(f"worker facts with no CellResult field: {unknown}")
    taken = {k: v for k, v in facts.items() if k in CellResult.FROM_WORKER and v is not None}
    return CellResult(
        **taken,
        cell_id=spec.cell_id,
        cell=spec,
        plan=plan,
        env=env,
        outcome=Outcome(outcome),
        reason=reason,
        diagnosis=Diagnosis.from_json(facts.get("diagnosis")),
        memory=_memory(plan, facts.get("memory") or {}),
        worker_exit_code=returncode,
        wall_s=time.time() - started,
        started_at=started,
        ended_at=time.time(),
        command=shlex.join(command),
    ).to_json()


def _memory(plan: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Measured peaks by stage beside the estimate made before training (the tracker's accuracy)."""
    memory = {
        **measured,
        "estimate_bytes": plan["estimate"]["estimate_bytes"],
        "estimate_components": plan["estimate"]["components"],
        "estimate_not_modelled": plan["estimate"].get("not_modelled"),
        # the worker path whose runtime constant the estimate took (spawned / forked): plan.csv's for this path
        "estimate_worker": plan["estimate"].get("worker"),
        # why the cell trained with torch's oneDNN kernels off (None: on), decided with the estimate
        "cpu_onednn_off": plan["estimate"].get("cpu_onednn_off"),
        "budget_bytes": plan["budget_bytes"],
        "target": plan["target"],
    }
    peak = measured.get("peak_bytes")
    memory["estimate_over_measured"] = plan["estimate"]["estimate_bytes"] / peak if peak else None
    return memory
