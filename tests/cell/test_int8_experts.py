"""int8-experts: the 8-bit load (LLM.int8 for nn.Linear) plus axolotl's row-wise int8 of every fused expert
parameter (`quantize_moe_experts` with `load_in_8bit`), dequantized to fp32 on use. A cell trains on it, the audit
counts the experts as 8-bit, the estimate stores them at one byte per value and a scale per row, and a study that
asks for adapters on them is refused."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_study, one_cell, one_cell_spec, ready_trainer

from tunegrid.cell.experts.int8 import Int8RowwiseParametrization
from tunegrid.contract import MemoryEstimate
from tunegrid.study.config import resolve_study
from tunegrid.study.errors import ConfigError

ATTENTION_ONLY = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _unquantized_experts(checkpoints, dataset_path, tmp_path, precision):
    spec = one_cell(model="olmoe-tiny", precision=precision, lora=ATTENTION_ONLY)
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.dim() >= 3}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_int8_experts_cell_trains_over_row_wise_int8_experts(checkpoints, dataset_path, tmp_path, precision):
    full = _unquantized_experts(checkpoints, dataset_path, tmp_path / "full", precision)  # as stored in the cell
    spec = one_cell(model="olmoe-tiny", precision=precision, quant="int8-experts", lora=ATTENTION_ONLY)
    assert spec["cell_id"] == f"olmoe-tiny_{precision}_bs2_int8-experts_s0"
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path / "int8")
    experts = {
        f"{name}.{attr}": plist
        for name, module in trainer.model.named_modules()
        for attr, plist in getattr(module, "parametrizations", {}).items()
        if isinstance(plist[0], Int8RowwiseParametrization)
    }
    assert len(experts) == 4, "gate_up_proj and down_proj of both layers"  # olmoe-tiny: 2 MoE layers
    for name, plist in experts.items():
        original = full[name]
        assert plist.original.dtype == torch.int8 and not plist.original.requires_grad
        rows = original.reshape(-1, original.shape[-1]).to(torch.float16).float()  # axolotl casts to fp16 first
        absmax = rows.abs().amax(dim=1)
        assert torch.equal(plist[0].row_stats, absmax)
        rounded = torch.round(rows * (127.0 / absmax[:, None])).to(torch.int8)
        assert torch.equal(plist.original.reshape(rows.shape), rounded)
        owner, attr = name.rsplit(".", 1)
        dequantized = getattr(trainer.model.get_submodule(owner), attr)  # what the experts' forward reads
        assert dequantized.dtype == torch.float32 and dequantized.shape == original.shape
        assert (dequantized - original.float()).abs().max() <= absmax.max() / 127
    audit = trainer.facts["quant_audit"]
    assert audit["expert_quantization"]["order"] == "after_load"
    assert not [f for f in audit["after_load"]["flagged"] if f["role"] == "experts"], "no expert left full width"
    optimizer_step = trainer.build_optimizer()
    losses = [optimizer_step.run(step, trainer.stream.micro_batches(step)).loss for step in range(2)]
    assert all(math.isfinite(loss) for loss in losses)


def test_the_estimate_stores_int8_experts_at_a_byte_and_a_row_scale_and_loads_them_full_width(checkpoints):
    from tunegrid.prepare.memory_estimate import estimate_cell, tensor_shapes

    def estimate(quant: str) -> MemoryEstimate:
        spec = one_cell_spec(model="olmoe-tiny", quant=quant, lora=ATTENTION_ONLY)
        return estimate_cell(spec, checkpoints["olmoe-tiny"])

    int8, experts = estimate("int8"), estimate("int8-experts")
    shapes = tensor_shapes(checkpoints["olmoe-tiny"])
    expert_values = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    rows = sum(math.prod(s[:-1]) for n, s in shapes.items() if ".experts." in n)
    saved = int8.components.weights - experts.components.weights
    assert saved == expert_values * 4 - (expert_values + 4 * rows), "fp32 experts become 1 byte + a scale per row"
    assert experts.load_bytes > int8.load_bytes, "quantized once loaded: the load holds them at full width"


def test_a_study_asking_for_adapters_on_int8_experts_is_refused():
    study = make_study(
        grid={
            "model": ["olmoe-tiny"],
            "precision": ["fp32"],
            "batch_size": [2],
            "quant": ["int8-experts"],
            "seed": [0],
        },
        lora={"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]},
    )
    with pytest.raises(ConfigError, match="lora.target_parameters.*int8-experts"):
        resolve_study(study)


def test_the_docs_snippet_puts_an_int8_experts_adapter_back_on_its_base(checkpoints, dataset_path, tmp_path):
    from conftest import run_in_process
    from test_readme_adapters import readme_snippet

    spec = one_cell(model="olmoe-tiny", quant="int8-experts", lora=ATTENTION_ONLY, train={"steps": 2})
    facts = run_in_process(spec, checkpoints, dataset_path, tmp_path)
    assert facts["outcome"] == "ok", facts["reason"]
    code = readme_snippet().replace("results/<study>/models/<model>", str(checkpoints["olmoe-tiny"]))
    code = code.replace("results/<study>/runs/<cell_id>/adapter", str(tmp_path / "adapter"))
    namespace: dict = {}
    exec(compile(code, "review.md", "exec"), namespace)  # noqa: S102 — the page's own snippet, as written
    expected = facts["training"]["reference_batch_loss"]
    assert abs(namespace["loss"] - expected) <= 1e-6 * abs(expected)
