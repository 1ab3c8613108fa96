"""A warm worker: one process per local `snakemake` invocation that has imported torch, transformers, peft and
bitsandbytes once and forks each cell's worker on request (and the environment and checkpoint jobs). Its sibling, the
warm supervisor, has imported MLflow and the supervisor's code once and forks each cell's supervisor and the
tracking, summary and report jobs.

Why: a short cell is mostly imports (~6.5 s of an 8 s CPU cell here: benchmarks/README.md); the fork inherits them.
The supervisor's own share is MLflow's import and its SQL store's (~2 CPU-s per cell, more than a tiny cell's
training), paid once per invocation by the warm supervisor (tunegrid.run.warm_jobs). What stays as before: the worker
is a process of its own in its own session, so the supervisor still stops its whole group, reads its exit code
(relayed over the socket) and watches its heartbeat; its stdout/stderr are the supervisor's own descriptors (passed
with SCM_RIGHTS), its environment and working directory the supervisor's. Anything unusual — no socket, a refused or
broken connection — and the supervisor spawns the worker the ordinary way; nothing depends on this process. The
supervisor's side of the socket is tunegrid.run.warm_client.

It must stay single-threaded and must not touch CUDA or torch's thread pools before forking (neither survives a
fork): it only imports. It exits when the `snakemake` that started it is gone or after `idle_s` without requests.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tunegrid.runtime.lifeline import JOB_PID_ENV, alive, hold
from tunegrid.runtime.workers import WARM_SOCKET_ENV, WARM_SUPERVISOR_SOCKET_ENV

SOCKET_ENV = WARM_SOCKET_ENV  # the jobs find this invocation's socket here
SUPERVISOR_SOCKET_ENV = WARM_SUPERVISOR_SOCKET_ENV  # and the warm supervisor's here
WORKER, SUPERVISOR = "worker", "supervisor"  # which warm process: the one with torch, or the one with MLflow
# the modules every worker imports; importing more would inflate each forked worker's RSS (the CPU peak)
PRELOAD = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "tunegrid.cell.train",
    "tunegrid.cell.loop.instrument",
    "tunegrid.cell.loop.precision",
)
# what a cell's supervisor and the tracking jobs import (no torch: they never train); MLflow's client and SQL store
# (which import pandas too) are the cost
SUPERVISOR_PRELOAD = (
    "tunegrid.run.supervisor",
    "tunegrid.track.tracking",
    "tunegrid.track.execution",
    "tunegrid.track.probe_run",
)


def socket_path(execution_id: str, role: str = WORKER) -> Path:
    import tempfile

    # AF_UNIX paths are limited to ~107 bytes: the temp dir, not the (possibly deep) results folder
    suffix = "" if role == WORKER else f"-{role}"
    return Path(tempfile.gettempdir()) / f"tunegrid-{os.getuid()}-{execution_id}{suffix}.sock"


# ----------------------------------------------------------------------------------------- server


def fork_refusal() -> str | None:
    """Why this process must not fork workers, or None.

    CUDA does not survive a fork: a child of a process that initialised it fails with "Cannot
    re-initialize CUDA in forked subprocess". On a CUDA machine importing peft (bitsandbytes under it)
    already initialises it, so where a GPU is visible the warm worker does not serve at all and every
    cell is spawned (the imports it saves are seconds; a broken GPU run is every cell). Asked again
    before each fork, in case anything initialised CUDA since.
    """
    import torch

    if torch.cuda.is_initialized():
        return "CUDA is initialised in the warm process (a forked worker could not use it)"
    if torch.cuda.device_count() > 0:  # NVML-based: does not initialise CUDA
        return f"{torch.cuda.device_count()} CUDA device(s) visible: cells are spawned, never forked"
    return None


def serve(path: Path, owner_pid: int, idle_s: float = 600.0, role: str = WORKER) -> None:
    import importlib

    started = time.time()
    for name in PRELOAD if role == WORKER else SUPERVISOR_PRELOAD:
        importlib.import_module(name)
    if role == SUPERVISOR:
        from tunegrid.track.store import import_client

        import_client()
    # What the imports made lives as long as this process: out of the collector's sight (gc.freeze, after one
    # collection so that no import's garbage is frozen with it), a child's collections scan only what the child
    # made, not the parent's millions of objects: a forked cell's worker spends about half its CPU less (0.6 -> 0.3 s
    # for a tiny cell, measured in benchmarks/README.md), its peak unchanged.
    gc.collect()
    gc.freeze()
    refusal = fork_refusal() if role == WORKER else None  # a supervisor never touches torch, so nor CUDA
    if refusal:  # no socket appears: every supervisor spawns its worker the ordinary way
        Path(str(path) + ".json").write_text(json.dumps({"pid": os.getpid(), "refused": refusal}))
        print(f"warm {role} {os.getpid()} not serving: {refusal}", flush=True)
        return
    # what a forked worker holds at work is the probe's to measure (tunegrid.run.calibrate), not this process's
    info = {"pid": os.getpid(), "import_s": time.time() - started}
    Path(str(path) + ".json").write_text(json.dumps(info))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    listener.bind(str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)  # the socket appears only when it is ready to serve
    listener.listen(64)
    print(f"warm {role} {os.getpid()} ready at {path} after {time.time() - started:.1f} s", flush=True)
    children: dict[int, socket.socket] = {}
    last_request = time.time()
    try:
        while os.getppid() == owner_pid and (children or time.time() - last_request < idle_s):
            ready, _, _ = select.select([listener], [], [], 0.2)
            if ready:
                conn, _ = listener.accept()
                last_request = time.time()
                _fork_one(conn, listener, children, role)
            _reap(children)
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def _fork_one(
    conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket], role: str
) -> int | None:
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        if len(fds) != 3:
            raise ValueError(f"expected 3 descriptors, got {len(fds)}")
    except (OSError, ValueError) as exc:
        print(f"bad request: {exc}", flush=True)
        conn.close()
        return None
    refusal = fork_refusal() if role == WORKER else None
    if refusal:  # closing the connection makes the supervisor spawn this worker instead
        print(f"refused to fork: {refusal}", flush=True)
        conn.close()
        return None
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the worker
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        _become_worker(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    what = f" ({request['argv'][1]})" if JOB_PID_ENV in request["env"] and len(request["argv"]) > 1 else ""
    print(f"forked {role} {pid}{what}", flush=True)
    return pid


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        job_pid = os.environ.pop(JOB_PID_ENV, "")
        if job_pid:  # a rule's job (tunegrid.run.warm_jobs), not a cell's worker
            # the job that asked owns this process: killed (kill -9 of its tree), it takes this process, and a
            # supervisor its worker (whose lifeline watches this pid), with it
            hold(int(job_pid))
            # the job's command line, as `python -m tunegrid.cli ...` runs it (and as a cell's worker is spawned):
            # its entry point flushes and leaves by os._exit with the command's code
            runpy.run_module("tunegrid.cli", run_name="__main__")  # sys.argv stays the job's own
        else:
            from tunegrid.cell.entry import run_worker_from_argv

            code = run_worker_from_argv(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 — printed like an uncaught exception, the exit code says it failed
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed descriptor must not keep the exit code from us
                stream.flush()
        os._exit(code)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)  # -N for signal N, as subprocess.Popen reports it
        try:
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        except OSError:  # the supervisor is gone; nobody to tell
            pass
        conn.close()


# ----------------------------------------------------------------------------------------- lifecycle


def sweep_stale(directory: Path) -> list[Path]:
    """Remove what warm processes killed without their cleanup (a SIGKILL of the tree) left behind:
    their socket, pid and facts files, recognised by a pid file whose process is gone."""
    removed = []
    for pid_file in directory.glob(f"tunegrid-{os.getuid()}-*.sock.pid"):
        try:
            running = alive(int(pid_file.read_text()))
        except (OSError, ValueError):
            running = False
        if running:
            continue
        sock = Path(str(pid_file).removesuffix(".pid"))
        for leftover in (sock, Path(str(sock) + ".json"), pid_file):
            leftover.unlink(missing_ok=True)
        removed.append(sock)
    return removed


def start(path: Path, log_path: Path, role: str = WORKER) -> subprocess.Popen[bytes]:
    """Start the warm process for this invocation (Snakefile onstart). Same process group as snakemake,
    so a signal to the whole tree reaches it too."""
    sweep_stale(path.parent)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    src = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": src + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
    }
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunegrid.run.warm", str(path), str(os.getpid()), role],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    Path(str(path) + ".pid").write_text(str(proc.pid))
    return proc


def stop(proc: subprocess.Popen[bytes], path: Path) -> None:
    """Stop the warm process (Snakefile onsuccess/onerror). Workers it forked are not its to stop: each
    belongs to its supervisor."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for leftover in (path, Path(str(path) + ".pid"), Path(str(path) + ".json")):
        leftover.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]), role=sys.argv[3] if len(sys.argv) > 3 else WORKER)
    sys.stdout.flush()
    os._exit(0)
