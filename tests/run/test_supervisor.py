"""The finetune job end to end without Snakemake: child process, timeouts, MLflow, result.json."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from conftest import one_cell, one_cell_spec, processes_mentioning, run_supervised

from tunegrid.run.supervisor import compose_result
from tunegrid.runtime.files import read_json, read_jsonl, write_json
from tunegrid.track.store import client, init_experiment
from tunegrid.track.tracking import CELL_TAG, metrics_from_records, sync_cell


def _spec(model="qwen3moe-tiny", train=None):
    return one_cell(model=model, quant="nf4", train={"steps": 4, **(train or {})})


def _store(tmp_path: Path, sqlite_store) -> tuple[str, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    uri = sqlite_store(tmp_path / "mlflow.db")
    experiment_id = init_experiment(uri, "tunegrid/t", tmp_path / "artifacts")
    tracking = tmp_path / "tracking.json"
    write_json(
        tracking,
        {
            "tracking_uri": uri,
            "experiment_id": experiment_id,
            "experiment_name": "tunegrid/t",
            "system_metrics_interval_s": 0.5,
        },
    )
    return uri, tracking


def _run(spec, checkpoints, dataset_path, tmp_path, tracking=None, capabilities=None):
    run_dir = tmp_path / "runs" / spec["cell_id"]
    return run_supervised(
        spec, checkpoints, dataset_path, run_dir, tracking=tracking, capabilities=capabilities
    ), run_dir


@pytest.mark.slow
def test_cell_run_is_in_mlflow_with_every_metric_point(checkpoints, dataset_path, tmp_path, sqlite_store):
    uri, tracking = _store(tmp_path, sqlite_store)
    spec = _spec()
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path, tracking)
    assert result["outcome"] == "ok", result["reason"]
    assert read_json(run_dir / "result.json")["outcome"] == "ok"
    c = client(uri)
    run = c.get_run(result["tracking"]["run_id"])
    assert run.info.run_name == f"ok · {spec['cell_id']}" and run.info.status == "FINISHED"
    # MLflow's own system-metrics monitor sampled the host while the cell ran
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    assert run.data.tags["outcome"] == "ok" and run.data.tags["precision"] == "fp32" and run.data.tags["quant"] == "nf4"
    assert run.data.params["train.steps"] == "4"
    assert int(run.data.params["audit.after_load.role.experts_bytes"]) > 0  # the audit, as params
    assert float(run.data.tags["audit.flagged_share"]) > 0
    assert "audit.json" in {a.path for a in c.list_artifacts(run.info.run_id)}
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert len(c.get_metric_history(run.info.run_id, "loss")) == len(records) == 4
    assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {"result.json", "metrics.jsonl"}
    adapter_files = {a.path for a in c.list_artifacts(run.info.run_id, "adapter")}
    assert {
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "adapter/base_model.json",
    } <= adapter_files
    assert result["adapter"]["base_model"]["manifest_sha256"] and result["training"]["reference_batch_loss"] > 0
    (dataset,) = run.inputs.dataset_inputs  # the training set is the run's dataset input, with its size
    profile = json.loads(dataset.dataset.profile)
    assert dataset.dataset.name == "synthetic:generated" and len(dataset.dataset.digest) == 16
    assert profile["examples"] == result["data"]["examples"] > 0 and profile["tokens"] == result["data"]["tokens"] > 0
    assert {t.key: t.value for t in dataset.tags}["mlflow.data.context"] == "training"

    # running the same cell again leaves exactly one current run, and says which one replaced it
    again, _ = _run(spec, checkpoints, dataset_path, tmp_path, tracking)
    active = c.search_runs([run.info.experiment_id], filter_string=f"tags.`{CELL_TAG}` = '{spec['cell_id']}'")
    assert [r.info.run_id for r in active] == [again["tracking"]["run_id"]]
    old = c.get_run(run.info.run_id)
    assert old.info.lifecycle_stage == "deleted"
    assert old.data.tags["tunegrid.superseded_by"] == again["tracking"]["run_id"]


def test_wall_clock_limit_ends_as_timeout_without_orphans(checkpoints, dataset_path, tmp_path):
    spec = _spec(train={"time_limit_s": 2, "steps": 1000})
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path)
    assert result["outcome"] == "timeout"
    assert "wall-clock limit" in result["reason"]
    # cut by the limit, not by the work: far from its 1000 steps (no figure of this host's speed asserted)
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) < 1000
    assert processes_mentioning(run_dir) == []


def test_killed_worker_is_an_error_with_the_signal(tmp_path):
    spec = one_cell_spec(model="qwen3moe-tiny", quant="nf4", train={"steps": 4})
    plan = {"estimate": {"estimate_bytes": 1, "components": {}}, "budget_bytes": None, "target": None}
    result = compose_result(spec, plan, tmp_path, -9, None, time.time(), ["x"])
    assert result["outcome"] == "error"
    assert "SIGKILL" in result["reason"]


@pytest.mark.slow
def test_store_down_training_goes_on_and_sync_fills_the_run(checkpoints, dataset_path, tmp_path, sqlite_store):
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracking = tmp_path / "tracking.json"
    write_json(tracking, {"tracking_uri": f"http://127.0.0.1:{port}", "experiment_id": "1", "experiment_name": "x"})
    spec = _spec()
    result, run_dir = _run(spec, checkpoints, dataset_path, tmp_path, tracking)
    assert result["outcome"] == "ok"
    assert result["tracking"]["run_id"] is None and result["tracking"]["errors"]
    uri, _ = _store(tmp_path / "later", sqlite_store)
    experiment_id = client(uri).get_experiment_by_name("tunegrid/t").experiment_id
    synced = sync_cell(uri, experiment_id, result, run_dir, None)
    assert synced["created"]
    # 4 steps x 8 metrics (loss, grad_norm, lr, tokens_per_s, step_time_s, local_time_s, mem_peak_bytes, skipped_steps)
    assert synced["points_filled"] == len(metrics_from_records(read_jsonl(run_dir / "metrics.jsonl"))) == 4 * 8
    run = client(uri).get_run(synced["run_id"])
    assert run.data.tags["outcome"] == "ok"
    assert run.info.run_name == f"ok · {spec['cell_id']}" and run.info.status == "FINISHED", "as a live run ends"
    assert len(client(uri).get_metric_history(run.info.run_id, "loss")) == 4
    # a nan cell's run made from the files ends FAILED and named by its outcome too
    nan = {**result, "outcome": "nan", "cell": {**result["cell"], "cell_id": "nan-cell"}}
    failed = client(uri).get_run(sync_cell(uri, experiment_id, nan, run_dir, None)["run_id"])
    assert failed.info.status == "FAILED" and failed.info.run_name == "nan · nan-cell"
    # a second sync finds nothing missing
    assert (
        sync_cell(uri, experiment_id, {**result, "tracking": {"run_id": synced["run_id"]}}, run_dir, None)[
            "points_filled"
        ]
        == 0
    )


@pytest.mark.slow
def test_a_cell_that_did_not_end_ok_ends_its_run_failed_and_named_by_outcome(
    checkpoints, dataset_path, tmp_path, sqlite_store
):
    uri, tracking = _store(tmp_path, sqlite_store)
    spec = one_cell(debug={"inject_nonfinite": {"module": "model.layers.0.mlp", "step": 1, "phase": "forward"}})
    result, _ = _run(spec, checkpoints, dataset_path, tmp_path, tracking)
    assert result["outcome"] == "nan", result["reason"]
    run = client(uri).get_run(result["tracking"]["run_id"])
    assert run.info.status == "FAILED", "the UI marks it red"
    assert run.info.run_name == f"nan · {spec['cell_id']}" and run.data.tags["outcome"] == "nan"
    assert "system/cpu_utilization_percentage" in run.data.metrics
