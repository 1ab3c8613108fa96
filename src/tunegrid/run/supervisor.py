"""The finetune job: supervise one cell's training in a child process and always write result.json.

The child (train.py) imports torch and trains; this process stays light. It watches a wall-clock limit
and a heartbeat, so a hang becomes `timeout`, never a stuck pipeline; it tails metrics.jsonl into MLflow
so training never blocks on the store; and whatever happens to the child, it writes result.json.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import CellContract, LivenessLimits
from tunegrid.outcome import CellResult, compose_result, infrastructure_fault
from tunegrid.prepare.environment import light_env
from tunegrid.run.hang_watch import EarlyVerdict, HangWatch
from tunegrid.run.launch import launch_ranks, stop_group, wait_any
from tunegrid.run.nodes import nodes_shortfall
from tunegrid.run.recorder_read import dump_files
from tunegrid.runtime.devices import cell_devices
from tunegrid.runtime.files import read_json, read_jsonl, write_json
from tunegrid.runtime.rundir import MetricsTail, clear_run_files, last_activity
from tunegrid.runtime.workers import FORKED, SPAWNED, WARM_SOCKET_ENV
from tunegrid.study.paths import StudyPaths
from tunegrid.study.sources import fetched_env
from tunegrid.targets import gpu_shortfall
from tunegrid.track.diagnosis import diagnosis_line, result_metrics
from tunegrid.track.tags import (
    ARTIFACT_FILES,
    axis_tags,
    dataset_input,
    env_tags,
    rerun_tags,
    result_params,
    run_name,
    run_tags,
    spec_id,
    study_cell_ids,
)
from tunegrid.track.tracking import NullRun
from tunegrid.vocabulary import Outcome

POLL_S = 0.5
FLUSH_EVERY_S = 2.0


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
) -> tuple[list[int | None], tuple[str, str] | None, list[dict[str, Any]], list[int], EarlyVerdict | None]:
    """Run the rank(s) to their end, a timeout, a stall or a lost rank.

    Returns (exit code per rank, verdict, unsent metrics, ranks this supervisor stopped, a hang named early)."""
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
    return [proc.returncode for proc in procs], verdict, pending, stopped, watch.verdict if watch else None


def run_cell(contract_path: Path, command: list[str]) -> dict[str, Any]:
    """The `finetune` job: the cell of this contract (tunegrid.contract, made by the `cell_plan` rule) trained
    under supervision, or decided without training where its plan says so; returns result.json's content."""
    started = time.time()
    contract = CellContract.read(contract_path)
    spec, plan, job = contract.spec, contract.plan, contract.job
    spec_json = spec.to_json()  # what the targets', nodes', devices' and ranks' rules and result.json read
    run_dir, model_dir, data_path = job.run, Path(job.model_dir), Path(job.data_path)
    result_path = Path(job.result_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_run_files(run_dir)
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
        verdict = gpu_shortfall(spec_json, capabilities)
    verdict = verdict or nodes_shortfall(spec_json)  # a cell across nodes: in a SLURM job that holds them (run.nodes)
    cell = {**spec_json, "plan": plan.record(worker)}  # the spec and plan as the cell ran them: result.json's cell

    # the job's own GPUs (none on CPU) from launch to result.json: cells side by side never share a device
    world = spec.axes.world_size
    with (
        cell_devices(cell["hardware"], world, capabilities) if verdict is None else contextlib.nullcontext() as visible
    ):
        # The worker starts first, so its torch/transformers imports (seconds) overlap the MLflow set-up below.
        early = launch_ranks(contract, contract_path, warm_socket, visible) if verdict is None else None
        tracker: Any = NullRun()
        try:
            if job.tracking_path is not None:
                tracking = read_json(job.tracking_path)
                tracker = _open_run(cell, capabilities, tracking, result_path, command, job.snakemake_job, started)
        except BaseException:  # never leave a started worker behind
            for proc in early or []:
                stop_group(proc)
            raise
        tail = MetricsTail(run_dir / "metrics.jsonl")
        attempts: list[dict[str, Any]] = []
        feasible = verdict is None
        while True:
            returncodes: list[int | None] = [None]
            pending: list[dict[str, Any]] = []
            stopped: list[int] = []
            named: EarlyVerdict | None = None
            if feasible:
                returncodes, verdict, pending, stopped, named = _supervise(
                    contract, contract_path, tracker, tail, early, visible
                )
                early = None
            env = cell_env(spec) | fetched_env(model_dir, data_path)  # where the model and data came from
            result = compose_result(cell, run_dir, returncodes[0], verdict, started, command, env)
            if world > 1 and returncodes != [None]:
                from tunegrid.run.rank_diagnosis import diagnose_ranks

                ranks = diagnose_ranks(spec_json, run_dir, result, returncodes, stopped, named, capabilities)
                # the supervisor's view of the ranks completes the worker's (its DDP backend stays)
                ranks["distributed"] = {**result.get("distributed", {}), **ranks.get("distributed", {})}
                result.update(ranks)
            attempts.append(
                {
                    "outcome": result["outcome"],
                    "reason": result["reason"],
                    "infrastructure": infrastructure_fault(result),
                }
            )
            if not attempts[-1]["infrastructure"] or len(attempts) > spec.train.retries:
                break
            # a process died under us (signal, node loss): bounded retry from scratch; the count is recorded
            print(f"attempt {len(attempts)} ended {result['outcome']} ({result['reason']}); retrying", flush=True)
            tracker.log_records(pending + tail.read_new())
            clear_run_files(run_dir)
            tail = MetricsTail(run_dir / "metrics.jsonl")
            verdict = None
        result["attempts"] = attempts
        result["visible_devices"] = visible  # the job's own GPUs ("" none, null as the cluster granted)
        tracker.log_records(pending + tail.read_new())
        filled = tracker.reconcile(read_jsonl(run_dir / "metrics.jsonl"))
        if tracker.enabled:
            result["tracking"] = {
                "run_id": tracker.run_id,
                "points_sent_live": tracker.sent_points,
                "points_filled": filled,
                "errors": tracker.errors,
            }
        # the cell's log ends with how the cell ended (a failing cell's log would otherwise end mid-progress-bar)
        print(f"tunegrid: {spec.cell_id} ended {diagnosis_line(result)}", flush=True)
        # result.json is the job's declared output: it appears last, once everything the job owes (the
        # MLflow run finished, the parent's counts) is done, so a kill before it re-runs the cell and a
        # kill after it finds nothing left to do. The copy MLflow keeps is staged beside it.
        staged = run_dir / ".staged" / "result.json"
        result = CellResult.from_json(result).to_json()  # the declared shape: a key no field holds is an error
        write_json(staged, result)
        if tracker.enabled:
            _finish_run(tracker, result, staged, data_path, Path(job.log_path) if job.log_path else None)
            from tunegrid.track.execution import cell_ended

            cell_ended(tracker.uri, StudyPaths.of_result(result_path).study_dir, spec.cell_id, result["outcome"])
        _kill_point("before_result")
        write_json(result_path, result)
        shutil.rmtree(staged.parent, ignore_errors=True)
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


def _finish_run(tracker: Any, result: dict[str, Any], staged: Path, data_path: Path, log_path: Path | None) -> None:
    """The cell's MLflow run at its end: the dataset input, outcome tags, params and artifacts."""
    run_dir = staged.parent.parent  # <run_dir>/.staged/result.json
    if data_path.is_file():
        tracker.log_dataset(dataset_input(result, data_path))
    artifacts = [staged] + [run_dir / name for name in ARTIFACT_FILES if name != "result.json"]
    artifacts += sorted((run_dir / "ranks").glob("rank*.log")) + [
        path for _, path in sorted(dump_files(run_dir / "flight_recorder")[0].items())
    ]
    if log_path is not None:
        artifacts.append(log_path)
    tracker.finish(
        {**run_tags(result), "attempts": str(len(result["attempts"]))},
        artifacts,
        failed=result["outcome"] != Outcome.OK,
        params=result_params(result),
        end_time=result["ended_at"],
        metrics=result_metrics(result),
        name=run_name(result["outcome"], spec_id(result), study_cell_ids(run_dir)),
    )
    if tracker.errors:  # the store was unreachable at the end: say so in the file too
        result["tracking"]["errors"] = tracker.errors
    if tracker.refused:  # keys MLflow would not take (named, never valued): the files hold them
        result["tracking"]["refused"] = tracker.refused


def _kill_point(name: str) -> None:
    """TUNEGRID_KILL_AT=<name>: the supervisor SIGKILLs itself there (a test's `kill -9` of the job at its worst)."""
    if os.environ.get("TUNEGRID_KILL_AT") == name:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _open_run(
    spec: dict[str, Any],
    capabilities: dict[str, Any],
    tracking: dict[str, Any],
    result_path: Path,
    command: list[str],
    snakemake_job: str,
    started: float,
) -> Any:
    """The cell's MLflow run: axes, env and re-run tags, params, the parent (invocation) and probe links."""
    from tunegrid.track.execution import INVOCATION_TAG, parent_run_id
    from tunegrid.track.params import split_params, study_specs
    from tunegrid.track.store import tracking_uri_for_cells
    from tunegrid.track.tracking import CellRun

    tracker = CellRun(tracking_uri_for_cells(tracking), tracking["experiment_id"])
    tags = axis_tags(spec["axes"], spec.get("debug"))
    tags.update(study=spec["study"], command=shlex.join(command), target=str(spec["plan"]["target"]))
    tags.update(env_tags(capabilities))
    tags.update(rerun_tags(result_path, snakemake_job))
    probe_run = capabilities.get("mlflow_run_id") or ""
    if probe_run:
        tags["probe.run_id"] = probe_run
    params, common = split_params(spec, study_specs(result_path.parent))
    parent = parent_run_id(
        tracker.uri,
        tracking["experiment_id"],
        spec["study"],
        StudyPaths.of_result(result_path).study_dir,
        probe_run,
        spec["cell_id"],
        params=common,
    )
    if parent:
        tags[INVOCATION_TAG] = parent
    tracker.start(spec["cell_id"], tags, params, start_time=started)
    tracker.monitor_system(float(tracking.get("system_metrics_interval_s", 0)))
    return tracker
