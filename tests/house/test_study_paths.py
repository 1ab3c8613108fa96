"""A study's files are named by StudyPaths: no module walks up from one file to find another, no rule spells one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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


RULE_FILES = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
# A path spelled in a rule file: the study's or the logs folder interpolated into a string, a folder appended to
# a StudyPaths member, or the results folder written out. Rules name their files through PATHS (common.smk).
SPELLED = re.compile(r"""f["'][^"'\n]*\{(RESULTS|LOGS)\}|\{PATHS\.[^}]*\}/|["']results/""")
# The plan rules' own lines (plan.smk), the last that spell their files, each with the member that names it; no
# other line may join them.
STILL_SPELLED = {
    "plan.smk": {
        'f"{LOGS}/study_config.log",': "log",
        'f"{LOGS}/specs/{{cell_id}}.log",': "log",
        'f"{LOGS}/plans/{{cell_id}}.log",': "log",
        'plan=f"{RESULTS}/plan.csv",': "plan_table",
        'f"{LOGS}/plan.log",': "log",
    }
}


def _spelled(path: Path, root: Path = REPO) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.strip()
        if code.startswith("#") or not SPELLED.search(code):
            continue
        if code.split("  #")[0].strip() not in STILL_SPELLED.get(path.name, set()):
            found.append(f"{path.relative_to(root)}:{number}: {code}")
    return found


def test_no_rule_spells_a_path_of_the_study():
    spelled = [line for path in RULE_FILES for line in _spelled(path)]
    assert not spelled, "paths spelled in the rules (name them with StudyPaths, common.smk's PATHS):\n" + "\n".join(
        spelled
    )


def test_the_check_finds_a_spelled_path(tmp_path):
    rule = tmp_path / "bad.smk"
    rule.write_text(
        'rule bad:\n    output:\n        f"{RESULTS}/runs/{{cell_id}}/result.json",\n    log:\n'
        '        f"{PATHS.logs_dir}/bad.log",\n    params:\n        root="results/mlartifacts",\n'
        '        # results/<study>/runs/ in a comment is prose\n        ok=str(PATHS.result("{cell_id}")),\n'
    )
    assert [line.split(": ", 1)[1] for line in _spelled(rule, tmp_path)] == [
        'f"{RESULTS}/runs/{{cell_id}}/result.json",',
        'f"{PATHS.logs_dir}/bad.log",',
        'root="results/mlartifacts",',
    ]


def test_every_member_of_study_paths_is_used():
    """A member nobody reads is a name to keep in step for nothing."""
    members = {name for name in vars(StudyPaths) if not name.startswith("_")} - {"results", "study"}
    texts = [path.read_text() for path in [*RULE_FILES, *(REPO / "src" / "tunegrid").rglob("*.py")]]
    texts = [text for text in texts if "class StudyPaths" not in text]
    texts += [f".{member}" for lines in STILL_SPELLED.values() for member in lines.values()]
    unused = {name for name in members if not any(re.search(rf"\.{name}\b", text) for text in texts)}
    assert not unused, unused
