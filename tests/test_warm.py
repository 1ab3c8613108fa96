"""The warm worker (tunegrid.warm): a forked worker trains exactly like a spawned one, its exit code and
signals reach the supervisor, a timeout stops it, and without a warm process the supervisor spawns."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import make_study, processes_mentioning

from tunegrid import warm
from tunegrid.config import cell_spec, expand_cells, resolve_study
from tunegrid.files import read_json
from tunegrid.supervisor import run_cell


def _spec(train=None):
    grid = {"model": ["qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["nf4"], "seed": [0]}
    study = resolve_study(make_study(grid=grid, train={"steps": 5, "seq_len": 32, **(train or {})}))
    return cell_spec(study, expand_cells(study)[0])


def _run(spec, checkpoints, dataset_path, run_dir):
    return run_cell(
        spec=spec, model_dir=checkpoints["qwen3moe-tiny"], data_path=dataset_path, run_dir=run_dir,
        result_path=run_dir / "result.json", tracking_path=None, capabilities_path=None, log_path=None,
        command=["tunegrid", "finetune"],
    )


@pytest.fixture
def warm_process(tmp_path, monkeypatch):
    path = warm.socket_path(f"test-{os.getpid()}-{time.monotonic_ns()}")
    proc = warm.start(path, tmp_path / "warm.log")
    monkeypatch.setenv(warm.SOCKET_ENV, str(path))
    yield path
    warm.stop(proc, path)
    assert not path.exists()


def test_forked_worker_trains_exactly_like_a_spawned_one(warm_process, checkpoints, dataset_path, tmp_path, capfd, monkeypatch):
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


def test_a_timeout_stops_the_forked_worker_and_leaves_nothing(warm_process, checkpoints, dataset_path, tmp_path, capfd):
    spec = _spec(train={"time_limit_s": 2, "steps": 100000})
    started = time.time()
    result = _run(spec, checkpoints, dataset_path, tmp_path / "run")
    assert result["outcome"] == "timeout" and "wall-clock limit" in result["reason"]
    assert result["worker_exit_code"] in (-15, -9), "the signal is relayed like Popen's returncode"
    assert time.time() - started < 30
    # a forked worker's command line is the warm process's, so look it up by pid
    pid = int(re.search(r"worker (\d+) forked by the warm worker", capfd.readouterr().out).group(1))
    assert not Path(f"/proc/{pid}").exists()
    assert processes_mentioning(tmp_path / "run") == []


def test_exit_codes_of_a_failing_worker_reach_the_supervisor(warm_process, tmp_path):
    proc = warm.fork_worker(warm_process, ["tunegrid", "worker", "--spec", str(tmp_path / "missing.json"),
                                           "--model-dir", "x", "--data", "x", "--run-dir", str(tmp_path)], dict(os.environ))
    assert proc is not None
    assert proc.wait(timeout=60) == 1  # the traceback goes to the supervisor's stderr, the code to it


def test_without_a_warm_process_the_supervisor_spawns(tmp_path):
    started = time.monotonic()
    assert warm.fork_worker(tmp_path / "none.sock", ["tunegrid", "worker"], {}) is None
    assert time.monotonic() - started < 1, "no pid file: nothing is starting, no wait"


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
