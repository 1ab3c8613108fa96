"""The GPU tests' Snakemake command line, dry-run on any machine: those tests run only where a GPU is lent (a few
minutes every few sessions), so a command Snakemake would refuse must be found here, not there."""

from __future__ import annotations

import subprocess

import pytest
from conftest import GEMMA_HOT, workflow_env
from test_gpu import study_command

STUDY = {
    "study": "gpu-command",
    "models": {"gemma3-hot": GEMMA_HOT},
    "grid": {"model": ["gemma3-hot"], "precision": ["fp16"], "batch_size": [8], "quant": ["none"], "seed": [0]},
    "train": {"steps": 2, "seq_len": 64},
}


@pytest.mark.parametrize("resources", [("gpu=1",), ()], ids=["gpu-limit", "no-limit"])
def test_the_gpu_tests_study_command_parses_and_plans(tmp_path, resources):
    line = study_command(tmp_path, STUDY, resources)
    done = subprocess.run([*line, "-n"], capture_output=True, text=True, timeout=300, env=workflow_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "finetune" in done.stdout  # the plan holds the cell's training job
