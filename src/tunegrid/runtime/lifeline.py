"""A worker never outlives its supervisor.

The supervisor (the cell's Snakemake job) may be killed with SIGKILL, which leaves it no chance to stop
its workers; a worker left running would train on next to the re-run of its own cell. Two guards, set
at the worker's start:

- Linux `PR_SET_PDEATHSIG`: the kernel sends SIGKILL when the worker's parent dies. For a spawned
  worker or rank the parent is the supervisor itself.
- A watchdog thread on the supervisor's pid (its pid is in `SUPERVISOR_PID_ENV`): a worker forked by
  the warm worker has the warm process as its parent, not the supervisor. The thread waits on a pidfd
  (no polling, immune to pid reuse) or, where there is none, checks every half second; when the
  supervisor is gone it kills the worker's whole process group (its session).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
import time
from pathlib import Path

SUPERVISOR_PID_ENV = "TUNEGRID_SUPERVISOR_PID"
# A supervisor forked by the warm supervisor (tunegrid.run.warm_jobs) is held the same way to its `finetune` job,
# the process Snakemake started and would kill: this variable carries that job's pid in the fork request.
JOB_PID_ENV = "TUNEGRID_JOB_PID"
_PR_SET_PDEATHSIG = 1


def hold(supervisor_pid: int | None = None) -> None:
    """Tie this process's life to its parent and to the supervisor's (from the environment). A process
    that no supervisor started (a worker called in-process, e.g. by a test) is left alone."""
    pid = supervisor_pid or int(os.environ.get(SUPERVISOR_PID_ENV) or 0)
    if pid <= 1 or pid == os.getpid():
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not alive(pid):  # the supervisor died before the guard was set
        _die()
    threading.Thread(target=_watch, args=(pid,), name="supervisor-lifeline", daemon=True).start()


def die_with_parent() -> None:
    """preexec_fn for a server child that is not Python of ours (MLflow's): SIGTERM when its parent
    dies, however it dies, so a killed `snakemake mlflow_ui` leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _watch(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
    else:
        while alive(pid):
            time.sleep(0.5)
    _die()


def alive(pid: int) -> bool:
    """Whether a process with this pid is running (one we may not signal counts as alive). A zombie, ended
    but not yet reaped by its parent, answers signals as if it ran: it is not alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # the state letter follows the parenthesised command name in /proc/<pid>/stat
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):  # no procfs (or gone meanwhile): the signal's answer stands
        return True
    return state not in ("Z", "X")


def _die() -> None:
    """The supervisor is gone: take this worker and anything it started with it."""
    with contextlib.suppress(OSError):
        if os.getpgid(0) == os.getpid():  # the worker leads its own group (its own session)
            os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
