"""A cell across nodes, without a cluster: the rank's srun step reads a signal back from srun's 128 + N, the step's
environment keeps the job and drops the supervisor's own step and pid, a cell outside a job that holds its nodes is
`unsupported`, the grid refuses nodes that do not divide the world size, and a slow link is told from ranks at pace
by the probe's all-reduce bus bandwidth (tests/workflow/test_two_nodes.py runs all of it on two SLURM nodes)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import make_study, one_cell_spec

from tunegrid.run.link_check import find_slow_link, predicted_allreduce
from tunegrid.run.nodes import RankStep, nodes_shortfall, step_env
from tunegrid.runtime.lifeline import SUPERVISOR_PID_ENV
from tunegrid.runtime.netif import NODE_ADDR_ENV, interface_of, pin_interface
from tunegrid.study.config import ConfigError, resolve_study
from tunegrid.targets import cluster_shortfall
from tunegrid.vocabulary import parse_cell_id

PROBE = {"allreduce": {"2": {"sizes": [{"bytes": 2**20, "busbw_gbs": 1.2, "time_s": 0.0009}]}}}


@pytest.mark.parametrize(("status", "code"), [("exit 3", 3), ("kill -9 $$", -9), ("kill -TERM $$", -15), ("", 0)])
def test_a_rank_step_reads_the_signal_back_from_srun_status(status, code):
    # srun exits 128 + N for a task killed by signal N (what `sh -c 'exit 137'` stands for here)
    shell = {"kill -9 $$": "exit 137", "kill -TERM $$": "exit 143"}.get(status, status or "true")
    step = RankStep(["sh", "-c", shell])
    assert step.wait() == code and step.returncode == code


def test_a_rank_step_environment_keeps_the_job_not_the_supervisors_step():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "1",
        "SLURM_STEP_NODELIST": "a",
        "SRUN_CPUS_PER_TASK": "4",
        SUPERVISOR_PID_ENV: "123",
        "PATH": "/bin",
    }
    assert step_env(env) == {"SLURM_JOB_ID": "7", "PATH": "/bin"}


def test_a_cell_across_nodes_needs_a_job_that_holds_them(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    two = one_cell_spec(model="qwen3moe-tiny", world=2, axes={"nodes": 2})
    assert two.cell_id.endswith("_ws2_nodes2")
    assert parse_cell_id(two.cell_id)["nodes"] == 2
    outcome, reason = nodes_shortfall(two)
    assert outcome == "unsupported" and "not inside a SLURM job" in reason
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert "holds 1" in nodes_shortfall(two, nodes=[("a", "10.0.0.1")])[1]
    assert nodes_shortfall(two, nodes=[("a", "10.0.0.1"), ("b", "10.0.0.2")]) is None
    assert nodes_shortfall(one_cell_spec(world=2)) is None


def test_the_grid_refuses_nodes_that_do_not_divide_the_world_size():
    grid = {"model": ["gemma3-hot"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}
    with pytest.raises(ConfigError, match="2 nodes do not divide grid.world_size 1"):
        resolve_study(make_study(grid={**grid, "world_size": [1, 2], "nodes": [2]}))
    resolve_study(make_study(grid={**grid, "world_size": [1, 2], "nodes": [2], "exclude": [{"world_size": 1}]}))


def test_a_partition_must_hold_the_nodes_and_each_nodes_share():
    spec = one_cell_spec(model="qwen3moe-tiny", world=4, axes={"nodes": 2}, train={"threads": 2})
    partition = {"name": "ci", "up": True, "cpus_per_node": 4, "gpus_per_node": 0}
    assert cluster_shortfall(spec, {"cluster": {"partitions": [{**partition, "nodes": 2}]}}) is None
    outcome, reason = cluster_shortfall(spec, {"cluster": {"partitions": [{**partition, "nodes": 1}]}})
    assert outcome == "unsupported" and "needs 4 CPUs and 0 GPUs on each of 2 nodes" in reason


def test_a_rank_binds_to_the_interface_of_its_nodes_address():
    assert interface_of("127.0.0.1") == "lo"
    env = {NODE_ADDR_ENV: "127.0.0.1"}
    assert pin_interface(env) == "lo" and env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    named = {NODE_ADDR_ENV: "127.0.0.1", "GLOO_SOCKET_IFNAME": "ib0"}
    assert pin_interface(named) is None and named["GLOO_SOCKET_IFNAME"] == "ib0"  # the user's choice stands


def _times(per_step: float, steps: int = 5) -> dict[int, float]:
    return {s: per_step for s in range(steps)}


def test_a_slow_link_is_slow_collectives_while_every_rank_keeps_pace():
    predicted = predicted_allreduce(PROBE, 2, 118_784)
    assert predicted is not None and predicted["seconds"] == pytest.approx(118_784 / 1.2e9)
    local = {0: _times(0.01), 1: _times(0.012)}
    found = find_slow_link(local, {0: _times(0.45), 1: _times(0.44)}, predicted, min_lag_s=0.1)
    assert found is not None and found["kind"] == "slow_link" and found["ratio"] > 1000
    assert found["text"].startswith("slow link: the collectives took 0.404 s a step") and "not a rank" in found["text"]
    # the same ranks with their collectives at pace: a step is about its forward and backward
    assert find_slow_link(local, {0: _times(0.035), 1: _times(0.04)}, predicted, min_lag_s=0.1) is None
    # a slow rank makes its peer wait: the rank that waited least in a step is at pace, so no link is blamed
    slow_rank = {0: _times(0.01), 1: _times(0.5)}
    assert find_slow_link(slow_rank, {0: _times(0.53), 1: _times(0.53)}, predicted, min_lag_s=0.1) is None
    assert find_slow_link(local, {0: _times(0.45), 1: _times(0.44)}, None, min_lag_s=0.1) is None  # no probe figure
    assert predicted_allreduce({}, 2, 100) is None


def test_slow_link_wrapper_runs_the_rank_and_keeps_its_exit_status(tmp_path):
    # no interface holds the address: nothing is limited, the command runs and its status comes back
    command = [sys.executable, "-m", "tunegrid.run.nodes", "slow-link", "1mbit", "--", "sh", "-c", "exit 4"]
    proc = subprocess.run(command, env={NODE_ADDR_ENV: "192.0.2.250", "PATH": "/usr/bin:/bin", **_pythonpath()})
    assert proc.returncode == 4
    killed = subprocess.run([*command[:-3], "sh", "-c", "kill -9 $$"], env={"PATH": "/usr/bin:/bin", **_pythonpath()})
    assert killed.returncode == -9


def _pythonpath() -> dict[str, str]:
    from tunegrid.study.config import REPO_ROOT

    return {"PYTHONPATH": str(REPO_ROOT / "src")}


def test_a_stopped_rank_step_undoes_its_set_up_after_the_stop(tmp_path):
    from tunegrid.run.launch import stop_group

    undone = tmp_path / "undone"
    step = RankStep(["sleep", "60"], start_new_session=True)
    step.cleanup = (["sh", "-c", f"touch {undone}"], {"PATH": "/usr/bin:/bin"})
    stop_group(step)
    assert step.returncode == -15 and undone.exists()
