"""What MLflow refuses of a cell's record costs only itself: the run still ends with its outcome tag, its
`<outcome> · <cell_id>` name and its status, the other params land, and the refused keys are named (a real
sqlite store, MLflow's own validators)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tunegrid.outcome import Outcome
from tunegrid.track.records import flatten
from tunegrid.track.refusals import REFUSED_TAG
from tunegrid.track.store import client, init_experiment
from tunegrid.track.tags import result_params, run_name, run_tags
from tunegrid.track.tracking import CellRun, sync_cell

RESULT = Path(__file__).resolve().parents[1] / "data" / "result-a7de793-gemma3-tiny_fp16_bs8_nf4_s0.json"
BAD_ROLE = "lm_head{tied}"  # braces: a character MLflow forbids in a param name
SECRET = "s3cretVALUE"  # inside the too-long value: a refusal names the key, never the value


@pytest.fixture
def store(tmp_path, monkeypatch, sqlite_store):
    monkeypatch.delenv("TUNEGRID_EXECUTION_ID", raising=False)
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")  # over the limit is refused, not cut
    uri = sqlite_store(tmp_path / "mlflow.db")
    return uri, init_experiment(uri, "refusals", tmp_path / "art")


def _result(outcome: str) -> dict:
    result = json.loads(RESULT.read_text())
    result["outcome"] = outcome
    result.pop("tracking", None)
    result["cell"] = copy.deepcopy(result["cell"])
    # over MLflow's MAX_PARAM_VAL_LENGTH (6000), in a key the spec holds (one it holds not is refused on reading)
    result["cell"]["data"]["path"] = SECRET + "x" * 7000
    result["quant_audit"]["after_load"]["by_role"][BAD_ROLE] = 123
    return result


def _check(uri: str, run_id: str, result: dict, capsys) -> None:
    run = client(uri).get_run(run_id)
    cell_id = result["cell"]["cell_id"]
    expected = "FINISHED" if result["outcome"] == Outcome.OK else "FAILED"
    assert run.info.status == expected
    assert run.info.run_name == f"{result['outcome']} · {cell_id}"
    assert run.data.tags["outcome"] == result["outcome"] and run.data.tags["tunegrid.status"] == "done"
    params = run.data.params
    assert "data.path" not in params and f"audit.after_load.role.{BAD_ROLE}_bytes" not in params
    assert params["lora.r"] == str(result["cell"]["lora"]["r"]), "the batch's other params landed"
    assert params["audit.after_load.total_bytes"] == str(result["quant_audit"]["after_load"]["total_bytes"])
    refused = run.data.tags[REFUSED_TAG]
    assert "param data.path" in refused and f"param audit.after_load.role.{BAD_ROLE}_bytes" in refused
    out = capsys.readouterr().out
    assert "MLflow refused 'param data.path'" in out, "the cell's log names what was refused"
    assert SECRET not in refused and SECRET not in out, "a refusal never shows the value"


@pytest.mark.parametrize("outcome", ["nan", "ok"])
def test_live_run_ends_with_its_verdict_when_mlflow_refuses_params(store, capsys, outcome):
    uri, experiment_id = store
    result = _result(outcome)
    cell_id = result["cell"]["cell_id"]
    run = CellRun(uri, experiment_id)
    run.start(cell_id, {"study": result["cell"]["study"]}, flatten("", result["cell"], {}))
    run.log_records([{"step": 0, "time": 1.0, "loss": 2.5}])
    run.finish(
        run_tags(result),
        [],
        failed=outcome != Outcome.OK,
        params=result_params(result),
        name=run_name(outcome, cell_id),
    )
    assert run.errors == [] and not run.down, "a refusal is not an outage"
    _check(uri, run.run_id, result, capsys)
    assert [m.value for m in client(uri).get_metric_history(run.run_id, "loss")] == [2.5]


def test_sync_creates_the_run_with_its_verdict_when_mlflow_refuses_params(store, tmp_path, capsys):
    uri, experiment_id = store
    result = _result("nan")
    run_dir = tmp_path / "results" / "s" / "runs" / result["cell"]["cell_id"]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "loss": 2.5}) + "\n")
    synced = sync_cell(uri, experiment_id, result, run_dir, None)
    assert synced["created"] and synced["errors"] == [] and synced["points_filled"] == 1
    assert "param data.path" in synced["refused"]
    _check(uri, synced["run_id"], result, capsys)


def test_a_param_the_store_refuses_after_the_check_costs_only_itself(store, capsys):
    """MLflow refuses a param logged again with another value only in the store: the batch is sent again
    item by item, and the run still ends with its verdict."""
    uri, experiment_id = store
    run = CellRun(uri, experiment_id)
    run.start("c", {}, {"lr": "0.1"})
    run.finish({"outcome": "oom"}, [], failed=True, params={"lr": "0.2", "steps": "3"}, name="oom · c")
    stored = client(uri).get_run(run.run_id)
    assert stored.info.status == "FAILED" and stored.info.run_name == "oom · c"
    assert stored.data.params == {"lr": "0.1", "steps": "3"} and stored.data.tags["outcome"] == "oom"
    assert stored.data.tags[REFUSED_TAG] == "param lr" and "0.2" not in capsys.readouterr().out


def test_sync_ends_a_live_run_left_open_without_its_verdict(store, tmp_path):
    """The cell's supervisor opened its run but never ended it (the store failed at the end): the sync gives
    it its outcome, name and status from result.json, and leaves an ended run as it is."""
    uri, experiment_id = store
    result = _result("nan")
    cell_id = result["cell"]["cell_id"]
    live = CellRun(uri, experiment_id)
    live.start(cell_id, {}, {"lr": "0.1"})
    result["tracking"] = {"run_id": live.run_id}
    run_dir = tmp_path / "results" / "s" / "runs" / cell_id
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "loss": 2.5}) + "\n")
    synced = sync_cell(uri, experiment_id, result, run_dir, None)
    assert synced["run_id"] == live.run_id and not synced["created"] and synced["completed"]
    run = client(uri).get_run(live.run_id)
    assert run.info.status == "FAILED" and run.info.run_name == f"nan · {cell_id}"
    assert run.data.tags["outcome"] == "nan" and synced["points_filled"] == 1
    again = sync_cell(uri, experiment_id, result, run_dir, None)
    assert not again["completed"] and again["points_filled"] == 0
