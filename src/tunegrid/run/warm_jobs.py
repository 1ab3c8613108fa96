"""The `finetune` job: its supervisor forked by the invocation's warm supervisor, or run in the job's own process.

A cell's supervisor imports MLflow's client and SQL store to keep the cell's run live (~2 CPU-s on a 2-core host,
more than a tiny cell's training); the warm supervisor (tunegrid.run.warm, role `supervisor`) has imported them
once, so the job asks it to fork the supervisor instead. What Snakemake sees is unchanged: the job's process lives
as long as the supervisor, its output is the supervisor's (the same descriptors), its exit code is the
supervisor's, and a SIGTERM or SIGINT it gets (Snakemake's cancel) is passed on. A supervisor killed by a signal
ends the job by the same signal. Killed with SIGKILL, the job takes the supervisor with it (the supervisor holds a
lifeline on the job's pid, tunegrid.runtime.lifeline) and the supervisor its worker, as before. No warm supervisor,
or one that does not answer, and the job supervises in its own process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tunegrid.runtime.lifeline import JOB_PID_ENV
from tunegrid.runtime.workers import WARM_SUPERVISOR_SOCKET_ENV


def run_finetune(contract_path: Path, argv: list[str]) -> int:
    """The job (`tunegrid finetune --contract C`, `argv` its command line): the exit code to leave with."""
    socket = os.environ.get(WARM_SUPERVISOR_SOCKET_ENV)
    if socket:
        code = _forked(Path(socket), argv)
        if code is not None:
            return code
    return finetune(contract_path, argv)


def finetune(contract_path: Path, command: list[str]) -> int:
    """Supervise the cell of this contract in this process (tunegrid.run.supervisor) and say how it ended."""
    from tunegrid.run.supervisor import run_cell

    result = run_cell(contract_path, command=command)
    print(f"cell {result['cell_id']}: {result['outcome']} — {result['reason']}", flush=True)
    return 0


def finetune_from_argv(argv: list[str]) -> int:
    """The forked supervisor's entry: `argv` is the job's own command line (`... finetune --contract C`)."""
    parser = argparse.ArgumentParser(prog="tunegrid finetune")
    parser.add_argument("--contract", required=True)
    args = parser.parse_args(argv[argv.index("finetune") + 1 :])
    return finetune(Path(args.contract), argv)


def _forked(socket: Path, argv: list[str]) -> int | None:
    """The forked supervisor's exit code (a signal re-raised here), or None where the warm supervisor does not
    fork one (none serving, refused, gone): the caller then supervises in this process."""
    from tunegrid.run.warm_client import fork_worker

    env = {key: value for key, value in os.environ.items() if key != WARM_SUPERVISOR_SOCKET_ENV}
    env[JOB_PID_ENV] = str(os.getpid())
    supervisor = fork_worker(socket, argv, env, wait_ready_s=60.0)
    if supervisor is None:
        return None

    def pass_on(signum: int, frame: Any) -> None:  # the supervisor is in a session of its own: tell it
        try:
            os.kill(supervisor.pid, signum)
        except ProcessLookupError:
            pass

    previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = supervisor.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code < 0:  # killed by a signal: so is the job, as Snakemake would have seen it in-process
        sys.stdout.flush()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
