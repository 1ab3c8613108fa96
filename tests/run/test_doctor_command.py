"""`tunegrid doctor` on a recipe: imported as a study whose baseline is the recipe's own cell and whose grid holds
every precision row beside it; the Snakemake line it runs names the doctor's target first (so --config
cannot swallow it) and the study through `--config study=<file>`, and that target dry-runs; a --cell the study
lacks is an error naming it."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, workflow_env

from tunegrid.meanings import PRECISION_ROWS
from tunegrid.run.doctor_workflow import command, run_doctor, study_of, target
from tunegrid.study.config import ConfigError

RECIPE = REPO / "tests" / "data" / "recipes" / "trl-sft-chat.yaml"
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """The held-out TRL recipe beside the local model (a config.json) and the data file it names."""
    shutil.copy(RECIPE, tmp_path / RECIPE.name)
    (tmp_path / "models" / "local-gemma").mkdir(parents=True)
    (tmp_path / "models" / "local-gemma" / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text("\n".join(json.dumps(CHAT) for _ in range(4)) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _args(source: str, **options) -> argparse.Namespace:
    defaults = {"tool": "auto", "ignore": [], "model": "", "dataset": "", "study_out": "", "cell": ""}
    defaults.update(first=False, steps=0, cores=2, snakemake="", target="")
    return argparse.Namespace(source=source, **{**defaults, **options})


def test_a_recipe_becomes_a_study_around_its_own_cell_with_every_precision(workdir):
    args = _args(RECIPE.name, steps=5, snakemake="--dry-run")
    study, written = study_of(args)
    assert written == Path("results/doctor/trl-sft-chat.yaml") and written.is_file()
    assert study["grid"]["precision"][0] == "fp16"  # the recipe's own first: its cell is the baseline
    assert set(study["grid"]["precision"]) == {str(p) for p in PRECISION_ROWS}
    goal = target(study, "local-gemma_fp16_bs8_none_s3", first=True)
    assert goal == Path("results/trl-sft-chat/doctor/local-gemma_fp16_bs8_none_s3/first/doctor.json")
    line = command(args, written, goal)
    assert line[3] == str(goal) and "--dry-run" in line
    assert line[-3:] == ["--config", f"study={written}", "train={steps: 5}"]

    done = subprocess.run(
        [*line[:3], str(goal), "-s", str(REPO / "Snakefile"), "--cores", "2", "-n", "--config", f"study={written}"],
        capture_output=True,
        text=True,
        env=workflow_env(),
        cwd=workdir,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "doctor_reproduce" in done.stdout and "finetune" in done.stdout


def test_a_cell_the_study_lacks_is_refused_naming_it(workdir):
    with pytest.raises(ConfigError, match="--cell: 'local-gemma_fp64_bs8_none_s3' is not a cell"):
        run_doctor(_args(RECIPE.name, cell="local-gemma_fp64_bs8_none_s3"))


def test_the_users_card_is_the_target_of_a_recipe_which_names_none(workdir):
    """`--target t4`: the doctor's study of a recipe targets the card, and a study's own target is overridden."""
    study, written = study_of(_args(RECIPE.name, target="t4"))
    assert study["hardware"]["target"] == "t4"
    assert yaml.safe_load(written.read_text())["hardware"]["target"] == "t4"
    assert study_of(_args(RECIPE.name))[0]["hardware"]["target"] == "native"  # without it, the machine itself

    args = _args(str(written), target="l4")
    over, same = study_of(args)
    assert same == written and over["hardware"]["target"] == "l4"
    line = command(args, written, target(over, "local-gemma_fp16_bs8_none_s3", first=False))
    assert line[-3:] == ["--config", f"study={written}", "hardware={target: l4}"]


def test_import_writes_the_users_card_as_the_studys_target(workdir, capsys):
    from tunegrid.cli.main import main

    main(["import", RECIPE.name, "--target", "t4", "--out", "configs/imported.yaml"])
    assert yaml.safe_load(Path("configs/imported.yaml").read_text())["hardware"]["target"] == "t4"
    assert "written to configs/imported.yaml" in capsys.readouterr().out
