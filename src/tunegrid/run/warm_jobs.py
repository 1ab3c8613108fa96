"""A tunegrid job (a rule's `python scripts/tunegrid.py <command> ...`) forked by the invocation's warm supervisor, or
run in the job's own process.

A cell's supervisor imports MLflow's client and SQL store to keep the cell's run live (~2 CPU-s on a 2-core host,
more than a tiny cell's training), and so do the rules that create the study's experiment, log the probe and sync
the runs; the report and the summary import pandas. The warm supervisor (tunegrid.run.warm, role `supervisor`) has
imported them once, so such a job asks it to fork the command instead. What Snakemake sees is unchanged: the job's
process lives as long as the command, its output is the command's (the same descriptors), its exit code is the
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
from tunegrid.runtime.workers import WARM_SUPERVISOR_SOCKET_ENV

# the commands whose imports the warm supervisor holds; none of them imports torch (nor, so, touches CUDA)
SERVED_COMMANDS = frozenset({"finetune", "tracking-init", "probe-tracking", "sync", "summary", "report", "cell-plan"})


def forked_job(argv: list[str]) -> int | None:
    """The exit code of the command `argv` names (`[script, command, ...]`, as sys.argv holds it) forked by the warm
    supervisor, a signal that ended it re-raised here; or None where it is not forked (no warm supervisor in this
    invocation, a command it does not serve, or it does not answer): the caller then runs it in this process."""
    socket = os.environ.get(WARM_SUPERVISOR_SOCKET_ENV)
    if not socket or len(argv) < 2 or argv[1] not in SERVED_COMMANDS:
        return None
    from tunegrid.run.warm_client import fork_worker

    env = {key: value for key, value in os.environ.items() if key != WARM_SUPERVISOR_SOCKET_ENV}
    env[JOB_PID_ENV] = str(os.getpid())
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
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
