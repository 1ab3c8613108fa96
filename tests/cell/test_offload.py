"""train.activation_offloading: the cell's step keeps every saved tensor but the weights in host memory, and
trains the same numbers; on CUDA the step's measured peak falls, on CPU nothing moves."""

from __future__ import annotations

import pytest
import torch
from conftest import one_cell, one_cell_spec, ready_trainer, run_in_process

from tunegrid.cell.memory.activation_offload import ActivationOffload
from tunegrid.cell_spec import CellSpec
from tunegrid.contract import MemoryComponents


def _step(checkpoints, dataset_path, tmp_path, offloading: bool, checkpointing: bool = False):
    spec = one_cell(train={"activation_offloading": offloading, "gradient_checkpointing": checkpointing})
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path / str(offloading))
    optimizer_step = trainer.build_optimizer()
    packed = []
    if optimizer_step.offload is not None:  # count what the cell's hooks are handed
        pack = optimizer_step.offload.pack
        optimizer_step.offload.pack = lambda tensor: packed.append(tensor.numel()) or pack(tensor)
    result = optimizer_step.run(0, trainer.stream.micro_batches(0))
    return optimizer_step, result, packed


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_cpu_cell_hands_its_saved_tensors_to_the_hooks_and_trains_the_same(
    checkpoints, dataset_path, tmp_path, checkpointing
):
    plain, plain_result, _ = _step(checkpoints, dataset_path, tmp_path, False, checkpointing)
    offloaded, result, packed = _step(checkpoints, dataset_path, tmp_path, True, checkpointing)
    assert plain.offload is None and len(packed) > 10, "the forward's saved tensors go through the hooks"
    assert offloaded.offload.moved_bytes == 0, "on a CPU cell the activations already live in host memory"
    assert result.loss == plain_result.loss and result.grad_norm == plain_result.grad_norm


def test_the_worker_records_what_the_first_step_moved(checkpoints, dataset_path, tmp_path):
    spec = one_cell(train={"steps": 1, "activation_offloading": True})
    facts = run_in_process(spec, checkpoints, dataset_path, tmp_path)
    assert facts["memory"]["activations_offloaded_bytes"] == 0  # a CPU cell: nothing to move


def test_the_hooks_leave_weights_and_small_tensors_and_bring_the_rest_back():
    offload = ActivationOffload(torch.device("cpu"))
    weight = torch.nn.Parameter(torch.ones(4, 4))
    assert offload.pack(weight) is weight and offload.unpack(offload.pack(torch.ones(2))).shape == (2,)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_estimate_keeps_one_layers_activations_on_cuda_and_all_of_them_on_cpu(checkpoints, checkpointing):
    from tunegrid.prepare.memory_estimate import estimate_cell

    def parts(offloading: bool, device: str) -> MemoryComponents:
        train = {"activation_offloading": offloading, "gradient_checkpointing": checkpointing}
        spec = one_cell_spec(batch=8, train=train)
        return estimate_cell(spec, checkpoints["gemma3-hot"], 0, device=device).components

    assert parts(True, "cpu") == parts(False, "cpu")
    plain, offloaded = parts(False, "cuda"), parts(True, "cuda")
    assert offloaded.activations < plain.activations and offloaded.activations_offloaded_to_host > 0
    assert offloaded.activations + offloaded.activations_offloaded_to_host == plain.activations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloading_lowers_the_measured_step_peak_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(8)])
    model = model.cuda()
    x = torch.randn(512, 256, device="cuda", requires_grad=True)

    def peak(offload: ActivationOffload | None) -> tuple[int, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if offload is None:
            loss = model(x).square().mean()
        else:
            with offload.active():
                loss = model(x).square().mean()
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, model[0][0].weight.grad.clone()

    plain, grad = peak(None)
    offload = ActivationOffload(torch.device("cuda"))
    offloaded, offloaded_grad = peak(offload)
    assert offload.moved_bytes >= 8 * 2 * 512 * 256 * 4 * 0.9  # each layer's input and pre-activation
    assert offloaded < 0.5 * plain, (offloaded, plain)
    # cuBLAS may pick another kernel for tensors at other addresses, so the sums can differ in the last bit; a
    # stale or unsynchronised copy would differ by far more than this
    torch.testing.assert_close(offloaded_grad, grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("offloaded", ["activations_offloaded_to_host", "weights_offloaded_to_host"])
def test_the_plan_asks_the_host_for_what_is_offloaded(offloaded):
    from dataclasses import replace

    from tunegrid.contract import MemoryEstimate
    from tunegrid.prepare.cell_plan import host_mem_mb

    plain = MemoryEstimate(
        worker="spawned",
        estimate_bytes=4 * 2**30,
        stage="step",
        load_bytes=0,
        step_bytes=4 * 2**30,
        components=MemoryComponents(),
    )
    with_offload = replace(plain, components=MemoryComponents(**{offloaded: 2 * 2**30}))
    assert host_mem_mb(with_offload, 1) == host_mem_mb(plain, 1) + 3 * 1024  # the safety factor 1.5 over 2 GiB


def test_the_contract_of_an_offloading_cell_asks_the_host_for_its_plan(tmp_path, checkpoints):
    from tunegrid.contract import CellContract, CellJob
    from tunegrid.prepare.cell_plan import host_mem_mb, mem_mb_for_job, write_contract

    spec = one_cell(train={"activation_offloading": True})
    job = CellJob(model_dir=str(checkpoints[spec["model"]["name"]]), data_path="d", run_dir="r", result_path="r/x")
    contract = write_contract(CellSpec.from_json(spec), job, tmp_path / "contract.json", False, capabilities={})
    assert contract.plan.mem_mb == host_mem_mb(contract.plan.estimate(), 1)
    assert mem_mb_for_job(tmp_path / "contract.json", {}, 1) == contract.plan.mem_mb
    assert CellContract.read(tmp_path / "contract.json") == contract
