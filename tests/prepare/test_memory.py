"""Hardware probe, named targets, the memory estimate, and out-of-memory as a measured outcome."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO, make_study, one_cell, run_supervised

from tunegrid.cell_spec import CellSpec
from tunegrid.prepare.memory_estimate import estimate_cell, estimate_from_shapes, nf4_bytes, tensor_shapes
from tunegrid.targets import TARGETS, cuda_precision_support, feasibility, resolve_target


@pytest.fixture(scope="module")
def capabilities(tmp_path_factory) -> Path:
    # in a fresh process, as the probe rule runs it: the runtime baseline of this test process (which
    # has loaded models already) is not what a training process starts with
    path = tmp_path_factory.mktemp("probe") / "capabilities.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "tunegrid.py"),
            "probe",
            "--budget-s",
            "6",
            "--world-sizes",
            "2",
            "--out",
            str(path),
        ],
        check=True,
        timeout=900,  # a hang guard: with the micro cells on both worker paths, minutes on a loaded 2-core host
    )
    return path


# What that probe command wrote on this project's 2-core host (tests/data/README.md): for the tests whose claim is
# what a target decides before any cell trains, not what this host measures (the tests that measure run the probe)
RECORDED_CPU_PROBE = REPO / "tests" / "data" / "capabilities-cpu.json"


@pytest.mark.slow
def test_probe_has_every_field_with_sane_values(capabilities):
    import json

    record = json.loads(capabilities.read_text())
    assert record["device"] == "cpu" and record["gpus"] == []
    assert record["cpu"]["cores"] >= 1 and record["cpu"]["ram_bytes"] > 2**30
    assert record["precision"]["fp32"] == "native"
    assert record["precision"]["bf16"] in {"native", "emulated"}
    assert record["matmul_tflops"]["float32"] > 0
    assert record["memory_bandwidth_gbs"] > 0.1
    rows = record["allreduce"]["2"]["sizes"]
    assert record["allreduce"]["backend"] == "gloo" and rows
    assert all(row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * 2 * 1 / 2) and row["busbw_gbs"] > 0 for row in rows)
    assert 100 * 2**20 < record["runtime_baseline_bytes"] < 4 * 2**30
    # measured per precision on this host (fp16 autocast may be missing on an old CPU build: then absent)
    overhead = record["step_overhead_bytes"]
    assert {"fp32", "bf16"} <= set(overhead) and all(0 <= value < 2**30 for value in overhead.values())
    # what a worker holds at work beyond its tensors, per path: a fork starts below a fresh process
    at_work = record["worker_runtime_bytes"]
    assert set(at_work["forked"]) == set(at_work["spawned"]) == {"fp32", "bf16", "fp16"}
    assert all(100 * 2**20 < at_work["forked"][a] < at_work["spawned"][a] < 4 * 2**30 for a in at_work["forked"])
    assert record["bitsandbytes"]["nf4_runs"] is True
    # which CPU matmuls torch hands to oneDNN (the plan's kernels read it: prepare/cpu_kernels.py)
    assert {k: type(v) for k, v in record["cpu_onednn_matmul"].items()} == {"bf16": bool, "fp16": bool}
    assert record["probe_seconds"] > 0  # recorded; how long it takes depends on the host and its load


def test_t4_has_no_native_bf16_whatever_the_flag_says():
    assert cuda_precision_support((7, 5))["bf16"] == "emulated"
    assert cuda_precision_support((8, 0))["bf16"] == "native"
    t4 = TARGETS["t4"]
    assert (
        14.0 * 2**30 < t4.memory_bytes < 14.74 * 2**30
        and t4.precision["bf16"] == "emulated"
        and t4.precision["tf32"] == "absent"
    )
    hardware = _cell_spec(hardware={"target": "t4", "refuse_emulated": True, "oom_margin": 1.0}).hardware
    assert hardware.memory_budget_gb == 0 and hardware.predicted_oom == "run"
    assert feasibility("bf16", resolve_target(hardware, {}), hardware, 1)[0] == "unsupported"
    assert feasibility("fp16", resolve_target(hardware, {}), hardware, 1) is None
    skip = replace(hardware, predicted_oom="skip")
    assert feasibility("fp16", resolve_target(skip, {}), skip, 17 * 2**30)[0] == "predicted_oom"


def test_a_cpu_cells_predicted_oom_weighs_what_its_budget_charges_not_the_runtime():
    """On a CPU the budget caps what the cell adds above its worker's start (the runtime is mapped already): an
    estimate over the budget only by its runtime term fits, as the out-of-memory study's fixes measure; on CUDA the
    allocator's cap covers every tensor, so the same figures do not fit."""
    from tunegrid.contract import MemoryComponents, MemoryEstimate

    hardware = {"target": "native", "memory_budget_gb": 0.5, "refuse_emulated": False, "oom_margin": 1.0}
    skip = _cell_spec(hardware={**hardware, "predicted_oom": "skip"}).hardware
    target = resolve_target(skip, {"precision": {"fp32": "native"}})
    tensors, runtime = 400 * 2**20, 300 * 2**20  # 700 MiB in all against 512 MiB
    components = MemoryComponents(weights=tensors, runtime=runtime)
    planned = MemoryEstimate(
        worker="forked",
        estimate_bytes=tensors + runtime,
        stage="step",
        load_bytes=0,
        step_bytes=0,
        components=components,
    )
    assert feasibility("fp32", target, skip, planned.charge_bytes("cpu")) is None
    verdict = feasibility("fp32", target, skip, planned.charge_bytes("cuda"))
    assert verdict is not None and verdict[0] == "predicted_oom" and "estimated charge 0.68 GiB" in verdict[1]


def test_nf4_storage_is_about_half_a_byte_per_param():
    assert nf4_bytes(64 * 256 * 100) / (64 * 256 * 100) == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))


def _spec(model="gemma3-hot", batch=2, precision="fp32", quant="none", hardware=None, train=None):
    return one_cell(
        model=model,
        batch=batch,
        precision=precision,
        quant=quant,
        train={"steps": 2, **(train or {})},
        hardware=hardware or {},
    )


def _cell_spec(**settings) -> CellSpec:
    """_spec's cell, typed: what the plan reads."""
    return CellSpec.from_json(_spec(**settings))


def _run(spec, checkpoints, dataset_path, tmp_path, capabilities):
    """Spawned, as on a cluster: the estimate's constants for a fresh process (the forked path's: test_warm.py)."""
    run_dir = tmp_path / spec["cell_id"]
    return run_supervised(spec, checkpoints, dataset_path, run_dir, capabilities=capabilities, worker="spawned")


def test_estimate_grows_with_batch_and_shrinks_with_nf4(checkpoints):
    small = estimate_cell(_cell_spec(batch=2), checkpoints["qwen3moe-tiny"], 0)
    large = estimate_cell(_cell_spec(batch=64), checkpoints["qwen3moe-tiny"], 0)
    assert large.components.activations > 10 * small.components.activations
    plain = estimate_cell(_cell_spec(quant="nf4"), checkpoints["qwen3moe-tiny"], 0).components.weights
    experts = estimate_cell(_cell_spec(quant="nf4-experts"), checkpoints["qwen3moe-tiny"], 0).components.weights
    full = estimate_cell(_cell_spec(quant="none"), checkpoints["qwen3moe-tiny"], 0).components.weights
    assert full > plain > experts  # the experts are what plain nf4 leaves in full precision


def test_t4_target_refuses_bf16_without_training(checkpoints, dataset_path, tmp_path):
    spec = _spec(precision="bf16", hardware={"target": "t4", "refuse_emulated": True})
    result = _run(spec, checkpoints, dataset_path, tmp_path, RECORDED_CPU_PROBE)
    assert result["outcome"] == "unsupported"
    assert "emulated on target t4" in result["reason"]
    assert result["training"] == {} and result["memory"]["target"] == "t4"
    assert result["memory"]["budget_bytes"] == TARGETS["t4"].memory_bytes  # what a process gets on a T4


@pytest.mark.slow
def test_too_small_budget_ends_oom_with_stage_while_neighbour_is_ok(checkpoints, dataset_path, tmp_path, capabilities):
    hardware = {"memory_budget_gb": 0.25}
    ok = _run(
        _spec(batch=2, hardware=hardware, train={"seq_len": 256}), checkpoints, dataset_path, tmp_path, capabilities
    )
    oom = _run(
        _spec(batch=256, hardware=hardware, train={"seq_len": 256}), checkpoints, dataset_path, tmp_path, capabilities
    )
    assert ok["outcome"] == "ok", ok["reason"]
    assert oom["outcome"] == "oom", oom["reason"]
    assert oom["diagnosis"]["oom"]["stage"] == "step"
    assert oom["diagnosis"]["oom"]["bytes_at_failure"] > 0
    assert oom["memory"]["budget_enforcement"]["mechanism"] == "RLIMIT_AS"
    # the estimate saw it coming: with predicted_oom: skip the same cell is not even started
    skipped = _run(
        _spec(batch=256, hardware={**hardware, "predicted_oom": "skip"}, train={"seq_len": 256}),
        checkpoints,
        dataset_path,
        tmp_path / "skip",
        capabilities,
    )
    assert skipped["outcome"] == "predicted_oom"


@pytest.mark.slow
def test_estimate_is_close_to_measured_for_ok_cells(checkpoints, dataset_path, tmp_path, capabilities):
    """Spawned workers, the probe's constants for that path; a bf16 MoE cell among them stays flat (oneDNN off).
    The whole default study on both paths: test_cpu_memory_evidence.py."""
    ratios = {}
    for model, precision, batch, quant in (
        ("gemma3-hot", "fp32", 2, "none"),
        ("qwen3moe-tiny", "fp32", 8, "nf4"),
        ("qwen3moe-tiny", "bf16", 8, "nf4-experts"),
    ):
        result = _run(
            _spec(model=model, precision=precision, batch=batch, quant=quant, train={"seq_len": 64, "steps": 6}),
            checkpoints,
            dataset_path,
            tmp_path,
            capabilities,
        )
        assert result["outcome"] == "ok"
        memory = result["memory"]
        assert memory["load_peak_bytes"] and memory["first_step_peak_bytes"] and memory["steady_peak_bytes"]
        assert memory["estimate_worker"] == "spawned"
        assert memory["steady_peak_bytes"] <= 1.05 * memory["first_step_peak_bytes"]  # no step-by-step growth
        ratios[result["cell_id"]] = memory["estimate_over_measured"]
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


def test_plan_reads_before_training_which_cells_a_t4_cannot_run(checkpoints, tmp_path):
    import pandas as pd

    from tunegrid.cli import main
    from tunegrid.contract import CellContract
    from tunegrid.prepare.cell_plan import MEM_FLOOR_MB_PER_RANK, job_mem_mb
    from tunegrid.study.config import expand_cells, resolve_study, spec_json

    grid = {
        "model": ["gemma3-hot", "qwen3moe-tiny"],
        "precision": ["fp32", "bf16", "fp16"],
        "batch_size": [2],
        "quant": ["nf4"],
        "seed": [0],
    }
    study = make_study(grid=grid, hardware={"target": "t4", "refuse_emulated": True})
    models = next(iter(checkpoints.values())).parent
    out = tmp_path / "plan.csv"
    study_file = tmp_path / "study.json"  # as the study_config rule writes it: resolved
    study_file.write_text(spec_json(resolve_study(study)))
    plans = tmp_path / "plans"
    for cell in expand_cells(resolve_study(study)):  # each cell's contract, as the cell_plan rule makes it
        args = ["cell-plan", "--study-file", str(study_file), "--cell", cell.cell_id, "--model-dir"]
        args += [
            str(models / cell.model),
            "--capabilities",
            str(RECORDED_CPU_PROBE),
            "--out",
            str(plans / f"{cell.cell_id}.json"),
        ]
        assert main(args) == 0
    assert main(["plan", "--study-file", str(study_file), "--plans", str(plans), "--out", str(out)]) == 0
    plan = pd.read_csv(out, keep_default_na=False)
    assert len(plan) == 6
    assert set(plan.loc[plan.precision == "bf16", "verdict"]) == {"unsupported"}
    assert set(plan.loc[plan.precision != "bf16", "verdict"]) == {"run"}
    assert (plan.estimate_bytes > 0).all() and set(plan.target) == {"t4"}

    # plan.csv is the union of the cells' contracts (the finetune job's mem_mb comes from the same file)
    for row in plan.itertuples():
        cell = CellContract.read(plans / f"{row.cell_id}.json").plan
        estimate = cell.estimate()
        assert (estimate.estimate_bytes, estimate.stage, estimate.verdict, cell.target) == (
            row.estimate_bytes,
            row.estimate_stage,
            row.verdict,
            row.target,
        )
        assert cell.mem_mb == job_mem_mb(row.estimate_bytes, 1) >= MEM_FLOOR_MB_PER_RANK


def test_job_memory_is_the_estimate_with_room_a_floor_per_rank_or_the_override():
    from tunegrid.prepare.cell_plan import MEM_FLOOR_MB_PER_RANK, MEM_SAFETY_FACTOR, job_mem_mb, mem_mb_for_job

    sixty_gb = 60 * 2**30
    assert job_mem_mb(sixty_gb, 1) == round(60 * 1024 * MEM_SAFETY_FACTOR)
    assert job_mem_mb(sixty_gb, 2) == 2 * job_mem_mb(sixty_gb, 1)  # every rank of the job loads the model
    assert job_mem_mb(10 * 2**20, 2) == 2 * MEM_FLOOR_MB_PER_RANK
    assert job_mem_mb(sixty_gb, 2, override_mb=123_000) == 123_000
    # no plan yet (a dry run before the probe): the floor, or the override
    assert mem_mb_for_job(None, {"mem_mb": 0}, 2) == 2 * MEM_FLOOR_MB_PER_RANK
    assert mem_mb_for_job("/nonexistent/plan.json", {"mem_mb": 9000}, 1) == 9000


def test_the_job_memory_override_re_runs_no_cell():
    from tunegrid.study.config import cell_spec, expand_cells, resolve_study

    studies = [resolve_study(make_study(hardware={"mem_mb": mb})) for mb in (0, 64_000)]
    assert studies[1]["hardware"]["mem_mb"] == 64_000 and studies[0]["hardware"]["mem_mb"] == 0
    specs = [[cell_spec(s, c).to_json() for c in expand_cells(s)] for s in studies]
    assert specs[0] == specs[1]  # the finetune job's params: unchanged, so no cell re-runs


def test_cpu_bf16_with_routed_experts_and_only_that_trains_without_onednn(checkpoints):
    """oneDNN's bf16 kernels grew CPU bf16 MoE cells step by step (benchmarks/onednn_bf16_growth.py): the plan
    turns them off for those cells, and only for them, and leaves nothing unmodelled."""
    import json

    from tunegrid.prepare.cpu_kernels import cpu_onednn_off

    cells = [
        (model, precision, device)
        for model in ("qwen3moe-tiny", "gemma3-hot")
        for precision in ("fp32", "bf16")
        for device in ("cpu", "cuda")
    ]
    config = {model: json.loads((checkpoints[model] / "config.json").read_text()) for model, _, _ in cells}
    off = {(m, p, d): cpu_onednn_off(_cell_spec(model=m, precision=p), config[m], d) for m, p, d in cells}
    assert "oneDNN" in off[("qwen3moe-tiny", "bf16", "cpu")]
    assert [cell for cell, why in off.items() if why] == [("qwen3moe-tiny", "bf16", "cpu")]
    estimates = [estimate_cell(_cell_spec(model=m, precision=p), checkpoints[m], 0, d) for m, p, d in cells]
    assert not any(estimate.not_modelled for estimate in estimates)


def _saved_expert_weights(trainer) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Storages autograd keeps for backward in one training forward+backward that hold an experts-shaped
    tensor ([experts, ...]) and are no parameter's: the full-width expert weights the forward built."""
    import torch

    from tunegrid.cell.loop.step import loss_tokens

    experts = trainer.model.get_base_model().config.num_experts
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    kept: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if tensor.dim() == 3 and tensor.shape[0] == experts and storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape))
        return tensor

    optimizer_step = trainer.build_optimizer()
    (batch,) = trainer.stream.micro_batches(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        optimizer_step.forward_backward(batch, step_tokens=loss_tokens(batch))
    return kept


@pytest.mark.parametrize(
    "quant,target_parameters",
    [("nf4-experts", []), ("nf4", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])],
    ids=["nf4-experts", "nf4-with-expert-lora"],
)
def test_cuda_estimate_counts_every_layers_expert_weights_kept_for_backward(
    checkpoints, dataset_path, tmp_path, quant, target_parameters
):
    """Without checkpointing the grouped matmul keeps each MoE layer's full-width expert weight (dequantized, or
    base + LoRA delta) for the input's gradient until backward: measured here as autograd's saved tensors (the
    same ops on either device), against the CUDA estimate, which counted one layer (nf4-experts) or none."""
    from conftest import ready_trainer

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "target_parameters": target_parameters}
    spec = one_cell(
        model="qwen3moe-tiny",
        precision="bf16",
        quant=quant,
        batch=2,
        lora=lora,
        train={"gradient_checkpointing": False},
    )
    trainer = ready_trainer(spec, checkpoints, dataset_path, tmp_path)
    # the two weights of each layer (gate_up [4, 64, 64], down [4, 64, 32] in bf16), not the LoRA factors'
    # products of the expert adapters (r = 4 wide)
    weights = [kept for kept in _saved_expert_weights(trainer).values() if min(kept[1][1:]) > lora["r"]]
    full_width = {shape: nbytes for nbytes, shape in weights}
    measured = sum(nbytes for nbytes, _ in weights)
    layers = trainer.model.get_base_model().config.num_hidden_layers
    assert len(full_width) == 2 and measured == layers * sum(full_width.values())  # every layer's, both tensors
    estimate = estimate_cell(CellSpec.from_json(spec), checkpoints["qwen3moe-tiny"], device="cuda")
    assert estimate.components.experts_kept_for_backward == measured, estimate.components
    if target_parameters:  # and the expert adapters themselves: r x experts x (in + out) per adapted tensor
        adapters = sum(p.numel() for n, p in trainer.trainable_named if ".experts." in n)
        assert adapters > 0
        without = CellSpec.from_json({**spec, "lora": {**spec["lora"], "target_parameters": []}})
        plain = estimate_cell(without, checkpoints["qwen3moe-tiny"])
        lora_bytes = [e.components.lora_params_grads + e.components.optimizer_state for e in (estimate, plain)]
        assert lora_bytes[0] - lora_bytes[1] == adapters * 4 * 4  # fp32 params, grads and AdamW's two moments
    checkpointed = estimate_cell(
        CellSpec.from_json({**spec, "train": {**spec["train"], "gradient_checkpointing": True}}),
        checkpoints["qwen3moe-tiny"],
        device="cuda",
    )
    assert checkpointed.components.experts_kept_for_backward == 0
    assert checkpointed.components.dequant_buffer >= max(full_width.values())  # one layer's, rebuilt


def test_a_cuda_budget_caps_the_training_device_and_an_oom_records_the_reserved_peak_it_caps(monkeypatch):
    """Through a patched torch.cuda: the budget goes to the device this rank trains on (not device 0), and an
    out-of-memory record carries the reserved high-water mark the fraction caps beside the allocated peak (which
    can stay under the budget while the cell runs out of it)."""
    from types import SimpleNamespace

    import torch

    from tunegrid.cell.train import meter_at_failure
    from tunegrid.runtime.memory import MemoryMeter, apply_memory_budget

    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append((f, device))
    )
    enforcement = apply_memory_budget("cuda", 16 * 2**30, 1)
    assert fractions == [(0.2, 1)] and enforcement["device"] == 1 and enforcement["caps"] == "reserved"

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 12 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *args: 16 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: 11 * 2**30)
    at_failure = meter_at_failure(MemoryMeter("cuda"))
    assert at_failure == {"bytes_at_failure": 11 * 2**30, "peak_bytes": 12 * 2**30, "reserved_peak_bytes": 16 * 2**30}
    assert "reserved_peak_bytes" not in meter_at_failure(MemoryMeter("cpu"))


def test_the_manifest_measures_the_tokenizer_in_memory_and_the_estimate_holds_it(checkpoints, monkeypatch, tmp_path):
    """A real tokenizer is large in memory (Gemma 3's: ~340 MB for a 262k vocabulary), and a cell holds it for its
    whole life; the checkpoint measures it once, in a fresh process, and the estimate adds it at load and step. A
    tokenizer under SMALL_TOKENIZER_BYTES on disk (a synthetic model's) is not measured: the manifest says None."""
    import json
    import shutil

    from tunegrid.prepare import probes
    from tunegrid.prepare.checkpoints import write_manifest

    folder = checkpoints["gemma3-hot"]
    assert json.loads((folder / "manifest.json").read_text())["tokenizer_resident_bytes"] is None
    assert probes.tokenizer_resident_bytes(folder) is None
    monkeypatch.setattr(probes, "SMALL_TOKENIZER_BYTES", 0)  # as a real tokenizer is: measured
    measured = probes.tokenizer_resident_bytes(folder)
    assert measured is not None and measured > 0
    copy = tmp_path / "gemma3-hot"
    shutil.copytree(folder, copy)
    write_manifest(copy, json.loads((folder / "manifest.json").read_text())["source"])
    recorded = json.loads((copy / "manifest.json").read_text())["tokenizer_resident_bytes"]
    assert recorded > 0
    estimate = estimate_cell(_cell_spec(), copy, 0)
    assert estimate.components.tokenizer == recorded
    without = estimate_from_shapes(_cell_spec(), json.loads((copy / "config.json").read_text()), tensor_shapes(copy), 0)
    assert estimate.estimate_bytes - without.estimate_bytes == recorded


@pytest.mark.slow
def test_a_chunked_loss_cell_peaks_lower_and_its_estimate_stays_in_band(dataset_path, tmp_path, capabilities):
    """A Gemma 3 of vocab 32768 over 4 x 256 tokens: the full loss's fp32 logits (128 MiB, three times over with
    their log-softmax and gradient) lead its peak. With train.loss chunked the measured peak falls by most of
    them, and both estimates stay within 0.9-1.1 of the measured peaks (spawned workers, the probe's constants)."""
    import copy

    from conftest import GEMMA_HOT

    from tunegrid.dataset import read_dataset
    from tunegrid.prepare.checkpoints import produce_checkpoint
    from tunegrid.prepare.data import corpus_texts

    wide = {**GEMMA_HOT, "config": {**GEMMA_HOT["config"], "vocab_size": 32768, "initializer_range": 0.02}}
    produce_checkpoint(copy.deepcopy(wide), list(corpus_texts(read_dataset(dataset_path))), tmp_path / "wide")
    memory = {}
    for loss in ("full", "chunked"):
        spec = one_cell(
            model="wide",
            batch=4,
            train={"steps": 3, "seq_len": 256, "loss": loss, "loss_chunk_tokens": 128},
            models={"wide": copy.deepcopy(wide)},
        )
        result = _run(spec, {"wide": tmp_path / "wide"}, dataset_path, tmp_path / loss, capabilities)
        assert result["outcome"] == "ok", result["reason"]
        memory[loss] = result["memory"]
    full, chunked = memory["full"], memory["chunked"]
    assert full["steady_peak_bytes"] - chunked["steady_peak_bytes"] > 1.5 * 1024 * 32768 * 4, (full, chunked)
    ratios = {loss: m["estimate_over_measured"] for loss, m in memory.items()}
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios
