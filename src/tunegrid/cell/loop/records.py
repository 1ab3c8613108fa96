"""What the loop records: the step log (the tallies each step adds to, what a resume state saves and a resume
refills), a step's metrics line, a non-finite event with its origin, and the summary that turns the step log
into the cell's facts and outcome (ok only if every step ran and none ended non-finite).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunegrid.cell.loop.instrument import DtypeCensus, HeadroomMeter
from tunegrid.cell.loop.resume import ResumeState
from tunegrid.cell.loop.step import StepResult
from tunegrid.cell.nonfinite.origin import FailingStepReplay
from tunegrid.cell_spec import CellSpec, TrainSpec
from tunegrid.diagnosis import Diagnosis, NanDiagnosis, NonfiniteKind
from tunegrid.outcome import StepMetrics, module_name
from tunegrid.runtime.files import JsonlAppender
from tunegrid.sites import BLOCK_NAME, site_words
from tunegrid.vocabulary import Outcome


@dataclass
class StepLog:
    """What the loop accumulates step by step: a resume state saves it, a resume refills it, and the summary at
    the end turns it into the cell's facts."""

    census: DtypeCensus  # dtypes seen in forward/backward (step 0)
    headroom: HeadroomMeter  # fp16 headroom of sampled and failing steps
    start: int = 0  # the first step this run trains (after a resume, the resume state's)
    last_step: int = -1
    skipped_total: int = 0
    scaler_skips: int = 0  # of those, the GradScaler's: steps that do not count toward train.steps
    consecutive_skips: int = 0
    loss_scale_end: float | None = None  # the GradScaler's scale after the last step (None without one)
    step_times: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    steady_peaks: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    nonfinite_events: list[dict[str, Any]] = field(default_factory=list)
    headroom_steps: list[int] = field(default_factory=list)  # the failing steps whose headroom was measured on replay
    stop_event: dict[str, Any] | None = None
    stopped: bool = False  # the loop ended at a non-finite or unsupported step (the ranks' stop, not their end)
    unsupported: list[str] = field(default_factory=list)  # adapter tensors that got no gradient on step 0
    stopped_by_peer: int | None = None  # the step at which another rank's decision ended this rank's loop

    def tallies(self) -> dict[str, list[Any]]:
        """The lists a resume state saves, as the same objects (a resume extends them in place)."""
        return {
            "step_times": self.step_times,
            "tokens_per_s": self.tokens_per_s,
            "steady_peaks": self.steady_peaks,
            "losses": self.losses,
            "nonfinite_events": self.nonfinite_events,
            "headroom_steps": self.headroom_steps,
        }

    def saved(self, memory: dict[str, Any]) -> dict[str, Any]:
        """What a resume state keeps of the log (and of the cell's memory facts, the first step's peak)."""
        return {
            **self.tallies(),
            "skipped_total": self.skipped_total,
            "scaler_skips": self.scaler_skips,
            "consecutive_skips": self.consecutive_skips,
            "census": self.census.as_dict(),
            "headroom_worst": dict(self.headroom.worst_seen),
            "memory": {k: v for k, v in memory.items() if k == "first_step_peak_bytes"},
        }

    def refill(self, resumed: ResumeState, memory: dict[str, Any]) -> None:
        """The log as it was at the resume state's step; the loop goes on with that step."""
        saved = resumed.tallies
        for name, values in self.tallies().items():
            values.extend(saved[name])
        self.census.forward.update(saved["census"]["forward"])
        self.census.backward.update(saved["census"]["backward"])
        self.headroom.worst_seen.update(saved["headroom_worst"])
        memory.update(saved["memory"])
        self.start, self.skipped_total, self.consecutive_skips = (
            resumed.step,
            saved["skipped_total"],
            saved["consecutive_skips"],
        )
        # a resume state saved before scaler skips were told apart: under fp16 every skip of an ok run was one
        self.scaler_skips = saved.get("scaler_skips", saved["skipped_total"])

    def counted(self, steps_run: int) -> int:
        """The steps of the first `steps_run` that count toward train.steps: all but the GradScaler's skips."""
        return steps_run - self.scaler_skips


@dataclass
class StepFiles:
    """The run's per-step files: metrics.jsonl (one line per step), events.jsonl (non-finite events),
    headroom.jsonl (sampled and failing steps' activation max-abs)."""

    metrics: JsonlAppender
    events: JsonlAppender
    headroom: JsonlAppender

    @classmethod
    def open(cls, run_dir: Path) -> StepFiles:
        return cls(*(JsonlAppender(run_dir / f"{name}.jsonl") for name in ("metrics", "events", "headroom")))

    def close(self) -> None:
        for log in (self.metrics, self.events, self.headroom):
            log.close()


def record_step(
    log: StepLog, files: StepFiles, step: int, result: StepResult, tokens: int, measured_headroom: bool, scaled: bool
) -> None:
    """One line of metrics.jsonl (`tokens`: the step's real tokens, padding excluded), and the running tallies
    (step 0 is the first-step peak, not steady). `scaled`: the loss was scaled by a GradScaler."""
    log.skipped_total += int(result.skipped)
    log.scaler_skips += int(result.scaler_skipped)
    log.consecutive_skips = log.consecutive_skips + 1 if result.skipped else 0
    if step == 0:
        log.unsupported = result.params_without_grad or []
    else:
        log.step_times.append(result.elapsed)
        log.tokens_per_s.append(tokens / result.elapsed)
        log.steady_peaks.append(result.peak)
    headroom = None
    if measured_headroom:
        worst = log.headroom.collect(step)
        files.headroom.write(worst)
        headroom = worst["max_ratio"]
    metrics = StepMetrics(
        step=step,
        time=time.time(),
        loss=result.loss,
        grad_norm=result.grad_norm,
        lr=result.lr,
        tokens_per_s=tokens / result.elapsed,
        step_time_s=result.elapsed,
        local_time_s=result.local_time,
        mem_peak_bytes=result.peak,
        skipped_steps=log.skipped_total,
        loss_scale=result.scale if scaled else None,
        fp16_headroom_max_ratio=headroom,
    )
    files.metrics.write(metrics.as_record())


def on_nonfinite(
    log: StepLog,
    files: StepFiles,
    step: int,
    micro_batches: list[dict[str, Any]],
    result: StepResult,
    replay: FailingStepReplay,
    train: TrainSpec,
    scaled: bool,
) -> bool:
    """A step whose loss or gradient is not finite becomes an event with its origin; True ends the loop."""
    loss_finite, grad_finite = math.isfinite(result.loss), math.isfinite(result.grad_norm)
    if loss_finite:
        log.losses.append(result.loss)
    if loss_finite and grad_finite:
        return False
    kind = NonfiniteKind.LOSS if not loss_finite else (NonfiniteKind.SCALER_SKIP if scaled else NonfiniteKind.GRADIENT)
    event = NanDiagnosis(step=step, kind=kind, loss=result.loss, grad_norm=result.grad_norm, loss_scale=result.scale)
    policy = train.on_nonfinite
    stop = (
        policy == "stop"
        or (policy == "stop_after_skips" and kind != NonfiniteKind.SCALER_SKIP)
        or (policy == "stop_after_skips" and log.consecutive_skips >= train.max_consecutive_skips)
    )
    # Every event that ends the cell or is the first of its kind gets its origin (a replay of that
    # step); repeats of a kind already traced under `continue` are recorded without one.
    if stop or kind not in {e["kind"] for e in log.nonfinite_events}:
        origin = replay.origin(step, micro_batches, result, log.headroom)
        headroom = origin.pop("headroom")
        event = dataclasses.replace(event, origin=origin, micro_batch=origin["micro_batch"], headroom=headroom)
        files.headroom.write({**headroom, "failing_step": True})
        log.headroom_steps.append(step)
    # the log keeps the event as events.jsonl has it: a resume state saves the log as JSON
    record = event.to_json()
    log.nonfinite_events.append(record)
    files.events.write(record)
    if stop:
        log.stop_event = record
    return stop


def summarise(log: StepLog, spec: CellSpec, facts: dict[str, Any], memory: dict[str, Any]) -> None:
    """The cell's facts from the step log: peaks, dtypes seen, headroom, throughput, and the outcome."""
    steps_run = log.last_step + 1
    memory["steady_peak_bytes"] = max(log.steady_peaks) if log.steady_peaks else None
    memory["peak_bytes"] = max(
        v
        for v in (memory.get("load_peak_bytes"), memory.get("first_step_peak_bytes"), memory["steady_peak_bytes"])
        if v
    )
    facts["precision_in_effect"].update(log.census.as_dict())
    facts["fp16_headroom"] = {
        **log.headroom.summary(),
        "sampled_every": spec.train.headroom_every,  # the worst is over these samples plus the failing steps
        "failing_steps_measured": log.headroom_steps,
    }
    facts["throughput"] = {
        "tokens_per_s_median": statistics.median(log.tokens_per_s) if log.tokens_per_s else None,
        "step_time_s_median": statistics.median(log.step_times) if log.step_times else None,
    }
    facts["training"] = {
        "steps_run": steps_run,
        "initial_loss": log.losses[0] if log.losses else None,
        "final_loss": log.losses[-1] if log.losses else None,
        "skipped_steps": log.skipped_total,
        "updates_applied": steps_run - log.skipped_total,
        "scaler_skipped_steps": log.scaler_skips,  # run beyond train.steps, up to train.max_skipped_steps
        "loss_scale_end": log.loss_scale_end,
    }
    facts.update(
        conclude(
            spec,
            log.nonfinite_events,
            log.stop_event,
            log.consecutive_skips,
            steps_run,
            log.skipped_total,
            log.scaler_skips,
        )
    )
    if log.stopped_by_peer is not None and log.stop_event is None and facts["outcome"] == Outcome.ERROR:
        # no event of this rank's own ended it: a peer's did (its rank folder holds that event's origin)
        facts.update(
            outcome=Outcome.NAN,
            reason=f"stopped at step {log.stopped_by_peer} with the other ranks: another rank's step ended the cell",
            diagnosis={**facts.get("diagnosis", {}), "stopped_by_peer": {"step": log.stopped_by_peer}},
        )
    if log.unsupported:
        facts.update(
            outcome=Outcome.UNSUPPORTED,
            reason=f"{len(log.unsupported)} adapter tensors get no gradient with this peft/bitsandbytes combination "
            f"(e.g. {log.unsupported[0]}); refusing to train fewer parameters than requested",
            diagnosis={"params_without_grad": log.unsupported},
        )


def conclude(
    spec: CellSpec,
    events: list[dict[str, Any]],
    stop_event: dict[str, Any] | None,
    consecutive_skips: int,
    steps_run: int,
    skipped: int = 0,
    scaler_skips: int = 0,
) -> dict[str, Any]:
    """ok only if every step ran and none ended non-finite; else nan with the event that decided it.

    The deciding event is the one that stopped the loop, else the first non-finite loss/gradient
    (under `continue`), else scaler skips the scaler did not recover from. Scaler skips it recovered
    from are listed, not failures. A step the GradScaler skipped does not count toward train.steps: the
    loop ran one more for each, up to train.max_skipped_steps more.
    """
    train = spec.train
    steps = train.steps
    counted = steps_run - scaler_skips  # the steps that count: all but the GradScaler's skips
    allowance = train.max_skipped_steps if scaler_skips else 0
    more = f" ({scaler_skips} more skipped by the GradScaler)" if scaler_skips else ""
    hard = [e for e in events if e["kind"] != NonfiniteKind.SCALER_SKIP]
    unrecovered_skips = bool(events) and (
        train.on_nonfinite == "stop" or consecutive_skips >= train.max_consecutive_skips
    )
    deciding = stop_event or (hard[0] if hard else None) or (events[0] if unrecovered_skips else None)
    recovered = [e for e in events if e["kind"] == NonfiniteKind.SCALER_SKIP and e is not deciding]
    diagnosis = Diagnosis(recovered_scaler_skips=recovered[0] if recovered else None)
    if deciding is not None:
        origin = deciding.get("origin") or {}
        traced = origin.get("forward") or origin.get("backward")
        where = origin_text(traced) if traced or not origin.get("unlocated") else f"? ({origin['unlocated']})"
        stopped = f"; stopped after {counted} of {steps} steps{more}" if counted < steps else ""
        accum = spec.axes.grad_accum
        micro = (
            f" (micro-batch {deciding['micro_batch']} of {accum})"
            if accum > 1 and deciding.get("micro_batch") is not None
            else ""
        )
        return dict(
            outcome=Outcome.NAN,
            reason=f"{deciding['kind']} at step {deciding['step']}{micro}, first non-finite at {where}{stopped}",
            diagnosis=diagnosis.replace(nan=NanDiagnosis.from_json(deciding), nonfinite_events=len(events)).to_json(),
        )
    elif counted < steps and steps_run < steps + allowance:  # never ok when the loop ended early, whatever the reason
        return dict(
            outcome=Outcome.ERROR,
            reason=f"stopped after {counted} of {steps} steps{more} without a diagnosis",
            diagnosis=diagnosis.to_json(),
        )
    elif counted < steps:  # the skips used up their allowance: fewer updates than asked, and the reason says so
        return dict(
            outcome=Outcome.OK,
            reason=f"ran {steps_run} steps with finite loss: {steps_run - skipped} of {steps} updates applied, "
            f"{scaler_skips} steps skipped by the GradScaler (train.max_skipped_steps {allowance} used up)",
            diagnosis=diagnosis.to_json(),
        )
    else:
        # a step the GradScaler skipped ran but changed no weight: say how many ran beside the updates
        run = f" ({steps_run} run: {skipped} skipped by the GradScaler, not counted)" if skipped else ""
        return dict(
            outcome=Outcome.OK,
            reason=f"trained all {steps_run - skipped} steps with finite loss{run}",
            diagnosis=diagnosis.to_json(),
        )


def origin_text(fact: dict[str, Any] | None) -> str:
    """Where a traced non-finite value first appeared, saying when only padding positions held it."""
    if not fact:
        return "unknown module"
    fact = {**fact, "module": module_name(fact["module"])}
    if fact.get("at") == "padding":
        return f"{fact['module']} (at padding positions only: no loss term, but it reaches the gradients)"
    if fact.get("at") == "unlocated":
        return f"{fact['module']} (in a tensor without token positions; no real position went non-finite)"
    earlier = fact.get("preceded_by")
    if earlier:
        before = module_name(earlier["module"])
        return f"{fact['module']} (after a non-finite value at {earlier['at']} positions of {before})"
    block = BLOCK_NAME.search(fact["module"])
    if block and fact.get("phase") == "forward" and fact.get("dtype") == "float16":
        # the first non-finite forward output is a whole layer's: no module inside it returned one, its sum did
        return f"{fact['module']} ({site_words(fact['module'])} exceeds fp16's range)"
    return fact["module"]
