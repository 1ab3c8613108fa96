"""The docs site builds with warnings as errors, its reference pages hold what the code holds, and README stays
a front door."""

from __future__ import annotations

import dataclasses
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`mkdocs build --strict`, as docs/contributing.md shows it, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def _page(site: Path, name: str) -> str:
    return html.unescape((site / "reference" / name / "index.html").read_text())


def test_the_cli_reference_holds_every_command_and_argument(site):
    import argparse

    from tunegrid.cli.main import build_parser

    text = _page(site, "cli")
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        assert f"tunegrid {name}" in text, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert flag in text, (name, flag)


def test_the_study_reference_holds_every_key_of_the_schema(site):
    from tunegrid.study.config import load_schema

    text = _page(site, "study")
    schema = load_schema()
    for key, node in schema["properties"].items():
        assert f"<code>{key}</code>" in text, key
        for child in node.get("properties") or {}:
            assert f"{key}.{child}" in text, (key, child)


def test_the_result_reference_holds_every_field_of_the_result_types(site):
    from tunegrid.outcome import CellResult, Diagnosis, Outcome, StepMetrics

    text = _page(site, "result")
    for cls in (CellResult, Diagnosis, StepMetrics):
        for field in dataclasses.fields(cls):
            assert f"<code>{field.name}</code>" in text, (cls.__name__, field.name)
    assert all(outcome.value in text for outcome in Outcome)


def test_the_axes_reference_holds_every_axis_with_its_id_prefix(site):
    from tunegrid.vocabulary import axis_table

    text = _page(site, "axes")
    for axis in axis_table():
        assert f"<code>{axis.name}</code>" in text, axis.name
        assert axis.description.split()[0] in text, axis.name


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README is the front door: move the manual into docs/"
    links = re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme)
    missing = [link for link in links if not (REPO / link).exists()]
    assert links and not missing, missing


SCREENSHOTS = REPO / "docs" / "screenshots"
SCREENSHOTS_COMMAND = "python scripts/tunegrid.py screenshots --study-dir results/default --out docs/screenshots"


def test_the_screenshots_show_the_default_study_as_it_is_now() -> None:
    """docs/screenshots/screenshots.json records what the pictures show (written by the screenshots command): the
    host and commit that made them and the figures the review guide quotes; when the default study's grid changes,
    its cell count no longer matches and the pictures are out of date."""
    import json

    from tunegrid.study.config import DEFAULT_STUDY_PATH, expand_cells, load_study

    study = load_study(DEFAULT_STUDY_PATH)
    record = SCREENSHOTS / "screenshots.json"
    redo = f"run the default study, then `{SCREENSHOTS_COMMAND}`"
    assert record.exists(), f"docs/screenshots has no screenshots.json: {redo}"
    shown = json.loads(record.read_text())
    assert shown["study"] == study["study"], redo
    assert shown["cells"] == len(expand_cells(study)), f"the pictures show {shown['cells']} cells: {redo}"
    assert shown["runs"] >= shown["cells"], "every cell has its MLflow run"
    assert all((SCREENSHOTS / name).stat().st_size > 10_000 for name in shown["files"])
    # which host and commit made them (the guide's block of figures names both, tests/review/test_report_tables.py)
    assert shown["host"] and shown["commit"] and shown["date"], f"the pictures name no host: {redo}"
    assert sum(shown["outcomes"].values()) == shown["cells"] and shown["recommendations"], redo


def test_every_profile_a_help_text_names_exists():
    """A help text's `--profile NAME` is one Snakemake finds from the repository root (./NAME/config.yaml)."""
    import argparse
    import re

    from tunegrid.cli.main import build_parser

    def helps(parser: argparse.ArgumentParser):
        for action in parser._actions:
            yield action.help or ""
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from helps(sub)

    named = {m for text in helps(build_parser()) for m in re.findall(r"--profile (\S+?)['\s)]", text + " ")}
    assert named, "no help text names a profile any more: drop this test"
    missing = [name for name in named if not (REPO / name / "config.yaml").is_file()]
    assert missing == [], f"help texts name profiles this repository does not have: {missing}"
