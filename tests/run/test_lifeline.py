"""A worker never outlives its supervisor: kill -9 of the supervisor's whole tree mid-cell leaves no
worker (spawned, forked by the warm worker, or a DDP rank) running after 2 s. Nor does a supervisor forked by the
warm supervisor outlive its `finetune` job, which passes Snakemake's SIGTERM on to it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MOE_TINY_CELL, REPO, cell_contract, make_study, processes_mentioning

from tunegrid.run import warm
from tunegrid.study.config import cell_spec, expand_cells, resolve_study


def _start_supervisor(
    tmp_path: Path, checkpoints, dataset_path, world: int, env: dict[str, str], as_job: bool = False
) -> tuple[subprocess.Popen, Path]:
    """A supervisor training a long cell, once it trains; `as_job`: the `finetune` job's command line, as the
    rule runs it (forked by the warm supervisor where `env` names one), else run_cell in a process of its own."""
    grid = {**MOE_TINY_CELL, "world_size": [world]}
    study = resolve_study(
        make_study(grid=grid, train={"steps": 100000, "seq_len": 32, "threads": 1, "time_limit_s": 600})
    )
    spec = cell_spec(study, expand_cells(study)[0]).to_json()
    run_dir = tmp_path / "runs" / spec["cell_id"]
    contract = cell_contract(spec, checkpoints, dataset_path, run_dir, warm_worker=bool(env.get(warm.SOCKET_ENV)))
    code = (
        "from pathlib import Path; from tunegrid.run.supervisor import run_cell\n"
        f"run_cell(Path({str(contract)!r}), command=['tunegrid', 'finetune'])\n"
    )
    job = [str(REPO / "scripts" / "tunegrid.py"), "finetune", "--contract", str(contract)]
    proc = subprocess.Popen(
        [sys.executable, *(job if as_job else ["-c", code])],
        env={**env, "PYTHONPATH": str(REPO / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # training, by its files
        assert proc.poll() is None and time.time() < deadline, (
            proc.stdout.read()[-3000:] if proc.poll() is not None else "no progress"
        )
        time.sleep(0.1)
    return proc, run_dir


def _gone_within(pids_now, seconds: float = 2.0) -> list[str]:
    deadline = time.time() + seconds
    while time.time() < deadline:
        left = pids_now()
        if not left:
            return []
        time.sleep(0.05)
    return pids_now()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.slow
def test_spawned_workers_and_ranks_die_with_their_supervisor(checkpoints, dataset_path, tmp_path, world):
    env = {k: v for k, v in os.environ.items() if k != warm.SOCKET_ENV}
    proc, run_dir = _start_supervisor(tmp_path, checkpoints, dataset_path, world, env)
    assert processes_mentioning(run_dir), "the workers are running"
    os.killpg(proc.pid, signal.SIGKILL)  # the supervisor's whole tree; workers live in sessions of their own
    proc.wait()
    left = _gone_within(lambda: processes_mentioning(run_dir))
    for pid in left:  # a failing run must not leave them training for the rest of the suite
        os.kill(int(pid), signal.SIGKILL)
    assert left == []


@pytest.mark.slow
def test_a_worker_forked_by_the_warm_worker_dies_with_its_supervisor(checkpoints, dataset_path, tmp_path):
    path = warm.socket_path(f"test-lifeline-{os.getpid()}-{time.monotonic_ns()}")
    warm_proc = warm.start(path, tmp_path / "warm.log")
    try:
        proc, run_dir = _start_supervisor(
            tmp_path, checkpoints, dataset_path, 1, {**os.environ, warm.SOCKET_ENV: str(path)}
        )
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.stdout.read()
        worker = int(re.search(r"worker (\d+) forked by the warm worker", out).group(1))
        left = _gone_within(
            lambda: (
                [str(worker)]
                if Path(f"/proc/{worker}").exists() and "Z" not in Path(f"/proc/{worker}/stat").read_text().split()[2]
                else []
            )
        )
        if left:
            os.kill(worker, signal.SIGKILL)
        assert left == []
    finally:
        warm.stop(warm_proc, path)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.slow
def test_a_supervisor_forked_by_the_warm_supervisor_stops_with_its_job(checkpoints, dataset_path, tmp_path):
    """The job's SIGTERM (Snakemake's cancel) reaches the forked supervisor, which stops its worker and ends the
    job with its own code; kill -9 of the job's tree takes the supervisor and its worker with it."""
    sockets = {role: warm.socket_path(f"test-job-{os.getpid()}-{time.monotonic_ns()}", role) for role in ROLES}
    started = {role: warm.start(path, tmp_path / f"{role}.log", role) for role, path in sockets.items()}
    env = {**os.environ, warm.SOCKET_ENV: str(sockets[warm.WORKER])}
    env[warm.SUPERVISOR_SOCKET_ENV] = str(sockets[warm.SUPERVISOR])
    try:
        for signum in (signal.SIGTERM, signal.SIGKILL):
            proc, _ = _start_supervisor(tmp_path / signum.name, checkpoints, dataset_path, 1, env, as_job=True)
            supervisor = int(re.findall(r"forked supervisor (\d+)", (tmp_path / "supervisor.log").read_text())[-1])
            if signum == signal.SIGTERM:
                proc.send_signal(signum)  # the job alone: the supervisor is in a session of its own
            else:
                os.killpg(proc.pid, signum)
            code = proc.wait(timeout=60)
            # from the warm worker's log: the job's output stays open while anything holding it still runs
            worker = int(re.findall(r"forked worker (\d+)", (tmp_path / "worker.log").read_text())[-1])
            pids = (supervisor, worker)
            left = _gone_within(lambda pids=pids: [str(pid) for pid in pids if _alive(pid)])
            for pid in left:
                os.kill(int(pid), signal.SIGKILL)
            assert left == [], f"{signum.name}: left running"
            out = proc.stdout.read()
            assert f"worker {worker} forked by the warm worker" in out
            assert code == (128 + signal.SIGTERM if signum == signal.SIGTERM else -signal.SIGKILL), out[-2000:]
    finally:
        for role, proc in started.items():
            warm.stop(proc, sockets[role])


ROLES = (warm.WORKER, warm.SUPERVISOR)


def test_processes_mentioning_sees_only_this_sessions_processes(tmp_path):
    """Another checkout's suite or pipeline on the same host (its own marker, or none) is not this test's
    leftover, even with the same words on its command line."""
    from conftest import SESSION_ENV

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path)]
    foreign = {k: v for k, v in os.environ.items() if k != SESSION_ENV}
    procs = {
        "ours": subprocess.Popen(sleeper, env=dict(os.environ)),
        "another session": subprocess.Popen(sleeper, env={**foreign, SESSION_ENV: "another"}),
        "no session": subprocess.Popen(sleeper, env=foreign),
    }
    try:
        assert processes_mentioning(tmp_path) == [str(procs["ours"].pid)]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
