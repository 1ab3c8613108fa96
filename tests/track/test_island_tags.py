"""An fp16-islands cell's MLflow run says which modules computed in fp32 and what the calibration measured."""

from __future__ import annotations

from tunegrid.track.tags import run_tags


def test_islands_and_their_measured_maxima_are_run_tags():
    islands = {
        "mode": "auto",
        "modules": [
            {"module": "model.layers.0.mlp.down_proj", "max_abs": 73398.2, "ratio_to_fp16_max": 1.12},
            {"module": "model.layers.1.mlp.down_proj", "max_abs": 52060.4, "ratio_to_fp16_max": 0.79},
        ],
    }
    result = {
        "cell_id": "g_fp16-islands_bs2_none_s0",
        "cell": {"axes": {"model": "g", "precision": "fp16-islands", "batch_size": 2, "quant": "none", "seed": 0}},
        "outcome": "ok",
        "reason": "trained",
        "env": {"device": "cpu"},
        "fp32_islands": islands,
    }
    tags = run_tags(result)
    assert tags["fp32_islands"] == "model.layers.0.mlp.down_proj,model.layers.1.mlp.down_proj"
    assert tags["fp32_islands.max_abs"] == "73398,52060" and tags["fp32_islands.mode"] == "auto"
    assert "fp32_islands" not in run_tags({**result, "fp32_islands": None})


def test_a_model_spec_keyed_by_globs_is_one_param_mlflow_accepts():
    """init_scale's keys ("*.mlp.*") are no MLflow param names: refused, they failed every param of the run."""
    from tunegrid.track.records import PARAM_NAME, flatten

    params = flatten("", {"model": {"init_scale": {"*.mlp.*": 10}, "config": {"hidden_size": 64}}}, {})
    assert params == {"model.init_scale": '{"*.mlp.*": 10}', "model.config.hidden_size": "64"}
    assert all(PARAM_NAME.match(key) for key in params)
