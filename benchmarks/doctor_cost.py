#!/usr/bin/env python
"""The doctor against the full grid, measured in one run: for each study, `tunegrid doctor` on its failing cell
(every candidate, and `--first`), then the study's whole grid (`snakemake all`), in one folder, so the cells the
doctor ran are the grid's own (the same spec, run once); each side's cell-minutes are the sum of its cells'
wall-clock (result.json's `wall_s`), and each side's recommendation is the first fix offered for that cell (the
doctor's screen; the grid's report, read the way `tunegrid export recommended` reads it). Goal: the same
recommendation in at most 40 % of the grid's cell-minutes.

    python benchmarks/doctor_cost.py                          # the four CPU studies below, ~40 min on 2 shared cores
    python benchmarks/doctor_cost.py 'configs/gemma3-270m-cpu.yaml:gemma3-270m_fp16_bs1_none_s0'   # real weights
    python benchmarks/doctor_cost.py configs/memory-fixes-oom-cpu.yaml
    python benchmarks/doctor_cost.py 'configs/collective-timeout-cpu.yaml:<cell_id>'
    python benchmarks/doctor_cost.py examples/axolotl-gemma3-tiny.yaml   # its model: scripts/make_example_model.py
    python benchmarks/doctor_cost.py --workdir <a former run's> --redecide     # its cells, decided again

A study is `path[:cell_id]`; without a cell, the doctor's baseline is the first value of every axis. A training
recipe (examples/axolotl-gemma3-tiny.yaml) is imported as `tunegrid doctor` imports it, its study written in the
work folder: its grid is every setting around the recipe's own. Writes results/benchmarks/doctor_cost.json with
the machine facts (machine.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import machine_facts, write_results  # noqa: E402

DEFAULT_STUDIES = [
    str(REPO / "benchmarks" / "studies" / "gemma3-tiny-fp16.yaml"),
    str(REPO / "configs" / "memory-fixes-oom-cpu.yaml"),
    # its first cell trains without a fault; the one that fails is rank 1's single long pause at 5 s
    str(REPO / "configs" / "collective-timeout-cpu.yaml") + ":qwen3moe-tiny_fp32_bs2_none_s0_ws2_ct5_fault-stall-rank",
    str(REPO / "configs" / "config.yaml") + ":gemma3-tiny_fp16_bs2_none_s0",  # the default study's fp16 overflow
]
GOAL = 0.40


def _snakemake(workdir: Path, study: Path, cores: int, *targets: str, redecide: bool = False) -> float:
    line = [sys.executable, "-m", "snakemake", *targets, "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    # a rule's code names this tree's path: over a former run's cells only files' times say what is out of date
    line += ["--rerun-triggers", "mtime"] if redecide else []
    line += ["--cores", str(cores), "--config", f"study={study}"]  # targets first: --config takes every word after it
    started = time.monotonic()
    proc = subprocess.run(line, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"snakemake {' '.join(targets)} failed:\n{proc.stderr[-4000:]}")
    return time.monotonic() - started


def _study_file(path: str, workdir: Path) -> str:
    """A study file as it is; a recipe as the doctor's study, written in the work folder."""
    from tunegrid.run.doctor_workflow import _is_study, recipe_study
    from tunegrid.study.config import read_study_file
    from tunegrid.study.errors import ConfigError

    try:
        if _is_study(read_study_file(path)):
            return path
    except ConfigError:
        pass
    # the recipe's own paths (its model, its data) are relative to the repository: its top folder is copied into the
    # work folder, where the study runs and its recipe is read again (a study reads no data through a link out of it)
    import shutil

    relative = Path(path).relative_to(REPO)
    if not (workdir / relative.parts[0]).exists():
        shutil.copytree(REPO / relative.parts[0], workdir / relative.parts[0])
    args = argparse.Namespace(source=str(relative), tool="auto", ignore=[], model="", dataset="", target="")
    args.study_out = str(workdir / "recipes" / f"{Path(path).stem}.yaml")
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        _, written = recipe_study(args)
    finally:
        os.chdir(cwd)
    return str(Path(written).resolve())


def _fix_words(fix: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in fix["change"].items()) if fix else "none"


def _forget_decisions(paths) -> None:
    """The doctor's folders, the summary and the report removed, so that they are made again over the cells already
    measured (Snakemake runs no cell again: the doctor of another version, or a changed recommender, decides)."""
    import shutil

    for folder in (paths.study_dir / "doctor", paths.report_file("index.html").parent):
        shutil.rmtree(folder, ignore_errors=True)
    for path in (paths.summary, paths.summary_parquet):
        path.unlink(missing_ok=True)


def measure(entry: str, workdir: Path, cores: int, redecide: bool = False) -> dict:
    from tunegrid.review.doctor_verdict import baseline_fixes, cell_minutes
    from tunegrid.runtime.files import read_json
    from tunegrid.study.config import baseline_cell, cells_by_id, load_study
    from tunegrid.study.paths import StudyPaths

    path, _, cell = entry.partition(":")
    path = str(Path(path).resolve())  # the studies run in their own folder: a relative path would not reach it
    path = _study_file(path, workdir)
    study = load_study(path)
    baseline = baseline_cell(study, cell).cell_id
    paths = StudyPaths.of(study["study"], workdir / "results")
    if redecide:
        _forget_decisions(paths)
    doctor = {}
    for mode in ("all", "first"):
        goal = paths.doctor_file(baseline, mode, "doctor.json")
        wall = _snakemake(workdir, Path(path), cores, str(goal.relative_to(workdir)), redecide=redecide)
        record = read_json(goal)
        doctor[mode] = {
            "fix": _fix_words(record["fix"]),
            "answer": record["answer"],
            "cells": record["cells"],
            "cell_minutes": record["cell_minutes"],
            "wall_s": wall,
        }
    wall = _snakemake(workdir, Path(path), cores, "all", redecide=redecide)
    grid_cells = list(cells_by_id(study))
    fixes = baseline_fixes(baseline, read_json(paths.report_file("recommendations.json")))
    grid = {
        "fix": _fix_words(fixes[0] if fixes else None),
        "cells": len(grid_cells),
        "cell_minutes": cell_minutes([paths.result(c) for c in grid_cells]),
        "wall_s": wall,
    }
    for record in doctor.values():
        record["share"] = record["cell_minutes"] / grid["cell_minutes"] if grid["cell_minutes"] else None
        record["same"] = record["fix"] == grid["fix"]
    return {"study": study["study"], "baseline": baseline, "grid": grid, "doctor": doctor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="*", default=DEFAULT_STUDIES, help="study files, each path[:cell_id]")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--workdir", default="", help="where the studies run (default: a fresh temporary folder)")
    parser.add_argument(
        "--redecide",
        action="store_true",
        help="in a former run's --workdir: make the doctor's decisions, the summary and the report again over the "
        "cells it measured (cell-minutes are those cells' own); Snakemake goes by files' times alone, so this tree's "
        "files must be older than the cells (a fresh checkout is newer: set its times back)",
    )
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="doctor-cost-")).resolve()
    rows = [measure(entry, workdir, args.cores, args.redecide) for entry in args.studies]
    print(f"\n{'study':<26} {'mode':<6} {'recommendation':<34} {'cells':>5} {'cell-min':>9} {'share':>6} same")
    for row in rows:
        grid = row["grid"]
        print(f"{row['study']:<26} {'grid':<6} {grid['fix']:<34} {grid['cells']:>5} {grid['cell_minutes']:>9.2f}")
        for mode, record in row["doctor"].items():
            share = f"{record['share']:.0%}" if record["share"] is not None else "-"
            ok = "yes" if record["same"] else "NO"
            meets = " (goal met)" if record["same"] and record["share"] is not None and record["share"] <= GOAL else ""
            print(
                f"{'':<26} {mode:<6} {record['fix']:<34} {len(record['cells']):>5} {record['cell_minutes']:>9.2f} "
                f"{share:>6} {ok}{meets}"
            )
    out = write_results("doctor_cost", {**machine_facts("cpu"), "goal_share": GOAL}, rows)
    print(f"\nworkdir: {workdir}; {out}")


if __name__ == "__main__":
    main()
