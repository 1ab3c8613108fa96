"""The default study as a reviewer meets it in MLflow, through MLflow's own server (REST): the address the UI
prints opens the study's view (its current runs, failures first, the reviewer's columns), each run is named by
the axes that vary, a failed run says why and links to the runs that prove its fix, and a SIGTERM stops the UI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from urllib.parse import parse_qs, urlsplit

import pytest


def _get(base: str, endpoint: str) -> dict:
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/{endpoint}", timeout=30) as response:
        return json.loads(response.read())


def _post(base: str, endpoint: str, payload: dict) -> dict:
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{endpoint}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


@pytest.mark.slow
def test_the_printed_address_opens_a_comparison_of_the_studys_runs(default_study_clone, tmp_path):
    from tunegrid.run.ui import free_port

    study_dir = default_study_clone / "results" / "default"
    command = [sys.executable, "scripts/tunegrid.py", "mlflow-ui", "--tracking", str(study_dir / "tracking.json")]
    command += ["--host", "127.0.0.1", "--port", str(free_port()), "--log", str(tmp_path / "mlflow_ui.log")]
    ui = subprocess.Popen(command, cwd=default_study_clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed = ""
        while "MLflow UI:" not in printed:
            line = ui.stdout.readline()
            assert line, f"the UI ended before printing its address: {printed[-2000:]}"
            printed += line
        page = printed.split("MLflow UI: ", 1)[1].split()[0]
        base, fragment = page.split("/#", 1)
        path, query = fragment.split("?", 1)
        experiment_id = path.split("/")[2]
        assert path == f"/experiments/{experiment_id}/runs"
        params = {k: v[0] for k, v in parse_qs(query).items()}
        assert params["workflowType"] == "machine_learning" and params["compareRunsMode"] == "TABLE"
        assert "searchFilter" not in params and "orderByKey" not in params  # either would override the view
        assert urlsplit(base).hostname == "127.0.0.1"

        # the view the address names: its filter, sort and columns
        experiment = _get(base, f"experiments/get?experiment_id={experiment_id}")["experiment"]
        shared = {t["key"]: t["value"] for t in experiment["tags"]}[
            f"mlflow.sharedViewState.{params['viewStateShareKey']}"
        ]
        state = json.loads(json.loads(shared)["state"])
        columns = state["selectedColumns"]
        assert state["columnOrder"][0] == "attributes.`Run Name`"
        varying = ["model", "precision", "batch_size", "quant"]  # the default study's axes that vary
        assert [c for c in columns if c[6:-1] in (*varying, "seed", "world_size", "grad_accum")] == [
            f"tags.`{axis}`" for axis in varying
        ]
        for wanted in ("tags.`outcome`", "tags.`outcome.reason`", "metrics.`final_loss`", "metrics.`peak_bytes`"):
            assert wanted in columns
        for wanted in ("metrics.`tokens_per_s_median`", "metrics.`estimate_over_measured`", "metrics.`nan_step`"):
            assert wanted in columns
        order = f"{state['orderByKey']} {'ASC' if state['orderByAsc'] else 'DESC'}"
        runs = _post(
            base,
            "runs/search",
            {
                "experiment_ids": [experiment_id],
                "filter": state["searchFilter"],
                "order_by": [order],
                "max_results": 100,
            },
        )["runs"]
        outcomes = [_tags(r)["outcome"] for r in runs]
        assert len(runs) == 34 and outcomes[:4] == ["nan"] * 4 and set(outcomes[4:]) == {"ok"}  # failures first

        # names: the outcome, then the axes that vary, whole; one name per cell
        names = [r["info"]["run_name"] for r in runs]
        assert len(set(names)) == 34
        for run, name in zip(runs, names):
            tags = _tags(run)
            assert name.startswith(f"{tags['outcome']} · ")
            assert all(part in name.split(" · ")[1].split("_") for part in (tags["model"], tags["precision"]))
            assert f"bs{tags['batch_size']}" in name and name.endswith(tags["quant"])

        # a failed run says why: its first tag, its description, metrics a chart can place, no float max
        failing = runs[0]
        tags = _tags(failing)
        assert failing["data"]["tags"][0]["key"] == "diagnosis"
        assert tags["diagnosis"] == f"nan: {tags['outcome.reason']}"
        note = tags["mlflow.note.content"]
        assert note.startswith(f"**nan**: {tags['outcome.reason']}") and "model.layers.0.mlp.down_proj" in note
        metrics = {m["key"]: m["value"] for m in failing["data"]["metrics"]}
        assert metrics["nan_step"] == 0 and metrics["nonfinite"] >= 1 and "peak_bytes" in metrics
        every_value = [m["value"] for r in runs for m in r["data"]["metrics"]]
        assert not [v for v in every_value if isinstance(v, float) and abs(v) > 1e300]

        # links: the failing run to its twins that prove the fix, and back
        by_id = {r["info"]["run_id"]: r for r in runs}
        fixes = tags["fixed_by"].split(",")
        assert len(fixes) >= 2 and "[Compare it with them](#/compare-runs?runs=" in note
        for run_id in fixes:
            twin = _tags(by_id[run_id])
            assert twin["outcome"] == "ok" and twin["precision"] != tags["precision"]
            assert (twin["model"], twin["batch_size"], twin["quant"]) == (
                tags["model"],
                tags["batch_size"],
                tags["quant"],
            )
            assert f"(#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning)" in note
            assert failing["info"]["run_id"] in twin["proves_fix_of"].split(",")

        # params: the axes and the settings that vary; the rest once, on the study run
        params_of = [{p["key"]: p["value"] for p in r["data"].get("params", [])} for r in runs]
        settings = {k for p in params_of for k in p if not k.startswith("audit.")}  # the audit: measured, at the end
        assert all(len({p.get(k) for p in params_of}) > 1 for k in settings), "a setting every cell shares"
        (study,) = _post(base, "runs/search", {"experiment_ids": [experiment_id], "filter": "tags.kind = 'study'"})[
            "runs"
        ]
        assert {p["key"] for p in study["data"]["params"]} >= {"train.lr", "lora.r", "axes.seed"}
    finally:
        ui.send_signal(signal.SIGTERM)
        out, _ = ui.communicate(timeout=60)
    assert ui.returncode == 0 and "MLflow UI stopped" in out and "Traceback" not in out, out[-3000:]
