"""Launching a cell's worker processes and stopping them: one process per rank with the environment torchrun
would give it, in its own process group, tied to the supervisor by the lifeline (tunegrid.runtime.lifeline).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import DistributedSpec
from tunegrid.contract import CellContract

KILL_GRACE_S = 5.0


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the child and everything it started (its own process group): no orphans. A rank's SLURM step then
    undoes what its rank set up on its node and could not undo itself (tunegrid.run.nodes.RankStep.after_stop)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    after_stop = getattr(proc, "after_stop", None)
    if after_stop is not None:
        after_stop()


def launch_ranks(
    contract: CellContract,
    contract_path: Path,
    warm_socket: str | None = None,
    visible_devices: str | None = None,
) -> list[Any]:
    """One worker process per rank, with the environment torchrun would give them (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT). Launched here rather than through torchrun so that the supervisor sees
    every rank's exit code and heartbeat itself, and can stop them all. With `warm_socket` (CPU ranks) the
    invocation's warm worker forks each rank instead (tunegrid.run.warm); a rank it does not fork is spawned,
    and either way each rank's output goes to its own log. `visible_devices` (the job's own GPUs,
    tunegrid.runtime.devices.cell_devices; "" for none) becomes every rank's CUDA_VISIBLE_DEVICES; rank r trains on
    the r-th of them. A cell on a library stack runs its ranks in the stack's interpreter, spawned, never forked
    (the warm worker holds the base's libraries)."""
    spec, run_dir = contract.spec, contract.job.run
    world = spec.axes.world_size
    interpreter = spec.stack.python if spec.stack is not None else ""  # "": the base stack, this interpreter
    if spec.stack is not None and interpreter:
        warm_socket = None
        if not Path(interpreter).exists():
            raise FileNotFoundError(f"the interpreter of stack {spec.stack.name!r} is missing: {interpreter}")
    command = [
        interpreter or sys.executable,
        "-m",
        "tunegrid.cli",
        "worker",
        "--contract",
        str(contract_path),
    ]
    if spec.axes.nodes > 1:  # each rank a SLURM step on its node (spawned, never forked)
        from tunegrid.run.nodes import launch_on_nodes

        env = {**child_env(visible_devices), **flight_recorder_env(spec.distributed, run_dir)}
        return launch_on_nodes(spec, run_dir, command, env)
    if world == 1:
        if warm_socket:  # this invocation's warm worker forks it with the imports done (tunegrid.run.warm)
            from tunegrid.run.warm_client import fork_worker

            forked = fork_worker(Path(warm_socket), ["tunegrid", *command[3:]], child_env(visible_devices))
            if forked is not None:
                print(f"worker {forked.pid} forked by the warm worker", flush=True)
                return [forked]
        return [subprocess.Popen(command, start_new_session=True, env=child_env(visible_devices))]
    from tunegrid.run.ui import free_port

    env = child_env(visible_devices)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env.update(flight_recorder_env(spec.distributed, run_dir))
    procs: list[Any] = []
    for rank in range(world):
        log_path = run_dir / "ranks" / f"rank{rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(log_path, "wb") as log:
            forked = None
            if warm_socket:
                from tunegrid.run.warm_client import fork_worker

                forked = fork_worker(Path(warm_socket), ["tunegrid", *command[3:]], rank_env, output=log.fileno())
                if forked is not None:
                    print(f"rank {rank}: worker {forked.pid} forked by the warm worker", flush=True)
            procs.append(
                forked
                or subprocess.Popen(command, start_new_session=True, env=rank_env, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


def flight_recorder_env(settings: DistributedSpec, run_dir: Path) -> dict[str, str]:
    """NCCL Flight Recorder on for distributed GPU cells: a ring buffer of collectives per rank, dumped
    under the cell's folder when the watchdog fires (PyTorch >= 2.3 reads these variables)."""
    if not settings.flight_recorder:
        return {}
    dump = run_dir / "flight_recorder"
    dump.mkdir(parents=True, exist_ok=True)
    prefix = str(dump / "rank_")
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(settings.trace_buffer_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,  # the older name of the same setting
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def wait_any(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Sleep up to `timeout`, returning as soon as the first live rank exits (a fixed sleep would add
    half a poll, on average, to every cell's end)."""
    live = next((proc for proc in procs if proc.poll() is None), None)
    if live is None:
        return
    try:
        live.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def child_env(visible_devices: str | None = None) -> dict[str, str]:
    from tunegrid.runtime.devices import VISIBLE_ENV
    from tunegrid.runtime.lifeline import SUPERVISOR_PID_ENV
    from tunegrid.study.config import REPO_ROOT

    env = dict(os.environ)
    if visible_devices is not None:
        env[VISIBLE_ENV] = visible_devices
    env[SUPERVISOR_PID_ENV] = str(os.getpid())  # the worker dies with this process (tunegrid.runtime.lifeline)
    src = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
