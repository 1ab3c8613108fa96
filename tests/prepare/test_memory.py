"""Hardware probe, named targets, the memory estimate, and out-of-memory as a measured outcome."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_study, one_cell, run_supervised

from tunegrid.prepare.memory_estimate import estimate_cell, nf4_bytes
from tunegrid.prepare.targets import TARGETS, cuda_precision_support, feasibility, resolve_target


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
        timeout=120,
    )
    return path


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
    assert record["bitsandbytes"]["nf4_runs"] is True
    assert record["probe_seconds"] < 60


def test_t4_has_no_native_bf16_whatever_the_flag_says():
    assert cuda_precision_support((7, 5))["bf16"] == "emulated"
    assert cuda_precision_support((8, 0))["bf16"] == "native"
    t4 = TARGETS["t4"]
    assert (
        14.0 * 2**30 < t4.memory_bytes < 14.74 * 2**30
        and t4.precision["bf16"] == "emulated"
        and t4.precision["tf32"] == "absent"
    )
    hardware = {
        "target": "t4",
        "memory_budget_gb": 0,
        "refuse_emulated": True,
        "predicted_oom": "run",
        "oom_margin": 1.0,
    }
    assert feasibility("bf16", resolve_target(hardware, {}), hardware, 1)[0] == "unsupported"
    assert feasibility("fp16", resolve_target(hardware, {}), hardware, 1) is None
    skip = {**hardware, "predicted_oom": "skip"}
    assert feasibility("fp16", resolve_target(skip, {}), skip, 17 * 2**30)[0] == "predicted_oom"


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


def _run(spec, checkpoints, dataset_path, tmp_path, capabilities):
    return run_supervised(spec, checkpoints, dataset_path, tmp_path / spec["cell_id"], capabilities=capabilities)


def test_estimate_grows_with_batch_and_shrinks_with_nf4(checkpoints):
    small = estimate_cell(_spec(batch=2), checkpoints["qwen3moe-tiny"], 0)
    large = estimate_cell(_spec(batch=64), checkpoints["qwen3moe-tiny"], 0)
    assert large["components"]["activations"] > 10 * small["components"]["activations"]
    plain = estimate_cell(_spec(quant="nf4"), checkpoints["qwen3moe-tiny"], 0)["components"]["weights"]
    experts = estimate_cell(_spec(quant="nf4-experts"), checkpoints["qwen3moe-tiny"], 0)["components"]["weights"]
    full = estimate_cell(_spec(quant="none"), checkpoints["qwen3moe-tiny"], 0)["components"]["weights"]
    assert full > plain > experts  # the experts are what plain nf4 leaves in full precision


def test_t4_target_refuses_bf16_without_training(checkpoints, dataset_path, tmp_path, capabilities):
    spec = _spec(precision="bf16", hardware={"target": "t4", "refuse_emulated": True})
    result = _run(spec, checkpoints, dataset_path, tmp_path, capabilities)
    assert result["outcome"] == "unsupported"
    assert "emulated on target t4" in result["reason"]
    assert result["training"] == {} and result["memory"]["target"] == "t4"
    assert result["memory"]["budget_bytes"] == TARGETS["t4"].memory_bytes  # what a process gets on a T4


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


def test_estimate_is_close_to_measured_for_ok_cells(checkpoints, dataset_path, tmp_path, capabilities):
    ratios = []
    for model, batch, quant in (
        ("gemma3-hot", 2, "none"),
        ("qwen3moe-tiny", 8, "nf4"),
        ("qwen3moe-tiny", 8, "nf4-experts"),
    ):
        result = _run(
            _spec(model=model, batch=batch, quant=quant, train={"seq_len": 64}),
            checkpoints,
            dataset_path,
            tmp_path,
            capabilities,
        )
        assert result["outcome"] == "ok"
        memory = result["memory"]
        assert memory["load_peak_bytes"] and memory["first_step_peak_bytes"] and memory["steady_peak_bytes"]
        ratios.append(memory["estimate_over_measured"])
    assert all(0.85 <= r <= 1.15 for r in ratios), ratios


def test_plan_reads_before_training_which_cells_a_t4_cannot_run(checkpoints, capabilities, tmp_path):
    import json

    import pandas as pd

    from tunegrid.cli import main

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
    study_file = tmp_path / "study.json"  # what the workflow writes once per invocation
    study_file.write_text(json.dumps(study))
    assert (
        main(
            [
                "plan",
                "--study-file",
                str(study_file),
                "--capabilities",
                str(capabilities),
                "--models",
                str(models),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    plan = pd.read_csv(out, keep_default_na=False)
    assert len(plan) == 6
    assert set(plan.loc[plan.precision == "bf16", "verdict"]) == {"unsupported"}
    assert set(plan.loc[plan.precision != "bf16", "verdict"]) == {"run"}
    assert (plan.estimate_bytes > 0).all() and set(plan.target) == {"t4"}


def test_estimate_says_what_it_does_not_model_where_it_applies(checkpoints):
    """CPU bf16 MoE cells grow step by step in oneDNN (benchmarks/onednn_bf16_growth.py): the estimate says
    so for them, and only for them."""
    said = {
        (model, precision, device): estimate_cell(
            _spec(model=model, precision=precision), checkpoints[model], 0, device
        )["not_modelled"]
        for model in ("qwen3moe-tiny", "gemma3-hot")
        for precision in ("fp32", "bf16")
        for device in ("cpu", "cuda")
    }
    assert "oneDNN" in said[("qwen3moe-tiny", "bf16", "cpu")]
    assert [k for k, v in said.items() if v] == [("qwen3moe-tiny", "bf16", "cpu")]
