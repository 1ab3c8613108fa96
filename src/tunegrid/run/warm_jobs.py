"""A tunegrid job (a rule's `python scripts/tunegrid.py <command> ...`) forked by one of the invocation's warm
processes, or run in the job's own process.

A cell's supervisor imports MLflow's client and SQL store to keep the cell's run live (~2 CPU-s on a 2-core host,
more than a tiny cell's training), and so do the rules that create the study's experiment, log the probe and sync
the runs; the report and the summary import pandas. The warm supervisor (tunegrid.run.warm, role `supervisor`) has
imported them once, so such a job asks it to fork the command instead; the environment record, a checkpoint and the
probe import torch and transformers, which the warm worker holds, and ask it. What Snakemake sees is unchanged: the
job's process lives as long as the command, its output is the command's (the same descriptors), its exit code is the
command's, and a SIGTERM or SIGINT it gets (Snakemake's cancel) is passed on. A command killed by a signal ends the
job by the same signal. Killed with SIGKILL, the job takes the command with it (the command holds a lifeline on the
job's pid, tunegrid.runtime.lifeline), and a supervisor its worker, as before. No warm supervisor, or one that does
not answer, and the job runs the command in its own process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from tunegrid.runtime.lifeline import JOB_PID_ENV
from tunegrid.runtime.workers import WARM_SOCKET_ENV, WARM_SUPERVISOR_SOCKET_ENV

# Which warm process forks which command, by the socket the job finds in its environment. The warm supervisor's
# commands never import torch (nor, so, touch CUDA); the warm worker's import what it holds (torch, transformers:
# the environment record, the checkpoints and the probe), and it serves no fork where a GPU is visible.
SERVED_BY = {
    **dict.fromkeys(("environment", "checkpoint", "probe"), WARM_SOCKET_ENV),
    **dict.fromkeys(
        ("finetune", "tracking-init", "probe-tracking", "sync", "execution-end", "summary", "report", "cell-plan"),
        WARM_SUPERVISOR_SOCKET_ENV,
    ),
}

FORKED_ENV = "TUNEGRID_FORKED_JOB"


def forked_job(argv: list[str]) -> int | None:
    """The exit code of the command `argv` names (`[script, command, ...]`, as sys.argv holds it) forked by the warm
    process that serves it, a signal that ended it re-raised here; or None where it is not forked (none in this
    invocation, a command none serves, or it does not answer): the caller then runs it in this process."""
    if os.environ.pop(FORKED_ENV, None):  # this is the forked command (its children do not inherit the mark)
        return None
    socket_env = SERVED_BY.get(argv[1]) if len(argv) > 1 else None
    socket = os.environ.get(socket_env) if socket_env else None
    if not socket_env or not socket:
        return None
    from tunegrid.run.warm_client import fork_worker

    # the environment as it is (the probe asks the warm worker that forked it for its calibration's forked micro
    # cells, tunegrid.run.calibrate), marked so that the forked command runs itself instead of asking again
    env = {**os.environ, JOB_PID_ENV: str(os.getpid()), FORKED_ENV: "1"}
    job = fork_worker(Path(socket), list(argv), env, wait_ready_s=60.0)
    if job is None:
        return None

    def pass_on(signum: int, frame: Any) -> None:  # the command is in a session of its own: tell it
        try:
            os.kill(job.pid, signum)
        except ProcessLookupError:
            pass

    previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = job.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code < 0:  # killed by a signal: so is the job, as Snakemake would have seen it in-process
        sys.stdout.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
