"""The "Bring your recipe" page's commands (docs/guide/recipes.md), as written, in a fresh copy of this checkout: the
example axolotl and TRL recipes import, train on the CPU, end with the study at a glance, and their recommended fix
comes back as the user's own config, changed only where the fix changes it (a TRL one builds trl's SFTConfig)."""

from __future__ import annotations

import html
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, with_session_warm_processes, workflow_env

from tunegrid.meanings import PRECISION_ROWS
from tunegrid.recipes.core import tool_value
from tunegrid.recipes.export import split_trl

pytestmark = pytest.mark.slow


def precision_keys(tool: str) -> set[str]:
    """The keys of `tool`'s config that say a precision tunegrid can export (axolotl's bf16/fp16 and its storage
    switches bfloat16/float16; TRL's bf16/fp16)."""
    keys: set[str] = set()
    for precision in PRECISION_ROWS:
        try:
            keys |= set(tool_value(tool, "precision", precision))
        except ValueError:  # a tunegrid-only fix: no key of the tool says it
            pass
    return keys


def recipe_commands() -> list[str]:
    """The first fenced bash block of docs/guide/recipes.md, line by line."""
    text = (REPO / "docs" / "guide" / "recipes.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_recipe_commands_import_run_and_export_the_examples(tmp_path: Path):
    root = tmp_path / "tunegrid"
    shutil.copytree(
        REPO, root, ignore=shutil.ignore_patterns(".git", ".venv", "results", ".snakemake", "__pycache__", "models")
    )
    # the copy's code is this checkout's, so its runs may fork from the session's warm processes (conftest)
    env = with_session_warm_processes(workflow_env("TUNEGRID_EXECUTION_ID"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    outputs = {}
    for command in recipe_commands():
        done = subprocess.run(
            ["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=900, check=False
        )
        assert done.returncode == 0, f"{command}:\n{(done.stdout + done.stderr)[-3000:]}"
        outputs[command] = done.stdout + done.stderr
    for tool in ("axolotl", "trl"):
        study = f"{tool}-gemma3-tiny"
        (run,) = [out for command, out in outputs.items() if command.startswith("snakemake") and study in command]
        tail = run.strip().splitlines()[-5:]
        assert any(line.startswith(f"tunegrid study '{study}': 6 cells: 3 ok, 3 nan") for line in tail), tail
        assert f"report: results/{study}/report/index.html" in tail
        page = (root / "results" / study / "report" / "index.html").read_text()
        assert "Your recipe, fixed" in page
        # the report's export command runs as printed (it names the study's folder)
        for command in re.findall(r"<code>(tunegrid export [^<]+)</code>", html.unescape(page)):
            argv = shlex.split(command)[1:]
            done = subprocess.run(
                [sys.executable, "-m", "tunegrid.cli", *argv],
                cwd=root,
                capture_output=True,
                text=True,
                env=workflow_env(),
            )
            assert done.returncode == 0 and done.stdout.strip(), (command, done.stderr[-2000:])
        recipe = yaml.safe_load((root / "examples" / f"{study}.yaml").read_text())
        fixed = yaml.safe_load((root / "results" / study / "fixed.yaml").read_text())
        changed = {k for k in set(recipe) | set(fixed) if recipe.get(k) != fixed.get(k)}
        # the fix is a precision (which one is the study's ranking, by throughput: the host's to decide); nothing
        # else moved
        assert changed and changed <= precision_keys(tool), changed
        assert fixed["fp16"] is False
    from trl import SFTConfig

    trl_fixed = yaml.safe_load((root / "results" / "trl-gemma3-tiny" / "fixed.yaml").read_text())
    config = SFTConfig(**split_trl(trl_fixed)["SFTConfig"])  # the file sets use_cpu, as a CPU recipe does
    assert not config.fp16 and config.gradient_accumulation_steps == 8
