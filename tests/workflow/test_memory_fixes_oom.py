"""The shipped out-of-memory study through Snakemake (configs/memory-fixes-oom-cpu.yaml, --cores 2): the plain
setting (a micro-batch of 4) and 8-bit AdamW alone run out of their budget at the step; activation checkpointing, a
micro-batch of 1 with grad_accum 4 (the same effective batch) and every combination with them fit; the report ranks
the fixes by throughput, a fix that adds settings to another after it, each with its peak, cost and loss parity.
`tunegrid doctor` runs first in the same folder and reaches the grid's recommendation on its failing cell, its repeat
and the two fixes that could rank first; the grid then runs the rest. One run feeds every test of this module.

The study holds on any CPU family only if the budget sits far from every cell: a failing cell needs at least
1.2x the budget and every fix at most 0.8x. The tests assert those margins first -- from the plans' own estimates
before anything trains, then from the charge each cell recorded -- so a margin gone thin fails there, naming the
cell, before any outcome is read. What a cell is charged does not depend on how fast it runs: under a budget the
worker keeps one malloc arena from its start and maps every large block on its own (tunegrid.runtime.memory), so
the charge follows the tensors alive."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO, processes_mentioning, snakemake_command, with_session_warm_processes, workflow_env

from tunegrid.contract import CellContract
from tunegrid.review.doctor_choice import CLEAR_MISS
from tunegrid.review.doctor_verdict import baseline_fixes
from tunegrid.runtime.files import read_json

pytestmark = pytest.mark.slow

STUDY = "memory-fixes-oom-cpu"
PLAIN = "llama-deep-mlp_fp32_bs4_none_s0"
MICRO = "llama-deep-mlp_fp32_bs1_none_s0_ga4"  # a micro-batch of 1, 4 accumulated: the same effective batch
CHECKPOINTING, CHECKPOINTING_8BIT = f"{PLAIN}_ac", f"{PLAIN}_adamw-8bit_ac"
FAILING = {PLAIN, f"{PLAIN}_adamw-8bit"}
FIXES = {CHECKPOINTING, CHECKPOINTING_8BIT, MICRO, f"{MICRO}_ac", f"{MICRO}_adamw-8bit", f"{MICRO}_adamw-8bit_ac"}


def _run(line: list[str], workdir) -> subprocess.CompletedProcess:
    return subprocess.run(
        line,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        env=with_session_warm_processes(workflow_env()),
        preexec_fn=lambda: os.umask(0o022),  # the usual umask: results readable by the group and others
    )


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("memory-fixes-oom")
    config = REPO / "configs" / f"{STUDY}.yaml"
    doctor = _run([sys.executable, str(REPO / "scripts" / "tunegrid.py"), "doctor", str(config)], workdir)
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    grid = _run(snakemake_command(workdir, "all", "--cores", "2", "--config", f"study={config}"), workdir)
    assert grid.returncode == 0, grid.stderr[-4000:]
    out = workdir / "results" / STUDY
    summary = pd.read_csv(out / "summary.csv", keep_default_na=False).set_index("cell_id")
    advice = {r["title"].split(":")[0]: r for r in read_json(out / "report" / "recommendations.json")}
    return out, summary, advice


BUDGET = int(0.6 * 2**30)
# the margins: a failing cell needs >= 1.2x the budget (where the doctor rules a candidate out by its plan), a fix
# <= 0.8x
FAILS, FITS = CLEAR_MISS, 0.8


def planned_charge(out, cell: str) -> int:
    """What the cell's plan predicts it adds above its runtime: the estimate less its runtime term (on a CPU the
    budget is of address space above what the worker mapped at its start)."""
    return CellContract.read(out / "plans" / f"{cell}.json").plan.charge_bytes()


def test_the_plans_put_every_cell_far_from_the_budget(study_run):
    """The study's premise, from the plans alone: what tunegrid predicts for each cell before it trains."""
    out, _, _ = study_run
    for cell in FAILING:
        assert planned_charge(out, cell) >= FAILS * BUDGET, (cell, planned_charge(out, cell) / BUDGET)
    for cell in FIXES:
        assert planned_charge(out, cell) <= FITS * BUDGET, (cell, planned_charge(out, cell) / BUDGET)


def test_each_fix_is_charged_well_under_the_budget_and_the_failing_cells_reach_it(study_run):
    """What is deterministic about the demonstration: the address space each cell added, against the budget."""
    out, _, _ = study_run
    for cell in FIXES:
        enforcement = read_json(out / "runs" / cell / "result.json")["memory"]["budget_enforcement"]
        assert enforcement["large_blocks"] == "M_MMAP_THRESHOLD=262144", enforcement
        assert enforcement["address_space_added_peak"] <= FITS * BUDGET, (cell, enforcement)
    for cell in FAILING:  # each reached the budget (the allocation the limit refused is not in its peak)
        enforcement = read_json(out / "runs" / cell / "result.json")["memory"]["budget_enforcement"]
        assert enforcement["address_space_added_peak"] > FITS * BUDGET, (cell, enforcement)


def test_results_are_written_with_the_users_umask(study_run):
    out, _, _ = study_run
    private = [p for p in out.rglob("*") if p.is_file() and not stat.S_IMODE(p.stat().st_mode) & 0o044]
    assert private == [], private[:5]  # e.g. index.html, summary.csv, an adapter's files were 0600


def test_the_plain_setting_runs_out_of_memory_at_the_step_and_each_memory_fix_fits(study_run):
    out, summary, _ = study_run
    for cell in FAILING:
        failing = summary.loc[cell]
        assert failing["outcome"] == "oom" and failing["oom_stage"] == "step", failing.to_dict()
        result = read_json(out / "runs" / cell / "result.json")
        enforcement = result["memory"]["budget_enforcement"]
        assert enforcement["mechanism"] == "RLIMIT_AS" and enforcement["malloc_arenas"] == "M_ARENA_MAX=1"
        assert result["memory"]["budget_bytes"] == BUDGET
    for cell in FIXES:
        fix = summary.loc[cell]
        assert fix["outcome"] == "ok", (cell, fix.to_dict())
        assert fix["quality"] == "holds"  # it learned (its loss fell >= 5 %)
    # what the 8-bit state saves is what the summary says it held, against the estimate's figure: a quarter of the
    # bytes, less what bitsandbytes keeps in 32 bits (tensors under 4,096 elements: the attention's LoRA A at r 32)
    state = {cell: int(float(summary.loc[cell, "optimizer_state_bytes"])) for cell in FIXES}
    assert state[CHECKPOINTING_8BIT] * 2.5 < state[CHECKPOINTING]
    assert state[CHECKPOINTING_8BIT] == int(float(summary.loc[CHECKPOINTING_8BIT, "optimizer_state_estimate_bytes"]))


def test_the_recommendation_is_the_fastest_fix_that_adds_to_no_other_with_each_fixs_peak_cost_and_parity(study_run):
    out, summary, advice = study_run
    rec = advice[PLAIN]
    assert rec["failing"] == [PLAIN] and "out of memory at step" in rec["title"]
    evidence = [fix["evidence"][0] for fix in rec["fixes"]]
    # whichever of the micro-batch and checkpointing runs faster on this host comes first; checkpointing with 8-bit
    # AdamW adds a setting to checkpointing, which fits alone, so it comes after it however fast
    faster = max((MICRO, CHECKPOINTING), key=lambda cell: float(summary.loc[cell, "tokens_per_s"]))
    assert evidence[0] == faster and sorted(evidence) == sorted([MICRO, CHECKPOINTING, CHECKPOINTING_8BIT])
    assert evidence.index(CHECKPOINTING) < evidence.index(CHECKPOINTING_8BIT)
    assert "Ranked by throughput, fastest first; a fix that adds settings to another, after it." in rec["text"]
    changes = {fix["evidence"][0]: fix["change"] for fix in rec["fixes"]}
    assert changes[CHECKPOINTING] == {"activation_checkpointing": True}
    assert changes[CHECKPOINTING_8BIT] == {"optimizer": "adamw-8bit", "activation_checkpointing": True}
    assert changes[MICRO] == {"batch_size": 1, "grad_accum": 4}
    for fix in rec["fixes"]:
        cell = fix["evidence"][0]
        peak_mib = float(summary.loc[cell, "peak_bytes"]) / 2**20
        assert f"(peak {peak_mib:.1f} MiB)" in fix["why"]
        assert fix["cost"]["peak_bytes"] == float(summary.loc[cell, "peak_bytes"])
        assert 0 < fix["cost"]["tokens_per_s_ratio"] <= 1.0 and fix["cost"]["against"] == "the fastest fix"
        assert "of the fastest fix)" in fix["why"]
    assert max(fix["cost"]["tokens_per_s_ratio"] for fix in rec["fixes"]) == 1.0
    # the checkpointing twin (the same arithmetic) stands for the failing setting's loss, and the other fixes are
    # compared with it. The plain cell runs out of memory in its first step (far over the budget), so it logged
    # no loss and the stand-in has nothing to be compared with
    by_cell = {fix["evidence"][0]: fix for fix in rec["fixes"]}
    stand_in = by_cell[CHECKPOINTING]
    assert stand_in["parity"] is None and "stands for the failing setting's (the failing cell" in stand_in["why"]
    for cell in (CHECKPOINTING_8BIT, MICRO):
        assert 0 <= by_cell[cell]["parity"] <= 0.05, by_cell[cell]
        assert f"of {CHECKPOINTING} over the last quarter of steps" in by_cell[cell]["why"]
        assert f"its reference {cell}" not in by_cell[cell]["why"]  # never a cell compared with itself
    assert "at the same effective batch of 4" in by_cell[MICRO]["why"]
    # 8-bit AdamW alone saves too little to fit: its own fixes are checkpointing and the micro-batch, with 8-bit
    # AdamW kept, and checkpointing with torch's AdamW (two settings away)
    rec_8bit = advice[f"{PLAIN}_adamw-8bit"]
    assert {fix["evidence"][0] for fix in rec_8bit["fixes"]} == {
        CHECKPOINTING,
        CHECKPOINTING_8BIT,
        f"{MICRO}_adamw-8bit",
    }
    report = (out / "report" / "index.html").read_text()
    assert f"{PLAIN}: out of memory at step" in report
    assert processes_mentioning(out) == []


def test_the_doctor_reaches_the_grids_fix_on_the_two_fixes_that_could_rank_first(study_run):
    """The doctor runs the failing cell, its repeat, then the fixes one setting away -- the micro-batch first, the
    cheaper by its plan's bound -- and leaves every cell that adds settings to a fix that holds, and 8-bit AdamW alone
    (its plan charges the budget 1.2 times over or more), unrun: 3 of the grid's 8 cells, with the grid's fix."""
    out, _, advice = study_run
    record = read_json(out / "doctor" / PLAIN / "all" / "doctor.json")
    assert record["reproduction"]["verdict"] == "deterministic"
    assert record["cells"] == [PLAIN, f"{PLAIN}_rep1", MICRO, CHECKPOINTING]
    grid_fix = baseline_fixes(PLAIN, [advice[PLAIN]])[0]
    assert record["fix"]["change"] == grid_fix["change"] and record["fix"]["cell_id"] == grid_fix["cell_id"]
    not_run = " ".join(record["not_run"])
    for cell in (CHECKPOINTING_8BIT, f"{MICRO}_ac", f"{MICRO}_adamw-8bit", f"{MICRO}_adamw-8bit_ac"):
        changes = {c["cell_id"]: c["change"] for c in record["choice"]["candidates"]}
        assert ", ".join(f"{k}={v}" for k, v in changes[cell].items()) + ": adds" in not_run, (cell, not_run)
    assert [s.split(":")[0] for s in record["choice"]["skipped"]] == ["optimizer=adamw-8bit"]
    assert "out of memory too" in record["choice"]["skipped"][0]
