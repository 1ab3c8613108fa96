"""bitsandbytes 8-bit (`int8`) as a quantization row: a cell trains end to end on it, the audit says
8-bit, the estimate counts one byte per quantized weight, and the adapter's record rebuilds its base."""

from __future__ import annotations

import pytest
from conftest import one_cell, run_supervised

from tunegrid.prepare.memory_estimate import tensor_shapes
from tunegrid.review.summary import summary_row
from tunegrid.runtime.files import read_json

ATTENTION_ONLY = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.slow
def test_an_int8_cell_trains_is_audited_as_8_bit_and_estimated_at_one_byte_per_weight(
    checkpoints, dataset_path, tmp_path
):
    spec = one_cell(model="olmoe-tiny", quant="int8", lora=ATTENTION_ONLY)
    assert spec["cell_id"] == "olmoe-tiny_fp32_bs2_int8_s0"
    run_dir = tmp_path / spec["cell_id"]
    result = run_supervised(spec, checkpoints, dataset_path, run_dir)
    assert result["outcome"] == "ok", result["reason"]

    audit = read_json(run_dir / "audit.json")
    assert audit["quant"] == "int8" and audit["bits"] == 8
    loaded = audit["after_load"]
    linears = [p for p in loaded["params"] if p["quantized"]]
    assert linears and all(p["dtype"] == "int8" and len(p["shape"]) == 2 for p in linears)
    assert "nf4" not in loaded["by_dtype"] and loaded["by_dtype"]["int8"] == loaded["quantized_bytes"]
    # bitsandbytes replaces nn.Linear only: the fused experts stay float32, and the audit flags them
    assert {f["role"] for f in loaded["flagged"]} == {"experts"}
    # one byte per value plus one fp32 scale per output row, as measured on the loaded tensors
    assert all(p["bytes"] == p["shape"][0] * p["shape"][1] + 4 * p["shape"][0] for p in linears)

    # the estimate, from the checkpoint's headers alone, counts what the load stored: every 2-D layer weight
    # at one byte per value plus its row scales. The one gap: a v5 MoE router is a Parameter of its own
    # module, not an nn.Linear, so bitsandbytes leaves it float32 where the estimate counts it as int8
    weights = result["memory"]["estimate_components"]["weights"]
    routers = [p for p in loaded["params"] if not p["quantized"] and p["name"].endswith(".mlp.gate.weight")]
    assert len(routers) == 2
    router_gap = sum(p["bytes"] - (p["shape"][0] * p["shape"][1] + 4 * p["shape"][0]) for p in routers)
    assert weights + router_gap == loaded["total_bytes"], (weights, router_gap, loaded["total_bytes"])
    matrices = [s for s in tensor_shapes(checkpoints["olmoe-tiny"]).values() if len(s) == 2]
    assert sum(p["shape"][0] * p["shape"][1] for p in linears) < sum(a * b for a, b in matrices)  # not everything

    base = read_json(run_dir / "adapter" / "base_model.json")["load"]
    assert base["quant"] == "int8" and base["bnb_8bit"] == {"load_in_8bit": True} and "bnb_4bit" not in base
    assert summary_row(result)["quant"] == "int8"
