"""nf4-experts quantizes each fused expert tensor while the checkpoint is read: the same NF4 bytes as
quantizing after a plain 4-bit load, without the full-precision experts ever being resident."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import REPO

BNB = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def _expert_states(model: Any) -> dict[str, tuple[Any, Any]]:
    return {
        f"{module_name}.{name}": (plist.original.detach(), plist[0].quant_state)
        for module_name, module in model.named_modules()
        for name, plist in getattr(module, "parametrizations", {}).items()
    }


@pytest.mark.parametrize("model", ["qwen3moe-tiny", "olmoe-tiny"])
def test_load_time_experts_equal_post_load_quantization_bit_for_bit(checkpoints, model):
    import torch
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunegrid.cell.experts import quant as expert_quant
    from tunegrid.cell.load import quant_audit

    kwargs = {"dtype": torch.float32, "use_safetensors": True}
    post = AutoModelForCausalLM.from_pretrained(
        checkpoints[model], quantization_config=BitsAndBytesConfig(**BNB), **kwargs
    )
    post.requires_grad_(False)  # as peft leaves the base model; the post-load pass skips trainable tensors
    assert len(quant_audit.quantize_experts_post_load(post)["changed"]) == 4
    at_load = expert_quant.load_causal_lm(
        checkpoints[model], {**kwargs, "quantization_config": expert_quant.ExpertNF4Config(**BNB)}
    )

    # the experts were fused and quantized one expert at a time, not as a fused full-precision tensor
    assert {type(c).__name__ for c in at_load._weight_conversions} == {"ExpertStreamConverter"}
    want, got = _expert_states(post), _expert_states(at_load)
    assert got.keys() == want.keys() and len(got) == 4
    for name, (data, state) in got.items():
        ref_data, ref_state = want[name]
        assert torch.equal(data, ref_data), name
        assert torch.equal(dequantize_4bit(data, state), dequantize_4bit(ref_data, ref_state)), name
    ids = torch.arange(24).view(2, 12)
    with torch.no_grad():
        assert torch.equal(at_load(input_ids=ids).logits, post(input_ids=ids).logits)


MEASURE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import torch
from tunegrid.runtime.memory import runtime_baseline_bytes
from tunegrid.runtime.memory import MemoryMeter
from tunegrid.cell.experts import quant as expert_quant
from tunegrid.cell.load import quant_audit

baseline = runtime_baseline_bytes()  # the training stack imported, no model
meter = MemoryMeter("cpu")
meter.reset()
bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
config = expert_quant.ExpertNF4Config(**bnb)
model = expert_quant.load_causal_lm(Path(sys.argv[1]), {"dtype": torch.float32, "quantization_config": config})
peak = meter.peak_bytes()
after = meter.current_bytes()
audit = quant_audit.audit_model(model, quantization_requested=True)
print(json.dumps({"baseline": baseline, "peak": peak, "after": after,
                  "weights": audit["total_bytes"], "flagged": audit["flagged"]}))
"""

# OLMoE-1B-7B's expert layout at half width: 64 experts, 4 layers; fp32 experts are 1.5 GiB.
REDUCED_OLMOE = {
    "source": "synthetic",
    "architecture": "olmoe",
    "seed": 0,
    "config": {
        "vocab_size": 512,
        "hidden_size": 1024,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_experts": 64,
        "num_experts_per_tok": 8,
    },
}
MiB = 2**20


@pytest.mark.slow
def test_load_peak_is_quantized_weights_plus_one_full_precision_tensor(tmp_path, dataset_path):
    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import build_synthetic
    from tunegrid.prepare.data import corpus_texts

    model_dir = tmp_path / "olmoe-reduced"
    build_synthetic(dict(REDUCED_OLMOE), list(corpus_texts(read_dataset(dataset_path))), model_dir)
    config = REDUCED_OLMOE["config"]
    layers, experts, hidden, inter = (
        config["num_hidden_layers"],
        config["num_experts"],
        config["hidden_size"],
        config["intermediate_size"],
    )
    largest = experts * 2 * inter * hidden * 4  # one layer's gate_up_proj in fp32
    full_experts = layers * experts * 3 * inter * hidden * 4

    # a fresh process: its peak is this load's alone
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model_dir), str(REPO / "src")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["flagged"] == []  # every expert tensor is NF4
    growth = measured["peak"] - measured["baseline"]
    # what the loaded process holds beyond the runtime and the quantized weights: the allocator's cache
    # of freed pieces and the small tensors around them, measured in that same process
    retained = max(0, measured["after"] - measured["baseline"] - measured["weights"])
    shown = {k: round(v / MiB) for k, v in measured.items() if k != "flagged"}
    # the bound: quantized weights + the largest full-precision tensor + what the runtime keeps
    assert growth <= measured["weights"] + largest + retained, {**shown, "largest": largest / MiB}
    # a load that ever held all full-precision experts grows by at least full_experts
    assert growth < full_experts / 2, shown
