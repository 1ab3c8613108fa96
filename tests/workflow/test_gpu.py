"""The GPU path, end to end on one CUDA device (`python -m pytest -m gpu`, about 10 minutes on an H100;
skipped where no GPU is visible). Each study runs through Snakemake as a user would run it, with the
defaults (warm worker on: it must step aside for CUDA), and the verdicts, origins, peaks and memory
estimates are checked from the files the run wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import GEMMA_HOT, OLMOE, QWEN_MOE, REPO, snakemake_command, workflow_env

from tunegrid.files import read_json

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GEMMA3_4B_WIDTH = {  # google/gemma-3-4b-it's text width, 2 of 34 layers, a small vocabulary
    "source": "synthetic",
    "architecture": "gemma3_text",
    "seed": 0,
    "config": {
        "vocab_size": 4096,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
        "query_pre_attn_scalar": 256,
        "initializer_range": 0.5,
    },
}
OLMOE_WIDTH = {  # allenai/OLMoE-1B-7B-0924's width, 2 of 16 layers
    "source": "synthetic",
    "architecture": "olmoe",
    "seed": 0,
    "config": {
        "vocab_size": 4096,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
    },
}


def _run(tmp_path: Path, study: dict, timeout: int = 420) -> pd.DataFrame:
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump(study))
    env = workflow_env()
    done = subprocess.run(
        snakemake_command(tmp_path, "--cores", "8", "--resources", "gpu=1", "all", "--configfile", str(config)),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return pd.read_parquet(tmp_path / "results" / study["study"] / "summary.parquet").set_index("cell_id")


def _check_common(summary: pd.DataFrame, results: Path) -> None:
    assert "error" not in set(summary["outcome"]), summary.loc[summary.outcome == "error", "reason"].to_dict()
    for cell_id, row in summary.iterrows():
        result = read_json(results / "runs" / cell_id / "result.json")
        assert result["memory"]["device"] == "cuda"
        if row["outcome"] == "ok":
            assert row["steps_run"] == result["cell"]["train"]["steps"]
            assert 0.9 <= row["estimate_over_measured"] <= 1.1, (cell_id, row["estimate_over_measured"])
        log = (results.parent / "logs" / results.name / "finetune" / f"{cell_id}.log").read_text()
        assert "forked by the warm worker" not in log  # CUDA does not survive a fork


def test_probe_measures_the_cuda_step_overhead(tmp_path):
    """The estimate's device constant on CUDA: the cuBLAS workspaces a training step leaves allocated
    (test_memory_evidence.py replays the H100's recorded peaks with 2 x 32 MiB, torch's sm90 default)."""
    out = tmp_path / "capabilities.json"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tunegrid.py"), "probe", "--budget-s", "4", "--out", str(out)],
        check=True,
        timeout=300,
    )
    record = read_json(out)
    overhead = record["step_overhead_bytes"]
    assert set(overhead) == {"fp32", "bf16", "fp16"} and all(value > 0 for value in overhead.values())
    if record["gpus"][0]["compute_capability"] == "9.0" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        assert all(abs(value - 2 * 32 * 2**20) <= 4 * 2**20 for value in overhead.values()), overhead


def test_default_models_on_the_gpu(tmp_path):
    study = {
        "study": "gpu-tiny",
        "models": {"gemma3-hot": GEMMA_HOT, "qwen3moe-tiny": QWEN_MOE, "olmoe-tiny": OLMOE},
        "grid": {
            "model": ["gemma3-hot", "qwen3moe-tiny"],
            "precision": ["fp32", "bf16", "fp16"],
            "batch_size": [8],
            "quant": ["none", "nf4", "nf4-experts"],
            "seed": [0],
        },
        "train": {"steps": 12, "seq_len": 64},
    }
    summary = _run(tmp_path, study)
    results = tmp_path / "results" / "gpu-tiny"
    _check_common(summary, results)
    hot = summary.loc["gemma3-hot_fp16_bs8_none_s0"]
    assert hot["outcome"] == "nan" and ".mlp." in hot["nan_forward_module"]
    assert summary.loc["gemma3-hot_bf16_bs8_none_s0", "outcome"] == "ok"


def test_gemma3_4b_width_fp16_nan_with_origin_under_checkpointing(tmp_path):
    study = {
        "study": "gpu-gemma",
        "models": {"gemma3-4b-width": GEMMA3_4B_WIDTH},
        "grid": {
            "model": ["gemma3-4b-width"],
            "precision": ["fp16", "fp32"],
            "batch_size": [2],
            "quant": ["nf4"],
            "seed": [0],
        },
        "train": {"steps": 8, "seq_len": 256, "gradient_checkpointing": True},
    }
    summary = _run(tmp_path, study)
    _check_common(summary, tmp_path / "results" / "gpu-gemma")
    fp16 = summary.loc["gemma3-4b-width_fp16_bs2_nf4_s0"]
    assert fp16["outcome"] == "nan" and "down_proj" in fp16["nan_forward_module"]
    assert summary.loc["gemma3-4b-width_fp32_bs2_nf4_s0", "outcome"] == "ok"


def test_moe_width_expert_quantization_cuts_weights_and_peak(tmp_path):
    study = {
        "study": "gpu-moe",
        "models": {"olmoe-width": OLMOE_WIDTH},
        "grid": {
            "model": ["olmoe-width"],
            "precision": ["bf16"],
            "batch_size": [1],
            "quant": ["nf4", "nf4-experts"],
            "seed": [0],
        },
        "train": {"steps": 6, "seq_len": 256},
    }
    summary = _run(tmp_path, study)
    _check_common(summary, tmp_path / "results" / "gpu-moe")
    nf4, experts = summary.loc["olmoe-width_bf16_bs1_nf4_s0"], summary.loc["olmoe-width_bf16_bs1_nf4-experts_s0"]
    assert nf4["flagged_share"] > 0.5 and experts["weight_bytes"] < 0.5 * nf4["weight_bytes"]
    assert experts["steady_peak_bytes"] < nf4["steady_peak_bytes"]
