"""The warm worker (tunegrid.run.warm): a forked worker trains exactly like a spawned one, its exit code and
signals reach the supervisor, a timeout stops it, and without a warm process the supervisor spawns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import one_cell, processes_mentioning, run_supervised

from tunegrid.run import warm, warm_client
from tunegrid.runtime.files import read_json


def _spec(train=None):
    return one_cell(model="qwen3moe-tiny", quant="nf4", train={"steps": 5, **(train or {})})


def _run(spec, checkpoints, dataset_path, run_dir):
    """Forked by the test's own warm process where it started one, else spawned (never the session's)."""
    worker = "forked" if os.environ.get(warm.SOCKET_ENV) else "spawned"
    return run_supervised(spec, checkpoints, dataset_path, run_dir, worker=worker)


@pytest.fixture
def warm_process(tmp_path, monkeypatch):
    path = warm.socket_path(f"test-{os.getpid()}-{time.monotonic_ns()}")
    proc = warm.start(path, tmp_path / "warm.log")
    monkeypatch.setenv(warm.SOCKET_ENV, str(path))
    yield path
    warm.stop(proc, path)
    assert not path.exists()


@pytest.mark.slow
def test_forked_worker_trains_exactly_like_a_spawned_one(
    warm_process, checkpoints, dataset_path, tmp_path, capfd, monkeypatch
):
    spec = _spec()
    forked = _run(spec, checkpoints, dataset_path, tmp_path / "forked")
    out = capfd.readouterr().out
    assert "forked by the warm worker" in out, "the supervisor used the warm process"
    monkeypatch.delenv(warm.SOCKET_ENV)
    spawned = _run(spec, checkpoints, dataset_path, tmp_path / "spawned")
    assert "forked by the warm worker" not in capfd.readouterr().out
    assert forked["outcome"] == spawned["outcome"] == "ok"
    assert forked["worker_exit_code"] == 0
    assert forked["training"]["final_loss"] == spawned["training"]["final_loss"], "same seed, same numbers"
    assert read_json(tmp_path / "forked" / "worker.json")["training"]["steps_run"] == 5
    # each result names the path its worker took, whose runtime constant its estimate counted
    assert (forked["memory"]["estimate_worker"], spawned["memory"]["estimate_worker"]) == ("forked", "spawned")


@pytest.mark.slow
def test_a_timeout_stops_the_forked_worker_and_leaves_nothing(warm_process, checkpoints, dataset_path, tmp_path, capfd):
    spec = _spec(train={"time_limit_s": 2, "steps": 100000})
    started = time.time()
    result = _run(spec, checkpoints, dataset_path, tmp_path / "run")
    assert result["outcome"] == "timeout" and "wall-clock limit" in result["reason"]
    assert result["worker_exit_code"] in (-15, -9), "the signal is relayed like Popen's returncode"
    # a hang guard, not a speed test (the outcome and the signal above say the 2 s limit stopped it): 32 s were
    # seen beside a second test worker at load 7, and 100000 steps would run for many minutes
    assert time.time() - started < 180
    # a forked worker's command line is the warm process's, so look it up by pid
    pid = int(re.search(r"worker (\d+) forked by the warm worker", capfd.readouterr().out).group(1))
    assert not Path(f"/proc/{pid}").exists()
    assert processes_mentioning(tmp_path / "run") == []


@pytest.mark.slow
def test_exit_codes_of_a_failing_worker_reach_the_supervisor(warm_process, tmp_path):
    proc = warm_client.fork_worker(
        warm_process,
        [
            "tunegrid",
            "worker",
            "--contract",
            str(tmp_path / "missing.json"),
        ],
        dict(os.environ),
    )
    assert proc is not None
    assert proc.wait(timeout=60) == 1  # the traceback goes to the supervisor's stderr, the code to it


@pytest.mark.slow
def test_the_probe_forked_by_the_warm_worker_records_a_fresh_processs_baseline(warm_process, tmp_path):
    """The probe job is forked once (it does not ask for a fork of itself), its calibration's forked micro cells
    come from the same warm worker, and the runtime baseline it records is a fresh process's: measured in one on
    a cache miss, then kept with the calibration (the fork's own resident set is not that baseline)."""
    from conftest import REPO

    env = {**os.environ, "TUNEGRID_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "src")}
    records = []
    for run in ("miss", "hit"):
        out = tmp_path / f"{run}.json"
        command = [sys.executable, str(REPO / "scripts" / "tunegrid.py"), "probe", "--budget-s", "1", "--out", str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        records.append(read_json(out))
    log = (tmp_path / "warm.log").read_text()
    assert log.count("(probe)") == 2, log[-2000:]  # one fork per probe job, none of itself
    assert log.count("forked worker") == 2 + 3, "and the three forked micro cells of the one calibration"
    miss, hit = records
    assert (miss["worker_runtime_bytes"]["cache"], hit["worker_runtime_bytes"]["cache"]) == ("filled", "hit")
    assert "runtime_baseline_bytes" not in miss["worker_runtime_bytes"]  # a cache entry's, not the record's
    # a fresh process's, as this test measures one (a fork of the warm worker holds ~20 % less: it maps its
    # parent's pages lazily), and the hit takes the miss's measurement
    from tunegrid.prepare.stacks import fresh_runtime_baseline_bytes

    baseline, fresh = miss["runtime_baseline_bytes"], fresh_runtime_baseline_bytes()
    assert fresh and abs(baseline - fresh) < 0.05 * fresh, (baseline, fresh)
    assert hit["runtime_baseline_bytes"] == baseline


def test_without_a_warm_process_the_supervisor_spawns(tmp_path):
    started = time.monotonic()
    assert warm_client.fork_worker(tmp_path / "none.sock", ["tunegrid", "worker"], {}) is None
    assert time.monotonic() - started < 1, "no pid file: nothing is starting, no wait"


def _unreaped_exit() -> subprocess.Popen[bytes]:
    """A child that has exited and that nobody has reaped yet: a zombie, as a refused warm process is until its
    Snakemake parent stops it at the end of the run."""
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    return child


def _returns(call, within_s: float = 60.0):
    """call()'s value, or a failure if it is still waiting after `within_s` (never a measure of speed: the calls
    below would otherwise wait an hour)."""
    import threading

    answer: list = []
    waiting = threading.Thread(target=lambda: answer.append(call()), daemon=True)  # left behind if it hangs
    waiting.start()
    waiting.join(within_s)
    assert answer, f"still waiting after {within_s:.0f} s"
    return answer[0]


def test_a_zombie_is_not_alive():
    from tunegrid.runtime.lifeline import alive

    child = _unreaped_exit()
    try:
        assert alive(os.getpid())
        assert not alive(child.pid), "an exited, unreaped process answers signal 0 but runs no more"
    finally:
        child.wait()


@pytest.mark.parametrize("refused", [True, False])
def test_a_warm_process_that_will_not_serve_is_not_waited_for(tmp_path, refused):
    """The Snakemake process that starts a warm process reaps it only at the end of the run. Before, a warm
    worker that refused to serve (a GPU visible) stayed a zombie that looked alive, and every cell's supervisor
    waited 30 s for its socket, every environment and checkpoint job 60 s (seen on an H200)."""
    path = tmp_path / "warm.sock"
    child = _unreaped_exit()
    try:
        Path(str(path) + ".pid").write_text(str(child.pid))
        if refused:
            Path(str(path) + ".json").write_text(f'{{"pid": {child.pid}, "refused": "a GPU is visible"}}')
        assert _returns(lambda: warm_client.ready_info(path, wait_s=3600)) is None
        assert _returns(lambda: warm_client.fork_worker(path, ["tunegrid", "worker"], {}, wait_ready_s=3600)) is None
    finally:
        child.wait()


def test_a_refusal_on_file_is_final_while_the_process_lives(tmp_path):
    """It wrote why it will not serve and has not ended yet: no socket will appear, so nobody waits."""
    path = tmp_path / "warm.sock"
    Path(str(path) + ".pid").write_text(str(os.getpid()))  # alive: this very process
    Path(str(path) + ".json").write_text('{"pid": 1, "refused": "a GPU is visible"}')
    assert _returns(lambda: warm_client.ready_info(path, wait_s=3600)) is None


def test_files_left_by_a_killed_warm_process_are_swept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"tunegrid-{os.getuid()}-old.sock"
    for suffix in ("", ".json", ".pid"):
        Path(str(stale) + suffix).write_text(str(dead.pid))
    live = tmp_path / f"tunegrid-{os.getuid()}-live.sock"
    Path(str(live) + ".pid").write_text(str(os.getpid()))
    assert warm.sweep_stale(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name + ".pid"], "a live one is kept"


def test_importing_the_warm_modules_never_initialises_cuda():
    """Tripwire: a warm process that initialised CUDA would break every forked cell on a GPU machine.
    torch.cuda's lazy initialiser is patched to record any call before the warm worker's imports."""
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "original = torch.cuda._lazy_init\n"
        "torch.cuda._lazy_init = lambda *a, **k: (calls.append(1), original(*a, **k))[1]\n"
        "import importlib\n"
        "from tunegrid.run.warm import PRELOAD\n"
        "for name in PRELOAD: importlib.import_module(name)\n"
        "assert not calls and not torch.cuda.is_initialized(), 'importing the warm modules initialised CUDA'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_fork_once_cuda_is_initialised_or_a_gpu_is_visible(monkeypatch):
    import torch

    assert warm.fork_refusal() is None  # this CPU host: forking is fine
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "initialised" in warm.fork_refusal()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "spawned" in warm.fork_refusal()


@pytest.mark.slow
def test_a_warm_process_that_refuses_leaves_the_cell_to_a_spawned_worker(
    checkpoints, dataset_path, tmp_path, monkeypatch, capfd
):
    """On a GPU machine the warm process starts, finds CUDA visible and does not serve: the cell is spawned, ok."""
    sitecustomize = tmp_path / "fakegpu" / "sitecustomize.py"
    sitecustomize.parent.mkdir()
    sitecustomize.write_text("import torch\ntorch.cuda.device_count = lambda: 1\n")  # what a GPU machine reports
    path = warm.socket_path(f"test-refuse-{os.getpid()}-{time.monotonic_ns()}")
    monkeypatch.setenv("PYTHONPATH", f"{sitecustomize.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = warm.start(path, tmp_path / "warm.log")
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.setenv(warm.SOCKET_ENV, str(path))
    try:
        # not reaped, as the Snakemake process that started it does not reap it: a zombie with a refusal on file
        deadline = time.monotonic() + 300
        while "not serving" not in (tmp_path / "warm.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "not serving" in (tmp_path / "warm.log").read_text()
        result = _run(_spec(), checkpoints, dataset_path, tmp_path / "cell")
        assert "forked by the warm worker" not in capfd.readouterr().out
        assert result["outcome"] == "ok", result["reason"]
        assert result["memory"]["estimate_worker"] == "spawned"
    finally:
        warm.stop(proc, path)


@pytest.mark.slow
def test_mlflow_ui_starts_no_warm_worker(tmp_path):
    """The warm worker serves cells only: `snakemake mlflow_ui` (no cell to run) must not import torch for
    nothing. Serving is checked by the port answering; then the invocation is stopped."""
    import signal
    import socket

    import yaml
    from conftest import make_study, snakemake_command, workflow_env

    with socket.socket() as s:  # a free port: other checkouts may serve their own UI on this host
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(make_study(tracking={"ui_port": port})))
    proc = subprocess.Popen(
        snakemake_command(tmp_path, "--cores", "1", "mlflow_ui", "--configfile", str(study)),
        env=workflow_env(warm.SOCKET_ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(1)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert not list((tmp_path / "results").rglob("warm_worker.log"))
        assert processes_mentioning(Path("tunegrid.run.warm")) == []
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_no_warm_worker_is_started_where_a_gpu_is_visible(tmp_path, monkeypatch):
    """Every cell's worker is spawned beside a GPU (fork_refusal), so the invocation starts no warm worker to
    import the stack for nothing and to keep jobs asking; the log says why."""
    from tunegrid.run import hooks
    from tunegrid.runtime import devices
    from tunegrid.track.execution import EXECUTION_ENV

    started = []
    monkeypatch.setattr(warm, "start", lambda path, log, role=warm.WORKER: started.append(role))
    monkeypatch.setenv(EXECUTION_ENV, f"test-{os.getpid()}")
    monkeypatch.delenv(warm.SOCKET_ENV, raising=False)
    monkeypatch.delenv(warm.SUPERVISOR_SOCKET_ENV, raising=False)
    study = {"execution": {"warm_worker": True}, "tracking": {"enabled": True}}
    monkeypatch.setattr(hooks, "_WARM", [])
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 1)
    hooks.on_start(study, str(tmp_path / "gpu"), local=True)
    assert started == [warm.SUPERVISOR], "the supervisor needs no torch and still serves"
    assert "no warm worker: 1 CUDA device(s) visible" in (tmp_path / "gpu" / "warm_worker.log").read_text()
    assert warm.SOCKET_ENV not in os.environ

    monkeypatch.setattr(hooks, "_WARM", [])
    monkeypatch.delenv(warm.SUPERVISOR_SOCKET_ENV)
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 0)
    hooks.on_start(study, str(tmp_path / "cpu"), local=True)
    assert started[1:] == [warm.WORKER, warm.SUPERVISOR]
