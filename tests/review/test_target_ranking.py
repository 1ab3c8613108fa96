"""Fixes ranked for the card the study targets, not the machine it ran on: where the study's target is a named
card, each cell's step is modelled from the card's data sheet (its FLOPs at the peak rate of its arithmetic,
its bytes at the memory bandwidth) and the precision fixes are ranked by that, the host's measured cost beside
it; on the machine itself they are ranked by measurement, and the summary models nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunegrid import targets
from tunegrid.review.recommend import recommend
from tunegrid.review.summary import build_summary

CPU = {"precision": {"fp32": "native", "bf16": "native", "fp16": "emulated", "tf32": "absent"}}
MIB = 2**20
FLOPS = 6 * 170e6 * 48  # six FLOPs per matmul weight per token: a 270M model's matmuls, one row of 48 tokens
FP32_WEIGHTS = 536 * MIB
# (tokens/s measured on a CPU, where fp32 is the fastest; the weights as each precision stores them)
CELLS = {
    "fp16": (None, FP32_WEIGHTS // 2),
    "fp32": (120.0, FP32_WEIGHTS),
    "fp16-mixed": (60.0, FP32_WEIGHTS),  # fp32 master weights
    "fp16-islands": (80.0, FP32_WEIGHTS // 2),
}
CURVE = [4.0, 3.0, 2.0, 1.0]


def _result(run: Path, precision: str, target: str) -> Path:
    tokens, weights = CELLS[precision]
    axes = {"model": "g", "precision": precision, "batch_size": 1, "quant": "none", "seed": 0}
    components = {"weights": weights, "activations": 8 * MIB, "logits": 4 * MIB, "lora_params_grads": MIB}
    components["optimizer_state"] = 2 * MIB
    plan = {"target": target, "liveness": {"step_flops": FLOPS}, "estimate": {"components": components}}
    failed = precision == "fp16"
    result = {
        "cell_id": f"g_{precision}_bs1_none_s0",
        "cell": {"axes": axes, "plan": plan},
        "outcome": "nan" if failed else "ok",
        "reason": "non-finite loss" if failed else "trained all steps with finite loss",
        "memory": {"target": target, "peak_bytes": 2 * weights},
        "throughput": {"tokens_per_s_median": tokens, "step_time_s_median": 48 / tokens if tokens else None},
    }
    if failed:
        origin = {"forward": {"module": "model.layers.7"}}
        result["diagnosis"] = {"nan": {"step": 0, "kind": "loss_nonfinite", "origin": origin}}
    if precision == "fp16-islands":  # 8 of 18 layers' weights widened from 2 to 4 bytes
        modules = [{"module": f"model.layers.{i}", "max_abs": 7e4, "ratio_to_fp16_max": 1.1} for i in range(10, 18)]
        result["fp32_islands"] = {"modules": modules, "weights_widened_bytes": int(FP32_WEIGHTS / 2 * 8 / 18)}
    folder = run / result["cell_id"]
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(result))
    curve = [float("nan")] if failed else CURVE
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(curve))
    )
    return folder / "result.json"


def _study(tmp_path: Path, target: str):
    frame = build_summary([_result(tmp_path, p, target) for p in CELLS])
    (rec,) = recommend(frame, CPU)
    return frame, rec


def test_on_a_t4_target_the_fp16_fix_ranks_first_though_fp32_ran_fastest_here(tmp_path):
    frame, rec = _study(tmp_path, "t4")
    order = [fix.change["precision"] for fix in rec.fixes]
    assert order[-1] == "fp32" and set(order[:-1]) == {"fp16-mixed", "fp16-islands"}  # measured: fp32 1st
    assert frame.set_index("cell_id")["modelled_step_s"].notna().all()  # the failing cell's plan is modelled too
    first = rec.fixes[0]
    # the target's modelled ratio, and the host's measured one beside it
    assert first.cost["target"] == "t4" and first.cost["modelled_against"] == "fp16"
    assert first.cost["modelled_tokens_per_s_ratio"] > 1.5 * rec.fixes[-1].cost["modelled_tokens_per_s_ratio"]
    assert (
        f"on t4 modelled {first.cost['modelled_tokens_per_s_ratio']:.2f}x the tokens/s of fp16, the failing setting"
        in first.why
    )
    measured = first.cost["tokens_per_s_ratio"]
    assert measured < 1 and f"measured on this machine: {measured:.2f}x the tokens/s" in first.why
    assert f"Ranked by the cost modelled on target t4 among the fixes that hold: {order[0]} first" in rec.text
    assert "which is not the target" in rec.text


def test_on_the_machine_itself_the_fixes_are_ranked_by_measurement_and_nothing_is_modelled(tmp_path):
    frame, rec = _study(tmp_path, "native")
    assert frame["modelled_step_s"].isna().all()  # the default study's columns keep their values
    assert [fix.change["precision"] for fix in rec.fixes] == ["fp32", "fp16-islands", "fp16-mixed"]
    assert all("modelled" not in fix.why and "target" not in fix.cost for fix in rec.fixes)
    assert "Ranked by throughput among the fixes that hold: fp32 first" in rec.text


def test_the_step_model_counts_fp32_rates_islands_and_the_master_weights_casts():
    StepWork, modelled_step = targets.StepWork, targets.modelled_step  # noqa: N806
    components = {"weights": 1000, "activations": 100, "logits": 10, "lora_params_grads": 1, "optimizer_state": 2}
    half = StepWork.of("fp16", 1.5e9, components, checkpointing=False)  # the limits' bound: a third recomputes
    assert half.bytes_moved == 2 * 1000 + 2 * 111 + 2 * 2 and half.fp32_share == 0
    # fp32 weights read, the fp16 copy written, read twice
    mixed = StepWork.of("fp16-mixed", 1e9, components, checkpointing=True)
    assert mixed.bytes_moved == 1000 + 3 * 500 + 2 * 111 + 2 * 2
    islands = StepWork.of("fp16-islands", 1e9, components, widened_bytes=250, checkpointing=True)
    assert islands.fp32_share == pytest.approx(250 / 1250) and islands.bytes_moved == half.bytes_moved + 500
    t4 = targets.TARGETS["t4"]
    step = modelled_step(t4, half)
    assert step is not None and step.compute_s == pytest.approx(1e9 / 65e12)
    assert step.memory_s == pytest.approx(half.bytes_moved / 320e9)
    full = modelled_step(t4, StepWork.of("fp32", 1e9, components, checkpointing=True))
    assert full is not None and full.compute_s == pytest.approx(1e9 / 8.1e12)
    emulated = StepWork.of("bf16", 1e9, components, checkpointing=True)
    assert modelled_step(t4, emulated) is None  # emulated: no data-sheet rate
