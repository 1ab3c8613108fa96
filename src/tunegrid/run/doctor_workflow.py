"""`tunegrid doctor <recipe or study>`: the study (a recipe is imported first, every setting the tables know
as an axis around it), the baseline cell, and Snakemake run on the doctor's target, whose rules
(workflow/rules/doctor.smk) decide the waves; then its one screen. Run again after a kill, it resumes.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tunegrid.study.config import REPO_ROOT, read_study_file, resolve_study
from tunegrid.study.errors import ConfigError
from tunegrid.study.paths import StudyPaths

STUDY_KEYS = {"study", "models", "grid", "base"}  # a file holding any of these is a study, not a recipe


def _is_study(raw: dict[str, Any]) -> bool:
    return bool(STUDY_KEYS & set(raw))


def recipe_study(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """A recipe as the doctor's study: imported for every failure, every precision row beside its own,
    written where the doctor keeps it (the file Snakemake reads)."""
    from tunegrid.meanings import PRECISION_ROWS
    from tunegrid.recipes.importer import import_recipe

    base = {"recipe": args.source, "from": args.tool, "failure": "all", "ignore": list(args.ignore)}
    base.update({k: v for k, v in (("model", args.model), ("dataset", args.dataset)) if v})
    study, recipe, _ = import_recipe(base)
    study["base"]["from"] = recipe.tool
    if args.target:  # the user's card: a recipe names none
        study["hardware"] = {**(study.get("hardware") or {}), "target": args.target}
    own = study["grid"]["precision"][0]
    study["grid"]["precision"] = [own, *(str(p) for p in PRECISION_ROWS if p != own)]
    out = Path(args.study_out or f"results/doctor/{study['study']}.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# tunegrid doctor's study for {args.source}\n" + yaml.safe_dump(study, sort_keys=False))
    return study, out


def study_of(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from tunegrid.recipes.importer import expand_base

    path = Path(args.source)
    if not path.is_file():
        raise ConfigError(f"{args.source!r} is not a file; give a study YAML or a training recipe")
    try:
        raw = read_study_file(path)
    except ConfigError:
        raw = {}  # a JSON recipe, or YAML that is no mapping: the recipe reader says what is wrong
    if _is_study(raw):
        if args.target:  # as `command` passes it: the card the fix is for, over the study's
            raw = {**raw, "hardware": {**(raw.get("hardware") or {}), "target": args.target}}
        return resolve_study(expand_base(raw)), path
    study, written = recipe_study(args)
    return resolve_study(study), written


def target(study: dict[str, Any], cell_id: str, first: bool) -> Path:
    return StudyPaths.of(study["study"]).doctor_file(cell_id, "first" if first else "all", "doctor.json")


def command(args: argparse.Namespace, study_file: Path, goal: Path) -> list[str]:
    """The Snakemake line: the target first (--config takes every word after it), the study file through
    tunegrid's bounded loader (`--config study=<file>`), the steps budget and the card (`--target`, over a study's
    own hardware.target; a recipe's study file already holds it) as overrides beside it."""
    line = [sys.executable, "-m", "snakemake", str(goal), "-s", str(REPO_ROOT / "Snakefile"), "--cores"]
    line += [str(args.cores), *shlex.split(args.snakemake), "--config", f"study={study_file}"]
    line += [f"train={{steps: {args.steps}}}"] if args.steps else []
    return line + ([f"hardware={{target: {args.target}}}"] if args.target else [])


def run_doctor(args: argparse.Namespace) -> int:
    from tunegrid.study.config import baseline_cell

    study, study_file = study_of(args)
    try:
        baseline = baseline_cell(study, args.cell)
    except ValueError as exc:
        raise ConfigError(f"--cell: {exc}") from None
    goal = target(study, baseline.cell_id, args.first)
    line = command(args, study_file, goal)
    print(f"tunegrid doctor: {baseline.cell_id} of study {study['study']!r}\n  {shlex.join(line)}", flush=True)
    code = subprocess.run(line, check=False).returncode
    screen = goal.with_name("screen.txt")
    if code != 0 or not screen.is_file():
        print(f"tunegrid doctor: snakemake ended with {code}; run the same command again to resume", file=sys.stderr)
        return code or 1
    print("\n" + screen.read_text(), end="")
    return 0
