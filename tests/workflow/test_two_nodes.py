"""A cell's two ranks on two SLURM nodes: a real slurmctld and two slurmd, each node in a network namespace of its own
with its own address (tests/workflow/two_node_cluster.py), gloo across the veth links between them.

Each cell's job holds both nodes, one task each; its supervisor starts each rank as a step on its node. The
collective-timeout study's rank faults, injected into rank 1 on the second node, end as they do on one node: a slow
rank `straggler`, a stall `long_pause`, a skipped collective `mismatch`, a killed rank `error` naming it, and a
stall ended on its named hang has the supervisor stop that rank on the second node (these cells are submitted as
the SLURM profile submits a `finetune` job: sbatch --nodes=2 --ntasks=2, the command under `srun -n1`). Through
`snakemake --profile slurm` itself, with the study's own probe: the cell without a fault is `ok` at pace, and a
`tc` rate limit on the second node's link is `ok` with a `slow_link` finding, no rank to blame. After the cells no
process of theirs is left on either node.

CI installs slurm-wlm and sets TUNEGRID_REQUIRE_SYSTEM_TOOLS=1: there this test fails rather than skips where the
cluster cannot be made.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cell_contract, make_study, one_cell, workflow_env
from two_node_cluster import NODES, available, leftovers, node_processes, two_node_cluster

from tunegrid.runtime.files import read_json, write_json

WHY_NOT = available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm_cluster"),  # one cluster at a time: both own /etc/slurm/slurm.conf
    pytest.mark.skipif(
        WHY_NOT is not None and not os.environ.get("TUNEGRID_REQUIRE_SYSTEM_TOOLS"),
        reason=f"needs root, iproute2 network namespaces and Debian's slurm-wlm + munge ({WHY_NOT})",
    ),
]

TIMEOUT_S = 5
# the collective-timeout study's faults (configs/collective-timeout-cpu.yaml), each on rank 1: the second node
DEBUG = {
    "slow_rank": {"rank": 1, "seconds": 0, "growth_s": 2},
    "stall_rank": {"rank": 1, "step": 3, "seconds": 6},
    "skip_collective": {"rank": 1, "step": 3},
    "kill_rank": {"rank": 1, "step": 2},
}
# run folder -> the cell's fault; `stopped` ends on the named hang of a rank that stalls far longer than the timeout,
# so the supervisor itself must stop that rank on the second node
CELLS = {
    **{fault: fault for fault in ("slow-rank", "stall-rank", "skip-collective", "kill-rank")},
    "stopped": "stall-rank",
}


def _spec(name: str) -> dict:
    stopped = name == "stopped"
    return one_cell(
        model="qwen3moe-tiny",
        world=2,
        axes={"nodes": 2, "fault": CELLS[name], "collective_timeout_s": TIMEOUT_S},
        train={"steps": 5, "threads": 1},
        debug={**DEBUG, "stall_rank": {**DEBUG["stall_rank"], "seconds": 300}} if stopped else DEBUG,
        distributed={"backend": "gloo", "exit_grace_s": 2, "straggler_factor": 1.5, "end_on_hang": stopped},
        hardware={"gpus_per_rank": 0},
    )


def _submit(contract: Path, log: Path, env: dict[str, str]) -> str:
    """The cell's job as the SLURM profile submits a `finetune` job of a two-node cell (the plugin's sbatch
    --nodes --ntasks, and its job step's `srun -n1` around the command)."""
    command = [sys.executable, "-m", "tunegrid.cli", "finetune", "--contract", str(contract)]
    step = f"srun -n1 --cpu-bind=q --cpus-per-task=1 --nodes=2 {shlex.join(command)}"
    sbatch = ["sbatch", "--parsable", "--nodes=2", "--ntasks=2", "--cpus-per-task=1", "--mem=3000"]
    sbatch += [f"--chdir={log.parent}"]  # the job's own folder: a cell's default MLflow store is its working folder
    sbatch += [f"--output={log}", f"--wrap={step}"]
    return subprocess.run(sbatch, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _wait(jobs: list[str], env: dict[str, str], timeout_s: float, root: Path) -> None:
    """Until the jobs have left the queue. The limit only keeps a stuck cluster from hanging the suite (a loaded
    host starts two-node jobs slowly); what the cluster said is in the failure."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
        if not set(jobs) & set(queued):
            return
        if _held(env):
            break
        time.sleep(1)
    raise AssertionError(f"jobs {jobs} held or still queued after {timeout_s} s\n{_cluster_state(env, root)}")


def _held(env: dict[str, str]) -> bool:
    """A job SLURM could not launch on its node is requeued and held: it will never run, so waiting is over."""
    reasons = subprocess.run(["squeue", "-h", "-o", "%r"], env=env, capture_output=True, text=True).stdout
    return "launch failed" in reasons


def _cluster_state(env: dict[str, str], root: Path) -> str:
    """The queue with each job's reason, the nodes' states and the daemons' last log lines."""
    queue = subprocess.run(["squeue", "-o", "%i %T %r %N"], env=env, capture_output=True, text=True).stdout
    nodes = subprocess.run(["sinfo", "-N", "-o", "%N %T %E"], env=env, capture_output=True, text=True).stdout
    logs = "".join(
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]) + "\n"
        for log in sorted((root / "log").glob("*.log"))
    )
    return f"squeue:\n{queue}sinfo:\n{nodes}{logs}"


def test_faults_on_the_second_node_get_their_one_node_verdicts(tmp_path, checkpoints, dataset_path):
    capabilities = tmp_path / "capabilities.json"
    # what the probe wrote on this project's 2-core host (its all-reduce bus bandwidth at 2 ranks among it), as a
    # probe run as a SLURM job records it
    write_json(capabilities, {**read_json(REPO / "tests" / "data" / "capabilities-cpu.json"), "cluster_job": True})
    env = {**workflow_env(), "PYTHONPATH": str(REPO / "src")}
    with two_node_cluster(tmp_path / "slurm") as slurm_env:
        started = time.time()
        jobs = []
        for name in CELLS:
            contract = cell_contract(
                _spec(name), checkpoints, dataset_path, tmp_path / name, capabilities=capabilities, warm_worker=False
            )
            jobs.append(_submit(contract, tmp_path / f"{name}.log", {**env, **slurm_env}))
        _wait(jobs, slurm_env, 420, tmp_path / "slurm")
        wall = time.time() - started
        left = {node: node_processes(node, "tunegrid") for node in NODES}
    print(f"two nodes: daemons up in {slurm_env['TUNEGRID_SLURM_STARTUP_S']} s, {len(CELLS)} cells in {wall:.0f} s")
    assert leftovers() == [], "the namespaces, links and daemons are gone"
    assert left == {node: [] for node in NODES}, "no rank left on either node"
    results = {}
    for name in CELLS:
        assert (tmp_path / name / "result.json").exists(), (tmp_path / f"{name}.log").read_text()[-3000:]
        results[name] = read_json(tmp_path / name / "result.json")
        assert results[name]["env"]["scheduler"]["SLURM_JOB_ID"], name
        assert [rank["rank"] for rank in results[name]["ranks"]] == [0, 1], name

    def verdict(name: str) -> tuple[str, str | None]:
        result = results[name]
        return result["outcome"], ((result.get("diagnosis") or {}).get("collective") or {}).get("kind")

    assert verdict("slow-rank") == ("timeout", "straggler"), results["slow-rank"]["reason"]
    assert results["slow-rank"]["diagnosis"]["collective"]["missing_ranks"] == [1]
    assert verdict("stall-rank") == ("timeout", "long_pause"), results["stall-rank"]["reason"]
    assert verdict("skip-collective") == ("timeout", "mismatch"), results["skip-collective"]["reason"]
    killed = results["kill-rank"]
    assert killed["outcome"] == "error" and "rank 1 died (killed by SIGKILL)" in killed["reason"], killed["reason"]
    # the supervisor named the hang and stopped the stalled rank on the second node itself, long before its 300 s
    stopped = results["stopped"]
    assert verdict("stopped") == ("timeout", "long_pause"), stopped["reason"]
    assert stopped["diagnosis"]["collective"]["missing_from"] == "hang_watch" and stopped["wall_s"] < 120
    assert stopped["ranks"][1]["stopped_by_supervisor"] and stopped["ranks"][1]["exit_code"] < 0, stopped["ranks"]


def test_a_slow_link_through_the_slurm_profile(tmp_path):
    """`snakemake --profile slurm` as a user runs it, its probe included: each cell's job asks for two nodes, one task
    each, its ranks run one on each node; a 1 mbit link on the second node slows the collectives 100s of times past
    what the probe's all-reduce bus bandwidth predicts while both ranks keep pace, and the unlimited twin does not."""
    grid = {"model": ["qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}
    study = make_study(
        study="two-nodes",
        grid={**grid, "world_size": [2], "nodes": [2], "fault": ["none", "slow-link", "debug"]},
        # each cell's job holds both nodes' two cores: the twins run one after the other, never beside the limit
        train={"steps": 5, "seq_len": 32, "threads": 2},
        hardware={"gpus_per_rank": 0},
        # `debug` (every fault of the section): the slow link and a stall the supervisor ends on its named hang, so
        # it stops the limited rank itself and removes the limit its killed step left
        # (a hang is named after 3 s without progress: well above a limited link's 0.5 s collectives)
        distributed={"backend": "gloo", "collective_timeout_s": TIMEOUT_S, "end_on_hang": True, "hang_window_s": 3},
        debug={"slow_link": {"rank": 1, "rate": "1mbit"}, "stall_rank": {"rank": 1, "step": 3, "seconds": 300}},
        probe={"world_sizes": [2], "budget_s": 2},
        tracking={"enabled": False},
    )
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    workdir = tmp_path / "work"
    workdir.mkdir()
    with two_node_cluster(tmp_path / "slurm") as slurm_env:
        output = tmp_path / "snakemake.log"
        with open(output, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "snakemake", "--profile", "slurm", "--directory", str(workdir)]
                + ["--configfile", str(config), "--slurm-init-seconds-before-status-checks", "2"]
                + ["--seconds-between-status-checks", "3", "--slurm-no-account"],
                cwd=REPO,
                env={**workflow_env(), **slurm_env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                deadline = time.time() + 600  # a stuck cluster fails, not hangs; a loaded host starts jobs slowly
                while proc.poll() is None:
                    if time.time() > deadline or _held(slurm_env):
                        raise subprocess.TimeoutExpired(proc.args, 600)
                    time.sleep(2)
            except subprocess.TimeoutExpired:
                steps = subprocess.run(["squeue", "-s"], env=slurm_env, capture_output=True, text=True).stdout
                state = _cluster_state(slurm_env, tmp_path / "slurm")
                proc.kill()
                proc.wait()
                raise AssertionError(
                    f"held, or running after 600 s; steps:\n{steps}\n{state}\n{output.read_text()[-5000:]}"
                ) from None
        assert proc.returncode == 0, output.read_text()[-6000:]
        left = {node: node_processes(node, "tunegrid") for node in NODES}
        qdisc = subprocess.run(
            ["ip", "netns", "exec", "tgnode2", "tc", "qdisc", "show"], capture_output=True, text=True
        )
    assert left == {node: [] for node in NODES} and leftovers() == []
    assert "tbf" not in qdisc.stdout, "the limit is gone from the second node's link"
    results = workdir / "results" / "two-nodes"
    cell = "qwen3moe-tiny_fp32_bs2_none_s0_ws2_nodes2{}"
    suffix = {"none": "_fault-none", "slow-link": "_fault-slow-link", "debug": ""}
    for fault in ("none", "slow-link", "debug"):
        log = (results.parent / "logs" / "two-nodes" / "finetune" / f"{cell.format(suffix[fault])}.log").read_text()
        assert "rank 0: srun step on tgnode1" in log and "rank 1: srun step on tgnode2" in log, log[-2000:]
    at_pace, limited = (
        read_json(results / "runs" / cell.format(suffix[f]) / "result.json") for f in ("none", "slow-link")
    )
    assert at_pace["outcome"] == "ok" and limited["outcome"] == "ok", (at_pace["reason"], limited["reason"])
    assert "slow_link" not in at_pace["distributed"] and "straggler" not in at_pace["distributed"]
    link = limited["distributed"]["slow_link"]
    assert link["kind"] == "slow_link" and link["ratio"] > 100 and "not a rank" in link["text"], link
    assert "straggler" not in limited["distributed"]
    stopped = read_json(results / "runs" / cell.format("") / "result.json")
    assert stopped["outcome"] == "timeout" and stopped["diagnosis"]["collective"]["kind"] == "long_pause"
    assert stopped["ranks"][1]["stopped_by_supervisor"], stopped["ranks"]
    busbw = read_json(results / "probe" / "capabilities.json")["allreduce"]["2"]["sizes"]
    assert link["busbw_gbs"] in [row["busbw_gbs"] for row in busbw], "measured against the study's own probe"
