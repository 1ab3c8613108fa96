"""train.loss: chunked: the same loss and the same LoRA gradients as the model's own loss over every token's
logits (fp32, tight tolerance), on a tiny Gemma 3 (its final logit softcapping on) and a tiny OLMoE (its router
auxiliary loss on), with ignored tokens and a chunk that does not divide the loss tokens; the logits of one
chunk at a time (the measured peak falls); the replay and the headroom meter still read the step."""

from __future__ import annotations

import pytest
import torch
from conftest import one_cell, ready_trainer, run_in_process

from tunegrid.cell.data.packing import IGNORE
from tunegrid.cell.memory.chunked_loss import ChunkedLoss, chunked_loss_of, chunked_token_loss, loss_positions
from tunegrid.cell_spec import CellSpec
from tunegrid.study.recorded import recorded_spec


def _trainer(checkpoints, dataset_path, tmp_path, model: str, accum: int = 1, **train):
    """A chunked cell's trainer, its adapters' B matrices off their zero init (so every A gets a gradient)."""
    train = {"loss": "chunked", "loss_chunk_tokens": 9, "seq_len": 64, **train}
    trainer = ready_trainer(
        one_cell(model=model, batch=4, accum=accum, train=train), checkpoints, dataset_path, tmp_path
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.trainable_named:
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return trainer


def _loss_and_grads(optimizer_step, micro_batches, chunked: ChunkedLoss | None):
    """The step's summed micro-batch losses and every trainable gradient, with or without the chunked loss."""
    optimizer_step.chunked = chunked
    optimizer_step.optimizer.zero_grad(set_to_none=True)
    step_tokens = sum((micro["labels"][..., 1:] != IGNORE).sum() for micro in micro_batches)
    total = sum(optimizer_step.forward_backward(micro, step_tokens=step_tokens).detach() for micro in micro_batches)
    grads = {name: p.grad.detach().clone() for name, p in optimizer_step.trainable_named}
    optimizer_step.optimizer.zero_grad(set_to_none=True)
    return total, grads


def _assert_same(full, chunked):
    (full_loss, full_grads), (loss, grads) = full, chunked
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-7)
    assert full_grads.keys() == grads.keys() and len(grads) >= 4
    for name, grad in grads.items():
        assert bool(full_grads[name].abs().max() > 0), f"{name}: a gradient of zeros would prove nothing"
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("by_count", [True, False])
def test_gemma3_with_softcapping_trains_the_same_loss_and_gradients(checkpoints, dataset_path, tmp_path, by_count):
    trainer = _trainer(checkpoints, dataset_path, tmp_path, "gemma3-hot", accum=2)
    config = trainer.model.get_base_model().config
    config.final_logit_softcapping = 3.0  # small enough to bend the fixture's logits (init_range 3)
    optimizer_step = trainer.build_optimizer()
    assert optimizer_step.chunked is not None and optimizer_step.chunked.softcap == 3.0
    optimizer_step.loss_by_count = by_count  # also the path of a model whose loss only averages
    micro = trainer.stream.micro_batches(0)
    labels = torch.cat([m["labels"] for m in micro])
    loss_tokens = int((labels[..., 1:] != IGNORE).sum())
    assert (labels == IGNORE).any() and loss_tokens % 9, "ignored tokens, and a chunk that leaves a remainder"
    chunked = optimizer_step.chunked
    _assert_same(_loss_and_grads(optimizer_step, micro, None), _loss_and_grads(optimizer_step, micro, chunked))
    config.final_logit_softcapping = None  # the cap is honoured: without it the loss differs
    uncapped, _ = _loss_and_grads(optimizer_step, micro, ChunkedLoss.of(trainer.model, 9))
    assert abs(float(uncapped) - float(_loss_and_grads(optimizer_step, micro, chunked)[0])) > 1e-3


def test_olmoe_with_its_router_loss_trains_the_same_loss_and_gradients(checkpoints, dataset_path, tmp_path):
    trainer = _trainer(checkpoints, dataset_path, tmp_path, "olmoe-tiny")
    config = trainer.model.get_base_model().config
    config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    optimizer_step = trainer.build_optimizer()
    assert optimizer_step.chunked.aux_coef == 0.5
    micro = trainer.stream.micro_batches(0)
    _assert_same(
        _loss_and_grads(optimizer_step, micro, None), _loss_and_grads(optimizer_step, micro, optimizer_step.chunked)
    )


def test_a_spec_without_the_setting_takes_the_full_loss(checkpoints, dataset_path, tmp_path):
    spec = one_cell()
    assert spec["train"]["loss"] == "full" and chunked_loss_of(CellSpec.from_json(spec), None) is None
    del spec["train"]["loss"]  # a spec written before the setting, read with today's keys
    del spec["axes"]["loss"]
    assert chunked_loss_of(recorded_spec(spec), None) is None
    chunked = one_cell(axes={"loss": "chunked"})
    assert chunked["train"]["loss"] == "chunked" and chunked["cell_id"].endswith("_loss-chunked")


def test_a_model_that_scales_its_logits_otherwise_is_refused(checkpoints, dataset_path, tmp_path):
    trainer = _trainer(checkpoints, dataset_path, tmp_path, "gemma3-hot")
    trainer.model.get_base_model().config.logit_scale = 0.0625  # Cohere's
    with pytest.raises(ValueError, match="logit_scale"):
        trainer.build_optimizer()


PEAKS = """
import sys, torch
from tunegrid.cell.memory.chunked_loss import chunked_token_loss, loss_positions
from tunegrid.runtime.memory import MemoryMeter

torch.manual_seed(0)
head = torch.nn.Linear(64, 8192, bias=False)
hidden = torch.randn(2, 512, 64, requires_grad=True)
labels = torch.randint(0, 8192, (2, 512))
labels[:, :100] = -100
meter = MemoryMeter("cpu")
for chunked in (False, True, False, True):
    hidden.grad = head.weight.grad = None
    meter.reset()
    before = meter.current_bytes()
    if chunked:
        kept, targets = loss_positions(labels)
        loss = chunked_token_loss(hidden, kept, targets, head, 64) / kept.numel()
    else:
        logits = head(hidden).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 8192), labels[:, 1:].reshape(-1))
    loss.backward()
    del loss
    logits = None
    print(int(chunked), meter.peak_bytes() - before, float(head.weight.grad.double().norm()), flush=True)
"""


def test_one_chunk_of_logits_at_a_time_on_cpu():
    """A head of vocab 8192 over 1024 tokens: the full loss holds 1024 x 8192 fp32 logits (32 MiB), their
    log-softmax and their gradient; chunks of 64 tokens one sixteenth of that. Measured with the cell's own
    meter (VmHWM, reset through clear_refs) in a process whose allocator hands every freed block of 64 KiB or
    more back at once (MALLOC_MMAP_THRESHOLD_), each variant twice, the second run counted."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PEAKS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    (_, full, full_grad), (_, chunked, grad) = rows[2], rows[3]
    assert float(grad) == pytest.approx(float(full_grad), rel=1e-5)  # the head's gradient norm
    logits_bytes = 2 * 512 * 8192 * 4
    assert int(full) > 2 * logits_bytes and int(chunked) < 0.25 * int(full), (full, chunked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_chunked_loss_lowers_the_measured_peak_on_cuda():
    torch.manual_seed(0)
    head = torch.nn.Linear(1024, 50304, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1, 2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50304, (1, 2048), device="cuda")

    def peak(chunked: bool) -> tuple[int, torch.Tensor]:
        hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if chunked:
            kept, targets = loss_positions(labels)
            loss = chunked_token_loss(hidden, kept, targets, head, 256) / kept.numel()
        else:
            logits = head(hidden).float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50304), labels[:, 1:].reshape(-1))
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, hidden.grad.clone()

    full, full_grad = peak(False)
    chunked, grad = peak(True)
    assert full >= 2048 * 50304 * 4 * 2  # the fp32 logits and their gradient, at least
    assert chunked < 0.25 * full, (chunked, full)
    torch.testing.assert_close(grad.float(), full_grad.float(), rtol=2e-2, atol=1e-4)


def test_a_worker_trains_a_chunked_cell(checkpoints, dataset_path, tmp_path):
    spec = one_cell(train={"steps": 2, "loss": "chunked", "loss_chunk_tokens": 5})
    plain = run_in_process(one_cell(train={"steps": 2}), checkpoints, dataset_path, tmp_path / "full")
    facts = run_in_process(spec, checkpoints, dataset_path, tmp_path / "chunked")
    assert facts["outcome"] == plain["outcome"] == "ok", facts.get("reason")


def _sites(line: dict) -> dict[tuple[str, str], float]:
    """A headroom line's sites but the output head's and the model's own output (where the logits differ)."""
    return {
        (m["module"], m["site"]): m["max_abs"]
        for m in line["modules"]
        if m["module"] and not m["module"].endswith("lm_head")
    }


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_nan_replay_and_the_headroom_read_a_chunked_step_as_they_read_a_full_one(
    checkpoints, dataset_path, tmp_path, phase
):
    from tunegrid.runtime.files import read_jsonl

    target = "model.layers.0.self_attn.o_proj"
    facts, headroom = {}, {}
    for loss in ("full", "chunked"):
        spec = one_cell(
            accum=2,
            train={"steps": 3, "on_nonfinite": "stop", "headroom_every": 1, "loss": loss, "loss_chunk_tokens": 7},
            debug={"inject_nonfinite": {"module": target, "step": 2, "micro_batch": 1, "phase": phase}},
        )
        facts[loss] = run_in_process(spec, checkpoints, dataset_path, tmp_path / loss)
        headroom[loss] = read_jsonl(tmp_path / loss / "headroom.jsonl")
    full, chunked = facts["full"], facts["chunked"]
    assert chunked["outcome"] == full["outcome"] == "nan", chunked["reason"]
    nan, full_nan = chunked["diagnosis"]["nan"], full["diagnosis"]["nan"]
    assert (nan["step"], nan["kind"], nan["micro_batch"]) == (full_nan["step"], full_nan["kind"], 1)
    for way in ("forward", "backward"):
        if full_nan["origin"][way] is None:
            assert nan["origin"][way] is None
            continue
        assert nan["origin"][way]["module"].endswith(target) if way == phase else True
        assert (nan["origin"][way]["module"], nan["origin"][way]["at"]) == (
            full_nan["origin"][way]["module"],
            full_nan["origin"][way]["at"],
        )
    assert len(headroom["chunked"]) == len(headroom["full"]) >= 2
    for line, full_line in zip(headroom["chunked"], headroom["full"]):
        sites, full_sites = _sites(line), _sites(full_line)
        shared = sites.keys() & full_sites.keys()
        assert len(shared) >= 5
        for site in shared:  # a non-finite maximum is written as its text ("nan", "inf")
            expected = full_sites[site]
            assert sites[site] == (expected if isinstance(expected, str) else pytest.approx(expected, rel=1e-5))
