"""`snakemake --profile slurm` from the repository root against a real one-node SLURM (slurm-wlm + munge).

The daemons are started and stopped by the test (tests/workflow/slurm_cluster.py). CI installs slurm-wlm and
sets TUNEGRID_REQUIRE_SYSTEM_TOOLS=1, so there this test fails rather than skips when SLURM is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import MOE_TINY_CELL, REPO, make_study, workflow_env
from slurm_cluster import available, slurm_cluster

from tunegrid.runtime.files import read_json
from tunegrid.track.store import client
from tunegrid.track.tags import distinct_part
from tunegrid.track.tracking import CELL_TAG

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm_cluster"),  # one cluster at a time: both own /etc/slurm/slurm.conf
    pytest.mark.skipif(
        not available() and not os.environ.get("TUNEGRID_REQUIRE_SYSTEM_TOOLS"),
        reason="needs root and Debian's slurm-wlm + munge (.ci/run installs them)",
    ),
]


def test_study_through_the_slurm_profile(tmp_path):
    # 4 ranks x 1 GPU: more than the node's 3, unsupported before submission
    grid = {**MOE_TINY_CELL, "world_size": [1, 2, 4]}
    study = make_study(
        study="slurm",
        grid=grid,
        train={"steps": 3, "seq_len": 32, "threads": 1},
        hardware={"gpus_per_rank": 1},  # the fake GPUs: a 2-rank cell must really be given --gpus=2
        debug={"stall_rank": {"rank": 1, "step": 1, "seconds": 90}},
        distributed={"collective_timeout_s": 5, "exit_grace_s": 2},
        probe={"world_sizes": [2], "budget_s": 2},  # its timed micro-benchmarks: no figure of theirs is judged here
    )
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = workflow_env()
    with slurm_cluster(tmp_path / "slurm") as slurm_env:
        started = time.time()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "snakemake",
                "--profile",
                "slurm",
                "--directory",
                str(workdir),
                "--configfile",
                str(config),
                # this test cluster has no slurmdbd: the workflow finds that out and checks job states with
                # squeue (the profile as shipped, no status command named); early and often
                "--slurm-init-seconds-before-status-checks",
                "2",
                "--seconds-between-status-checks",
                "3",
                "--slurm-no-account",
                "--slurm-keep-successful-logs",
            ],
            cwd=REPO,
            env={**env, **slurm_env},
            capture_output=True,
            text=True,
            timeout=900,
        )
        wall = time.time() - started
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        submitted = proc.stdout.count("Job ") + proc.stderr.count("has been submitted with SLURM jobid")
    print(f"SLURM: daemons up in {slurm_env['TUNEGRID_SLURM_STARTUP_S']} s, workflow {wall:.0f} s")

    assert submitted >= 4, "cells, checkpoint, environment and probe went through sbatch"
    results = workdir / "results" / "slurm"
    summary = pd.read_parquet(results / "summary.parquet").set_index("cell_id")
    assert summary.loc["qwen3moe-tiny_fp32_bs2_none_s0", "outcome"] == "ok"
    unschedulable = summary.loc["qwen3moe-tiny_fp32_bs2_none_s0_ws4"]
    assert unschedulable["outcome"] == "unsupported", unschedulable.to_dict()
    assert "needs 4 CPUs and 4 GPUs on one node" in unschedulable["reason"], unschedulable["reason"]
    assert "ci: 1 node(s) of 8 CPUs, 3 GPUs" in unschedulable["reason"], unschedulable["reason"]
    stalled = summary.loc["qwen3moe-tiny_fp32_bs2_none_s0_ws2"]
    assert stalled["outcome"] == "timeout" and stalled["collective_missing_ranks"] == "1"
    for cell in summary.index:
        scheduler = read_json(results / "runs" / cell / "result.json")["env"]["scheduler"]
        assert scheduler["SLURM_JOB_ID"], "the cell ran inside a SLURM job"
        if cell == unschedulable.name:  # its job only wrote the verdict: one core, no GPU, so it was scheduled
            assert scheduler.get("SLURM_GPUS_ON_NODE") in (None, "", "0"), scheduler
            continue
        world = 2 if cell.endswith("_ws2") else 1
        assert scheduler["SLURM_GPUS_ON_NODE"] == str(world), "gpu=N became --gpus=N"

    c = client(f"sqlite:///{workdir / 'results' / 'mlflow.db'}")
    experiment = c.get_experiment_by_name("tunegrid/slurm")
    runs = c.search_runs([experiment.experiment_id], filter_string=f"tags.`{CELL_TAG}` != ''")
    names = {f"{row.outcome} · {distinct_part(cell, summary.index)}" for cell, row in summary.iterrows()}
    assert {r.info.run_name for r in runs} == names
    assert all(r.data.tags.get("slurm.job_id") for r in runs)
    assert subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True).stdout == b"", "no processes left behind"


def test_one_interrupt_stops_the_workflow_and_cancels_its_jobs(tmp_path):
    """Ctrl-C once, while a cell's job runs on the cluster: Snakemake ends, and the job is cancelled with it (no
    job left in the queue, no rank left on the node). SIGTERM is Snakemake's graceful stop (running jobs finish),
    so the interrupt is what a user at the terminal sends: SIGINT to the foreground process group."""
    study = make_study(
        study="slurm-interrupt",
        grid={
            "model": ["qwen3moe-tiny"],
            "precision": ["fp32"],
            "batch_size": [2],
            "quant": ["none"],
            "seed": [0],
            "world_size": [2],
        },
        train={"steps": 3, "seq_len": 32, "threads": 1},
        hardware={"gpus_per_rank": 0},
        debug={"stall_rank": {"rank": 1, "step": 1, "seconds": 600}},  # the cell is still running when interrupted
        distributed={"collective_timeout_s": 900},
        probe={"world_sizes": [2], "budget_s": 2},
    )
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    workdir = tmp_path / "work"
    workdir.mkdir()
    out = tmp_path / "snakemake.out"
    with slurm_cluster(tmp_path / "slurm") as slurm_env:
        env = {**workflow_env(), **slurm_env}
        line = [sys.executable, "-m", "snakemake", "--profile", "slurm", "--directory", str(workdir)]
        line += ["--configfile", str(config), "--slurm-init-seconds-before-status-checks", "2"]
        line += ["--seconds-between-status-checks", "3", "--slurm-no-account"]
        with out.open("w") as sink:
            proc = subprocess.Popen(
                line,
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_interruptible,
            )
        try:
            deadline = time.time() + 300
            while not _a_cell_job_runs(out, env):
                assert proc.poll() is None and time.time() < deadline, out.read_text()[-3000:]
                time.sleep(2)
            time.sleep(5)  # its ranks started
            os.killpg(proc.pid, signal.SIGINT)
            interrupted = time.time()
            proc.wait(timeout=120)
            stopped_after = time.time() - interrupted
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout
        print(f"SLURM: one interrupt ended the workflow in {stopped_after:.1f} s")
        assert queue.strip() == "", f"jobs left in the queue after one interrupt: {queue}"
        assert "Terminating processes on user request" in out.read_text()
    assert subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True).stdout == b"", "no processes left behind"


def _interruptible() -> None:
    """Snakemake with Ctrl-C's default action, as at a terminal: a process started in the background of a shell
    without job control (`cmd &` in a script) inherits SIGINT ignored, and Python then never turns it into
    KeyboardInterrupt, so the workflow would not see the interrupt at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _a_cell_job_runs(out: Path, env: dict[str, str]) -> bool:
    """The cell's finetune job was submitted and the queue shows a job running."""
    queue = subprocess.run(["squeue", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
    return "rule finetune" in out.read_text() and "RUNNING" in queue
