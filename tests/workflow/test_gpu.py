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

from tunegrid.runtime.files import read_json, read_jsonl

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


def study_command(tmp_path: Path, study: dict, resources: tuple[str, ...] = ("gpu=1",)) -> list[str]:
    """The Snakemake command line every study here runs (a CPU test dry-runs it, so a command Snakemake would
    not parse is found before a GPU is lent)."""
    config = tmp_path / "study.yaml"
    # the probe's micro-benchmarks in 4 s rather than 30 (no test here reads their TFLOP/s): the suite runs a
    # study per test, and the whole suite has to fit one device call beside the other GPU checks
    config.write_text(yaml.safe_dump({"probe": {"budget_s": 4}} | study))
    limits = ("--resources", *resources) if resources else ()
    # the target first: `--resources` takes every word after it up to the next option
    return snakemake_command(tmp_path, "all", "--cores", "8", *limits, "--configfile", str(config))


def _run(tmp_path: Path, study: dict, timeout: int = 420, resources: tuple[str, ...] = ("gpu=1",)) -> pd.DataFrame:
    done = subprocess.run(
        study_command(tmp_path, study, resources), capture_output=True, text=True, timeout=timeout, env=workflow_env()
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return pd.read_parquet(tmp_path / "results" / study["study"] / "summary.parquet").set_index("cell_id")


def _check_common(summary: pd.DataFrame, results: Path) -> None:
    assert "error" not in set(summary["outcome"]), summary.loc[summary.outcome == "error", "reason"].to_dict()
    for cell_id, row in summary.iterrows():
        result = read_json(results / "runs" / cell_id / "result.json")
        assert result["memory"]["device"] == "cuda"
        # gpus_per_rank is not set by these studies: auto gives each rank one GPU, claimed by the cell's job
        assert result["visible_devices"] not in ("", None), result["visible_devices"]
        if row["outcome"] == "ok":
            # the steps that trained: a step the GradScaler skipped does not count (the cell ran one more)
            assert row["updates_applied"] == result["cell"]["train"]["steps"]
            assert 0.9 <= row["estimate_over_measured"] <= 1.1, (cell_id, row["estimate_over_measured"])
        log = (results.parent / "logs" / results.name / "finetune" / f"{cell_id}.log").read_text()
        assert "forked by the warm worker" not in log  # CUDA does not survive a fork
        assert "the warm worker does not serve this run" not in log, "planned spawned: it never asks (or waits)"
    warm_log = (results.parent / "logs" / results.name / "warm_worker.log").read_text()
    assert "no warm worker: " in warm_log, warm_log  # none started beside the GPU, so no job waits for one


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


GEMMA3_4B_34_LAYERS = {**GEMMA3_4B_WIDTH, "config": {**GEMMA3_4B_WIDTH["config"], "num_hidden_layers": 34}}


def test_fp16_nan_replay_keeps_the_outcome_under_the_t4_budget(tmp_path):
    """configs/gemma3-4b-t4.yaml's shape: 34 layers of Gemma 3 4B width at seq 2048, checkpointing on, judged
    as on a T4. The checkpointed step fits the budget; the origin replay without checkpointing would keep every
    layer's activations (more than the budget). The cell must end `nan` as it would with memory to spare, never
    `oom`: the replay degrades (forward only, or unlocated with why)."""
    study = {
        "study": "gpu-t4-replay",
        "models": {"gemma3-4b-34": GEMMA3_4B_34_LAYERS},
        "grid": {"model": ["gemma3-4b-34"], "precision": ["fp16"], "batch_size": [1], "quant": ["nf4"], "seed": [0]},
        "train": {"steps": 6, "seq_len": 2048, "gradient_checkpointing": True},
        "hardware": {"target": "t4"},
        "data": {"examples": 4000},  # packed: full 2048-token rows
    }
    summary = _run(tmp_path, study, timeout=900)
    (cell_id,) = summary.index
    result = read_json(tmp_path / "results" / "gpu-t4-replay" / "runs" / cell_id / "result.json")
    assert result["outcome"] == "nan", result["reason"]
    origin = result["diagnosis"]["nan"]["origin"]
    assert origin["replay"] in ("full", "forward only", "out of memory")
    if origin["replay"] != "full":
        assert "out of memory" in origin["unlocated"]
    if origin["replay"] != "out of memory":
        assert "down_proj" in origin["forward"]["module"]


def test_cells_side_by_side_never_share_a_gpu(tmp_path):
    """No --resources limit: Snakemake would start both cells at once; each job claims its own GPU, so on a
    one-GPU machine the second waits for the first (their training never overlaps) and both train on it."""
    study = {
        "study": "gpu-claims",
        "models": {"gemma3-hot": GEMMA_HOT},
        "grid": {"model": ["gemma3-hot"], "precision": ["fp32"], "batch_size": [2, 4], "quant": ["none"], "seed": [0]},
        "train": {"steps": 6, "seq_len": 64},
    }
    summary = _run(tmp_path, study, resources=())
    results = tmp_path / "results" / "gpu-claims"
    runs = [read_json(results / "runs" / cell_id / "result.json") for cell_id in summary.index]
    assert [r["outcome"] for r in runs] == ["ok", "ok"]
    if torch.cuda.device_count() == 1:
        assert [r["visible_devices"] for r in runs] == ["0", "0"]
        steps = [read_jsonl(results / "runs" / cell_id / "metrics.jsonl") for cell_id in summary.index]
        first, second = sorted(steps, key=lambda lines: lines[0]["time"])
        assert second[0]["time"] > first[-1]["time"]  # the second trained only once the first had finished
    else:
        assert len({r["visible_devices"] for r in runs}) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_collective_timeout_is_timeout_not_a_retried_crash(tmp_path):
    """configs/collective-timeout.yaml in small: rank 1 stalls before step 2; NCCL's watchdog aborts rank 0
    (SIGABRT, no Python exception) after the collective timeout. The cell ends `timeout`, naming ALLREDUCE,
    its sequence number and rank 1, and is not retried."""
    study = {
        "study": "gpu-nccl-timeout",
        "models": {"qwen3moe-tiny": QWEN_MOE},
        "grid": {
            "model": ["qwen3moe-tiny"],
            "precision": ["bf16"],
            "batch_size": [2],
            "quant": ["none"],
            "seed": [0],
            "world_size": [2],
        },
        "train": {"steps": 6, "seq_len": 64, "retries": 1},
        "debug": {"stall_rank": {"rank": 1, "step": 2, "seconds": 300}},
        "distributed": {"collective_timeout_s": 20, "exit_grace_s": 5},
    }
    summary = _run(tmp_path, study, resources=("gpu=2",))
    (cell_id,) = summary.index
    result = read_json(tmp_path / "results" / "gpu-nccl-timeout" / "runs" / cell_id / "result.json")
    assert result["outcome"] == "timeout", result["reason"]
    collective = result["diagnosis"]["collective"]
    assert collective["op"] == "ALLREDUCE" and collective["missing_ranks"] == [1] and collective["step"] == 2
    assert isinstance(collective["seq"], int)
    assert len(result["attempts"]) == 1
