"""The resolved study (study.json) and each cell's resolved spec (specs/<cell_id>.json) are files of rules.

A study change re-makes the specs it changes, and Snakemake re-plans and re-runs those cells and no other; a
change no cell trains with (the review section) re-makes study.json and re-runs the summary and the report, no
cell. Checked by dry runs over a finished DAG: the study's own files made for real by their rules, every other
output a stand-in recorded as done by `--touch` (no model, probe or cell runs here).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import make_study, snakemake_command, stub_contract, workflow_env

from tunegrid.study.config import cell_spec, cells_by_id, resolve_study, spec_json
from tunegrid.study.paths import StudyPaths

GEMMA, QWEN = "gemma3-hot_fp32_bs2_none_s0", "qwen3moe-tiny_fp32_bs2_none_s0"


def _snakemake(workdir: Path, *args: str, override: str = "") -> str:
    """`args` first: --configfile and --config take every word after them."""
    config = ["--config", override] if override else []
    proc = subprocess.run(
        snakemake_command(workdir, *args, "--cores", "1", "--configfile", str(workdir / "study.yaml"), *config),
        env=workflow_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _planned(workdir: Path, override: str = "") -> dict[str, set[str]]:
    """rule -> the first output of each of its jobs a dry run of `all` would run."""
    out = _snakemake(workdir, "-n", "all", override=override)
    jobs: dict[str, set[str]] = {}
    for rule, body in re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=\n\n|\n\[|\Z)", out, flags=re.S | re.M):
        found = re.search(r"^\s+output: ([^,\n]+)", body, flags=re.M)
        jobs.setdefault(rule, set()).add(found.group(1) if found else "")
    return jobs


def _cells(jobs: dict[str, set[str]], rule: str) -> set[str]:
    return {Path(p).parent.name if rule == "finetune" else Path(p).stem for p in jobs.get(rule, set())}


def _finished(workdir: Path, study: dict) -> StudyPaths:
    """The study as after a complete run: its resolved files made by their rules, the rest stand-ins."""
    (workdir / "study.yaml").write_text(yaml.safe_dump(study))
    paths = StudyPaths.of(study["study"], workdir / "results")
    cells = cells_by_id(resolve_study(study))
    made = [str(p.relative_to(workdir)) for p in (paths.study_file, *(paths.cell_spec(c) for c in cells))]
    _snakemake(workdir, *made)
    summary = _snakemake(workdir, "-n", "all", "--detailed-summary")
    rows = [line.split("\t") for line in summary.splitlines() if line.count("\t") >= 7]
    for output, _, rule, *_ in rows[1:]:  # below the header
        path = workdir / output
        if rule == "model_checkpoint":
            path.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
    for cell_id, cell in cells.items():  # its finetune job's mem_mb is read from it
        stub_contract(cell_id, cell.world_size, 2**28, device="cpu").write(paths.cell_plan(cell_id))
    _snakemake(workdir, "all", "--touch")
    assert _planned(workdir) == {}, "a finished study has nothing left to run"
    return paths


@pytest.mark.slow
def test_a_study_change_reruns_the_cells_it_changes_and_no_other(tmp_path):
    grid = {"model": ["gemma3-hot", "qwen3moe-tiny"], "precision": ["fp32"], "batch_size": [2], "quant": ["none"]}
    study = make_study(study="rr", grid=grid, tracking={"enabled": False}, execution={"warm_worker": False})
    paths = _finished(tmp_path, study)
    before = {c: paths.cell_spec(c).stat().st_mtime_ns for c in (GEMMA, QWEN)}

    # one model's entry changes: its cells' specs are re-made, re-planned and re-run; the other model's are not
    changed = _planned(tmp_path, "models={gemma3-hot: {seed: 1}}")
    for rule in ("cell_config", "cell_plan", "finetune"):
        assert _cells(changed, rule) == {GEMMA}, (rule, changed)
    assert {"study_config", "summary", "comparison_report"} <= set(changed)

    # a training setting every cell reads: every spec re-made, every cell re-planned and re-run
    steps = _planned(tmp_path, "train={steps: 4}")
    for rule in ("cell_config", "cell_plan", "finetune"):
        assert _cells(steps, rule) == {GEMMA, QWEN}, (rule, steps)
    assert "probe" not in steps and "dataset" not in steps

    # the review section is no cell's: study.json and what reads it, no spec, plan or cell
    review = _planned(tmp_path, "review={loss_tolerance: 0.1}")
    assert {"study_config", "summary", "comparison_report"} <= set(review)
    assert not {"cell_config", "cell_plan", "finetune"} & set(review), review

    # a cell added to the grid runs alone; the cells already there stay done
    grown = _planned(tmp_path, "grid={precision: [fp32, bf16]}")
    assert _cells(grown, "finetune") == {GEMMA.replace("fp32", "bf16"), QWEN.replace("fp32", "bf16")}

    # made for real with the first change: the re-made spec is the new resolved spec; the other file is untouched
    override = {"models": {"gemma3-hot": {"seed": 1}}}
    _snakemake(
        tmp_path,
        *(str(paths.cell_spec(c).relative_to(tmp_path)) for c in (GEMMA, QWEN)),
        override="models={gemma3-hot: {seed: 1}}",
    )
    new = resolve_study(
        {
            **study,
            "models": {
                **study["models"],
                "gemma3-hot": {**study["models"]["gemma3-hot"], **override["models"]["gemma3-hot"]},
            },
        }
    )
    assert json.loads(paths.cell_spec(GEMMA).read_text()) == json.loads(
        spec_json(cell_spec(new, cells_by_id(new)[GEMMA]).to_json())
    )
    assert paths.cell_spec(GEMMA).stat().st_mtime_ns > before[GEMMA]
    assert paths.cell_spec(QWEN).stat().st_mtime_ns == before[QWEN]
