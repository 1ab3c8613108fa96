"""The summary table survives any mix of values a cell can write."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from tunegrid.review.summary import write_summary
from tunegrid.runtime.files import write_json


def _result(cell_id: str, outcome: str, headroom: object, steps: object) -> dict:
    return {
        "cell_id": cell_id,
        "cell": {"axes": {"model": "m", "precision": "fp16", "batch_size": 2, "quant": "none", "seed": 0}},
        "outcome": outcome,
        "reason": "r",
        "training": {"steps_run": steps, "final_loss": headroom if outcome == "nan" else 1.5},
        "fp16_headroom": {"worst_modules": [{"module": "layers.0.mlp.down_proj", "ratio_to_fp16_max": headroom}]},
    }


def test_summary_with_inf_string_numbers_and_missing_values(tmp_path: Path) -> None:
    paths = []
    for i, (outcome, headroom, steps) in enumerate(
        [("nan", "inf", 3), ("ok", 0.9, 10), ("ok", None, None), ("error", float("nan"), "4")]
    ):
        path = tmp_path / f"c{i}" / "result.json"
        path.parent.mkdir()
        write_json(path, _result(f"c{i}", outcome, headroom, steps))
        paths.append(path)
    frame = write_summary(paths, tmp_path / "summary.csv")
    back = pd.read_parquet(tmp_path / "summary.parquet").set_index("cell_id")
    assert back["fp16_headroom_worst_ratio"].dtype == "float64"
    assert math.isinf(back.loc["c0", "fp16_headroom_worst_ratio"])
    assert pd.isna(back.loc["c2", "fp16_headroom_worst_ratio"])
    assert back.loc["c3", "steps_run"] == 4 and pd.isna(back.loc["c2", "steps_run"])
    assert list(back["outcome"]) == ["nan", "ok", "ok", "error"]  # "nan" the outcome stays a string
    assert len(frame) == 4


def test_summary_has_the_effective_batch_and_the_resumed_step(tmp_path: Path) -> None:
    accumulated = _result("m_fp16_bs2_none_s0_ws2_ga4", "ok", 0.5, 8)
    accumulated["cell"]["axes"].update(world_size=2, grad_accum=4)
    accumulated["resumed_from_step"] = 3
    before_the_axis = _result("m_fp16_bs2_none_s0", "ok", 0.5, 8)  # no grad_accum, no world_size, no resume fact
    paths = []
    for result in (accumulated, before_the_axis):
        path = tmp_path / result["cell_id"] / "result.json"
        path.parent.mkdir()
        write_json(path, result)
        paths.append(path)
    write_summary(paths, tmp_path / "summary.csv")
    back = pd.read_parquet(tmp_path / "summary.parquet").set_index("cell_id")
    assert back.loc["m_fp16_bs2_none_s0_ws2_ga4", ["grad_accum", "effective_batch", "resumed_from_step"]].tolist() == [
        4,
        16,
        3,
    ]
    assert back.loc["m_fp16_bs2_none_s0", ["grad_accum", "effective_batch"]].tolist() == [1, 2]
    assert pd.isna(back.loc["m_fp16_bs2_none_s0", "resumed_from_step"])
