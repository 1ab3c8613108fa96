"""A cell's contract (tunegrid.contract): made once by the cell_plan rule, read back the same, holding every
decision the supervisor and the worker act on (the kernels among them) and recording the plan as result.json
always kept it."""

from __future__ import annotations

import pytest
from conftest import REPO, one_cell

from tunegrid.cell.loop.ranks import Ranks
from tunegrid.cell_spec import CellSpec
from tunegrid.contract import CellContract, CellJob
from tunegrid.prepare.cell_plan import write_contract
from tunegrid.runtime.workers import SPAWNED

CPU = {"device": "cpu", "gpus": [], "precision": {"fp32": "native", "bf16": "native", "fp16": "emulated"}}
CUDA = {
    "device": "cuda",
    "gpus": [{"total_bytes": 80 * 2**30, "compute_capability": "9.0"}],
    "precision": CPU["precision"],
}


def _contract(tmp_path, checkpoints, spec, capabilities):
    job = CellJob(model_dir=str(checkpoints[spec["model"]["name"]]), data_path="d", run_dir="r", result_path="r/x")
    path = tmp_path / f"{spec['cell_id']}.json"
    return write_contract(CellSpec.from_json(spec), job, path, False, capabilities=capabilities)


def test_the_contract_reads_back_as_written_and_records_the_plan_in_its_old_shape(tmp_path, checkpoints):
    contract = _contract(tmp_path, checkpoints, one_cell(), CPU)
    assert CellContract.read(tmp_path / f"{contract.cell_id}.json") == contract
    assert contract.schema_version == 1 and contract.spec.to_json() == one_cell()
    record = contract.plan.record(SPAWNED)  # result.json's cell.plan, the MLflow run's plan.* params
    assert set(record) == {"target", "budget_bytes", "estimate", "liveness"}
    assert {"estimate_bytes", "stage", "components", "not_modelled", "worker", "cpu_onednn_off"} <= set(
        record["estimate"]
    )
    assert "verdict" not in record["estimate"]


def test_the_plan_decides_the_kernels_for_the_device_the_cell_trains_on(tmp_path, checkpoints):
    moe_bf16 = one_cell(model="qwen3moe-tiny", precision="bf16")
    assert "oneDNN" in _contract(tmp_path, checkpoints, moe_bf16, CPU).plan.kernels.cpu_onednn_off
    assert _contract(tmp_path, checkpoints, one_cell(model="qwen3moe-tiny"), CPU).plan.kernels.cpu_onednn_off is None
    assert _contract(tmp_path, checkpoints, one_cell(precision="bf16"), CPU).plan.kernels.cpu_onednn_off is None
    on_gpu = _contract(tmp_path, checkpoints, moe_bf16, CUDA).plan
    assert on_gpu.kernels.cpu_onednn_off is None  # the GPU's kernels
    beside = {**moe_bf16, "hardware": {**moe_bf16["hardware"], "gpus_per_rank": 0}}
    assert "oneDNN" in _contract(tmp_path, checkpoints, beside, CUDA).plan.kernels.cpu_onednn_off  # trains on the CPU
    # the record says what the cell trained with
    assert on_gpu.record()["estimate"]["cpu_onednn_off"] is None
    fp16 = one_cell(precision="fp16")
    assert "fp32" in _contract(tmp_path, checkpoints, fp16, CPU).plan.record()["estimate"]["cpu_fp16_matmul"]
    assert _contract(tmp_path, checkpoints, fp16, CUDA).plan.kernels.cpu_fp16_matmul is None
    assert _contract(tmp_path, checkpoints, one_cell(), CPU).plan.kernels.cpu_fp16_matmul is None


def test_cpu_fp16_moe_trains_without_onednn_where_the_probe_says_onednn_runs_fp16(tmp_path, checkpoints):
    """On a CPU whose oneDNN runs fp16 (AVX512-FP16/AMX-FP16) the experts' per-expert products would keep a kernel
    per token count, as bf16's do (tests/prepare/test_cpu_onednn_fp16_evidence.py); elsewhere fp16 keeps oneDNN."""
    moe_fp16, dense_fp16 = one_cell(model="qwen3moe-tiny", precision="fp16"), one_cell(precision="fp16")
    xeon = {**CPU, "cpu_onednn_matmul": {"bf16": True, "fp16": True}}
    plan = _contract(tmp_path, checkpoints, moe_fp16, xeon).plan
    assert "fp16" in plan.kernels.cpu_onednn_off and plan.kernels.cpu_fp16_matmul  # the rest keeps tunegrid's sums
    assert plan.record()["estimate"]["cpu_onednn_off"] == plan.kernels.cpu_onednn_off
    assert _contract(tmp_path, checkpoints, dense_fp16, xeon).plan.kernels.cpu_onednn_off is None
    assert _contract(tmp_path, checkpoints, moe_fp16, CPU).plan.kernels.cpu_onednn_off is None  # fp16 emulated
    # a probe record from before the field: its fp16 flag decides
    flagged = {**CPU, "precision": {**CPU["precision"], "fp16": "native"}}
    assert _contract(tmp_path, checkpoints, moe_fp16, flagged).plan.kernels.cpu_onednn_off
    # on a GPU host with gpus_per_rank 0 the CPU's own record decides (its `precision` is the GPU's)
    beside = {**moe_fp16, "hardware": {**moe_fp16["hardware"], "gpus_per_rank": 0}}
    on_xeon = {**CUDA, "cpu_onednn_matmul": xeon["cpu_onednn_matmul"]}
    assert _contract(tmp_path, checkpoints, beside, on_xeon).plan.kernels.cpu_onednn_off
    gpu_fp16 = {**CUDA, "precision": flagged["precision"]}
    assert _contract(tmp_path, checkpoints, beside, gpu_fp16).plan.kernels.cpu_onednn_off is None


def test_no_gpu_per_rank_on_a_cuda_host_plans_a_cpu_estimate_and_trains_on_the_cpu(tmp_path, checkpoints, monkeypatch):
    """`hardware.gpus_per_rank: 0` beside the GPU a recorded probe found: the plan's device is the CPU, its estimates
    are the CPU's (none of the GPU's constants), its kernels the CPU's, and the worker trains there with CUDA in
    sight; the same cell with a GPU per rank plans and trains on CUDA."""
    import torch

    from tunegrid.cell.load.library_api import require_apis
    from tunegrid.cell.train import CellTrainer
    from tunegrid.prepare.memory_estimate import estimate_cell
    from tunegrid.runtime.files import read_json

    # the recorded probe predates step_overhead_bytes: one assumed here, so that a GPU's constant would show
    h100 = {**read_json(REPO / "tests" / "data" / "capabilities-h100.json"), "step_overhead_bytes": {"fp16": 2**26}}
    spec = one_cell(precision="fp16")
    beside = {**spec, "hardware": {**spec["hardware"], "gpus_per_rank": 0}}
    on_cpu, on_gpu = (_contract(tmp_path, checkpoints, s, h100) for s in (beside, spec))
    assert (on_cpu.plan.device, on_gpu.plan.device) == ("cpu", "cuda")
    model_dir = checkpoints[spec["model"]["name"]]
    for worker, estimate in on_cpu.plan.estimates.items():
        assert estimate == estimate_cell(on_cpu.spec, model_dir, 0, "cpu", 0, worker)
    assert on_cpu.plan.estimate().components.runtime == 0 < on_gpu.plan.estimate().components.runtime
    assert on_cpu.plan.kernels.cpu_fp16_matmul and on_gpu.plan.kernels.cpu_fp16_matmul is None

    require_apis(on_cpu.spec)  # the libraries' lazy modules imported first, as the host's torch sees it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # then a GPU in sight of the worker
    trainer = CellTrainer(on_cpu, tmp_path / "run")
    trainer.setup()
    assert trainer.device.type == "cpu" and trainer.memory["device"] == "cpu"
    assert Ranks().device(on_gpu.plan.device) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="plan trains it on CUDA"):
        Ranks().device(on_gpu.plan.device)
