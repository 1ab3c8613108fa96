"""LoRA on fused MoE experts held NF4 (quant: nf4-experts, lora.target_parameters): the adapters train over
the 4-bit base with the gradients of the same model whose experts are the dequantized weights in plain
fp32 (tight) or bf16 (bf16's rounding), the packed storage stays 4-bit and frozen, and a cell ends ok.

Every model here goes through the cell's own setup path (load, audit_and_adapt) on a simulated
AVX512-BF16 host (see test_gradients.py): bitsandbytes' inference repacking must never fire.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import test_gradients
from conftest import QWEN_MOE, one_cell, one_cell_spec, ready_trainer, run_in_process
from test_gradients import RELATIVE_TOLERANCE, _dequantized_reference

from tunegrid.runtime.files import read_json, read_jsonl

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "target_parameters": EXPERTS, "dropout": 0.0}
MOE_MODELS = ["qwen3moe-tiny", "olmoe-tiny"]
avx512bf16_host = test_gradients.avx512bf16_host  # the simulated AVX512-BF16 host, as a fixture here too

# bf16 keeps 8 significant bits (relative rounding 2^-9 per value); the reference rounds every weight,
# adapter and activation to it through two layers and a 512-way softmax: the gradients move by up to 3% of
# their norm (2.8% qwen3moe-tiny, 2.9% olmoe-tiny, the same on any CPU: rounding, not timing), the loss by
# 0.1%. 10% leaves room for that; a lost adapter path moves a gradient by its whole size (and the fp32
# comparison above holds every gradient to 1e-4 anyway).
BF16_RELATIVE_TOLERANCE = 1e-1


def _trainer(checkpoints: dict[str, Path], dataset_path: Path, tmp_path: Path, model: str, **train: Any) -> Any:
    spec = one_cell(model=model, quant="nf4-experts", lora=LORA, train={"steps": 1, **train})
    return ready_trainer(spec, checkpoints, dataset_path, tmp_path)


def _expert_lora(model: Any) -> dict[str, Any]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad and ".experts." in n}


def _randomize_lora_b(model: Any) -> None:
    """Non-zero B: the A matrices get a gradient too (peft initializes B to zero)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _loss_and_grads(model: Any, batch: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _expert_storage(model: Any) -> dict[str, Any]:
    """Every ≥3-D parametrized tensor: its packed storage and quant state."""
    return {
        f"{module_name}.{name}": (plist.original, plist[0].quant_state, len(plist))
        for module_name, module in model.named_modules()
        for name, plist in getattr(module, "parametrizations", {}).items()
        if len(plist[0].quant_state.shape) >= 3
    }


def _assert_close(got: dict[str, Any], want: dict[str, Any], tolerance: float) -> None:
    assert got.keys() == want.keys() and got
    for name, expected in want.items():
        assert got[name] is not None, f"{name} got no gradient"
        error = (got[name].float() - expected.float()).norm().item()
        assert error <= tolerance * expected.norm().item() + 1e-8, (name, error, expected.norm().item())


@pytest.mark.parametrize("model", MOE_MODELS)
def test_expert_lora_grads_match_dequantized_fp32_and_bf16_references(
    checkpoints, dataset_path, tmp_path, avx512bf16_host, model
):
    import torch

    trainer = _trainer(checkpoints, dataset_path, tmp_path, model)
    storage = _expert_storage(trainer.model)
    assert len(storage) == 4, "every expert tensor, those with adapters too, is NF4"
    assert len(_expert_lora(trainer.model)) == 8  # A and B on gate_up_proj and down_proj, two layers
    _randomize_lora_b(trainer.model)
    batch = {k: v.to(trainer.device) for k, v in trainer.stream.batch(0).items()}
    loss, got = _loss_and_grads(trainer.model, batch)
    assert avx512bf16_host == [], "bitsandbytes repacked a 4-bit weight into its inference-only layout"

    # peft's own ParamWrapper over plain fp32 experts that hold the dequantized NF4 values
    reference = _dequantized_reference(trainer, checkpoints[model])
    assert not any(getattr(m, "parametrizations", None) for m in reference.modules())
    want_loss, want = _loss_and_grads(reference, batch)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    _assert_close(got, want, RELATIVE_TOLERANCE)

    reference = reference.to(torch.bfloat16)  # weights, adapters and activations in bf16
    bf16_loss, bf16 = _loss_and_grads(reference, batch)
    assert loss == pytest.approx(bf16_loss, rel=1e-2)
    _assert_close(got, bf16, BF16_RELATIVE_TOLERANCE)


@pytest.mark.parametrize("model", MOE_MODELS)
def test_every_expert_adapter_gets_a_gradient_and_the_base_stays_nf4(
    checkpoints, dataset_path, tmp_path, avx512bf16_host, model
):
    import torch

    trainer = _trainer(checkpoints, dataset_path, tmp_path, model, gradient_checkpointing=True)
    before = {n: (data.clone(), state, depth) for n, (data, state, depth) in _expert_storage(trainer.model).items()}
    experts = _expert_lora(trainer.model)
    optimizer = torch.optim.AdamW([p for p in trainer.model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        batch = {k: v.to(trainer.device) for k, v in trainer.stream.batch(step).items()}
        optimizer.zero_grad(set_to_none=True)
        trainer.model(**batch).loss.backward()
        for name, param in experts.items():
            if step or "lora_B" in name:  # B starts at zero, so A's gradient is zero at the first step
                assert param.grad is not None and param.grad.abs().sum() > 0, (step, name)
        optimizer.step()
    assert avx512bf16_host == []
    after = _expert_storage(trainer.model)
    assert after.keys() == before.keys()
    for name, (data, state, depth) in after.items():
        packed, quant_state, depth_before = before[name]
        assert data.dtype == torch.uint8 and not data.requires_grad, name
        assert torch.equal(data, packed) and state is quant_state, f"{name}: the 4-bit base changed"
        assert depth == depth_before == 1, f"{name}: a LoRA parametrization was left on it"
    assert not [n for n, p in trainer.model.named_parameters() if p.dim() >= 3 and p.is_floating_point()], (
        "a full-precision expert tensor exists outside a forward"
    )


def test_plain_peft_over_nf4_experts_still_fails():
    """The defect cell/experts/lora.py works around, with peft's ParamWrapper left as it is: targets by suffix match
    nothing on a parametrized module. If this starts to fail, peft matches them now: recheck cell/experts/lora.py."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(QWEN_MOE["architecture"], **QWEN_MOE["config"])
    model = AutoModelForCausalLM.from_config(config).float()
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() >= 3:
                replace_parameter_4bit(module, name, quant_type="nf4", compress_statistics=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERTS))
    assert not [m for m in adapted.modules() if hasattr(m, "parameter_name")]
    assert any("no parameter was matched" in str(w.message) for w in caught)


def test_nf4_experts_cell_with_expert_adapters_ends_ok_and_its_adapter_reloads(
    checkpoints, dataset_path, tmp_path, avx512bf16_host
):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tunegrid.cell.adapters import REFERENCE_BATCH_FILE, load_adapter
    from tunegrid.cell.load.model import load_model
    from tunegrid.cell.loop.precision import precision_setup
    from tunegrid.cell_spec import CellSpec
    from tunegrid.contract import CellKernels

    spec = one_cell(model="olmoe-tiny", quant="nf4-experts", lora=LORA, train={"steps": 4})
    run_dir = tmp_path / spec["cell_id"]
    facts = run_in_process(spec, checkpoints, dataset_path, run_dir)
    assert facts["outcome"] == "ok", facts["reason"]
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 4
    assert avx512bf16_host == [], "the cell's eval no-grad reference forward repacked a 4-bit weight"
    audit = read_json(run_dir / "audit.json")
    trains = audit["lora"]["trains"]
    assert {t: (trains[t]["role"], trains[t]["base"]) for t in EXPERTS} == {t: ("experts", {"nf4": 2}) for t in EXPERTS}
    assert trains["q_proj"]["role"] == "attention" and trains["q_proj"]["base_4bit"]
    by_role = audit["lora"]["trainable_params_by_role"]
    assert by_role["experts"] > 0 and by_role["attention"] > 0 and by_role["other"] == 0
    assert sum(by_role.values()) == facts["params"]["trainable"]
    assert audit["after_adapters"]["flagged"] == [] and audit["expert_quantization"]["kept_for_lora"] == []

    # the saved adapter, loaded onto the same NF4 base, gives the cell's reference loss
    typed = CellSpec.from_json(spec)
    model = load_model(
        checkpoints["olmoe-tiny"], typed, precision_setup("fp32", "cpu"), CellKernels(), torch.device("cpu")
    )
    model = load_adapter(model, run_dir / "adapter")
    batch = load_file(str(run_dir / "adapter" / REFERENCE_BATCH_FILE))
    with torch.no_grad():
        loss = model.eval()(**batch).loss.item()
    assert loss == pytest.approx(facts["training"]["reference_batch_loss"], rel=1e-5)

    # and onto the full-precision checkpoint with peft's own loader: the same keys (the nesting order agrees)
    full = AutoModelForCausalLM.from_pretrained(checkpoints["olmoe-tiny"], dtype=torch.float32)
    with torch.no_grad():
        base_loss = full.eval()(**batch).loss.item()
    full = PeftModel.from_pretrained(full, run_dir / "adapter").eval()
    with torch.no_grad():
        full_loss = full(**batch).loss.item()
    assert abs(full_loss - base_loss) > 1e-3 and abs(full_loss - loss) < abs(base_loss - loss)


@pytest.mark.parametrize("model", MOE_MODELS)
def test_adapters_attached_before_the_post_load_quantization_train_the_same(checkpoints, model):
    """The post-load pass quantizes expert tensors that already carry an adapter and makes those train over
    NF4 too: same packed bytes, loss and gradients as quantizing at load and attaching after."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunegrid.cell.experts import quant as expert_quant
    from tunegrid.cell.load import quant_audit
    from tunegrid.cell.load.model import attach_lora

    bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    kwargs = {"dtype": torch.float32, "use_safetensors": True}
    spec = one_cell_spec(model=model, lora={"r": 4, "alpha": 8, **LORA})
    assert not spec.train.gradient_checkpointing
    at_load = expert_quant.load_causal_lm(
        checkpoints[model], {**kwargs, "quantization_config": expert_quant.ExpertNF4Config(**bnb)}
    )
    at_load = attach_lora(at_load, spec)
    post = AutoModelForCausalLM.from_pretrained(
        checkpoints[model], quantization_config=BitsAndBytesConfig(**bnb), **kwargs
    )
    post = attach_lora(post, spec)
    change = quant_audit.quantize_experts_post_load(post)
    assert len(change["changed"]) == 4 and change["kept_for_lora"] == []

    _randomize_lora_b(post)
    trained = dict(post.named_parameters())
    with torch.no_grad():
        for name, param in at_load.named_parameters():
            if param.requires_grad:
                param.copy_(trained[name])
    for name, (data, _state, _depth) in _expert_storage(at_load).items():
        assert torch.equal(data, _expert_storage(post)[name][0]), name
    batch = {"input_ids": torch.arange(24).view(2, 12) % 512, "labels": torch.arange(24).view(2, 12) % 512}
    loss, got = _loss_and_grads(post, batch)
    want_loss, want = _loss_and_grads(at_load, batch)
    assert loss == want_loss
    _assert_close(got, want, RELATIVE_TOLERANCE)
    assert all(g is not None and g.abs().sum() > 0 for n, g in got.items() if ".experts." in n)
