"""The finetune job: supervise one cell's training in a child process and always write result.json.

The child (train.py) imports torch and trains; this process stays light. It watches a wall-clock limit
and a heartbeat, so a hang becomes `timeout`, never a stuck pipeline; it tails metrics.jsonl into MLflow
so training never blocks on the store; and whatever happens to the child, it writes result.json.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tunegrid.environment import light_env
from tunegrid.files import read_json, read_jsonl, write_json
from tunegrid.warm import SOCKET_ENV as WARM_SOCKET_ENV

POLL_S = 0.5
FLUSH_EVERY_S = 2.0
KILL_GRACE_S = 5.0
RUN_FILES = ("metrics.jsonl", "events.jsonl", "headroom.jsonl", "audit.json", "worker.json", "heartbeat", "ranks", "flight_recorder")
ARTIFACT_FILES = ("result.json", "metrics.jsonl", "events.jsonl", "headroom.jsonl", "audit.json")


class MetricsTail:
    """Reads complete new lines of a growing JSONL file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind("\n") + 1  # a line without its newline is still being written
        self.offset += len(chunk[:end].encode())
        records = []
        for line in chunk[:end].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the child and everything it started (its own process group): no orphans."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_activity(run_dir: Path, started: float, world: int = 1) -> float:
    """The latest sign of life of any rank (a stalled collective stops them all)."""
    from tunegrid.train import rank_dir

    times = [started]
    for rank in range(world):
        for name in ("heartbeat", "metrics.jsonl"):
            path = rank_dir(run_dir, rank) / name
            if path.exists():
                times.append(path.stat().st_mtime)
    return max(times)


def run_tags(result: dict[str, Any]) -> dict[str, str]:
    tags = {"outcome": result["outcome"], "outcome.reason": result["reason"], "device": result["env"].get("device", "")}
    slurm_job = (result["env"].get("scheduler") or {}).get("SLURM_JOB_ID")
    if slurm_job:
        tags["slurm.job_id"] = slurm_job
    nan = (result.get("diagnosis") or {}).get("nan")
    if nan:
        origin = nan.get("origin") or {}
        tags.update(
            {
                "nan.kind": nan["kind"],
                "nan.step": str(nan["step"]),
                "nan.forward_module": (origin.get("forward") or {}).get("module", ""),
                "nan.backward_module": (origin.get("backward") or {}).get("module", ""),
            }
        )
    audit = result.get("quant_audit") or {}
    if audit.get("after_adapters"):
        final = audit["after_adapters"]
        tags.update(
            {
                "audit.weight_bytes": str(final["total_bytes"]),
                "audit.flagged_bytes": str(final["flagged_bytes"]),
                "audit.flagged_share": f"{final['flagged_share']:.4f}",
                "audit.flagged_tensors": str(len(final["flagged"])),
                "lora.unmatched": ",".join(audit["lora"]["unmatched"]),
            }
        )
    collective = (result.get("diagnosis") or {}).get("collective")
    if collective:
        tags.update({
            "collective.op": collective["op"], "collective.missing_ranks": ",".join(map(str, collective["missing_ranks"])),
            "collective.timeout_s": str(collective["timeout_s"]), "collective.step": str(collective["step"]),
        })
    crash = (result.get("diagnosis") or {}).get("rank_crash")
    if crash:
        tags.update({"rank_crash.ranks": ",".join(map(str, crash["ranks"])), "rank_crash.exit": crash["exit"]})
    oom = (result.get("diagnosis") or {}).get("oom")
    if oom:
        tags["oom.stage"] = str(oom.get("stage"))
    memory = result.get("memory") or {}
    if memory.get("estimate_bytes"):
        tags["memory.estimate_bytes"] = str(memory["estimate_bytes"])
        tags["memory.estimate_over_measured"] = f"{memory['estimate_over_measured']:.3f}" if memory.get("estimate_over_measured") else ""
    return tags


def env_tags(capabilities: dict[str, Any]) -> dict[str, str]:
    """Versions and device as tags, so the UI can filter and group by them."""
    from tunegrid.environment import package_version

    tags = {f"env.{name}": package_version(name) or "" for name in ("torch", "transformers", "peft", "bitsandbytes")}
    gpus = capabilities.get("gpus") or []
    tags["env.device"] = gpus[0].get("name", "cuda") if gpus else capabilities.get("device", "cpu")
    return tags


def rerun_tags(result_path: Path, snakemake_job: str) -> dict[str, str]:
    """The Snakemake job that ran the cell and the command that re-runs only this cell."""
    configfiles = os.environ.get("TUNEGRID_CONFIGFILES", "")
    rerun = ["snakemake", "--cores", "1", "--forcerun", str(result_path)]
    for path in filter(None, configfiles.split(os.pathsep)):
        rerun += ["--configfile", path]
    return {"snakemake.job": snakemake_job, "snakemake.rerun": shlex.join(rerun)}


def result_params(result: dict[str, Any]) -> dict[str, str]:
    """The quantization audit's summary as run params (logged once, at the end of the cell)."""
    audit = result.get("quant_audit") or {}
    params: dict[str, str] = {}
    for stage in ("after_load", "after_adapters"):
        summary = audit.get(stage) or {}
        for key in ("total_bytes", "quantized_bytes", "flagged_bytes"):
            if key in summary:
                params[f"audit.{stage}.{key}"] = str(summary[key])
        for role, size in (summary.get("by_role") or {}).items():
            params[f"audit.{stage}.role.{role}_bytes"] = str(size)
        for dtype, size in (summary.get("by_dtype") or {}).items():
            params[f"audit.{stage}.dtype.{dtype}_bytes"] = str(size)
    experts = audit.get("expert_quantization") or {}
    if experts:
        params["audit.expert_quantization.changed"] = str(len(experts.get("changed", [])))
        params["audit.expert_quantization.kept_for_lora"] = str(len(experts.get("kept_for_lora", [])))
        params["audit.expert_quantization.order"] = str(experts.get("order"))
    return params


def plan_cell(spec: dict[str, Any], model_dir: Path, capabilities: dict[str, Any]) -> dict[str, Any]:
    """Before training: the target, its memory budget, the memory estimate and whether to train at all."""
    from tunegrid.memory_estimate import device_constants, estimate_cell
    from tunegrid.targets import feasibility, resolve_target

    hardware = spec["hardware"]
    target = resolve_target(hardware, capabilities) if capabilities else None
    estimate = estimate_cell(spec, model_dir, **device_constants(capabilities, spec["axes"]["precision"]))
    enforced = bool(target) and (target.name != "native" or bool(hardware["memory_budget_gb"]))
    verdict = feasibility(spec["axes"]["precision"], target, hardware, estimate["estimate_bytes"]) if target else None
    verdict = verdict or gpu_shortfall(spec, capabilities)
    return {
        "target": target.name if target else None,
        "budget_bytes": target.memory_bytes if enforced and target else None,
        "estimate": estimate,
        "verdict": verdict,
    }


def gpu_shortfall(spec: dict[str, Any], capabilities: dict[str, Any]) -> tuple[str, str] | None:
    """`unsupported` before launch when the cell needs more GPUs than the probe found (a rank without
    its own GPU fails at set-up with "invalid device ordinal"; a launch would only prove it)."""
    world = spec["axes"].get("world_size", 1)
    needed = world * spec["hardware"]["gpus_per_rank"]
    present = len(capabilities.get("gpus") or [])
    if capabilities.get("device") != "cuda" or needed <= present:
        return None
    return ("unsupported", f"needs {needed} GPUs (world_size {world} x gpus_per_rank {spec['hardware']['gpus_per_rank']}), "
                           f"{present} present on this machine")


def _launch_ranks(spec: dict[str, Any], spec_path: Path, model_dir: Path, data_path: Path, run_dir: Path,
                  warm_socket: str | None = None) -> list[Any]:
    """One worker process per rank, with the environment torchrun would give them (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT). Launched here rather than through torchrun so that the supervisor sees
    every rank's exit code and heartbeat itself, and can stop them all. With `warm_socket` (one rank only)
    the invocation's warm worker forks it instead (tunegrid.warm)."""
    world = spec["axes"].get("world_size", 1)
    command = [sys.executable, "-m", "tunegrid.cli", "worker", "--spec", str(spec_path), "--model-dir", str(model_dir),
               "--data", str(data_path), "--run-dir", str(run_dir)]
    if world == 1:
        if warm_socket:  # this invocation's warm worker forks it with the imports done (tunegrid.warm)
            from tunegrid.warm import fork_worker

            forked = fork_worker(Path(warm_socket), ["tunegrid", *command[3:]], _child_env())
            if forked is not None:
                print(f"worker {forked.pid} forked by the warm worker", flush=True)
                return [forked]
        return [subprocess.Popen(command, start_new_session=True, env=_child_env())]
    from tunegrid.ui import free_port

    env = _child_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env.update(_flight_recorder_env(spec, run_dir))
    procs = []
    for rank in range(world):
        log_path = run_dir / "ranks" / f"rank{rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            procs.append(subprocess.Popen(
                command, start_new_session=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log, stderr=subprocess.STDOUT,
            ))
    return procs


def _flight_recorder_env(spec: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """NCCL Flight Recorder on for distributed GPU cells: a ring buffer of collectives per rank, dumped
    under the cell's folder when the watchdog fires (PyTorch >= 2.3 reads these variables)."""
    settings = spec["distributed"]
    if not settings["flight_recorder"]:
        return {}
    dump = run_dir / "flight_recorder"
    dump.mkdir(parents=True, exist_ok=True)
    prefix = str(dump / "rank_")
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(settings["trace_buffer_size"]),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,  # the older name of the same setting
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def _wait_any(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Sleep up to `timeout`, returning as soon as the first live rank exits (a fixed sleep would add
    half a poll, on average, to every cell's end)."""
    live = next((proc for proc in procs if proc.poll() is None), None)
    if live is None:
        return
    try:
        live.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _supervise(spec: dict[str, Any], spec_path: Path, model_dir: Path, data_path: Path, run_dir: Path,
               tracker: Any, tail: MetricsTail, procs: list[subprocess.Popen[bytes]] | None = None,
               ) -> tuple[list[int | None], tuple[str, str] | None, list[dict[str, Any]], list[int]]:
    """Run the rank(s) to their end, a timeout, a stall or a lost rank.

    Returns (exit code per rank, verdict, unsent metrics, ranks this supervisor stopped)."""
    train = spec["train"]
    grace = spec["distributed"]["exit_grace_s"]
    started = time.time()
    procs = procs or _launch_ranks(spec, spec_path, model_dir, data_path, run_dir)
    stopped: list[int] = []
    previous_handler = signal.getsignal(signal.SIGTERM)

    def stop_all() -> None:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                stopped.append(rank)
                _stop_group(proc)

    def on_term(signum: int, frame: Any) -> None:
        stop_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    pending: list[dict[str, Any]] = []
    last_flush = time.monotonic()
    verdict: tuple[str, str] | None = None
    first_exit: float | None = None
    try:
        while any(proc.poll() is None for proc in procs):
            _wait_any(procs, POLL_S)
            if tracker is not None:
                pending += tail.read_new()
            if tracker is not None and pending and time.monotonic() - last_flush > FLUSH_EVERY_S:
                if tracker.log_records(pending):
                    pending = []
                last_flush = time.monotonic()
            now = time.time()
            if first_exit is None and any(proc.poll() is not None for proc in procs):
                first_exit = now
            if now - started > train["time_limit_s"]:
                verdict = ("timeout", f"wall-clock limit of {train['time_limit_s']} s reached")
            elif now - _last_activity(run_dir, started, len(procs)) > train["heartbeat_timeout_s"]:
                verdict = ("timeout", f"no progress for {train['heartbeat_timeout_s']} s (heartbeat)")
            elif first_exit is not None and now - first_exit > grace:
                break  # one rank ended (crashed or gave up); the rest are stopped below
            if verdict:
                break
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        stop_all()
    return [proc.returncode for proc in procs], verdict, pending, stopped


def run_cell(
    *,
    spec: dict[str, Any],
    model_dir: Path,
    data_path: Path,
    run_dir: Path,
    result_path: Path,
    tracking_path: Path | None,
    capabilities_path: Path | None,
    log_path: Path | None,
    command: list[str],
    snakemake_job: str = "",
) -> dict[str, Any]:
    started = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    _clear_run_files(run_dir)
    capabilities = read_json(capabilities_path) if capabilities_path else {}
    warm_socket = os.environ.get(WARM_SOCKET_ENV) if spec["axes"].get("world_size", 1) == 1 else None
    if warm_socket:
        from tunegrid.warm import ready_info

        info = ready_info(Path(warm_socket))
        if info is None:
            warm_socket = None
        elif capabilities.get("runtime_baseline_bytes"):  # CPU: the forked worker's own constant
            capabilities = {**capabilities, "runtime_baseline_bytes": info["forked_runtime_baseline_bytes"]}
    plan = plan_cell(spec, model_dir, capabilities)
    verdict = plan.pop("verdict")
    spec = {**spec, "plan": plan}
    spec_path = run_dir / "cell.json"
    write_json(spec_path, spec)

    # The worker starts first, so its torch/transformers imports (seconds) overlap the MLflow set-up below.
    early = _launch_ranks(spec, spec_path, model_dir, data_path, run_dir, warm_socket) if verdict is None else None
    tracker = None
    try:
        if tracking_path is not None:
            tracker = _open_run(spec, plan, capabilities, read_json(tracking_path), result_path, command, snakemake_job)
    except BaseException:  # never leave a started worker behind
        for proc in early or []:
            _stop_group(proc)
        raise
    tail = MetricsTail(run_dir / "metrics.jsonl")
    attempts: list[dict[str, Any]] = []
    feasible = verdict is None
    while True:
        returncodes: list[int | None] = [None]
        pending: list[dict[str, Any]] = []
        stopped: list[int] = []
        if feasible:
            returncodes, verdict, pending, stopped = _supervise(spec, spec_path, model_dir, data_path, run_dir, tracker, tail, early)
            early = None
        result = _compose_result(spec, run_dir, returncodes[0], verdict, started, command)
        if spec["axes"].get("world_size", 1) > 1 and returncodes != [None]:
            from tunegrid.distributed import diagnose_ranks

            result.update(diagnose_ranks(spec, run_dir, result, returncodes, stopped))
        attempts.append({"outcome": result["outcome"], "reason": result["reason"], "infrastructure": _infrastructure_fault(result)})
        if not attempts[-1]["infrastructure"] or len(attempts) > spec["train"]["retries"]:
            break
        # a process died under us (signal, node loss): bounded retry from scratch; the count is recorded
        print(f"attempt {len(attempts)} ended {result['outcome']} ({result['reason']}); retrying", flush=True)
        if tracker is not None:
            tracker.log_records(pending + tail.read_new())
        _clear_run_files(run_dir)
        tail = MetricsTail(run_dir / "metrics.jsonl")
        verdict = None
    result["attempts"] = attempts
    if tracker is not None:
        pending += tail.read_new()
        tracker.log_records(pending)
        filled = tracker.reconcile(read_jsonl(run_dir / "metrics.jsonl"))
        result["tracking"] = {"run_id": tracker.run_id, "points_sent_live": tracker.sent_points, "points_filled": filled, "errors": tracker.errors}
    # result.json is the job's declared output: it appears last, once everything the job owes (the
    # MLflow run finished, the parent's counts) is done, so a kill before it re-runs the cell and a
    # kill after it finds nothing left to do. The copy MLflow keeps is staged beside it.
    staged = run_dir / ".staged" / "result.json"
    write_json(staged, result)
    if tracker is not None:
        artifacts = [staged] + [run_dir / name for name in ARTIFACT_FILES if name != "result.json"]
        artifacts += sorted((run_dir / "ranks").glob("rank*.log")) + sorted((run_dir / "flight_recorder").glob("rank_*"))
        if log_path is not None:
            artifacts.append(log_path)
        tracker.finish({**run_tags(result), "attempts": str(len(attempts))}, artifacts, failed=result["outcome"] == "error", params=result_params(result))
        if tracker.errors:  # the store was unreachable at the end: say so in the file too
            result["tracking"]["errors"] = tracker.errors
        from tunegrid.execution import cell_ended

        cell_ended(tracker.uri, result_path.parents[2], spec["cell_id"], result["outcome"])
    _kill_point("before_result")
    write_json(result_path, result)
    shutil.rmtree(staged.parent, ignore_errors=True)
    return result


def _kill_point(name: str) -> None:
    """Fault injection for the tests of kills between the job's steps: TUNEGRID_KILL_AT=<name> makes the
    supervisor SIGKILL itself there (what `kill -9` of the job does at the worst moment)."""
    if os.environ.get("TUNEGRID_KILL_AT") == name:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _open_run(spec: dict[str, Any], plan: dict[str, Any], capabilities: dict[str, Any], tracking: dict[str, Any],
              result_path: Path, command: list[str], snakemake_job: str) -> Any:
    """The cell's MLflow run: axes, env and re-run tags, params, the parent (invocation) and probe links."""
    from tunegrid.execution import parent_run_id
    from tunegrid.tracking import CellRun, flatten, tracking_uri_for_cells

    tracker = CellRun(tracking_uri_for_cells(tracking), tracking["experiment_id"])
    tags = {k: str(v) for k, v in spec["axes"].items()}
    tags.update(study=spec["study"], command=shlex.join(command), target=str(plan["target"]))
    tags.update(env_tags(capabilities))
    tags.update(rerun_tags(result_path, snakemake_job))
    probe_run = capabilities.get("mlflow_run_id") or ""
    if probe_run:
        tags["probe.run_id"] = probe_run
    parent = parent_run_id(tracker.uri, tracking["experiment_id"], spec["study"], result_path.parents[2], probe_run, spec["cell_id"])
    if parent:
        tags["mlflow.parentRunId"] = parent
    tracker.start(spec["cell_id"], tags, flatten("", spec, {}))
    return tracker


def _clear_run_files(run_dir: Path) -> None:
    """A re-run or a retry replaces the earlier attempt's files, never appends to them."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _infrastructure_fault(result: dict[str, Any]) -> bool:
    """A process that died without writing its facts (signal, lost rank): not a property of the cell's
    settings, so worth one more attempt. Exceptions the worker caught and classified are not retried."""
    if result["outcome"] != "error" or (result.get("diagnosis") or {}).get("rank_failure"):
        return False  # a rank that reported its own error fails the same way again
    if (result.get("diagnosis") or {}).get("rank_crash"):
        return True
    return result.get("worker_exit_code") not in (0, None) and not (result.get("training") or result.get("precision_plan"))


def _compose_result(
    spec: dict[str, Any],
    run_dir: Path,
    returncode: int | None,
    verdict: tuple[str, str] | None,
    started: float,
    command: list[str],
) -> dict[str, Any]:
    worker_path = run_dir / "worker.json"
    facts: dict[str, Any] = read_json(worker_path) if worker_path.exists() else {}
    if verdict is not None:  # decided by the supervisor: infeasible before training, or a timeout
        outcome, reason = verdict
        if outcome == "timeout":
            facts["diagnosis"] = {
                "timeout": {"stage": facts.get("stage") or _heartbeat_stage(run_dir), "limit_s": spec["train"]["time_limit_s"],
                            "heartbeat_timeout_s": spec["train"]["heartbeat_timeout_s"]}
            }
    elif facts:
        outcome, reason = facts["outcome"], facts["reason"]
    else:
        signame = signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None
        outcome = "error"
        reason = (
            f"worker killed by {signame}" + (" (the kernel's OOM killer sends SIGKILL)" if signame == "SIGKILL" else "")
            if signame
            else f"worker exited with code {returncode} before writing its facts"
        )
    env = light_env()
    env["device"] = (facts.get("precision_plan") or {}).get("device_type", "")
    return {
        "cell_id": spec["cell_id"],
        "cell": spec,
        "env": env,
        "outcome": outcome,
        "reason": reason,
        "diagnosis": facts.get("diagnosis", {}),
        "memory": _memory(spec, facts.get("memory", {})),
        "precision_in_effect": facts.get("precision_in_effect", {}),
        "precision_plan": facts.get("precision_plan", {}),
        "throughput": facts.get("throughput", {}),
        "fp16_headroom": facts.get("fp16_headroom", {}),
        "quant_audit": facts.get("quant_audit", {}),
        "training": facts.get("training", {}),
        "params": facts.get("params", {}),
        "traceback": facts.get("traceback"),
        "worker_exit_code": returncode,
        "wall_s": time.time() - started,
        "command": shlex.join(command),
    }


def _child_env() -> dict[str, str]:
    from tunegrid.config import REPO_ROOT

    from tunegrid.lifeline import SUPERVISOR_PID_ENV

    env = dict(os.environ)
    env[SUPERVISOR_PID_ENV] = str(os.getpid())  # the worker dies with this process (tunegrid.lifeline)
    src = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _memory(spec: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Measured peaks by stage beside the estimate made before training (the tracker's accuracy)."""
    plan = spec["plan"]
    memory = {**measured, "estimate_bytes": plan["estimate"]["estimate_bytes"],
              "estimate_components": plan["estimate"]["components"], "budget_bytes": plan["budget_bytes"],
              "target": plan["target"]}
    peak = measured.get("peak_bytes")
    memory["estimate_over_measured"] = plan["estimate"]["estimate_bytes"] / peak if peak else None
    return memory


def _heartbeat_stage(run_dir: Path) -> str:
    path = run_dir / "heartbeat"
    return path.read_text().strip() if path.exists() else "start"
