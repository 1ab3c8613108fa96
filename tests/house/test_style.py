"""One format for the whole tree: ruff's lint and formatter on the Python, snakefmt on the rules (settings in
pyproject.toml). Run as tests so the README's one test command checks them too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

RULE_FILES = ["Snakefile", "workflow/"]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -r envs/requirements-test.txt")
    return found


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint_is_clean():
    done = _run(_tool("ruff"), "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    done = _run(_tool("ruff"), "format", "--no-cache", "--check", ".")
    assert done.returncode == 0, "run `ruff format .`:\n" + done.stdout[-4000:] + done.stderr[-2000:]


def test_snakefmt_leaves_the_rules_as_they_are():
    done = _run(_tool("snakefmt"), "--check", *RULE_FILES)
    assert done.returncode == 0, "run `snakefmt Snakefile workflow/`:\n" + done.stdout[-4000:] + done.stderr[-2000:]
