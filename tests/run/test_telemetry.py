"""No vendor telemetry from tunegrid's processes unless the user asks (tunegrid.runtime.telemetry): MLflow's own
check agrees, in a process whose environment looks like a user's (no CI variables, which MLflow reads as
'stay quiet' by itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunegrid.runtime.telemetry import TELEMETRY_OFF, telemetry_off

SRC = str(Path(__file__).resolve().parents[2] / "src")
CI_VARS = ("CI", "PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "CIRCLECI", "TRAVIS", "JENKINS_URL")


def _mlflow_says_disabled(turn_off: bool, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in CI_VARS and k not in TELEMETRY_OFF and k != "DO_NOT_TRACK"}
    env.update(PYTHONPATH=SRC, **extra)
    code = (
        "from tunegrid.runtime.telemetry import telemetry_off; telemetry_off()\n" if turn_off else ""
    ) + "from mlflow.telemetry.utils import is_telemetry_disabled\nprint(bool(is_telemetry_disabled()))\n"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.slow
def test_mlflow_telemetry_is_off_in_tunegrid_processes_and_a_user_may_turn_it_on():
    assert _mlflow_says_disabled(turn_off=False) == "False", "control: a user's process sends telemetry by default"
    assert _mlflow_says_disabled(turn_off=True) == "True"
    assert _mlflow_says_disabled(turn_off=True, MLFLOW_DISABLE_TELEMETRY="false") == "False", "the user's setting wins"


def test_the_settings_leave_a_users_own_value():
    env = {"HF_HUB_DISABLE_TELEMETRY": "0"}
    telemetry_off(env)
    assert env == {"HF_HUB_DISABLE_TELEMETRY": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}


def test_every_entry_point_turns_it_off():
    """The CLI's entry point (every job's command) and the Snakemake invocation (every job's environment)."""
    root = Path(SRC).parent
    main = (root / "src" / "tunegrid" / "cli" / "main.py").read_text()
    common = (root / "workflow" / "rules" / "common.smk").read_text()
    assert main.index("telemetry_off()") < main.index("forked = forked_job(sys.argv)")
    assert "\ntelemetry_off()\n" in common
