"""The memory estimate of train.loss: chunked: the logits component is one chunk's worth (plus the loss tokens'
rows of the hidden states), the head's fp16-mixed cast copy is a chunk's transient instead of kept for backward,
and at OLMoE-1B-7B's full width (the MoE memory case, seq 2048) the step's transient becomes the dequantized
experts. Against a measured CPU peak: test_memory.py (slow)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import meta_model_shapes, one_cell

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import MemoryEstimate
from tunegrid.prepare.memory_estimate import device_constants, estimate_from_shapes
from tunegrid.study.recorded import recorded_spec

DATA = Path(__file__).resolve().parents[1] / "data"


def _parts(spec: dict, device: str = "cuda") -> MemoryEstimate:
    config, shapes = meta_model_shapes(spec["model"])
    return estimate_from_shapes(CellSpec.from_json(spec), config, shapes, 0, device)


def test_the_logits_are_one_chunks_worth():
    spec = one_cell(batch=8, train={"seq_len": 256})  # 2048 tokens
    chunked = one_cell(batch=8, train={"seq_len": 256, "loss": "chunked", "loss_chunk_tokens": 100})
    vocab, hidden = 512, 64
    assert _parts(spec).components.logits == 2048 * vocab * 12
    assert _parts(chunked).components.logits == 100 * vocab * 12 + 2048 * hidden * 4
    small = one_cell(batch=1, train={"seq_len": 64, "loss": "chunked", "loss_chunk_tokens": 1000})
    assert _parts(small).components.logits == 64 * vocab * 12 + 64 * hidden * 4  # a chunk past the tokens
    by_axis = one_cell(batch=8, train={"seq_len": 256, "loss_chunk_tokens": 100}, axes={"loss": "chunked"})
    assert _parts(by_axis).components == _parts(chunked).components


def test_fp16_mixed_keeps_no_cast_copy_of_the_head_for_backward():
    full = _parts(one_cell(precision="fp16-mixed")).components
    chunked = _parts(one_cell(precision="fp16-mixed", train={"loss": "chunked"})).components
    head = 512 * 64 * 2
    assert full.activations - chunked.activations == head
    assert chunked.logits == 64 * 512 * 12 + 64 * 64 * 4 + head  # cast afresh for the chunk


def test_at_olmoe_width_the_transient_becomes_the_dequantized_experts():
    """The recorded OLMoE-1B-7B-width nf4-experts cell at seq 2048 (the MoE memory case): full logits 1.24 GB
    over a 0.81 GB dequant buffer; chunked, the logits fall to 0.16 GB and the buffer is the step's transient."""
    evidence = json.loads((DATA / "evidence-h100-memory.json").read_text())
    probe = json.loads((DATA / "capabilities-h100.json").read_text())
    cell = next(c for c in evidence["studies"]["olmoe-full"]["cells"] if c["spec"]["axes"]["quant"] == "nf4-experts")
    recorded = recorded_spec(cell["spec"], "olmoe-full")  # the keys it predates at the values it ran at
    spec = replace(recorded, train=replace(recorded.train, seq_len=2048))
    config, shapes = meta_model_shapes(spec.to_json()["model"])
    constants = device_constants({**probe, "step_overhead_bytes": {"bf16": 2 * 32 * 2**20}}, "bf16", device="cuda")
    full = estimate_from_shapes(spec, config, shapes, **constants)
    spec = replace(spec, train=replace(spec.train, loss="chunked", loss_chunk_tokens=256))
    chunked = estimate_from_shapes(spec, config, shapes, **constants)
    parts, full_parts = chunked.components, full.components
    assert full_parts.logits == pytest.approx(1.236e9, rel=1e-3) and parts.logits < 0.17e9
    assert full_parts.dequant_buffer == parts.dequant_buffer == pytest.approx(0.805e9, rel=1e-3)
    saved = full_parts.logits - parts.dequant_buffer  # the transient was the logits, now the experts
    assert full.estimate_bytes - chunked.estimate_bytes == saved
    assert chunked.estimate_bytes == pytest.approx(5.151e9, rel=1e-3)
