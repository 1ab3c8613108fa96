"""The supervisor's side of the warm worker (tunegrid.run.warm): wait until it serves, ask it to fork a
cell's worker, and watch that worker through the parts of subprocess.Popen the supervisor uses.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tunegrid.runtime.lifeline import alive


def ready_info(path: Path, wait_s: float = 30.0) -> dict[str, Any] | None:
    """The warm process's facts once it serves, or None if there is none: it has ended, it said it will not
    serve (its facts name why: a GPU is visible), or it is not ready in time (it started before this cell
    did, so waiting for it is never slower than spawning)."""
    pid_file = Path(str(path) + ".pid")
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if "refused" in (_facts(path) or {}):  # it decided before serving; its socket never appears
            return None
        try:
            starting = alive(int(pid_file.read_text()))
        except (OSError, ValueError):
            starting = False
        if not starting or time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return _facts(path)


def _facts(path: Path) -> dict[str, Any] | None:
    """What the warm process wrote beside its socket (tunegrid.run.warm.serve), once it has."""
    try:
        return dict(json.loads(Path(str(path) + ".json").read_text()))
    except (OSError, ValueError):
        return None


class WarmProcess:
    """The parts of subprocess.Popen the supervisor uses, for a worker the warm process forked."""

    def __init__(self, conn: socket.socket, pid: int, buffer: bytes) -> None:
        self.conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self._buffer = buffer

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout or 0)
            self._read(left if left is not None else 1.0)
        return self.returncode

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.conn], [], [], timeout)
        if ready:
            chunk = self.conn.recv(4096)
            if not chunk:  # the warm process died: the worker may still run; it is gone once its pid is
                if not alive(self.pid):
                    self.returncode = -signal.SIGKILL
                    self.conn.close()
                elif timeout:
                    time.sleep(min(timeout, 0.2))
                return
            self._buffer += chunk
        if b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            self.returncode = int(json.loads(line)["exit"])
            self.conn.close()


def fork_worker(
    path: Path, argv: list[str], env: dict[str, str], wait_ready_s: float = 30.0, output: int | None = None
) -> WarmProcess | None:
    """A worker forked by the warm process at `path`, or None (the caller spawns one the usual way). Its stdout and
    stderr are this process's, or the open file `output` (a rank's log) for both."""
    if ready_info(path, wait_ready_s) is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        payload = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_RDONLY)  # a worker reads no input
        try:
            streams = [sys.stdout.fileno(), sys.stderr.fileno()] if output is None else [output, output]
            socket.send_fds(conn, [payload], [devnull, *streams])
        finally:
            os.close(devnull)
        buffer = b""
        conn.settimeout(30)
        while b"\n" not in buffer:
            chunk = conn.recv(4096)
            if not chunk:
                raise OSError("the warm process closed the connection")
            buffer += chunk
        conn.settimeout(None)
        line, _, rest = buffer.partition(b"\n")
        return WarmProcess(conn, int(json.loads(line)["pid"]), rest)
    except (OSError, ValueError, KeyError) as exc:
        print(f"warm worker unavailable ({exc}); starting the worker the usual way", flush=True)
        conn.close()
        return None
