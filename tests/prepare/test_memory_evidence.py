"""The memory estimate replayed against peaks recorded on a GPU.

`data/evidence-h100-memory.json` holds, for every cell of three studies run on one NVIDIA H100 80GB HBM3
(torch 2.11.0+cu130, transformers 5.17/5.23, bitsandbytes 0.50.2; see `recorded_on` in the file), the
cell's spec and the allocator peaks its run measured. The test rebuilds each cell's model on the meta
device from its config (no weights, no GPU), estimates it with the device constants of the H100's probe
record (`data/capabilities-h100.json`), and compares with what the GPU measured.

The recorded probe predates `step_overhead_bytes`, so that one device constant is an assumption, not a
recording, and is named so here (`ASSUMED_SM90_STEP_OVERHEAD`): what `probes.step_overhead_bytes` should
measure on sm90 with torch's defaults, one 32 MiB cuBLAS workspace per thread that runs matmuls (the
forward's and autograd's). The GPU suite (`test_gpu.py`) checks the measurement itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import meta_model_shapes

from tunegrid.cell_spec import CellSpec
from tunegrid.contract import MemoryEstimate
from tunegrid.prepare.memory_estimate import device_constants, estimate_from_shapes
from tunegrid.study.recorded import recorded_spec

DATA = Path(__file__).resolve().parents[1] / "data"
EVIDENCE = json.loads((DATA / "evidence-h100-memory.json").read_text())
RECORDED_PROBE = json.loads((DATA / "capabilities-h100.json").read_text())
ASSUMED_SM90_STEP_OVERHEAD = {precision: 2 * 32 * 2**20 for precision in ("fp32", "bf16", "fp16")}
CAPABILITIES = {**RECORDED_PROBE, "step_overhead_bytes": ASSUMED_SM90_STEP_OVERHEAD}
# each recorded spec read with today's keys: those it predates at the values the cells ran at
CELLS = [
    (name, {**cell, "spec": recorded_spec(cell["spec"], name).to_json()})
    for name, study in EVIDENCE["studies"].items()
    for cell in study["cells"]
    if cell["outcome"] == "ok"
]


def test_the_recorded_probe_holds_only_what_the_probe_recorded():
    """The assumed constant lives in this test, never in the file that says it is a recording."""
    assert "step_overhead_bytes" not in RECORDED_PROBE


def test_evidence_covers_dense_and_moe_cells_at_tiny_and_real_width():
    studies = {name for name, _ in CELLS}
    assert studies == {"default", "moe-qlora-memory-synthetic", "olmoe-full"}
    assert len(CELLS) == 33 + 12 + 2
    assert {cell["spec"]["axes"]["quant"] for _, cell in CELLS} == {"none", "nf4", "nf4-experts"}


@pytest.mark.parametrize("study,cell", CELLS, ids=[cell["spec"]["cell_id"] for _, cell in CELLS])
def test_estimate_matches_the_recorded_gpu_peak(study, cell):
    spec = cell["spec"]
    config, shapes = meta_model_shapes(spec["model"])
    constants = device_constants(CAPABILITIES, spec["axes"]["precision"], device=CAPABILITIES["device"])
    assert constants["device"] == "cuda" and constants["step_overhead"] > 0
    # these cells quantized their experts after the load (the path before load-time quantization)
    estimate = estimate_from_shapes(
        CellSpec.from_json(spec), config, shapes, **constants, experts_quantized_at="post_load"
    )
    ratio = estimate.estimate_bytes / cell["peak_bytes"]
    assert 0.9 <= ratio <= 1.1, (
        f"{spec['cell_id']}: estimate/measured {ratio:.3f} ({estimate.stage}: {estimate.components})"
    )
    # where the load is the peak (bf16 experts before quantization), the estimate says so
    if cell["load_peak_bytes"] >= cell["steady_peak_bytes"] * 1.02:
        assert estimate.stage == "load", spec["cell_id"]


# The second recording, 2026-11-26 (the GPU acceptance run, its own probe record inside the file): real Gemma 3 270M
# and SmolLM2-135M weights from their GGUF packages under the T4 budget, and OLMoE-1B-7B at full width at seq 2048.
# The real checkpoints' config and tensor shapes are in the file (read from the dequantized checkpoints' headers).
RECORDED = json.loads((DATA / "evidence-h100-2026-11-26.json").read_text())
RECORDED_CELLS = [
    {**cell, "spec": recorded_spec(cell["spec"]).to_json()} for cell in RECORDED["cells"] if cell["outcome"] == "ok"
]


def _recorded_estimate(cell: dict) -> MemoryEstimate:
    spec = cell["spec"]
    checkpoint = RECORDED["checkpoints"].get(spec["model"]["name"])
    if checkpoint is None:
        config, shapes = meta_model_shapes(spec["model"])
        facts = {}
    else:
        config, shapes = checkpoint["config"], checkpoint["shapes"]
        facts = {
            "tokenizer_bytes": checkpoint["tokenizer_bytes"],
            "largest_on_disk": tuple(checkpoint["largest_on_disk"]),
        }
    probe = RECORDED["capabilities"]
    constants = device_constants(probe, spec["axes"]["precision"], device=probe["device"])
    assert constants["device"] == "cuda" and constants["step_overhead"] > 0  # measured by that run's probe
    return estimate_from_shapes(CellSpec.from_json(spec), config, shapes, **constants, **facts)


def test_the_second_recording_holds_real_weights_and_the_full_width_moe_case():
    sources = {cell["spec"]["model"]["name"]: cell["spec"]["model"].get("source") for cell in RECORDED_CELLS}
    assert sources == {"gemma3-270m": "gguf", "smollm2-135m": "gguf", "olmoe-width": "synthetic"}
    assert {cell["spec"]["train"]["seq_len"] for cell in RECORDED_CELLS} == {48, 2048}


@pytest.mark.parametrize("cell", RECORDED_CELLS, ids=[cell["spec"]["cell_id"] for cell in RECORDED_CELLS])
def test_estimate_matches_the_peaks_recorded_with_real_weights_and_at_full_width(cell):
    estimate = _recorded_estimate(cell)
    ratio = estimate.estimate_bytes / cell["peak_bytes"]
    if estimate.not_modelled:
        # fp32 islands are chosen when the cell starts: the estimate says what it leaves out, and is short
        assert "fp32 islands" in estimate.not_modelled and ratio < 1.0
        return
    assert 0.9 <= ratio <= 1.1, f"{cell['spec']['cell_id']}: {ratio:.3f} ({estimate.stage}: {estimate.components})"
    # a GPU's peak holds neither the tokenizer nor a cast checkpoint's host-side read and cast copies
    assert estimate.components.tokenizer == 0
    if cell["spec"]["model"]["name"] in RECORDED["checkpoints"]:
        assert 0.9 <= estimate.load_bytes / cell["load_peak_bytes"] <= 1.1
