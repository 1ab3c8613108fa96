"""The floor plan holds: wings that mirror the rules, imports that only point down, no circles, and the
heavy dependencies each in their own wing. Read from the source (ast), nothing imported.

Layers, bottom to top: the shared base (tunegrid/*.py but cli), prepare, then cell / track / review
(side by side), then run, then cli. A module may import its own layer or any below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
LAYER = {"base": 0, "prepare": 1, "cell": 2, "track": 2, "review": 2, "run": 3, "cli": 4}
# Where the heavy dependencies may be imported, and why the exceptions are there.
ALLOWED = {
    "mlflow": {"track"},
    "torch": {
        "cell",
        "prepare.probes",
        "prepare.checkpoints",
        "prepare.data",
        "prepare.environment",
        "memory",
        "run.warm",
    },  # synthetic checkpoints, the tokenizer, the probe, the meter, the warm worker's preload
    "subprocess": {
        "run",
        "prepare.environment",
        "prepare.probes",
        "prepare.stacks",
        "cell.distributed",
    },  # git/pip facts; rank processes; pip builds stacks
}
MAX_LINES = 350
# Modules that read better whole: the cell's recipe (setup, model, data, the loop, the record in one place)
OVERSIZE: set[str] = {"cell/train.py", "vocabulary.py"}  # and the one table of axes: a row per axis


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "tunegrid").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _wing(module: str) -> str:
    parts = module.split(".")
    if parts == ["tunegrid", "cli"]:
        return "cli"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYER) else "base"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _internal(path: Path) -> set[str]:
    return {name for name in _imports(path) if name in MODULES and name != "tunegrid"}


def test_imports_point_down_the_layers():
    upward = []
    for module, path in MODULES.items():
        for target in _internal(path):
            if target.count(".") == 1 and target.split(".")[1] in LAYER and target != "tunegrid.cli":
                continue  # a wing package itself (its __init__ holds only a docstring)
            if LAYER[_wing(target)] > LAYER[_wing(module)] or (
                LAYER[_wing(target)] == LAYER[_wing(module)] and _wing(target) != _wing(module)
            ):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_no_import_cycles():
    graph = {module: _internal(path) - {module} for module, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, " -> ".join([*trail, node, nxt])
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_heavy_dependencies_stay_in_their_wings():
    misplaced = []
    for module, path in MODULES.items():
        short = module.removeprefix("tunegrid.")
        for dependency, places in ALLOWED.items():
            if any(name == dependency or name.startswith(dependency + ".") for name in _imports(path)):
                if not any(
                    short == place or short.startswith(place + ".") or _wing(module) == place for place in places
                ):
                    misplaced.append(f"{module} imports {dependency}")
    assert not misplaced, misplaced


def test_modules_are_small():
    big = {str(path.relative_to(SRC / "tunegrid")): len(path.read_text().splitlines()) for path in MODULES.values()}
    over = {name: lines for name, lines in big.items() if lines > MAX_LINES and name not in OVERSIZE}
    assert not over, over
