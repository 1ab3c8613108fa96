"""A cell cut by its wall-clock limit keeps its resume state; re-run, it resumes from it to the curve of an
uninterrupted run, and its MLflow run carries the whole curve.

The limit is reached deterministically: the worker stalls at a step (debug.stall_rank, far longer than any
test runs) and the supervisor's clock is moved past train.time_limit_s only once the heartbeat says it
stalled, so the cut falls between the resume state's step and the end whatever the host's speed.
"""

from __future__ import annotations

import time

import pytest
from conftest import one_cell, run_supervised

import tunegrid.run.supervisor as supervisor
from tunegrid.cell.loop.resume import RESUME_DIR
from tunegrid.runtime.files import read_json, read_jsonl, write_json

LIMIT_S = 10_000  # never reached by the real clock of a test
LORA = {"dropout": 0.1, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # dropout: the RNG must resume
TRAIN = {"steps": 8, "checkpoint_every": 3, "retries": 0, "time_limit_s": LIMIT_S, "heartbeat_timeout_s": LIMIT_S}


class _ClockPastLimitOnceStalled:
    """time.time() as the supervisor reads it: the real clock, plus the limit once the worker is stalled."""

    def __init__(self, heartbeat) -> None:  # type: ignore[no-untyped-def]
        self.heartbeat = heartbeat

    def time(self) -> float:
        stalled = self.heartbeat.exists() and "stalled" in self.heartbeat.read_text()
        return time.time() + (LIMIT_S + 1 if stalled else 0)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(time, name)


def _tracking(tmp_path, sqlite_store):  # type: ignore[no-untyped-def]
    from tunegrid.track.store import init_experiment

    store = sqlite_store(tmp_path / "mlflow.db")
    path = tmp_path / "tracking.json"
    experiment_id = init_experiment(store, "tunegrid/t", tmp_path / "mlartifacts")  # not the checkout's ./mlruns
    write_json(path, {"tracking_uri": store, "experiment_id": experiment_id})
    return path, store


@pytest.mark.slow  # three supervised cells, the first cut by its limit
def test_timed_out_cell_resumes_from_its_resume_state_to_the_uninterrupted_curve(
    checkpoints, dataset_path, tmp_path, monkeypatch, sqlite_store
):
    from mlflow.tracking import MlflowClient

    tracking, store = _tracking(tmp_path, sqlite_store)
    stalled = one_cell(
        model="qwen3moe-tiny", train=TRAIN, lora=LORA, debug={"stall_rank": {"rank": 0, "step": 5, "seconds": LIMIT_S}}
    )
    run_dir = tmp_path / "resumed" / stalled["cell_id"]
    with monkeypatch.context() as patched:
        patched.setattr(supervisor, "time", _ClockPastLimitOnceStalled(run_dir / "heartbeat"))
        first = run_supervised(stalled, checkpoints, dataset_path, run_dir, tracking=tracking)
    assert first["outcome"] == "timeout" and "wall-clock limit" in first["reason"], first["reason"]
    assert read_json(run_dir / RESUME_DIR / "meta.json")["step"] == 3, "the timeout kept the resume state"
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]

    # the user's re-run: the same cell with a longer limit (a new spec, so Snakemake re-runs it); the
    # limit and the stall hook are not training settings, so the resume state is the same cell's
    again = run_supervised(
        one_cell(model="qwen3moe-tiny", train={**TRAIN, "time_limit_s": 2 * LIMIT_S}, lora=LORA),
        checkpoints,
        dataset_path,
        run_dir,
        tracking=tracking,
    )
    assert again["outcome"] == "ok", again["reason"]
    assert again["resumed_from_step"] == 3
    assert not (run_dir / RESUME_DIR).exists()
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(8))

    plain_dir = tmp_path / "plain" / stalled["cell_id"]
    plain = run_supervised(
        one_cell(model="qwen3moe-tiny", train={**TRAIN, "checkpoint_every": 0}, lora=LORA),
        checkpoints,
        dataset_path,
        plain_dir,
    )
    assert plain["outcome"] == "ok" and plain["resumed_from_step"] is None
    reference = read_jsonl(plain_dir / "metrics.jsonl")
    for got, want in zip(resumed, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6), got["step"]
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9), got["step"]

    # MLflow: the re-run's run is the cell's one current run and holds the whole curve, the steps trained
    # before the timeout included (sent from metrics.jsonl); the timed-out run is superseded by it
    client = MlflowClient(store)
    current = again["tracking"]["run_id"]
    history = client.get_metric_history(current, "loss")
    assert sorted(m.step for m in history) == list(range(8))
    by_step = {m.step: m.value for m in history}
    for want in reference:
        assert by_step[want["step"]] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
    old = client.get_run(first["tracking"]["run_id"])
    assert old.data.tags.get("tunegrid.superseded_by") == current
    assert client.get_run(current).data.tags.get("resumed_from_step") == "3"
