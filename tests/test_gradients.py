"""Gradients through 4-bit layers are right on any CPU: LoRA grads of a quantized cell equal those of a
full-precision reference built from the same dequantized weights, and no 4-bit layer is ever left in
bitsandbytes' inference-only CPU layout (the one with no backward)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_study

from tunegrid.config import cell_spec, expand_cells, resolve_study
from tunegrid.files import read_json
from tunegrid.train import CellTrainer, attach_lora, run_worker

MODELS = ("gemma3-hot", "qwen3moe-tiny", "olmoe-tiny")  # a dense model and two MoE families


def _spec(model: str, quant: str, steps: int = 1) -> dict:
    grid = {"model": [model], "precision": ["fp32"], "batch_size": [2], "quant": [quant], "seed": [0]}
    study = resolve_study(make_study(grid=grid, train={"steps": steps, "seq_len": 32, "lr": 0.01}))
    return cell_spec(study, expand_cells(study)[0])


def _base_value(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A base parameter as the quantized model computes with it: 4-bit weights dequantized."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.nn import Linear4bit

    if isinstance(module, Linear4bit) and name == "weight":
        return bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    return getattr(module, name).detach().float()  # a parametrized (NF4) expert dequantizes on access


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("quant", ["none", "nf4", "nf4-experts"])
def test_lora_grads_match_a_dequantized_full_precision_reference(checkpoints, dataset_path, tmp_path, model, quant):
    from transformers import AutoModelForCausalLM

    spec = _spec(model, quant)
    trainer = CellTrainer(spec, checkpoints[model], dataset_path, tmp_path)
    trainer.setup()
    trainer.build_model()
    trainer.build_data()
    batch = trainer.stream.batch(0)
    trainer.forward_backward(batch)
    grads = _lora_grads(trainer.model)
    assert grads, "no adapter received a gradient"

    reference = attach_lora(AutoModelForCausalLM.from_pretrained(checkpoints[model], dtype=torch.float32), spec)
    quantized_modules = dict(trainer.model.named_modules())
    with torch.no_grad():
        for module_name, module in reference.named_modules():
            twin = quantized_modules[module_name]
            for name, param in module.named_parameters(recurse=False):
                param.copy_(_base_value(twin, name) if not param.requires_grad else getattr(twin, name).detach())
    reference.train()
    reference(**batch).loss.backward()
    expected = _lora_grads(reference)
    assert expected.keys() == grads.keys()
    # Same dequantized weights, same inputs, fp32 throughout: only the order of accumulation differs
    # (bitsandbytes dequantizes then multiplies), so agreement to ~1e-4 of each tensor's scale is
    # expected; a gradient lost through the frozen base differs by O(1).
    for name, grad in grads.items():
        scale = expected[name].abs().max().clamp_min(1e-8)
        assert ((grad - expected[name]).abs().max() / scale).item() < 1e-3, name


def test_no_4bit_layer_enters_the_inference_layout_even_where_the_cpu_offers_it(checkpoints, dataset_path, tmp_path, monkeypatch):
    """A tripwire for CPUs with AVX512-BF16: pretend this one has it, and record any repacking."""
    import bitsandbytes.nn.modules as bnb_modules

    repacked: list[tuple] = []
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu",
                        lambda weight, state, *a, **k: (repacked.append(tuple(weight.shape)), (weight, state))[1])
    run_dir = tmp_path / "cell"
    run_worker(_spec("qwen3moe-tiny", "nf4-experts", steps=2), str(checkpoints["qwen3moe-tiny"]), str(dataset_path), str(run_dir))
    facts = read_json(run_dir / "worker.json")
    assert repacked == [], f"{len(repacked)} 4-bit weights were repacked for inference before or during training"
    assert facts["outcome"] == "ok", facts["reason"]


def test_a_missing_autograd_kernel_warning_fails_the_cell(checkpoints, dataset_path, tmp_path, monkeypatch):
    import warnings

    original = CellTrainer.forward_backward

    def warn_then_step(self, batch, scaler=None, scale=None):  # what PyTorch says when an op has no backward
        warnings.warn("xyz: an autograd kernel was not registered to the Autograd key(s) but we are trying to "
                      "backprop through it. This may lead to silently incorrect behavior.", UserWarning)
        return original(self, batch, scaler, scale)

    monkeypatch.setattr(CellTrainer, "forward_backward", warn_then_step)
    run_dir = tmp_path / "cell"
    run_worker(_spec("gemma3-hot", "nf4"), str(checkpoints["gemma3-hot"]), str(dataset_path), str(run_dir))
    facts = read_json(run_dir / "worker.json")
    assert facts["outcome"] == "error" and "autograd kernel" in facts["reason"]
