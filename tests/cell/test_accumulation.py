"""Gradient accumulation is the same recipe as one big batch: micro-batch x grad_accum = effective batch.

In fp32 on CPU, 4 x 1, 2 x 2 and 1 x 4 train on the same rows and draw the same loss and grad-norm curves,
with response-only loss too (micro-batches then hold different numbers of loss tokens, so an average of
micro-batch means would differ). A non-finite value in the second micro-batch ends the cell `nan` at that
step, and the origin replay finds it in that micro-batch.
"""

from __future__ import annotations

import pytest
from conftest import one_cell, one_cell_spec, run_in_process, run_supervised

from tunegrid.runtime.files import read_jsonl

MODEL = "qwen3moe-tiny"
# Every split sums the same fp32 token losses in another order and through other matmul shapes: measured at
# most 3.1e-7 relative over 6 steps (loss and grad norm, both loss_on settings). An average of micro-batch
# means instead of the token-weighted sum is off by percents where the micro-batches' loss tokens differ.
RELATIVE_TOLERANCE = 5e-6


def _curve(checkpoints, dataset_path, tmp_path, batch, accum, data):
    spec = one_cell(model=MODEL, batch=batch, accum=accum, train={"steps": 6, "lr": 0.01}, data=data)
    run_dir = tmp_path / spec["cell_id"]
    facts = run_in_process(spec, checkpoints, dataset_path, run_dir)
    assert facts["outcome"] == "ok", facts["reason"]
    return spec["cell_id"], facts, read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("loss_on", ["response", "all"])
@pytest.mark.slow
def test_micro_batch_times_accumulation_draws_the_curve_of_one_batch(checkpoints, dataset_path, tmp_path, loss_on):
    data = {"examples": 64, "loss_on": loss_on}
    curves = {(b, a): _curve(checkpoints, dataset_path, tmp_path, b, a, data) for b, a in ((4, 1), (2, 2), (1, 4))}
    assert [cell_id for cell_id, _, _ in curves.values()] == [
        "qwen3moe-tiny_fp32_bs4_none_s0",
        "qwen3moe-tiny_fp32_bs2_none_s0_ga2",
        "qwen3moe-tiny_fp32_bs1_none_s0_ga4",
    ]
    _, one_batch, reference = curves[(4, 1)]
    for (batch, accum), (_, facts, records) in curves.items():
        assert [r["step"] for r in records] == list(range(6)), "one metrics line per optimizer step"
        for got, want in zip(records, reference, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=RELATIVE_TOLERANCE), (batch, accum, got["step"])
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RELATIVE_TOLERANCE), (batch, accum)
            assert got["lr"] == want["lr"]
        # tokens/s counts every micro-batch: the same tokens per step, whatever the split
        assert facts["data"]["tokens"] == one_batch["data"]["tokens"]
    first, last = reference[0]["loss"], reference[-1]["loss"]
    assert last < first, "the curves compared are of a model that learns"


def test_micro_batches_hold_different_numbers_of_loss_tokens(checkpoints, dataset_path):
    """The response-only comparison above is not vacuous: a mean of micro-batch means would differ."""
    import torch
    from transformers import AutoTokenizer

    from tunegrid.cell.data.packing import build_stream
    from tunegrid.cell.loop.step import loss_tokens
    from tunegrid.dataset import read_dataset

    class Plain:  # packing_mode reads only the config and the module of the model's class
        config = type("Config", (), {"_attn_implementation": "sdpa"})()

    tokenizer = AutoTokenizer.from_pretrained(checkpoints[MODEL])
    records = read_dataset(dataset_path)
    data = one_cell_spec(data={"examples": 64, "loss_on": "response"}).data
    split, _ = build_stream(records, tokenizer, Plain(), data, 32, 2, 0, accum=2)
    whole, _ = build_stream(records, tokenizer, Plain(), data, 32, 4, 0)
    for step in range(6):
        micro = split.micro_batches(step)
        assert len(micro) == 2 and all(m["input_ids"].shape[0] == 2 for m in micro)
        for key, value in whole.batch(step).items():
            assert value.equal(torch.cat([m[key] for m in micro])), "the same rows, in the same order"
    counts = {tuple(int(loss_tokens(m)) for m in split.micro_batches(step)) for step in range(6)}
    assert any(a != b for a, b in counts), counts


@pytest.mark.parametrize(
    ("precision", "phase", "kind"),
    [
        ("fp32", "forward", "loss_nonfinite"),
        ("fp32", "backward", "grad_nonfinite_finite_loss"),
        ("fp16", "backward", "scaler_skip"),
    ],
)
def test_nonfinite_in_the_second_micro_batch_ends_nan_there_with_its_origin(
    checkpoints, dataset_path, tmp_path, precision, phase, kind
):
    target = "model.layers.0.self_attn.o_proj"
    debug = {"inject_nonfinite": {"module": target, "step": 2, "micro_batch": 1, "phase": phase}}
    spec = one_cell(
        model=MODEL,
        precision=precision,
        batch=1,
        accum=2,
        train={"steps": 5, "on_nonfinite": "stop"},
        debug=debug,
    )
    run_dir = tmp_path / spec["cell_id"]
    facts = run_in_process(spec, checkpoints, dataset_path, run_dir)
    assert facts["outcome"] == "nan", facts["reason"]
    nan = facts["diagnosis"]["nan"]
    assert (nan["step"], nan["kind"], nan["micro_batch"]) == (2, kind, 1)
    assert nan["origin"][phase]["module"].endswith(target) and nan["origin"]["micro_batch"] == 1
    assert "(micro-batch 1 of 2)" in facts["reason"]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.slow
def test_two_ranks_accumulate_and_end_with_identical_lora_weights(checkpoints, dataset_path, tmp_path):
    spec = one_cell(model=MODEL, world=2, accum=2, train={"steps": 3, "threads": 1})
    assert spec["cell_id"].endswith("_ws2_ga2")
    result = run_supervised(spec, checkpoints, dataset_path, tmp_path / spec["cell_id"])
    assert result["outcome"] == "ok", result["reason"]
    assert result["distributed"]["lora_identical"] is True


@pytest.mark.slow
def test_an_accumulating_cell_resumes_at_its_data_position(checkpoints, dataset_path, tmp_path):
    train = {"steps": 6, "checkpoint_every": 2, "retries": 0}
    killed = one_cell(model=MODEL, batch=1, accum=2, train=train, debug={"kill_rank": {"rank": 0, "step": 3}})
    run_dir = tmp_path / "resumed" / killed["cell_id"]
    assert run_supervised(killed, checkpoints, dataset_path, run_dir)["outcome"] == "error"
    again = run_supervised(one_cell(model=MODEL, batch=1, accum=2, train=train), checkpoints, dataset_path, run_dir)
    assert again["outcome"] == "ok" and again["resumed_from_step"] == 2, again["reason"]
    plain_dir = tmp_path / "plain" / killed["cell_id"]
    plain = one_cell(model=MODEL, batch=1, accum=2, train={**train, "checkpoint_every": 0})
    assert run_supervised(plain, checkpoints, dataset_path, plain_dir)["outcome"] == "ok"
    resumed, reference = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(plain_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(6))
    for got, want in zip(resumed, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), got["step"]
