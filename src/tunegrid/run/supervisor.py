"""The finetune job: supervise one cell's training in a child process and always write result.json.

The child (train.py) imports torch and trains; this process stays light. It watches a wall-clock limit
and a heartbeat, so a hang becomes `timeout`, never a stuck pipeline; it tails metrics.jsonl into MLflow
so training never blocks on the store; and whatever happens to the child, it writes result.json.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import CellContract, LivenessLimits
from tunegrid.outcome import compose_result, infrastructure_fault
from tunegrid.prepare.environment import light_env
from tunegrid.run.cell_record import open_cell_run, record_result
from tunegrid.run.hang_watch import EarlyVerdict, HangWatch
from tunegrid.run.launch import launch_ranks, stop_group, wait_any
from tunegrid.run.nodes import nodes_shortfall
from tunegrid.runtime.devices import cell_devices
from tunegrid.runtime.files import read_json
from tunegrid.runtime.rundir import MetricsTail, clear_run_files, last_activity
from tunegrid.runtime.workers import FORKED, SPAWNED, WARM_SOCKET_ENV
from tunegrid.study.sources import fetched_env
from tunegrid.targets import gpu_shortfall
from tunegrid.track.tracking import NullRun
from tunegrid.vocabulary import Outcome

POLL_S = 0.5
FLUSH_EVERY_S = 2.0


@dataclass
class RanksLeft:
    """What one attempt's ranks left: an exit code per rank (none where no rank ran), the supervisor's verdict
    (a timeout), metrics not yet sent, the ranks it stopped, and a hang the watch named early."""

    returncodes: list[int | None]
    verdict: tuple[str, str] | None
    pending: list[dict[str, Any]]
    stopped: list[int]
    named: EarlyVerdict | None


class Liveness:
    """The limits a running cell is held to: the plan's (the study's, raised to the work the probe's rate
    predicts: tunegrid.prepare.liveness), raised again as the cell reports how long its steps really take, so
    that only a cell that stops making progress times out, never one on a host slower than predicted."""

    def __init__(self, limits: LivenessLimits, steps: int) -> None:
        self.heartbeat_s = float(limits.heartbeat_timeout_s)
        self.limit_s = float(limits.time_limit_s)
        self.margin, self.extra_steps = float(limits.margin), int(limits.extra_steps)
        self.steps = int(steps)
        self.step_s = 0.0  # the longest step the cell reported
        # the wall-clock limit follows the measured pace only where the plan knew the cell's work (a probed rate);
        # without one the study's limit is the cell's budget as written
        self.paced = limits.predicted_step_s is not None

    def observe(self, records: list[dict[str, Any]], elapsed: float) -> None:
        """Steps the cell recorded (metrics.jsonl lines) as it trains, `elapsed` seconds after its start."""
        for record in records:
            if not isinstance(record.get("step_time_s"), (int, float)) or not isinstance(record.get("step"), int):
                continue
            self.step_s = max(self.step_s, float(record["step_time_s"]))
            remaining = max(0, self.steps - record["step"] - 1) + self.extra_steps
            self.heartbeat_s = max(self.heartbeat_s, self.margin * self.step_s)
            if self.paced:
                self.limit_s = max(self.limit_s, elapsed + self.margin * self.step_s * remaining)


def _supervise(
    contract: CellContract,
    contract_path: Path,
    tracker: Any,
    tail: MetricsTail,
    procs: list[subprocess.Popen[bytes]] | None = None,
    visible_devices: str | None = None,
) -> RanksLeft:
    """Run the rank(s) to their end, a timeout, a stall or a lost rank."""
    spec, run_dir = contract.spec, contract.job.run
    grace = spec.distributed.exit_grace_s
    started = time.time()
    procs = procs or launch_ranks(contract, contract_path, visible_devices=visible_devices)
    stopped: list[int] = []
    previous_handler = signal.getsignal(signal.SIGTERM)

    def stop_all() -> None:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                stopped.append(rank)
                stop_group(proc)

    def on_term(signum: int, frame: Any) -> None:
        stop_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    pending: list[dict[str, Any]] = []
    last_flush = time.monotonic()
    verdict: tuple[str, str] | None = None
    first_exit: float | None = None
    liveness = Liveness(contract.plan.liveness, spec.train.steps)
    predicted = contract.plan.liveness.predicted_step_s
    watch = HangWatch(run_dir, len(procs), spec.distributed, predicted) if len(procs) > 1 else None
    try:
        while any(proc.poll() is None for proc in procs):
            wait_any(procs, POLL_S)
            recorded = tail.read_new()
            liveness.observe(recorded, time.time() - started)
            pending += recorded
            if pending and time.monotonic() - last_flush > FLUSH_EVERY_S:
                if tracker.log_records(pending):
                    pending = []
                last_flush = time.monotonic()
            now = time.time()
            if first_exit is None and any(proc.poll() is not None for proc in procs):
                first_exit = now
            if now - started > liveness.limit_s:
                verdict = (Outcome.TIMEOUT, f"wall-clock limit of {liveness.limit_s:.0f} s reached")
            elif now - last_activity(run_dir, started, len(procs)) > liveness.heartbeat_s:
                verdict = (Outcome.TIMEOUT, f"no progress for {liveness.heartbeat_s:.0f} s (heartbeat)")
            elif first_exit is not None and now - first_exit > grace:
                break  # one rank ended (crashed or gave up); the rest are stopped below
            named = watch.check([proc.poll() for proc in procs], now) if watch is not None else None
            if named is not None and watch.announce(tracker) and spec.distributed.end_on_hang:  # ends on a named hang
                verdict = (Outcome.TIMEOUT, named.reason(spec.distributed.collective_timeout_s))
            if verdict:
                break
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        stop_all()
    return RanksLeft([proc.returncode for proc in procs], verdict, pending, stopped, watch.verdict if watch else None)


@dataclass
class CellStart:
    """The cell as this job starts it: its contract and command, what the host offers (capabilities), the warm
    worker's socket where one serves it, a verdict reached before any training, and the plan as the cell runs it."""

    contract: CellContract
    contract_path: Path
    command: list[str]
    started: float
    capabilities: dict[str, Any]
    warm_socket: str | None
    verdict: tuple[str, str] | None
    plan: dict[str, Any]  # the contract's plan for the worker's path (CellPlan.record): result.json's cell.plan


def run_cell(contract_path: Path, command: list[str]) -> dict[str, Any]:
    """The `finetune` job: the cell of this contract (tunegrid.contract, made by the `cell_plan` rule) trained
    under supervision, or decided without training where its plan says so; returns result.json's content."""
    start = _start(contract_path, command)
    spec = start.contract.spec
    per_rank, world = spec.hardware.gpus_per_rank, spec.axes.world_size
    # the job's own GPUs (none on CPU) from launch to result.json: cells side by side never share a device
    with cell_devices(per_rank, world, start.capabilities) if start.verdict is None else nullcontext() as visible:
        tracker, early = _launch(start, visible)
        result, unsent = _attempts(start, tracker, early, visible)  # each supervised, then composed
        return record_result(start.contract, tracker, result, unsent, visible)


def _start(contract_path: Path, command: list[str]) -> CellStart:
    """The contract read, the run folder cleared, and what is settled before any rank runs: the worker's path
    and a verdict that spares training (the plan's, the GPUs a cluster job was granted, the nodes)."""
    started = time.time()
    contract = CellContract.read(contract_path)
    spec, plan, job = contract.spec, contract.plan, contract.job
    job.run.mkdir(parents=True, exist_ok=True)
    clear_run_files(job.run)
    capabilities = read_json(job.capabilities_path) if job.capabilities_path else {}
    probe_run = Path(job.capabilities_path).parent / "mlflow.json" if job.capabilities_path else None
    if probe_run is not None and probe_run.exists():  # the probe's MLflow run, logged by probe_tracking
        capabilities["mlflow_run_id"] = read_json(probe_run).get("run_id")
    # the plan decided the worker's path (tunegrid.runtime.workers.planned_worker): only a cell planned forked
    # asks the warm worker, so a spawned cell (a GPU, a cluster job, a stack of its own) never waits for one
    warm_socket = os.environ.get(WARM_SOCKET_ENV) if plan.worker == FORKED else None
    if warm_socket:
        from tunegrid.run.warm_client import ready_info

        if ready_info(Path(warm_socket)) is None:
            print("the warm worker does not serve this run: the cell's worker is spawned", flush=True)
            warm_socket = None
    # the plan's estimate (and the verdict it leads to) for the path this worker takes: the planned one, or
    # spawned where the warm worker does not answer (the plan holds both)
    worker = FORKED if warm_socket else SPAWNED
    estimate = plan.estimate(worker)
    verdict = None if estimate.verdict == "run" else (estimate.verdict, estimate.reason)
    if verdict is None and capabilities.get("cluster_job"):  # the GPUs granted to this job, known only now
        verdict = gpu_shortfall(spec, capabilities)
    verdict = verdict or nodes_shortfall(spec)  # a cell across nodes: in a SLURM job that holds them (run.nodes)
    return CellStart(contract, contract_path, command, started, capabilities, warm_socket, verdict, plan.record(worker))


def _launch(start: CellStart, visible: str | None) -> tuple[Any, list[subprocess.Popen[bytes]] | None]:
    """The cell's MLflow run opened, and its ranks launched where it trains (none where a verdict spared it).

    The worker starts first, so its torch/transformers imports (seconds) overlap the MLflow set-up."""
    job = start.contract.job
    early = (
        launch_ranks(start.contract, start.contract_path, start.warm_socket, visible) if start.verdict is None else None
    )
    tracker: Any = NullRun()
    try:
        if job.tracking_path is not None:
            tracking = read_json(job.tracking_path)
            result_path = Path(job.result_path)
            tracker = open_cell_run(
                start.contract.spec,
                start.plan,
                start.capabilities,
                tracking,
                result_path,
                start.command,
                job.snakemake_job,
                start.started,
            )
    except BaseException:  # never leave a started worker behind
        for proc in early or []:
            stop_group(proc)
        raise
    return tracker, early


def _attempts(
    start: CellStart, tracker: Any, early: list[subprocess.Popen[bytes]] | None, visible: str | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The cell's attempts, each supervised then composed; returns the last one's result (with the count of
    attempts) and the metrics not yet sent."""
    run_dir, retries = start.contract.job.run, start.contract.spec.train.retries
    tail = MetricsTail(run_dir / "metrics.jsonl")
    attempts: list[dict[str, Any]] = []
    verdict = start.verdict
    while True:
        left = _supervise_ranks(start, tracker, tail, early, visible, verdict)
        early = None
        result = _compose(start, left)
        attempts.append(
            {"outcome": result["outcome"], "reason": result["reason"], "infrastructure": infrastructure_fault(result)}
        )
        if not attempts[-1]["infrastructure"] or len(attempts) > retries:
            break
        # a process died under us (signal, node loss): bounded retry from scratch; the count is recorded
        print(f"attempt {len(attempts)} ended {result['outcome']} ({result['reason']}); retrying", flush=True)
        tracker.log_records(left.pending + tail.read_new())
        clear_run_files(run_dir)
        tail = MetricsTail(run_dir / "metrics.jsonl")
        verdict = None
    result["attempts"] = attempts
    return result, left.pending + tail.read_new()


def _supervise_ranks(
    start: CellStart,
    tracker: Any,
    tail: MetricsTail,
    early: list[subprocess.Popen[bytes]] | None,
    visible: str | None,
    verdict: tuple[str, str] | None,
) -> RanksLeft:
    """One attempt's ranks launched (unless already), watched and stopped; a cell a verdict spared before
    training left no rank (one exit code: none) and keeps that verdict."""
    if start.verdict is not None:
        return RanksLeft([None], verdict, [], [], None)
    return _supervise(start.contract, start.contract_path, tracker, tail, early, visible)


def _compose(start: CellStart, left: RanksLeft) -> dict[str, Any]:
    """The attempt's result from what its ranks left: outcome and reason (tunegrid.outcome), and for a cell across
    ranks the deciding rank and the diagnosis (run.rank_diagnosis)."""
    spec, job = start.contract.spec, start.contract.job
    env = cell_env(spec) | fetched_env(Path(job.model_dir), Path(job.data_path))  # where the model and data came from
    returncode, verdict = left.returncodes[0], left.verdict
    result = compose_result(spec, start.plan, job.run, returncode, verdict, start.started, start.command, env)
    if spec.axes.world_size > 1 and left.returncodes != [None]:
        from tunegrid.run.rank_diagnosis import diagnose_ranks

        ranks = diagnose_ranks(spec, job.run, result, left.returncodes, left.stopped, left.named, start.capabilities)
        # the supervisor's view of the ranks completes the worker's (its DDP backend stays)
        ranks["distributed"] = {**result.get("distributed", {}), **ranks.get("distributed", {})}
        result.update(ranks)
    return result


def cell_env(spec: CellSpec) -> dict[str, Any]:
    """The supervisor's light record of the environment; for a cell on a library stack, the packages are the
    versions its stack's interpreter resolved (the worker ran there, not here) and `stack` names it."""
    env = light_env()
    if spec.stack is not None and spec.stack.python:  # a stack of its own (the base stack's python is "")
        from tunegrid.study.stacks import read_stack_record

        record = read_stack_record(spec.stack.folder)
        versions = record.get("versions", {})
        env["packages"] = {name: versions.get(name) or version for name, version in env["packages"].items()}
        env["stack"] = {**spec.stack.to_json(), "versions": versions}
    return env
