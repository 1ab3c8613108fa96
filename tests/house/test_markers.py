"""The fast tier stays fast: a test that runs Snakemake jobs is marked `slow` (conftest's guard fails it
otherwise), and the guard tells a job-running command line from one that runs no job."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import runs_snakemake_jobs, snakemake_command


@pytest.mark.parametrize(
    "command",
    [
        ["snakemake", "--cores", "8", "all"],
        [sys.executable, "-m", "snakemake", "-s", "Snakefile", "--cores", "1", "all"],
        ["bash", "-c", "snakemake --cores 8 all --configfile configs/own-data-chat.yaml"],
        "snakemake --cores 1 mlflow_ui",
        ["/opt/venv/bin/snakemake", "--profile", "slurm"],
    ],
)
def test_a_command_that_runs_jobs_is_end_to_end(command):
    assert runs_snakemake_jobs(command)


@pytest.mark.parametrize(
    "command",
    [
        ["snakemake", "--cores", "8", "all", "-n"],
        ["bash", "-c", "snakemake --cores 8 all --configfile configs/config.yaml -n"],
        ["snakemake", "--lint"],
        ["snakemake", "--unlock"],
        ["snakemake", "-n", "all", "--detailed-summary"],
        [sys.executable, "-m", "pytest", "-q"],
        ["bash", "-c", "tunegrid validate configs/config.yaml"],
    ],
)
def test_a_command_that_runs_no_job_is_not(command):
    assert not runs_snakemake_jobs(command)


def test_outside_a_slow_test_starting_snakemake_jobs_fails_the_test(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow"):
        subprocess.run(snakemake_command(tmp_path, "--cores", "1", "all"), check=False)


@pytest.mark.slow
def test_inside_a_slow_test_the_guard_stands_aside():
    command = ["bash", "-c", "exit 0  # snakemake --cores 1 all"]  # reads as a job run; runs nothing
    assert runs_snakemake_jobs(command)
    assert subprocess.run(command, check=False).returncode == 0
