"""The whole DAG through Snakemake on a tiny study, checked through the MLflow client."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from conftest import REPO, make_study

from tunegrid.files import read_json, read_jsonl
from tunegrid.tracking import CELL_TAG, client

pytestmark = pytest.mark.slow


def _snakemake(workdir, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def test_lint_is_clean():
    proc = _snakemake(REPO, "--lint", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_tiny_study_end_to_end(tmp_path):
    grid = {"model": ["gemma3-hot", "qwen3moe-tiny"], "precision": ["fp32", "fp16"], "batch_size": [2, 4], "quant": ["nf4"], "seed": [0]}
    study = make_study(study="e2e", grid=grid, train={"steps": 4, "seq_len": 32, "lr": 0.01})
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))

    proc = _snakemake(tmp_path, "all", "--cores", "2", "--configfile", str(config))
    assert proc.returncode == 0, proc.stderr[-4000:]

    results = tmp_path / "results" / "e2e"
    summary = pd.read_parquet(results / "summary.parquet")
    assert len(pd.read_csv(results / "summary.csv", keep_default_na=False)) == len(summary)
    assert len(summary) == 8
    assert set(summary["outcome"]) <= {"ok", "nan"}
    assert summary.loc[summary.precision == "fp32", "outcome"].eq("ok").all()
    assert (tmp_path / "results" / "logs" / "e2e" / "finetune").is_dir()
    env = read_json(results / "env" / "environment.json")
    assert env["packages"]["torch"] and env["bitsandbytes"]["nf4_runs"] is True
    probe = read_json(results / "probe" / "capabilities.json")
    assert probe["device"] == "cpu" and probe["precision"]["fp32"] == "native"

    c = client(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    experiment = c.get_experiment_by_name("tunegrid/e2e")
    runs = c.search_runs([experiment.experiment_id], max_results=100)
    by_cell = {r.data.tags[CELL_TAG]: r for r in runs if CELL_TAG in r.data.tags}
    probe_runs = [r for r in runs if r.data.tags.get("kind") == "probe"]
    assert len(probe_runs) == 1 and probe["mlflow_run_id"] == probe_runs[0].info.run_id
    assert set(by_cell) == set(summary["cell_id"])
    for cell_id, run in by_cell.items():
        row = summary.set_index("cell_id").loc[cell_id]
        assert run.info.run_name == cell_id
        assert run.data.tags["outcome"] == row["outcome"]
        for axis in ("model", "precision", "batch_size", "quant", "seed"):
            assert run.data.tags[axis] == str(row[axis])
        assert run.data.params["lora.r"] == "8"
        assert run.data.tags["probe.run_id"] == probe["mlflow_run_id"]
        assert 0.85 <= row["estimate_over_measured"] <= 1.15 or row["outcome"] != "ok"
        steps = len(read_jsonl(results / "runs" / cell_id / "metrics.jsonl"))
        assert len(c.get_metric_history(run.info.run_id, "loss")) == steps == row["steps_run"]
        assert row["mlflow_run_id"] == run.info.run_id

    # nothing left to do: a second invocation runs no job
    again = _snakemake(tmp_path, "all", "-n", "--cores", "2", "--configfile", str(config))
    assert "Nothing to be done" in again.stdout + again.stderr
