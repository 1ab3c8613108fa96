"""A slow cell is not a hung one: limits from the plan's predicted work and from the steps the cell reports, signs
of life at every decoder block, and a forward that goes non-finite ends its step (and its replay) before any
backward."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import one_cell, one_cell_spec, run_in_process, run_supervised

from tunegrid.prepare.liveness import LIVENESS_MARGIN, matmul_weights, plan_liveness
from tunegrid.run.supervisor import Liveness
from tunegrid.runtime.files import read_jsonl


def test_the_plan_raises_the_limits_to_the_predicted_work_and_keeps_the_study_floor() -> None:
    spec = one_cell_spec(train={"heartbeat_timeout_s": 30, "time_limit_s": 60, "steps": 5, "seq_len": 128})
    config = {"vocab_size": 1000, "hidden_size": 100}
    shapes = {"model.embed_tokens.weight": [1000, 100], "model.layers.0.mlp.up_proj.weight": [400, 100]}
    assert matmul_weights(config, shapes) == 1000 * 100 + 400 * 100  # the tied LM head counted, the lookup not
    flops = 6 * 140_000 * 2 * 128
    slow = plan_liveness(spec, config, shapes, {"matmul_tflops": {"float32": flops / 100 / 1e12}})
    assert slow.predicted_step_s == pytest.approx(100.0)
    assert slow.heartbeat_timeout_s == pytest.approx(LIVENESS_MARGIN * 100)
    assert slow.time_limit_s == pytest.approx(LIVENESS_MARGIN * 100 * (5 + 3))
    fast = plan_liveness(spec, config, shapes, {"matmul_tflops": {"float32": 1.0}})
    assert (fast.heartbeat_timeout_s, fast.time_limit_s) == (30, 60)  # the study's limits are floors
    unprobed = plan_liveness(spec, config, shapes, {})
    assert (unprobed.heartbeat_timeout_s, unprobed.predicted_step_s) == (30, None)


def test_reported_step_times_raise_the_limits_while_the_cell_trains() -> None:
    spec = one_cell_spec(train={"heartbeat_timeout_s": 10, "time_limit_s": 20, "steps": 4})
    unprobed = plan_liveness(spec, {"vocab_size": 10, "hidden_size": 10}, {}, {})
    unplanned = Liveness(unprobed, steps=4)  # no probed rate: the study's wall-clock limit is the budget as written
    unplanned.observe([{"step": 0, "step_time_s": 30.0}], elapsed=45.0)
    assert (unplanned.heartbeat_s, unplanned.limit_s) == (LIVENESS_MARGIN * 30, 20)
    liveness = Liveness(dataclasses.replace(unprobed, predicted_step_s=5.0), steps=4)
    assert (liveness.heartbeat_s, liveness.limit_s) == (10, 20)
    liveness.observe([{"step": 0, "step_time_s": 30.0, "loss": 1.0}], elapsed=45.0)
    assert liveness.heartbeat_s == LIVENESS_MARGIN * 30
    assert liveness.limit_s == 45.0 + LIVENESS_MARGIN * 30 * (3 + 3)
    liveness.observe([{"step": 1, "step_time_s": 1.0}], elapsed=50.0)  # a faster step lowers nothing
    assert liveness.heartbeat_s == LIVENESS_MARGIN * 30


def slow_host(tmp_path, fp16_tflops: float | None):
    """A probe record of a host whose fp16 matmuls run at this rate (None: none measured)."""
    path = tmp_path / "capabilities.json"
    rates = {"float32": 1.0, "bfloat16": 1.0} | ({"float16": fp16_tflops} if fp16_tflops else {})
    path.write_text(json.dumps({"device": "cpu", "matmul_tflops": rates, "precision": {"fp16": "emulated"}}))
    return path


@pytest.mark.parametrize("measured", [True, False], ids=["rate-probed", "no-rate"])
def test_a_worker_slower_than_the_study_limits_ends_nan_where_its_work_was_predicted(
    checkpoints, dataset_path, tmp_path, measured
) -> None:
    """The study allows 1 s of silence and 3 s in all, far less than any worker needs to start (its imports
    alone): a host whose probe measured a slow fp16 rate gets limits from the cell's work and the cell ends
    `nan` at its first forward; without a measured rate the same cell is held to the study's limits and times
    out, which shows the limits, not luck, decided."""
    spec = one_cell(precision="fp16", batch=8, train={"heartbeat_timeout_s": 1, "time_limit_s": 3, "steps": 12})
    capabilities = slow_host(tmp_path, 1e-7 if measured else None)  # the cell's contract takes its limits from it
    # spawned: a forked worker has no imports to do and may reach the nan inside the study's 3 s
    run_dir = tmp_path / "run"
    result = run_supervised(spec, checkpoints, dataset_path, run_dir, capabilities=capabilities, worker="spawned")
    if measured:
        assert result["outcome"] == "nan", result["reason"]
    else:
        assert result["outcome"] == "timeout", result["reason"]


def test_a_forward_that_goes_nonfinite_ends_the_step_before_its_backward_and_is_replayed_forward_only(
    checkpoints, dataset_path, tmp_path
) -> None:
    spec = one_cell(precision="fp16", batch=8, train={"steps": 12})
    facts = run_in_process(spec, checkpoints, dataset_path, tmp_path)
    assert facts["outcome"] == "nan"
    event = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "loss_nonfinite"][0]
    assert event["origin"]["replay"] == "forward only"
    assert "forward loss was not finite" in event["origin"]["unlocated"]
    assert ".mlp.down_proj" in event["origin"]["forward"]["module"]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["step"] == event["step"]  # the loop ended at that step


def test_a_single_process_worker_beats_at_every_decoder_block(checkpoints, dataset_path, tmp_path) -> None:
    import torch

    from tunegrid.cell.loop.liveness import block_progress
    from tunegrid.runtime.rundir import Heartbeat

    class Recording(Heartbeat):
        pulses: list[str] = []

        def pulse(self, detail: str) -> None:
            self.pulses.append(detail)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["gemma3-hot"])
    beat = Recording(tmp_path / "heartbeat")
    ids = torch.randint(0, 512, (1, 8))
    with block_progress(model, beat), pytest.MonkeyPatch.context() as patch:
        patch.setattr("tunegrid.cell.loop.liveness.PULSE_EVERY_S", 0.0)
        model(input_ids=ids, labels=ids).loss.backward()
    assert beat.pulses == [
        "model.layers.0 forward",
        "model.layers.1 forward",
        "model.layers.1 backward",
        "model.layers.0 backward",
    ]
    before = len(beat.pulses)  # the hooks are gone: another forward pulses nothing
    model(input_ids=ids)
    assert len(beat.pulses) == before


def test_a_steps_floor_is_its_unskippable_flops_at_the_fastest_rate_its_products_can_run():
    """The doctor's bound: 4 FLOPs per weight and token (6 with the recomputed forward) at the probe's rate for the
    arithmetic; an emulated one (CPU fp16, computed in fp32 blocks) at the faster of its own rate and fp32's."""
    from tunegrid.prepare.liveness import step_floor_s

    probed = {
        "matmul_tflops": {"float32": 0.02, "bfloat16": 0.06, "float16": 0.002},
        "precision": {"fp32": "native", "bf16": "native", "fp16": "emulated"},
    }
    flops = 6e12  # what plan_liveness counts: 6 per weight and token
    assert step_floor_s(flops, "fp32", False, probed)[0] == pytest.approx(4e12 / 0.02e12)
    assert step_floor_s(flops, "fp32", True, probed)[0] == pytest.approx(6e12 / 0.02e12)
    assert step_floor_s(flops, "bf16", False, probed)[0] == pytest.approx(4e12 / 0.06e12)
    floor, how = step_floor_s(flops, "fp16-islands", False, probed)
    assert floor == pytest.approx(4e12 / 0.02e12) and "emulated" in how  # fp32's rate, not bf16's
    assert step_floor_s(flops, "fp32", False, {"precision": {"fp32": "native"}}) is None
