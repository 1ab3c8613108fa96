"""train.weight_offloading: each decoder layer's frozen base weights live in host memory and come to the device for
that layer's forward and backward (FSDP's parameter offloading at one rank). A CPU cell installs nothing (the
weights already live in host memory); installed on CPU by hand, the mechanism holds one layer's weights at a time
and trains the very same numbers as the cell without it."""

from __future__ import annotations

import pytest
import torch
from conftest import one_cell, one_cell_spec, ready_trainer, run_in_process

from tunegrid.cell.memory.weight_offload import WeightOffload, decoder_layers


def _steps(checkpoints, dataset_path, tmp_path, offloaded: bool, checkpointing: bool, quant: str, steps: int = 2):
    spec = one_cell(quant=quant, train={"gradient_checkpointing": checkpointing, "weight_offloading": offloaded})
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path / f"{offloaded}-{checkpointing}-{quant}")
    optimizer_step = trainer.build_optimizer()
    assert trainer.weight_offload is None, "a CPU cell moves nothing"
    offload = WeightOffload(trainer.model, torch.device("cpu")).install() if offloaded else None
    results = [optimizer_step.run(step, trainer.stream.micro_batches(step)) for step in range(steps)]
    adapters = {name: p.detach().clone() for name, p in trainer.trainable_named}  # after the updates
    return results, adapters, offload, trainer


@pytest.mark.parametrize(("checkpointing", "quant"), [(False, "none"), (True, "none"), (True, "nf4")])
def test_the_offloaded_layers_train_the_same_numbers_one_layer_on_the_device_at_a_time(
    checkpoints, dataset_path, tmp_path, checkpointing, quant
):
    plain, plain_adapters, _, _ = _steps(checkpoints, dataset_path, tmp_path, False, checkpointing, quant)
    results, adapters, offload, trainer = _steps(checkpoints, dataset_path, tmp_path, True, checkpointing, quant)
    assert [(r.loss, r.grad_norm) for r in results] == [(r.loss, r.grad_norm) for r in plain]
    assert all(torch.equal(adapters[name], plain_adapters[name]) for name in plain_adapters)
    layers = len(decoder_layers(trainer.model))
    assert layers == 2 and len(offload.units) == layers and offload.offloaded_bytes > 0
    largest = max(unit.nbytes for unit in offload.units)
    assert offload.peak_resident_bytes == largest, "one layer's weights at a time, in the forward and the backward"
    assert offload.resident_bytes == 0 and not offload.live, "between steps every layer's weights are on the host"
    assert offload.copied_bytes == 2 * 2 * offload.offloaded_bytes, "each layer comes for its forward and backward"
    frozen = [p for _, module in decoder_layers(trainer.model) for p in module.parameters() if not p.requires_grad]
    assert frozen and all(p.untyped_storage().nbytes() == 0 for p in frozen)
    assert all(p.untyped_storage().nbytes() > 0 for _, p in trainer.trainable_named), "the adapters stay"
    offload.remove()
    assert all(p.untyped_storage().nbytes() > 0 for p in frozen) and offload.resident_bytes == offload.offloaded_bytes


def test_a_no_grad_forward_leaves_no_weight_behind(checkpoints, dataset_path, tmp_path):
    spec = one_cell()
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path)
    batch = trainer.stream.micro_batches(0)[0]
    with torch.no_grad():
        plain = trainer.model(**batch).loss
    offload = WeightOffload(trainer.model, torch.device("cpu")).install()
    with torch.no_grad():
        offloaded = trainer.model(**batch).loss
    assert torch.equal(plain, offloaded) and not offload.live and offload.peak_resident_bytes > 0


def test_the_worker_records_what_it_offloaded(checkpoints, dataset_path, tmp_path):
    spec = one_cell(train={"steps": 1, "weight_offloading": True})
    facts = run_in_process(spec, checkpoints, dataset_path, tmp_path)
    assert facts["outcome"] == "ok" and facts["memory"]["weights_offloaded_bytes"] == 0  # a CPU cell: nothing moves


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_estimate_keeps_one_layers_weights_on_cuda_and_all_of_them_on_cpu(checkpoints, checkpointing):
    from tunegrid.prepare.memory_estimate import estimate_cell

    def parts(offloading: bool, device: str, quant: str = "none") -> dict[str, int]:
        train = {"weight_offloading": offloading, "gradient_checkpointing": checkpointing}
        spec = one_cell_spec(quant=quant, train=train)
        return estimate_cell(spec, checkpoints["gemma3-hot"], 0, device=device).components.as_dict()

    assert parts(True, "cpu") == parts(False, "cpu")
    for quant in ("none", "nf4"):
        plain, offloaded = parts(False, "cuda", quant), parts(True, "cuda", quant)
        assert offloaded["weights_offloaded_to_host"] > 0 and offloaded["weights"] < plain["weights"]
        assert offloaded["weights"] + offloaded["weights_offloaded_to_host"] == plain["weights"]
        assert {k: v for k, v in offloaded.items() if not k.startswith("weights")} == {
            k: v for k, v in plain.items() if not k.startswith("weights")
        }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloading_lowers_the_measured_step_peak_on_cuda():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8))
    model = torch.nn.Module()
    model.layers = blocks
    for p in model.parameters():
        p.requires_grad_(False)
    model.cuda()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)

    def peak() -> tuple[int, torch.Tensor]:  # the device's high-water mark, the weights on it included
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        h = x
        for block in model.layers:
            h = torch.nn.functional.gelu(block(h))
        h.square().mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), x.grad.clone()

    layer = 1024 * 1025 * 4  # one Linear's weight and bias in fp32
    plain, grad = peak()
    offload = WeightOffload(model, torch.device("cuda")).install()
    offloaded, offloaded_grad = peak()
    assert offload.offloaded_bytes == 8 * layer and offload.peak_resident_bytes == layer
    assert offloaded < plain - 6 * layer, (offloaded, plain)
    assert torch.equal(grad, offloaded_grad)
