"""A cell's products: the saved adapter reloads onto its base with the cell's loss, and a cell that saves its resume
state, killed mid-training, resumes to the loss curve of an uninterrupted run."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from conftest import make_study, run_supervised, work_cell

from tunegrid.cell.adapters import BASE_FILE, REFERENCE_BATCH_FILE, base_model_identity
from tunegrid.cell.loop.resume import RESUME_DIR
from tunegrid.manifest import verify_checkpoint
from tunegrid.review.summary import summary_row
from tunegrid.runtime.files import read_json, read_jsonl
from tunegrid.study.config import cell_spec, expand_cells, resolve_study
from tunegrid.track.tags import run_tags

MODEL = "qwen3moe-tiny"
# attention only: peft wraps the fused experts as parameters, which refuse dropout
LORA = {"dropout": 0.1, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _spec(train: dict, debug: dict | None = None) -> dict:
    grid = {"model": [MODEL], "precision": ["fp32"], "batch_size": [2], "quant": ["none"], "seed": [0]}
    # dropout on: a resume that did not restore the RNG would draw other masks and leave the curve
    study = resolve_study(
        make_study(grid=grid, train={"seq_len": 32, "lr": 0.01, **train}, lora=LORA, debug=debug or {})
    )
    return cell_spec(study, expand_cells(study)[0]).to_json()


def _run_cell(spec: dict, checkpoints: dict, dataset_path: Path, run_dir: Path) -> dict:
    return run_supervised(spec, checkpoints, dataset_path, run_dir)


def test_saved_adapter_reloads_onto_its_base_with_the_cells_loss(checkpoints, dataset_path, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = _spec({"steps": 4})
    run_dir = tmp_path / spec["cell_id"]
    work_cell(spec, checkpoints[MODEL], dataset_path, run_dir)
    facts = read_json(run_dir / "worker.json")
    assert facts["outcome"] == "ok", facts["reason"]
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    base = read_json(adapter / BASE_FILE)
    assert base["base_model"] == base_model_identity(verify_checkpoint(checkpoints[MODEL]))
    # the folder it was loaded from, not "None" (which peft's save looks up on the hub)
    assert read_json(adapter / "adapter_config.json")["base_model_name_or_path"] == str(checkpoints[MODEL])
    expected = facts["training"]["reference_batch_loss"]
    assert base["reference"]["loss"] == expected and math.isfinite(expected)

    model = AutoModelForCausalLM.from_pretrained(checkpoints[MODEL], dtype=torch.float32)
    untrained = model.eval()
    batch = load_file(str(adapter / REFERENCE_BATCH_FILE))
    with torch.no_grad():
        base_loss = untrained(**batch).loss.item()
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    assert loss == pytest.approx(expected, rel=1e-5)
    assert abs(base_loss - expected) > 100 * 1e-5 * abs(expected), (
        "the adapter changed nothing: the check would be vacuous"
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_nf4_adapter_reloads_onto_its_4bit_base_with_the_cells_loss(
    checkpoints, dataset_path, tmp_path, precision
):
    """Rebuilt from base_model.json alone: the same NF4 quantization (deterministic), the same layout, the
    same loss, exactly. Without the layout guard, on a CPU with AVX512-BF16 the eval forward repacks the
    4-bit weights for bitsandbytes' inference kernel: measured 3.1e-4 (fp32) and 2.0e-4 (bf16) relative
    off the cell's loss there, kernel rounding and not a wrong adapter."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunegrid.cell.load.quant_audit import disable_cpu_inference_packing

    grid = {"model": [MODEL], "precision": [precision], "batch_size": [2], "quant": ["nf4"], "seed": [0]}
    study = resolve_study(make_study(grid=grid, train={"steps": 4, "seq_len": 32, "lr": 0.01}, lora=LORA))
    spec = cell_spec(study, expand_cells(study)[0]).to_json()
    run_dir = tmp_path / spec["cell_id"]
    work_cell(spec, checkpoints[MODEL], dataset_path, run_dir)
    facts = read_json(run_dir / "worker.json")
    assert facts["outcome"] == "ok", facts["reason"]
    expected = facts["training"]["reference_batch_loss"]
    load = read_json(run_dir / "adapter" / BASE_FILE)["load"]
    assert load["quant"] == "nf4" and load["cpu_inference_packing"] is False

    bnb = {**load["bnb_4bit"], "bnb_4bit_compute_dtype": getattr(torch, load["bnb_4bit"]["bnb_4bit_compute_dtype"])}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the cell trained
    base = AutoModelForCausalLM.from_pretrained(
        checkpoints[MODEL],
        dtype=getattr(torch, load["storage_dtype"]),
        quantization_config=BitsAndBytesConfig(**bnb),
        device_map={"": device},
    )
    assert disable_cpu_inference_packing(base) > 0
    model = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    batch = {k: v.to(device) for k, v in load_file(str(run_dir / "adapter" / REFERENCE_BATCH_FILE)).items()}
    compute = getattr(torch, load["compute_dtype"])
    with torch.no_grad(), torch.autocast(device, dtype=compute, enabled=precision != "fp32"):
        loss = model(**batch).loss.float().item()
    assert loss == pytest.approx(expected, rel=1e-6), "0 measured on CPU: the same weights through the same kernels"


@pytest.mark.slow
def test_killed_cell_resumes_from_its_resume_state_to_the_uninterrupted_curve(checkpoints, dataset_path, tmp_path):
    train = {"steps": 8, "checkpoint_every": 3, "retries": 0}
    killed = _spec(train, debug={"kill_rank": {"rank": 0, "step": 5}})
    run_dir = tmp_path / "resumed" / killed["cell_id"]

    first = _run_cell(killed, checkpoints, dataset_path, run_dir)
    assert first["outcome"] == "error" and "SIGKILL" in first["reason"]
    assert read_json(run_dir / RESUME_DIR / "meta.json")["step"] == 3
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]

    again = _run_cell(_spec(train), checkpoints, dataset_path, run_dir)  # the kill hook is not training: same key
    assert again["outcome"] == "ok", again["reason"]
    assert again["resumed_from_step"] == 3
    assert summary_row(again)["resumed_from_step"] == 3 and run_tags(again)["resumed_from_step"] == "3"
    assert not (run_dir / RESUME_DIR).exists(), "a concluded cell keeps no resume state"
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(8))

    plain = _run_cell(
        _spec({**train, "checkpoint_every": 0}), checkpoints, dataset_path, tmp_path / "plain" / killed["cell_id"]
    )
    assert plain["outcome"] == "ok" and plain["resumed_from_step"] is None
    reference = read_jsonl(tmp_path / "plain" / killed["cell_id"] / "metrics.jsonl")
    for got, want in zip(resumed, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6), got["step"]
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9), got["step"]
    assert again["training"]["reference_batch_loss"] == pytest.approx(
        plain["training"]["reference_batch_loss"], rel=1e-6
    )


@pytest.mark.slow
def test_checkpoint_of_a_different_spec_is_removed_not_resumed(checkpoints, dataset_path, tmp_path):
    train = {"steps": 6, "checkpoint_every": 2, "retries": 0}
    killed = _spec(train, debug={"kill_rank": {"rank": 0, "step": 3}})
    run_dir = tmp_path / killed["cell_id"]
    assert _run_cell(killed, checkpoints, dataset_path, run_dir)["outcome"] == "error"
    assert read_json(run_dir / RESUME_DIR / "meta.json")["step"] == 2

    changed = copy.deepcopy(_spec(train))
    changed["train"]["lr"] = 0.02
    result = _run_cell(changed, checkpoints, dataset_path, run_dir)
    assert result["outcome"] == "ok", result["reason"]
    assert result["resumed_from_step"] is None
    assert result["checkpoint"]["discarded"] == "written for a different training spec"
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(6))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[0]["step"] == 0 and metrics[1]["lr"] == pytest.approx(0.02 / 2)  # warm-up (from 0) to the new lr
