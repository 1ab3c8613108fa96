"""Multi-process cells on CPU (gloo): DDP training, a stalled rank, a killed rank, no orphans."""

from __future__ import annotations

import re
import time

import pytest
from conftest import REPO, one_cell, processes_mentioning, run_supervised

from tunegrid.runtime.files import read_json
from tunegrid.study.config import ConfigError


def _spec(world=2, train=None, debug=None, distributed=None, precision="fp32"):
    return one_cell(
        model="qwen3moe-tiny",
        precision=precision,
        world=world,
        train={"steps": 4, "threads": 1, **(train or {})},
        debug=debug or {},
        distributed=distributed or {},
    )


def _run(spec, checkpoints, dataset_path, tmp_path):
    run_dir = tmp_path / "runs" / spec["cell_id"]
    return run_supervised(spec, checkpoints, dataset_path, run_dir), run_dir


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["forked", "spawned"])  # a local study's ranks, and a cluster's or a GPU's
def test_two_rank_gloo_cell_trains_with_identical_lora_weights(checkpoints, dataset_path, tmp_path, capfd, worker):
    spec = _spec()
    assert spec["cell_id"].endswith("_ws2")
    run_dir = tmp_path / "runs" / spec["cell_id"]
    result = run_supervised(spec, checkpoints, dataset_path, run_dir, worker=worker)
    assert result["outcome"] == "ok", result["reason"]
    forks = re.findall(r"rank (\d): worker \d+ forked by the warm worker", capfd.readouterr().out)
    assert forks == (["0", "1"] if worker == "forked" else [])
    assert result["memory"]["estimate_worker"] == worker  # the estimate of the path the ranks took
    for rank in (0, 1):  # each rank's output in its own log, whichever way it started
        assert "precision=fp32 on cpu" in (run_dir / "ranks" / f"rank{rank}.log").read_text()
    assert result["distributed"]["lora_identical"] is True
    assert [r["exit_code"] for r in result["ranks"]] == [0, 0]
    assert result["ranks"][0]["lora_sha256"] == result["ranks"][1]["lora_sha256"]
    assert read_json(run_dir / "worker.json")["distributed"] == {
        "backend": "gloo",
        "world_size": 2,
        "collective_timeout_s": 600,
    }
    assert result["training"]["steps_run"] == 4
    assert processes_mentioning(run_dir) == []


@pytest.mark.slow
def test_stalled_rank_is_a_collective_timeout_naming_the_rank(checkpoints, dataset_path, tmp_path):
    timeout_s = 4
    spec = _spec(
        debug={"stall_rank": {"rank": 1, "step": 2, "seconds": 120}},
        distributed={"collective_timeout_s": timeout_s, "exit_grace_s": 2},
    )
    started = time.time()
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path)
    took = time.time() - started
    assert result["outcome"] == "timeout", result["reason"]
    collective = result["diagnosis"]["collective"]
    assert collective["missing_ranks"] == [1] and collective["waiting_ranks"] == [0]
    assert collective["op"] == "ALLREDUCE" and collective["step"] == 2 and collective["timeout_s"] == timeout_s
    assert collective["last_step_per_rank"] == {0: 2, 1: 2}
    assert "rank(s) 1 did not arrive" in result["reason"]
    # start-up (~15 s for two ranks on 2 cores) + 2 steps + the timeout + grace, far below the 120 s stall
    assert took < 60, took
    assert result["ranks"][1]["stopped_by_supervisor"] is True
    assert processes_mentioning(run_dir) == []


@pytest.mark.slow
def test_killed_rank_is_an_error_with_its_signal_and_log(checkpoints, dataset_path, tmp_path):
    spec = _spec(debug={"kill_rank": {"rank": 1, "step": 1}}, distributed={"exit_grace_s": 2}, train={"retries": 1})
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path)
    assert result["outcome"] == "error", result["reason"]
    # an infrastructure fault is retried once (the count is recorded), then the cell ends error: no loop
    assert [a["infrastructure"] for a in result["attempts"]] == [True, True]
    crash = result["diagnosis"]["rank_crash"]
    assert crash["ranks"] == [1] and crash["exit"] == "killed by SIGKILL" and crash["last_step"] == 1
    assert crash["last_log_lines"], "the dead rank's last log lines are kept"
    assert result["reason"].startswith("rank 1 died (killed by SIGKILL) at step 1")
    assert processes_mentioning(run_dir) == []


def test_fault_injection_rank_must_exist():
    with pytest.raises(ConfigError, match=r"debug.kill_rank.rank.*at most 2"):
        _spec(debug={"kill_rank": {"rank": 2, "step": 0}})


@pytest.mark.slow
def test_a_rank_that_fails_on_its_own_is_named_with_its_error_and_never_retried(checkpoints, dataset_path, tmp_path):
    spec = _spec(
        debug={"inject_nonfinite": {"module": "no.such.module", "step": 1}},
        train={"retries": 1},
        distributed={"exit_grace_s": 2},
    )
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path)
    assert result["outcome"] == "error"
    assert "no.such.module" in result["reason"] and result["reason"].startswith("rank ")
    failure = result["diagnosis"]["rank_failure"]
    assert "no.such.module" in failure["traceback"]
    assert len(result["attempts"]) == 1  # deterministic: the same settings fail the same way
    assert processes_mentioning(run_dir) == []


def test_more_ranks_than_gpus_is_unsupported_before_launch(checkpoints, dataset_path, tmp_path):

    capabilities = REPO / "tests" / "data" / "capabilities-h100.json"  # recorded on a one-GPU machine
    spec = _spec(world=2)
    spec["hardware"]["gpus_per_rank"] = 1
    run_dir = tmp_path / "runs" / spec["cell_id"]
    result = run_supervised(spec, checkpoints, dataset_path, run_dir, capabilities=capabilities)
    assert result["outcome"] == "unsupported"
    assert "needs 2 GPUs" in result["reason"] and "1 present" in result["reason"]
    assert not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
def test_ranks_stop_together_when_only_one_ranks_loss_goes_nonfinite(checkpoints, dataset_path, tmp_path):
    """fp16, two ranks, an overflow in rank 1's forward only: rank 1's loss is non-finite (it stops), rank 0's
    loss is finite and the all-reduced gradient makes its step a GradScaler skip (alone, it would go on and
    wait in the next all-reduce). The decision is collective: both stop at that step, the cell ends `nan`
    with rank 1's event and origin."""
    module = "model.layers.0.self_attn.o_proj"
    spec = _spec(
        debug={"inject_nonfinite": {"module": module, "step": 1, "rank": 1}},
        train={"steps": 4, "on_nonfinite": "stop_after_skips"},
        distributed={"collective_timeout_s": 30, "exit_grace_s": 2},
        precision="fp16",
    )
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path)
    assert result["outcome"] == "nan", result["reason"]
    assert result["diagnosis"]["decided_by_rank"] == 1 and result["reason"].startswith("rank 1: loss_nonfinite")
    assert result["diagnosis"]["nan"]["origin"]["forward"]["module"].endswith(module)
    assert [r["exit_code"] for r in result["ranks"]] == [0, 0]  # nobody waited for a peer that had left
    assert [r["last_step"] for r in result["ranks"]] == [1, 1]
    assert read_json(run_dir / "worker.json")["diagnosis"]["stopped_by_peer"] == {"step": 1}
    assert len(result["attempts"]) == 1
