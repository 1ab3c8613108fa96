"""The trainer is composed, not mixed in: no class of the cell wing inherits from another tunegrid class (a mixin, a
base whose methods share `self` with it). Its components are constructed and passed in. Read from the source (ast),
nothing imported.

Library bases stay allowed: exceptions, enums, dataclasses (a decorator, no base), torch's nn.Module, typing's
Protocol, and the extension points a library is extended through (a transformers quantizer or weight converter, a
peft wrapper). A tunegrid exception may derive from another tunegrid exception.
"""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "src" / "tunegrid"
CELL = PACKAGE / "cell"
EXCEPTION_BASES = {"Exception", "BaseException", "ValueError", "RuntimeError", "TypeError", "KeyError", "OSError"}


def _base_name(base: ast.expr) -> str:
    """`Name`, `module.Name` or `Name[...]` as the dotted text of the base."""
    if isinstance(base, ast.Subscript):
        return _base_name(base.value)
    if isinstance(base, ast.Attribute):
        return f"{_base_name(base.value)}.{base.attr}"
    return base.id if isinstance(base, ast.Name) else ""


def project_exceptions(sources: list[str]) -> set[str]:
    """Names of the package's exception classes (derived, at any depth, from a built-in exception)."""
    bases = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [_base_name(b).rsplit(".", 1)[-1] for b in node.bases]
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, parents in bases.items():
            if name not in found and any(p in EXCEPTION_BASES or p.endswith("Error") or p in found for p in parents):
                found.add(name)
                changed = True
    return found


def mixin_bases(source: str, exceptions: set[str] = frozenset()) -> list[str]:
    """`Class(Base)` for every class in `source` with a tunegrid base: a class defined in the same source, or a
    name imported from a tunegrid module (directly or as `module.Name`). Exceptions are let through."""
    tree = ast.parse(source)
    local = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    imported, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tunegrid":
            for alias in node.names:
                (imported if alias.name[:1].isupper() else modules).add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.split(".")[0] == "tunegrid")
    offenders = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            name = _base_name(base)
            head, _, last = name.rpartition(".")
            ours = name in local or name in imported or (head and (head in modules or head.startswith("tunegrid")))
            if ours and (last or name) not in exceptions:
                offenders.append(f"{node.name}({name})")
    return offenders


def test_no_class_of_the_cell_wing_has_a_mixin_base():
    sources = {path: path.read_text() for path in PACKAGE.rglob("*.py")}
    exceptions = project_exceptions(list(sources.values()))
    offenders = [
        f"{path.relative_to(REPO)}: {found}"
        for path, source in sources.items()
        if CELL in path.parents
        for found in mixin_bases(source, exceptions)
    ]
    assert not offenders, "classes of the cell wing built on tunegrid classes (compose them instead):\n" + "\n".join(
        offenders
    )


MIXED_IN = '''
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch.nn as nn
from transformers.quantizers import Bnb4BitHfQuantizer

from tunegrid.cell.loop import step
from tunegrid.cell.loop.records import StepLog
from tunegrid.prepare.checkpoints import CheckpointError


class OptimizerSteps:
    def train_step(self): ...


class CellTrainer(OptimizerSteps, nn.Module):
    """mixed in: shares self with a mixin defined beside it"""


class Recorded(StepLog):
    """built on an imported tunegrid class"""


class Stepping(step.OptimizerStep):
    """built on one reached through its module"""


@dataclass
class Fine:
    """a dataclass, no base"""


class Layer(nn.Module): ...


class Kind(StrEnum):
    A = "a"


class Reads(Protocol): ...


class Quantizer(Bnb4BitHfQuantizer): ...


class IslandError(ValueError): ...


class LoadError(CheckpointError): ...
'''


def test_the_check_fails_on_a_mixed_in_class_and_passes_library_bases():
    exceptions = project_exceptions([MIXED_IN, "class CheckpointError(RuntimeError): ..."])
    assert mixin_bases(MIXED_IN, exceptions) == [
        "CellTrainer(OptimizerSteps)",
        "Recorded(StepLog)",
        "Stepping(step.OptimizerStep)",
    ]


def test_the_check_reads_the_trainer_it_guards():
    """The recipe is a class with no base, and its components are there by those names (the check is not
    passing because it reads nothing)."""
    recipe = ast.parse((CELL / "train.py").read_text())
    classes = {node.name: node for node in ast.walk(recipe) if isinstance(node, ast.ClassDef)}
    assert "CellTrainer" in classes and classes["CellTrainer"].bases == []
    assert mixin_bases((CELL / "train.py").read_text()) == []
    assert mixin_bases("from tunegrid.cell.train import CellTrainer\nclass Mixed(CellTrainer): ...") == [
        "Mixed(CellTrainer)"
    ]
