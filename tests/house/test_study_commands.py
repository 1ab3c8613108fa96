"""Every study command a user is shown names its study file with `--config study=<file>` (tunegrid's bounded
loader), never `--configfile` (Snakemake's own loader, which expands an alias bomb before tunegrid can check
it): README, the docs, the shipped studies' and examples' comments, the SLURM and default profiles, and the
commands tunegrid prints."""

from __future__ import annotations

import re

from conftest import REPO

# the one page that shows `--configfile` commands on purpose: the report to Snakemake's maintainers, which
# reproduces the upstream problem with them
REPRODUCES_UPSTREAM = {"docs/upstream-snakemake-configfile.md"}
SHOWN = ["README.md", "docs/**/*.md", "configs/*.yaml", "examples/*", "profiles/**/*.yaml", "slurm/*.yaml"]
PRINTED = ["src/tunegrid/**/*.py", "scripts/*.py", "workflow/**/*.smk", "Snakefile"]
CONFIGFILE_COMMAND = re.compile(r"snakemake\b[^\n`|]*--configfile|--configfile\s+\S+\.ya?ml|add `--configfile")


def _files(patterns):
    for pattern in patterns:
        for path in sorted(REPO.glob(pattern)):
            if path.is_file() and path.relative_to(REPO).as_posix() not in REPRODUCES_UPSTREAM:
                yield path


def _offenders(patterns):
    found = []
    for path in _files(patterns):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if CONFIGFILE_COMMAND.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
    return found


def test_no_study_command_shown_to_users_uses_configfile():
    offenders = _offenders(SHOWN)
    assert not offenders, "show `--config study=<file>` instead:\n" + "\n".join(offenders)


def test_no_command_tunegrid_prints_uses_configfile():
    offenders = _offenders(PRINTED)
    assert not offenders, "print `--config study=<file>` instead:\n" + "\n".join(offenders)


def test_the_readme_shows_the_protected_form_for_every_shipped_study():
    readme = (REPO / "README.md").read_text()
    studies_table = (REPO / "docs" / "guide" / "gpu.md").read_text()  # the ready-to-run studies, README's link
    shown = set(re.findall(r"--config study=configs/([\w.-]+)\.yaml", readme + studies_table))
    assert "<study>" in readme and "--config study=configs/<study>.yaml" in readme
    assert shown >= {"memory-fixes-oom-cpu", "collective-timeout", "gemma3-4b-t4"}, shown


def test_the_checker_finds_what_it_looks_for():
    for line in (
        "snakemake --cores 8 all --configfile configs/x.yaml",
        "| `snakemake all --cores 8 --configfile configs/x.yaml --resources gpu=1` |",
        "#   snakemake --profile slurm --configfile configs/x.yaml",
        "`snakemake --cores 8 plan` (add `--configfile configs/<study>.yaml`)",
    ):
        assert CONFIGFILE_COMMAND.search(line), line
    assert not CONFIGFILE_COMMAND.search("snakemake --cores 8 all --config study=configs/x.yaml")
    assert not CONFIGFILE_COMMAND.search("`--configfile <file>` still works, but Snakemake parses that")
