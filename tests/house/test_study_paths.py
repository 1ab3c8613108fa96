"""A study's files are named by StudyPaths: no module walks up from one file to find another."""

from __future__ import annotations

import ast

from conftest import REPO

from tunegrid.study.paths import StudyPaths

# where `.parents[N]` is allowed: locating the package or the repository itself, never a study's files
PACKAGE_LOCATION = {"study/config.py", "run/warm.py"}


def test_no_module_finds_a_study_file_by_walking_up():
    offenders = []
    for path in (REPO / "src" / "tunegrid").rglob("*.py"):
        if path.relative_to(REPO / "src" / "tunegrid").as_posix() in PACKAGE_LOCATION:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                if node.value.attr == "parents":
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, "parents[N] path arithmetic (use tunegrid.study.paths.StudyPaths):\n" + "\n".join(offenders)


def test_a_cell_file_leads_back_to_its_study():
    paths = StudyPaths.of("default")
    result = paths.result("gemma3-tiny_fp16_bs8_nf4_s0")
    assert str(result) == "results/default/runs/gemma3-tiny_fp16_bs8_nf4_s0/result.json"
    assert StudyPaths.of_result(result) == paths
    assert paths.cell_log("c") == paths.logs_dir / "finetune" / "c.log"
    assert str(paths.logs_dir) == "results/logs/default" and str(paths.study_file) == "results/default/study.json"
