"""A cell is planned once: only the `cell_plan` rule's job (tunegrid.prepare.cell_plan) makes a plan, and the
supervisor and the worker read its file (tunegrid.contract). Read from the source (ast), nothing imported.

Each planning function may be called only where the plan is made; a new caller (a supervisor that re-estimates, a
worker that re-decides its kernels, a command that re-plans the grid) fails here. The worker's wing (cell/) does
not import the prepare wing at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
PLAN = "tunegrid.prepare.cell_plan"
# a planning function -> the only places (module:function) that may call it
PLANNING: dict[str, set[str]] = {
    "make_contract": {f"{PLAN}:write_contract"},
    # the entry: the cell-plan command (the cell_plan rule's job) and the probe's calibration of its micro cell
    "write_contract": {"tunegrid.cli.commands:cell_plan", "tunegrid.run.calibrate:_beyond_tensors"},
    "plan_cell": {f"{PLAN}:make_contract"},
    "planned_worker": {f"{PLAN}:plan_cell"},
    "resolve_target": {f"{PLAN}:plan_cell"},
    "cell_liveness": {f"{PLAN}:plan_cell"},
    "plan_liveness": {"tunegrid.prepare.liveness:cell_liveness"},
    "estimate_cell": {f"{PLAN}:_estimate"},
    "device_constants": {f"{PLAN}:_estimate"},
    "feasibility": {f"{PLAN}:_estimate"},
    "estimate_from_shapes": {"tunegrid.prepare.memory_estimate:estimate_cell"},
    # the kernels are decided where the plan decides them; the estimate is of a cell that trains with them
    "cpu_onednn_off": {f"{PLAN}:_kernels"},
    # the device a cell trains on: its estimate, kernels and verdicts follow it, and the worker reads it
    "training_device": {f"{PLAN}:plan_cell"},
    # the GPUs a cluster job was granted are known only once it runs: the supervisor asks then (a plan made on
    # the submitting host could not), nothing else
    "gpu_shortfall": {f"{PLAN}:_estimate", "tunegrid.run.supervisor:_start"},
    "needs_cuda": {f"{PLAN}:_estimate"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "tunegrid").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def planning_calls(module: str, source: str) -> list[str]:
    """`module:function calls planner` for each call of a planning function outside its allowed places."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name if where == "<module>" else where)
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name in PLANNING and f"{module}:{where}" not in PLANNING[name]:
                    found.append(f"{module}:{where} calls {name}")
            visit(child, where)

    visit(ast.parse(source), "<module>")
    return found


def prepare_imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("tunegrid.prepare")}


def test_only_the_cell_plan_rule_makes_a_plan():
    found = [call for module, path in _modules().items() for call in planning_calls(module, path.read_text())]
    assert not found, found


def test_the_planning_check_finds_a_supervisor_that_plans_again():
    bad = (
        "from tunegrid.prepare.cell_plan import plan_cell\n"
        "def run_cell(spec, model_dir, capabilities):\n"
        "    plan = plan_cell(spec, model_dir, capabilities, True)\n"
        "    return plan.budget_bytes\n"
        "class Worker:\n"
        "    def setup(self):\n"
        "        from tunegrid.prepare import cpu_kernels\n"
        "        return cpu_kernels.cpu_onednn_off(self.spec, self.config, 'cpu')\n"
    )
    assert planning_calls("tunegrid.run.supervisor", bad) == [
        "tunegrid.run.supervisor:run_cell calls plan_cell",
        "tunegrid.run.supervisor:setup calls cpu_onednn_off",
    ]
    assert (
        planning_calls(PLAN, "def make_contract(spec, job, warm):\n    return plan_cell(spec, job, {}, warm)\n") == []
    )


def test_the_worker_takes_nothing_from_the_prepare_wing():
    """What the worker reads that the prepare stage also reads (the data set, the checkpoint's manifest, the
    runtime baseline) is in a shared module; what the plan decided it reads from the cell's contract."""
    taken = {}
    for module, path in _modules().items():
        if module.startswith("tunegrid.cell."):
            for name in prepare_imports(path.read_text()):
                taken.setdefault(name, []).append(module)
    assert not taken, f"cell/ imports the prepare wing: {taken}; read a plan's decision from the cell's contract"


def test_the_import_check_finds_a_worker_that_decides_its_kernels():
    bad = "def use_cpu_kernels(spec):\n    from tunegrid.prepare.cpu_kernels import cpu_onednn_off\n"
    assert prepare_imports(bad) == {"tunegrid.prepare.cpu_kernels"}
    assert prepare_imports("from tunegrid.contract import CellKernels\n") == set()
