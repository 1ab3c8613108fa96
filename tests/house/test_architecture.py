"""The floor plan holds: rooms that mirror the rules, each importing only the rooms its row of the table names,
no circles, and the heavy dependencies each in their own room. Read from the source (ast), nothing imported.

The rooms: the shared words and types (tunegrid/*.py, "words"), the runtime helpers (tunegrid.runtime), the study
itself (tunegrid.study), a user's recipes (tunegrid.recipes), then the stages prepare, cell, track, review and
run, and the command line (cli). A module may import its own room and the rooms MAY_IMPORT lists for it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
BELOW_THE_STAGES = {"words", "runtime", "study"}
# Which rooms each room may import, besides its own. A row says what the room means: the review reads files
# and speaks the study's words, it never prepares a cell (review -> prepare) nor starts a process; the tracker
# records, it never prepares (track -> prepare); the run starts cells and reads what they leave, it never
# imports their training code (run -> cell) nor the review's (run -> review).
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": set(),  # standard library only: it knows no word of a study
    "words": {"runtime"},
    "study": {"words", "runtime"},
    "recipes": BELOW_THE_STAGES,
    "prepare": BELOW_THE_STAGES,
    "cell": BELOW_THE_STAGES,  # it trains from its contract: every decision about it was made when it was planned
    "track": BELOW_THE_STAGES,
    "review": BELOW_THE_STAGES | {"recipes"},  # a fix written back as the user's own recipe
    "run": BELOW_THE_STAGES | {"recipes", "prepare", "track"},
    "cli": BELOW_THE_STAGES | {"recipes", "prepare", "cell", "track", "review", "run"},
}
# The imports across a line of the table, each with why it is there.
CROSSINGS = {
    ("tunegrid.run.warm", "tunegrid.cell.entry"): "the warm worker forks, and the child runs the cell's worker",
    ("tunegrid.outcome", "tunegrid.study.recorded"): "an earlier version's result.json reads with its spec completed, "
    "in the one place a spec is (from the schema's defaults: the study's)",
}
# Where the heavy dependencies may be imported, and why the exceptions are there.
ALLOWED = {
    "mlflow": {"track"},
    "torch": {
        "cell",
        "prepare.probes",
        "prepare.checkpoints",
        "prepare.data",
        "prepare.environment",
        "recipes.core",
        "runtime.memory",
        "run.warm",
        "run.recorder_read",
    },  # synthetic checkpoints, the tokenizer, the probe, all-linear on the meta device, the meter, the warm preload,
    # PyTorch's flight-recorder reader (run as a process of its own by the supervisor, never imported by it)
    "subprocess": {
        "run",
        "prepare.environment",
        "prepare.probes",
        "prepare.stacks",
        "prepare.cluster",
    },  # git/pip facts; rank processes and PyTorch's flight-recorder reader; pip builds stacks; sinfo and sacct
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


def room(module: str) -> str:
    """tunegrid.X.Y (and the package tunegrid.X) is in room X; a module of the package root is in `words`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "words"


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


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """`module -> target` for every import the table does not allow (a room package itself, whose __init__
    holds only a docstring, is no import of its room's code)."""
    found = []
    for module, targets in graph.items():
        for target in targets:
            if target.count(".") == 1 and target.split(".")[1] in MAY_IMPORT and target != "tunegrid.cli":
                continue
            source_room, target_room = room(module), room(target)
            if target_room == source_room or target_room in MAY_IMPORT[source_room]:
                continue
            if (module, target) not in CROSSINGS:
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_every_module_is_in_a_room_of_the_table():
    rooms = {room(module) for module in MODULES}
    assert rooms == set(MAY_IMPORT), rooms ^ set(MAY_IMPORT)
    packages = {path.parent.name for path in (SRC / "tunegrid").glob("*/__init__.py")}
    assert packages == set(MAY_IMPORT) - {"words"}, packages ^ (set(MAY_IMPORT) - {"words"})


def test_imports_follow_the_table():
    graph = {module: _internal(path) for module, path in MODULES.items()}
    forbidden = forbidden_imports(graph)
    assert not forbidden, "imports the table of rooms does not allow (MAY_IMPORT):\n" + "\n".join(forbidden)


def test_the_table_refuses_the_imports_that_break_meaning():
    bad = {
        "tunegrid.run.supervisor": {"tunegrid.cell.train", "tunegrid.review.summary", "tunegrid.track.tags"},
        "tunegrid.review.report": {"tunegrid.prepare.hub", "tunegrid.recipes.export"},
        "tunegrid.track.tags": {"tunegrid.prepare.environment", "tunegrid.study.config"},
        "tunegrid.study.config": {"tunegrid.prepare.plan", "tunegrid.vocabulary"},
        "tunegrid.runtime.files": {"tunegrid.vocabulary"},
        "tunegrid.outcome": {"tunegrid.study.errors", "tunegrid.runtime.rundir"},
        "tunegrid.run.warm": {"tunegrid.cell.entry"},
    }
    assert forbidden_imports(bad) == [
        "tunegrid.outcome -> tunegrid.study.errors",
        "tunegrid.review.report -> tunegrid.prepare.hub",
        "tunegrid.run.supervisor -> tunegrid.cell.train",
        "tunegrid.run.supervisor -> tunegrid.review.summary",
        "tunegrid.runtime.files -> tunegrid.vocabulary",
        "tunegrid.study.config -> tunegrid.prepare.plan",
        "tunegrid.track.tags -> tunegrid.prepare.environment",
    ]


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


def test_heavy_dependencies_stay_in_their_rooms():
    misplaced = []
    for module, path in MODULES.items():
        short = module.removeprefix("tunegrid.")
        for dependency, places in ALLOWED.items():
            if any(name == dependency or name.startswith(dependency + ".") for name in _imports(path)):
                if not any(
                    short == place or short.startswith(place + ".") or room(module) == place for place in places
                ):
                    misplaced.append(f"{module} imports {dependency}")
    assert not misplaced, misplaced


def test_modules_are_small():
    big = {str(path.relative_to(SRC / "tunegrid")): len(path.read_text().splitlines()) for path in MODULES.values()}
    over = {name: lines for name, lines in big.items() if lines > MAX_LINES and name not in OVERSIZE}
    assert not over, over


# Module names two rooms both hold: one subject, each room's half of it (a third room, or another name, fails)
TWINS = {
    "stacks": "the light part every stage reads (study) and the build (prepare)",
    "records": "what the loop records (cell) and what MLflow makes of those files (track)",
    "liveness": "the heartbeat a step beats (cell) and how long a cell may go without one (prepare)",
    "diagnosis": "the record of why a cell ended (words) and what its MLflow run says of it (track)",
}


def test_module_names_say_what_they_hold():
    """A module's name does not repeat its room's or its sub-room's (recipes/recipe_trl.py says `recipe` twice,
    cell/experts/expert_lora.py `expert`), and a name is in one room only, unless TWINS says why: `doctor.py` in
    three rooms told nobody which doctor it held."""
    repeats, rooms_of = [], {}
    for module, path in MODULES.items():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        name, where = path.stem, room(module)
        words = {w for place in (where, path.parent.name) for w in (place, place.removesuffix("s"))}
        if any(name == word or name.startswith(word + "_") for word in words):
            repeats.append(module)
        rooms_of.setdefault(name, []).append(where)
    assert not repeats, f"module names that repeat their room's: {repeats}"
    twins = {name: rooms for name, rooms in rooms_of.items() if len(rooms) > 1}
    assert set(twins) == set(TWINS) and all(len(rooms) == 2 for rooms in twins.values()), twins
