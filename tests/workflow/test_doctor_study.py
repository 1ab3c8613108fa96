"""`tunegrid doctor` end to end on the CPU, in one folder: on a Gemma 3 stand-in whose fp16 cell overflows in step
0, the doctor reproduces it (deterministic: the same step and origin in its same-seed re-run), runs only the
precisions the table offers and reaches the recommendation the full grid reaches afterwards; its fp32 cell
as the baseline is "not reproduced", with the steps and tokens it ran; a non-finite value injected into the
first run only is told apart as transient."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import GEMMA_HOT, REPO, snakemake_command, with_session_warm_processes, workflow_env

from tunegrid.review.doctor_verdict import baseline_fixes
from tunegrid.runtime.files import read_json
from tunegrid.study.config import cells_by_id, load_study

pytestmark = pytest.mark.slow

STUDY = {
    "study": "doctor-fp16",
    "models": {
        "gemma3-tiny": {
            "source": "synthetic",
            "architecture": "gemma3_text",
            "seed": 0,
            "init_scale": {"*.mlp.*": 10},  # its MLP down projections pass fp16's 65504, as Gemma 3's do
            "config": {**GEMMA_HOT["config"], "initializer_range": 0.3},
        }
    },
    "grid": {"model": ["gemma3-tiny"], "precision": ["fp16", "bf16", "fp32"], "batch_size": [2], "quant": ["none"]},
    "train": {"steps": 8, "lr": 0.01, "warmup_steps": 1, "seq_len": 64, "threads": 1},
    "lora": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "data": {"examples": 512},
    "tracking": {"enabled": False},
    "probe": {"budget_s": 1},
}
BASELINE = "gemma3-tiny_fp16_bs2_none_s0"


def doctor(workdir: Path, study: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tunegrid.py"), "doctor", str(study), *args],
        cwd=workdir,
        env=with_session_warm_processes(workflow_env()),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("doctor")


def _write(workdir: Path, study: dict) -> Path:
    path = workdir / f"{study['study']}.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def test_the_doctor_reaches_the_grids_recommendation_with_fewer_cells(workdir):
    study_file = _write(workdir, STUDY)
    done = doctor(workdir, study_file)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = workdir / "results" / "doctor-fp16" / "doctor" / BASELINE / "all"
    record = read_json(out / "doctor.json")
    assert record["reproduction"]["verdict"] == "deterministic"
    assert record["reproduction"]["repeat"]["origin"].endswith("layers.0.mlp.down_proj")
    assert record["cells"][:2] == [BASELINE, f"{BASELINE}_rep1"]
    screen = (out / "screen.txt").read_text()
    for label in ("failure:", "cause:", "fix:", "cost:", "evidence:", "recipe:", "report:"):
        assert label in screen, screen
    assert "cell-minutes" in screen and "deterministic" in screen and screen in done.stdout
    assert (out / "report" / "index.html").is_file()

    grid = subprocess.run(
        snakemake_command(workdir, "all", "--cores", "2", "--config", f"study={study_file}"),
        capture_output=True,
        text=True,
        timeout=1200,
        env=with_session_warm_processes(workflow_env()),
        check=False,
    )
    assert grid.returncode == 0, grid.stderr[-3000:]
    recs = read_json(workdir / "results" / "doctor-fp16" / "report" / "recommendations.json")
    grid_fix = baseline_fixes(BASELINE, recs)[0]
    assert record["fix"]["change"] == grid_fix["change"]
    assert set(record["cells"]) - {f"{BASELINE}_rep1"} <= set(cells_by_id(load_study(study_file)))


def test_a_baseline_that_trains_is_not_reproduced_with_its_steps_and_tokens(workdir):
    study_file = _write(workdir, STUDY)
    done = doctor(workdir, study_file, "--cell", "gemma3-tiny_fp32_bs2_none_s0")
    assert done.returncode == 0, done.stderr[-3000:]
    record = read_json(
        workdir / "results" / "doctor-fp16" / "doctor" / "gemma3-tiny_fp32_bs2_none_s0" / "all" / "doctor.json"
    )
    assert record["answer"] == "not reproduced" and record["cells"] == ["gemma3-tiny_fp32_bs2_none_s0"]
    assert "not reproduced" in done.stdout and "ran ok for 8 steps" in done.stdout and "tokens" in done.stdout


def test_a_fault_of_the_first_run_only_is_transient(workdir):
    study = copy.deepcopy(STUDY)
    study["study"] = "doctor-transient"
    study["grid"]["precision"] = ["fp32"]
    study["debug"] = {"inject_nonfinite": {"module": "model.layers.1.mlp.down_proj", "step": 2, "transient": True}}
    done = doctor(workdir, _write(workdir, study), "--first")
    assert done.returncode == 0, done.stderr[-3000:]
    cell = "gemma3-tiny_fp32_bs2_none_s0"
    record = read_json(workdir / "results" / "doctor-transient" / "doctor" / cell / "first" / "doctor.json")
    assert record["answer"] == "transient" and record["cells"] == [cell, f"{cell}_rep1"]
    assert record["reproduction"]["baseline"]["step"] == 2 and record["reproduction"]["repeat"]["outcome"] == "ok"
    assert "transient" in done.stdout and f"{cell}_rep1" in done.stdout
