"""Gradients through 4-bit layers equal those of the same model with the dequantized weights, on any host.

bitsandbytes repacks a Linear4bit weight into an inference-only CPU layout (no backward) on the first
eval-mode forward without grad when the CPU has AVX512-BF16. Most hosts lack it, so `avx512bf16_host`
simulates one: bitsandbytes' capability check answers yes; its conversion is replaced by a recorder that
flips the layer to the packed path exactly as the real one does (the weight bytes stay in the standard
layout, which bitsandbytes' portable gemv_4bit kernel reads); and gemv_4bit runs out of autograd's sight,
as the native AVX512-BF16 kernel does. An unguarded layer then trains through `gemv_4bit` and loses the
gradient through its frozen base weight, as on such a host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import one_cell, ready_trainer, work_cell

from tunegrid.cell.loop.step import OptimizerStep
from tunegrid.cell.train import CellTrainer
from tunegrid.runtime.files import read_json

LORA = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}

# Both sides compute in fp32 with bit-identical dequantized weights (bitsandbytes' own backward dequantizes
# and runs F.linear, as the reference does), so they can differ only by fp32 accumulation order (0 on a
# CPU here; a GPU's kernels may sum in another order, ~1e-6 relative).
# 1e-4 of each tensor's norm leaves two orders of magnitude for that; the defect changes gradients by
# tens of percent (a lost path through a frozen base weight), so the tolerance cannot hide it.
RELATIVE_TOLERANCE = 1e-4


@pytest.fixture
def avx512bf16_host(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """bitsandbytes believes this CPU has AVX512-BF16; every packing conversion it attempts is recorded."""
    import bitsandbytes.nn.modules as bnb_modules

    conversions: list[tuple[Any, ...]] = []

    def convert(qweight: Any, quant_state: Any, block_n: int = 32) -> tuple[Any, Any]:
        conversions.append(tuple(quant_state.shape))
        quant_state.packing_format_for_cpu = True  # from now on matmul_4bit takes the gemv_4bit path
        return qweight, quant_state

    import bitsandbytes.functional as bnb_functional
    import torch

    portable_gemv = bnb_functional.gemv_4bit

    def native_gemv(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():  # a native library call: autograd records nothing through it
            return portable_gemv(*args, **kwargs)

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu", convert)
    monkeypatch.setattr(bnb_functional, "gemv_4bit", native_gemv)
    return conversions


def _spec(model: str, quant: str) -> dict[str, Any]:
    return one_cell(model=model, quant=quant, lora=LORA, train={"steps": 1})


def _trainer(checkpoints: dict[str, Path], dataset_path: Path, tmp_path: Path, model: str, quant: str) -> CellTrainer:
    """The cell's own setup path: load, audit_and_adapt (with nf4-experts' reference forwards), data."""
    return ready_trainer(_spec(model, quant), checkpoints, dataset_path, tmp_path)


def _dequantized_reference(trainer: CellTrainer, model_dir: Path) -> Any:
    """A plain fp32 copy of the cell's model: dequantized base weights, same adapters, same everything else."""
    import torch
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit
    from transformers import AutoModelForCausalLM

    from tunegrid.cell.load.model import attach_lora

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
    reference = attach_lora(reference.to(trainer.device), trainer.spec)
    ref_modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, module in trainer.model.named_modules():
            if ".parametrizations" in name:  # bitsandbytes' storage of a parametrized tensor, handled below
                continue
            target = ref_modules[name]
            if isinstance(module, Linear4bit):
                assert not getattr(module.weight.quant_state, "packing_format_for_cpu", False), name
                target.weight.copy_(dequantize_4bit(module.weight.data, module.weight.quant_state).float())
                if module.bias is not None:
                    target.bias.copy_(module.bias.float())
                continue
            for pname in getattr(module, "parametrizations", {}):  # nf4-experts: bitsandbytes' own dequantization
                getattr(target, pname).copy_(getattr(module, pname).float())
            for pname, param in module.named_parameters(recurse=False):
                if getattr(param, "quant_state", None) is None:
                    getattr(target, pname).copy_(param.float())
    reference.train()
    return reference


def _lora_grads(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("quant", ["none", "nf4", "nf4-experts"])
@pytest.mark.parametrize("model", ["gemma3-hot", "qwen3moe-tiny", "olmoe-tiny"])
def test_lora_grads_match_dequantized_reference(checkpoints, dataset_path, tmp_path, avx512bf16_host, model, quant):
    import torch

    trainer = _trainer(checkpoints, dataset_path, tmp_path, model, quant)
    assert avx512bf16_host == [], "bitsandbytes repacked a 4-bit weight into its inference-only layout"
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B: the A matrices get a gradient too, through every later base layer
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    reference = _dequantized_reference(trainer, checkpoints[model])
    batch = {k: v.to(trainer.device) for k, v in trainer.stream.batch(0).items()}

    got = _lora_grads(trainer.model, batch)
    want = _lora_grads(reference, batch)
    assert avx512bf16_host == [], "a training forward repacked a 4-bit weight"
    assert got.keys() == want.keys() and got
    for name, expected in want.items():
        assert got[name] is not None, f"{name} got no gradient"
        error = (got[name].float() - expected.float()).norm().item()
        assert error <= RELATIVE_TOLERANCE * expected.norm().item() + 1e-8, (name, error, expected.norm().item())


def test_simulated_host_really_triggers_the_packing(avx512bf16_host):
    """The simulation is live: an unguarded Linear4bit on this 'host' is repacked and then loses its input gradient."""
    import torch
    from bitsandbytes.nn import Linear4bit

    layer = Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")  # quantizes
    assert layer.weight.quant_state is not None
    x = torch.randn(4, 64)
    layer.eval()
    with torch.no_grad():
        layer(x)
    assert avx512bf16_host == [(32, 64)]
    layer.train()
    assert not layer(x.requires_grad_(True)).requires_grad  # for good: training now gets no gradient through it


def test_packed_layout_is_refused(checkpoints, dataset_path, tmp_path):
    from tunegrid.cell.load.quant_audit import inference_packed_layers, require_trainable_layout

    trainer = _trainer(checkpoints, dataset_path, tmp_path, "qwen3moe-tiny", "nf4")
    assert inference_packed_layers(trainer.model) == []
    require_trainable_layout(trainer.model)
    name, param = next(
        (n, p) for n, p in trainer.model.named_parameters() if getattr(p, "quant_state", None) is not None
    )
    param.quant_state.packing_format_for_cpu = True
    assert inference_packed_layers(trainer.model) == [name]
    with pytest.raises(RuntimeError, match="inference-only CPU layout"):
        require_trainable_layout(trainer.model)


def test_census_counts_a_missing_grad():
    from tunegrid.cell.loop.instrument import DtypeCensus

    census = DtypeCensus()
    census._on_grad(None)
    assert census.as_dict()["backward"] == {"none": 1}


_NO_AUTOGRAD_LIB: Any = None


def _no_autograd_identity() -> Any:
    """An op with a CPU kernel and no autograd kernel: PyTorch's fallback warns in backward (as for gemv_4bit)."""
    import torch

    global _NO_AUTOGRAD_LIB
    if _NO_AUTOGRAD_LIB is None:
        _NO_AUTOGRAD_LIB = torch.library.Library("tunegrid_test", "DEF")
        _NO_AUTOGRAD_LIB.define("identity(Tensor x) -> Tensor")
        _NO_AUTOGRAD_LIB.impl("identity", lambda x: x.clone(), "CPU")
    return torch.ops.tunegrid_test.identity


def test_missing_autograd_kernel_warning_fails_the_cell(checkpoints, dataset_path, tmp_path, monkeypatch):
    identity = _no_autograd_identity()
    original = OptimizerStep.forward_backward

    def through_op_without_backward(self: OptimizerStep, batch: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        adapted = next(m for n, m in self.model.named_modules() if n.endswith("q_proj"))  # output requires grad
        hook = adapted.register_forward_hook(lambda _m, _i, out: identity(out))
        try:
            return original(self, batch, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(OptimizerStep, "forward_backward", through_op_without_backward)
    spec = _spec("gemma3-hot", "none")
    run_dir = tmp_path / spec["cell_id"]
    work_cell(spec, checkpoints["gemma3-hot"], dataset_path, run_dir)
    facts = read_json(run_dir / "worker.json")
    assert facts["outcome"] == "error", facts["reason"]
    assert "autograd kernel was not registered" in facts["reason"] and facts["stage"] == "step"
