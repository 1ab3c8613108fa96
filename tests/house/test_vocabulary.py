"""One vocabulary: the schema's grid, the cell ids, their parser and the wildcard pattern come from
tunegrid.vocabulary's axis table, and no other module keeps its own list of axes."""

from __future__ import annotations

import ast
import re

import yaml
from conftest import REPO, make_study

from tunegrid.study.config import expand_cells, load_schema, resolve_study
from tunegrid.vocabulary import (
    AXIS_TABLE,
    OUTCOMES,
    PRECISIONS,
    QUANTS,
    CurvePlace,
    Outcome,
    axis_names,
    cell_id_pattern,
    parse_cell_id,
)


def test_the_schema_grid_is_the_axis_table():
    grid = load_schema()["properties"]["grid"]
    # one key per axis, and `exclude`, whose entries are keyed by the same axes
    assert tuple(grid["properties"]) == (*axis_names(), "exclude")
    assert tuple(grid["properties"]["exclude"]["items"]["properties"]) == axis_names()
    assert tuple(grid["properties"]["precision"]["items"]["enum"]) == PRECISIONS
    assert tuple(grid["properties"]["quant"]["items"]["enum"]) == QUANTS
    assert grid["additionalProperties"] is False and grid["required"] == ["model"]
    # the file itself lists no axis: nothing to keep in step by hand
    on_disk = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert "properties" not in on_disk["properties"]["grid"]


def test_the_loss_figure_has_one_colour_and_one_style_axis():
    roles = [a.plot.curves for a in AXIS_TABLE if a.plot]
    assert roles.count(CurvePlace.COLOUR) == 1 and roles.count(CurvePlace.STYLE) == 1


def _literal_axis_lists(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Collections written out in the source that name two or more axes: a hand-kept list of axes."""
    names = set(axis_names())
    found = []
    for node in ast.walk(tree):
        elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not elements:
            continue
        named = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in names]
        if len(named) >= 2:
            found.append((node.lineno, named))
    return found


# Where two axes are named together for what they do, not to enumerate the grid
AXIS_EFFECTS = {
    "vocabulary.py": "the table itself",
    "review/batch_advice.py": "a micro-batch recipe is batch_size x grad_accum",
    "review/memory_advice.py": "the memory settings a fix changes (optimizer, activation checkpointing)",
    "review/doctor_choice.py": "the settings an out-of-memory fix may change (memory, quantization, micro-batch)",
    "study/grid_axes.py": "the axes that stand for a study setting, each beside its setting",
    "run/rank_diagnosis.py": "a distributed cell's facts: its world size and the timeout in effect",
    "cell/loop/ranks.py": "a distributed cell's facts: its world size and the timeout in effect",
    "recipes/importer.py": "recipe keys recorded, not study paths (its model name)",
    "recipes/core.py": "each axis beside the keys that say it in a tool's file (import and export)",
    "run/calibrate.py": "the probe's micro study: a study's grid as written in a study file",
}


def test_no_module_keeps_its_own_list_of_axes():
    """cell_id, the summary's columns, the plots and the recommender take their axes from AXIS_TABLE: a list
    of axis names written elsewhere would miss the next axis (cells differing in it would overwrite each
    other in the outcome matrix)."""
    offenders = []
    for path in (REPO / "src" / "tunegrid").rglob("*.py"):
        if path.relative_to(REPO / "src" / "tunegrid").as_posix() in AXIS_EFFECTS:
            continue
        for line, named in _literal_axis_lists(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(REPO)}:{line} {named}")
    assert not offenders, "axes listed outside tunegrid.vocabulary.AXIS_TABLE:\n" + "\n".join(offenders)


def test_a_cell_id_parses_back_to_its_axes():
    study = resolve_study(make_study(grid={"model": ["gemma3-hot"], "precision": ["fp16"], "grad_accum": [1, 4]}))
    for cell in expand_cells(study):
        assert parse_cell_id(cell.cell_id) == cell.axes()


def test_every_cell_id_matches_the_wildcard_pattern_and_nothing_else_does():
    grid = {
        "model": ["gemma3-hot", "qwen3moe-tiny"],
        "precision": list(PRECISIONS),
        "batch_size": [2, 16],
        "quant": list(QUANTS),
        "seed": [0, 3],
        "world_size": [1, 2],
        "grad_accum": [1, 4],
    }
    study = resolve_study(make_study(grid=grid))
    pattern = re.compile(cell_id_pattern())
    ids = [cell.cell_id for cell in expand_cells(study)]
    assert len(ids) == 2 * len(PRECISIONS) * 2 * len(QUANTS) * 2 * 2 * 2 and all(pattern.fullmatch(i) for i in ids)
    # a suffix only where the axis is not 1: ids of cells from before the axis existed stay as they were
    assert "gemma3-hot_fp32_bs2_none_s0" in ids and "gemma3-hot_fp32_bs2_none_s0_ws2_ga4" in ids
    assert not pattern.fullmatch("gemma3-hot_fp8_bs2_none_s0") and not pattern.fullmatch("gemma3-hot_fp16_bs2_int3_s0")


def test_outcomes_are_strings_as_written_in_results():
    assert Outcome.NAN == "nan" and f"{Outcome.PREDICTED_OOM}" == "predicted_oom"
    assert OUTCOMES == ("ok", "nan", "oom", "predicted_oom", "timeout", "error", "unsupported")


def test_every_outcome_has_a_colour_in_the_report():
    from tunegrid.review.plots import OUTCOME_COLOURS

    assert set(OUTCOME_COLOURS) == set(OUTCOMES)


def _named_constants(node: ast.AST, names: set[str]) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # a list of names (not YAML's "none" among "null", "~")
        values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        return values if values and set(values) <= names else []
    return []


def test_no_module_compares_quantization_or_precision_names():
    """What a precision or quantization does is read from its row in tunegrid.meanings, never decided by comparing
    its name (four places once read `quant != "none"` as "4-bit", so an int8 cell would have been audited,
    estimated and recorded as 4-bit)."""
    names = set(PRECISIONS) | set(QUANTS)
    offenders = []
    for path in (REPO / "src" / "tunegrid").rglob("*.py"):
        if path.name in ("vocabulary.py", "meanings.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = []
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "isin":
                operands = list(node.args)
            found = [name for operand in operands for name in _named_constants(operand, names)]
            # "none" is also an everyday word (a replay mode, YAML's null): a quant name only beside a quant
            if found == ["none"] and "quant" not in ast.unparse(node).lower():
                found = []
            if found:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {found}")
    assert not offenders, "names compared outside tunegrid.meanings:\n" + "\n".join(offenders)


# "Plan" means one thing: a cell's plan, the contract's (tunegrid.contract.CellPlan: one cell's target, budget,
# estimates, kernels and limits, made by the `cell_plan` rule, plan.csv's row, plans/<cell>.json).
CONTRACT_PLAN = {
    "CellPlan",
    "cell_plan",  # the rule, the command and the module that make it
    "plan",
    "plans",  # the cells' plans, by cell id
    "plan_cell",
    "plan_liveness",  # the plan's liveness limits
    "plan_table",  # plan.csv
    "planned",
    "planned_worker",  # the path the plan says the worker takes
    "_plan_row",
}
# Names that still say "plan" for something else, each with what it names. A name leaves this table when it is
# renamed (a row of tunegrid.meanings is a precision's or quantization's row, not a plan); none joins it.
OTHER_PLANS = {
    # the cell's PrecisionSetup as result.json records it: a file format, kept (tunegrid.outcome.CellResult)
    "precision_plan": "result.json's key for the precision a cell applied on its device",
}


def _plan_names() -> dict[str, set[str]]:
    """Every name the package defines that says plan (modules, classes, functions, arguments, fields, variables,
    imported names), with where."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "src" / "tunegrid").rglob("*.py"):
        where = path.relative_to(REPO / "src").as_posix()
        names = [where] if "plan" in path.stem.lower() else []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.append(node.id)
            elif isinstance(node, ast.arg):
                names.append(node.arg)
            elif isinstance(node, ast.alias):
                names.append(node.asname or node.name.split(".")[-1])
        for name in names:
            if "plan" in name.lower():
                found.setdefault(name, set()).add(where)
    return found


def test_plan_is_the_contracts_plan():
    """One word per meaning: a new name that says plan names the contract's plan (CONTRACT_PLAN), never a
    precision's row, a GPU kit's calls or another thing; the names left from before (OTHER_PLANS) only go."""
    found = _plan_names()
    modules = {name for name in found if name.endswith(".py")}
    assert modules == {"tunegrid/prepare/cell_plan.py", *(m for m in OTHER_PLANS if m.endswith(".py"))}
    undeclared = {name: sorted(found[name]) for name in set(found) - modules - CONTRACT_PLAN - set(OTHER_PLANS)}
    assert not undeclared, f"names that say plan and are not the contract's plan: {undeclared}"
    gone = set(OTHER_PLANS) - set(found)
    assert not gone, f"renamed: take them out of OTHER_PLANS: {gone}"
