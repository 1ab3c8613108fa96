"""A failed run that says why, and the study's runs page as a comparison table: the diagnosis first, non-finite
values a chart can place, params that tell the cells apart, links from a failing run to the runs that prove its
fix, and the view the printed address opens."""

from __future__ import annotations

import json
import math

from tunegrid.outcome import CellResult
from tunegrid.track.diagnosis import (
    DIAGNOSIS_TAG,
    FAILED_TAG,
    FIXED_BY_TAG,
    NOTE_TAG,
    PROVES_TAG,
    RUNNING,
    description,
    fix_links,
    result_metrics,
)
from tunegrid.track.params import split_params
from tunegrid.track.records import NONFINITE_KEY, step_metrics
from tunegrid.track.tracking import CELL_TAG


def _axes(precision, batch, quant):
    return {"model": "m", "precision": precision, "batch_size": batch, "quant": quant, "seed": 0}


def _result(cell_id, outcome, reason, axes, **extra):
    return {
        "cell_id": cell_id,
        "outcome": outcome,
        "reason": reason,
        "cell": {"cell_id": cell_id, "axes": axes},
        **extra,
    }


NAN = {
    "nan": {
        "step": 0,
        "kind": "loss_nonfinite",
        "origin": {"forward": {"module": "model.layers.0.mlp.down_proj", "at": "real"}, "backward": None},
    }
}
CELLS = {
    "m_fp16_bs2_nf4_s0": _result(
        "m_fp16_bs2_nf4_s0",
        "nan",
        "loss_nonfinite at step 0, first non-finite at model.layers.0.mlp.down_proj; stopped after 1 of 30 steps",
        _axes("fp16", 2, "nf4"),
        diagnosis=NAN,
        memory={"peak_bytes": 4e8, "estimate_over_measured": 1.0},
        training={"final_loss": None},
    ),
    "m_fp32_bs2_nf4_s0": _result(
        "m_fp32_bs2_nf4_s0",
        "ok",
        "trained all 30 steps with finite loss",
        _axes("fp32", 2, "nf4"),
        training={"final_loss": 9.7},
        throughput={"tokens_per_s_median": 4400.0},
    ),
    "m_fp32_bs8_nf4_s0": _result(
        "m_fp32_bs8_nf4_s0", "ok", "trained all 30 steps with finite loss", _axes("fp32", 8, "nf4")
    ),
    "m_fp16_bs8_nf4_s0": _result(
        "m_fp16_bs8_nf4_s0", "oom", "out of memory in the first step", _axes("fp16", 8, "nf4")
    ),
}
RECOMMENDATIONS = [
    {
        "failing": ["m_fp16_bs2_nf4_s0"],
        "fixes": [{"change": {"precision": "fp32"}, "evidence": ["m_fp32_bs2_nf4_s0", "m_fp32_bs8_nf4_s0"]}],
    }
]


def test_an_infinity_is_never_sent_and_a_chart_shows_where_non_finite_values_began():
    records = [
        {"step": 0, "time": 1.0, "loss": 2.0, "fp16_headroom_max_ratio": 0.5},
        {"step": 1, "time": 2.0, "loss": "nan", "grad_norm": "nan", "fp16_headroom_max_ratio": "inf"},
    ]
    metrics = step_metrics(records)
    assert all(not math.isinf(m.value) for m in metrics)  # MLflow would keep inf as the largest float
    by_step = {(m.key, m.step): m.value for m in metrics}
    assert (("fp16_headroom_max_ratio", 1)) not in by_step and math.isnan(by_step[("loss", 1)])
    assert by_step[(NONFINITE_KEY, 0)] == 0 and by_step[(NONFINITE_KEY, 1)] == 3


def test_the_cell_figures_are_finite_run_metrics():
    figures = result_metrics({**CELLS["m_fp16_bs2_nf4_s0"], "throughput": {"tokens_per_s_median": float("inf")}})
    assert figures == {"peak_bytes": 4e8, "estimate_over_measured": 1.0, "nan_step": 0.0}


def test_params_are_the_axes_and_settings_that_vary_the_rest_is_the_study_runs():
    specs = [
        {"study": "s", "cell_id": f"m{i}", "axes": {"model": f"m{i}", "seed": 0}, "model": {"init": i}, "lr": 1e-4}
        for i in range(3)
    ]
    cell, common = split_params(specs[1], specs)
    assert cell == {"cell_id": "m1", "axes.model": "m1", "model.init": "1"}
    assert common == {"study": "s", "axes.seed": "0", "lr": "0.0001"}
    assert split_params(specs[1], []) == ({**cell, **common}, {})  # a cell run by hand: everything is its own


def test_a_failing_cell_links_to_its_twin_that_proves_the_fix():
    links = fix_links(RECOMMENDATIONS, {cell: r["cell"]["axes"] for cell, r in CELLS.items()})
    assert links == {"m_fp16_bs2_nf4_s0": [("precision fp32", "m_fp32_bs2_nf4_s0")]}  # the twin, not bs8


def test_the_description_says_why_and_links_the_fix():
    text = description(
        CellResult.from_json(CELLS["m_fp16_bs2_nf4_s0"]), "7", [("precision fp32", "abc", "ok · fp32_bs2")]
    )
    assert text.startswith("**nan**: loss_nonfinite at step 0")
    assert "`model.layers.0.mlp.down_proj`" in text and "step 0, loss_nonfinite" in text
    assert "[ok · fp32_bs2](#/experiments/7/runs/abc?workflowType=machine_learning)" in text


def test_the_store_holds_the_diagnosis_first_the_links_and_the_view(tmp_path, sqlite_store):
    from tunegrid.track.current import mark_current
    from tunegrid.track.store import client, init_experiment
    from tunegrid.track.tags import axis_tags, run_name, run_tags
    from tunegrid.track.tracking import CellRun
    from tunegrid.track.view import VIEW_KEY, VIEW_TAG, publish_review, runs_view

    uri = sqlite_store(tmp_path / "mlflow.db")
    experiment = init_experiment(uri, "tunegrid/s", tmp_path / "artifacts")
    runs = {}
    for cell, result in CELLS.items():
        run = CellRun(uri, experiment)
        run.start(cell, axis_tags(result["cell"]["axes"]), {"cell_id": cell})
        assert run.client.get_run(run.run_id).data.tags[DIAGNOSIS_TAG] == RUNNING
        tags = run_tags({**result, "env": {}, "diagnosis": result.get("diagnosis", {})})
        run.finish(tags, [], result["outcome"] != "ok", name=run_name(result["outcome"], cell, CELLS))
        runs[cell] = run.run_id
    mark_current(uri, experiment, runs)
    review = publish_review(uri, experiment, list(CELLS.values()), RECOMMENDATIONS)
    assert review == {"runs": 4, "failing_linked": 1, "view": VIEW_KEY}

    c = client(uri)
    failing = c.get_run(runs["m_fp16_bs2_nf4_s0"])
    assert failing.info.run_name == "nan · fp16_bs2"
    assert next(iter(failing.data.tags)) == DIAGNOSIS_TAG  # the first tag MLflow lists
    assert failing.data.tags[DIAGNOSIS_TAG].startswith("nan: loss_nonfinite at step 0")
    assert failing.data.tags[FAILED_TAG] == "yes" and failing.data.tags[FIXED_BY_TAG] == runs["m_fp32_bs2_nf4_s0"]
    assert f"(#/experiments/{experiment}/runs/{runs['m_fp32_bs2_nf4_s0']}?" in failing.data.tags[NOTE_TAG]
    fix = c.get_run(runs["m_fp32_bs2_nf4_s0"]).data.tags
    assert fix[PROVES_TAG] == runs["m_fp16_bs2_nf4_s0"] and "Proves the fix of" in fix[NOTE_TAG]

    shared = json.loads(c.get_experiment(experiment).tags[VIEW_TAG])
    state = json.loads(shared["state"])
    assert state["searchFilter"] == "tags.`tunegrid.current` = 'yes'"
    assert state["orderByKey"] == "tags.`failed`" and state["orderByAsc"] is False
    axes = [
        col for col in state["selectedColumns"] if col.startswith("tags.`") and col[6:-1] in CELLS[cell]["cell"]["axes"]
    ]
    assert axes == ["tags.`precision`", "tags.`batch_size`"]  # the axes that vary, and only those
    assert state["columnOrder"][0] == "attributes.`Run Name`" and "metrics.`final_loss`" in state["selectedColumns"]
    page = runs_view("http://127.0.0.1:5000", experiment)
    assert "workflowType=machine_learning" in page and f"viewStateShareKey={VIEW_KEY}" in page
    assert "searchFilter" not in page and "orderByKey" not in page  # either would override the view's own
    assert c.search_runs([experiment], f"tags.`{CELL_TAG}` != ''", max_results=10)
