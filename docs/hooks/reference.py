"""MkDocs hook: the reference pages, generated from the code as the site builds, so they cannot drift from it.

A page holds a marker line `<!-- reference: NAME -->`; the hook replaces it with the markdown of NAME:
`study` (the study file's keys, from the schema the study is validated against), `cli` (every `tunegrid`
command, from its argparse parser), `result` (result.json and a metrics.jsonl line, from their dataclasses),
`axes` (the grid's axes, from the axis table) and `layout` (every module of the package, from its docstring).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

MARKER = re.compile(r"^<!-- reference: ([a-z]+) -->$", re.M)


def _cell(value: Any) -> str:
    """A value for one table cell: inline code, pipes escaped, never a line break."""
    text = value if isinstance(value, str) else json.dumps(value)
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _text(value: str) -> str:
    return " ".join(value.split()).replace("|", "\\|")


# ---- the study file, from its schema ------------------------------------------------------------------


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if not ref:
        return node
    target = schema
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def _allowed(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(_cell(v) for v in node["enum"])
    kind = node.get("type", "")
    if kind == "array":
        items = node.get("items", {})
        inner = _allowed(items) if isinstance(items, dict) else ""
        return f"list of {inner}" if inner else "list"
    bounds = [f"{sign} {node[key]}" for key, sign in (("minimum", "≥"), ("maximum", "≤")) if key in node]
    if "oneOf" in node or "anyOf" in node:
        options = node.get("oneOf") or node.get("anyOf")
        return " or ".join(_allowed(o) for o in options if isinstance(o, dict)) or "see description"
    text = kind if isinstance(kind, str) else " or ".join(kind)
    return " ".join([text, *bounds]).strip()


def _rows(schema: dict[str, Any], node: dict[str, Any], path: str) -> list[str]:
    node = _resolve(schema, node)
    rows = [
        f"| `{path}` | {_allowed(node)} | {_cell(node['default']) if 'default' in node else ''} | "
        f"{_text(node.get('description', ''))} |"
    ]
    properties = node.get("properties") or {}
    for key, child in properties.items():
        rows += _rows(schema, child, f"{path}.{key}")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("properties"):
        for key, child in extra["properties"].items():
            rows += _rows(schema, child, f"{path}.<name>.{key}")
    return rows


def study_reference() -> str:
    from tunegrid.study.config import load_schema

    schema = load_schema()
    out = [_text(schema.get("description", "")), ""]
    for key, node in schema["properties"].items():
        out += [f"## `{key}`", "", "| key | allowed | default | what it sets |", "|---|---|---|---|"]
        out += _rows(schema, node, key)
        out.append("")
    return "\n".join(out)


# ---- the command line, from its parser ----------------------------------------------------------------


def _option_row(action: argparse.Action) -> str:
    name = ", ".join(action.option_strings) or action.dest
    if action.nargs in ("+", "*"):
        name += " …"
    default = "" if action.default in (None, argparse.SUPPRESS, False) or action.required else _cell(action.default)
    choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices else ""
    required = "yes" if action.required or not action.option_strings else ""
    return f"| `{name}` | {required} | {default} | {_text(action.help or '')}{choices} |"


def cli_reference() -> str:
    from tunegrid.cli.main import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    out = []
    for name, sub in commands.choices.items():
        usage = sub.format_usage().removeprefix("usage: ").strip()
        out += [f"## `tunegrid {name}`", "", _text(helps.get(name) or ""), "", "```text", usage, "```", ""]
        options = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        if options:
            out += ["| argument | required | default | what it is |", "|---|---|---|---|"]
            out += [_option_row(a) for a in options]
            out.append("")
    return "\n".join(out)


# ---- result.json, from its dataclasses ----------------------------------------------------------------


def _comments(cls: type) -> dict[str, str]:
    """Each field's trailing or preceding comment in the class's source."""
    found: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
            continue
        match = re.match(r"(\w+): [^#]+?(?:#\s*(.*))?$", stripped)
        if match:
            found[match.group(1)] = " ".join([*pending, match.group(2) or ""]).strip()
        pending = []
    return found


def _type_name(hint: Any) -> str:
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", None) or repr(hint)
    return str(text).replace("typing.", "")


def _fields_table(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    notes = _comments(cls)
    rows = ["| field | type | default | note |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name in getattr(cls, "IN_CELL", ()):
            continue  # held inside another field's key in the file (result.json's `cell`), not a key of its own
        if field.default is not dataclasses.MISSING:
            default = _cell(field.default if not hasattr(field.default, "value") else field.default.value)
        elif field.default_factory is not dataclasses.MISSING:
            made = field.default_factory()
            default = f"`{type(made).__name__}()`" if dataclasses.is_dataclass(made) else _cell(made)
        else:
            default = "required"
        kind, note = _cell(_type_name(hints[field.name])), _text(notes.get(field.name, ""))
        rows.append(f"| `{field.name}` | {kind} | {default} | {note} |")
    return rows


def result_reference() -> str:
    from tunegrid.outcome import CellResult, Diagnosis, Outcome, StepMetrics

    out = [
        "## `result.json`: `CellResult`",
        "",
        _text(inspect.getdoc(CellResult) or ""),
        "",
        "`outcome` is one of " + ", ".join(_cell(o.value) for o in Outcome) + ".",
        "",
        *_fields_table(CellResult),
        "",
        "## `diagnosis`: `Diagnosis`",
        "",
        _text(inspect.getdoc(Diagnosis) or ""),
        "",
        *_fields_table(Diagnosis),
        "",
        "## A line of `metrics.jsonl`: `StepMetrics`",
        "",
        _text(inspect.getdoc(StepMetrics) or ""),
        "",
        *_fields_table(StepMetrics),
        "",
    ]
    return "\n".join(out)


# ---- the grid's axes, from the axis table -------------------------------------------------------------


def axes_reference() -> str:
    from tunegrid.vocabulary import axis_table

    rows = [
        "| axis | values | default | in the cell id | neutral value | plot | what it varies |",
        "|---|---|---|---|---|---|---|",
    ]
    for axis in axis_table():
        values = _allowed(axis.items) if "enum" in axis.items else axis.type.__name__
        default = _cell(list(axis.default)) if axis.default is not None else "required"
        id_part = f"`{axis.id_prefix}<value>`" if axis.type is not bool else f"`{axis.id_prefix}` when true"
        neutral = _cell(axis.neutral) if axis.neutral is not None else "none (always in the id)"
        plot = (
            f"{axis.plot.matrix.value} / {axis.plot.curves.value}"
            if axis.plot is not None and hasattr(axis.plot.matrix, "value")
            else ("" if axis.plot is None else f"{axis.plot.matrix} / {axis.plot.curves}")
        )
        rows.append(
            f"| `{axis.name}` | {values} | {default} | {id_part} | {neutral} | {plot} | {_text(axis.description)} |"
        )
    return "\n".join(rows) + "\n"


# ---- the package, from its modules' docstrings --------------------------------------------------------


def _summary(path: Path, paragraph: int = 0) -> str:
    """The first sentence of a module's docstring, or of a later paragraph of it (read, not imported: no module
    runs to be listed)."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[paragraph].split())
    return _text(re.split(r"(?<=\.)\s", first, maxsplit=1)[0].rstrip(".:"))


def layout_reference() -> str:
    package = SRC / "tunegrid"
    out = []
    # every room, and its sub-rooms after it (cell, cell/data, cell/experts, ...)
    for folder in [package, *sorted(p.parent for p in package.glob("*/**/__init__.py"))]:
        name = ".".join(folder.relative_to(SRC).parts)
        room = _summary(folder / "__init__.py", paragraph=1 if folder == package else 0)  # the root: its room
        out += [f"## `{name}`", "", room, "", "| module | what it holds |", "|---|---|"]
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py":
                out.append(
                    f"| `{module.relative_to(SRC).with_suffix('').as_posix().replace('/', '.')}` | {_summary(module)} |"
                )
        out.append("")
    return "\n".join(out)


GENERATORS = {
    "study": study_reference,
    "cli": cli_reference,
    "result": result_reference,
    "axes": axes_reference,
    "layout": layout_reference,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def generate(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: no reference named {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(generate, markdown)
