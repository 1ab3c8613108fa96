"""The study's `data` section checked before anything trains: the source's keys, the file, the records' fields.

Light (standard library; pyarrow only to read a parquet schema), so the config can run these checks at
parse time and name the key at fault; the dataset rule checks every record again as it writes them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunegrid.study.errors import ConfigError
from tunegrid.study.prompts import field_map, known_layout, layout_fields, message_view

LOCAL_SOURCES = ("jsonl", "parquet")


PINNED_REVISION = re.compile(r"^[0-9a-f]{40}$")


ROLES = ("system", "user", "assistant")


SAMPLE_RECORDS = 100  # records checked at config time; every record is checked when the set is written


DATA_ROOTS_ENV = "TUNEGRID_DATA_ROOTS"  # more folders data.path may lie in, os.pathsep-separated


def data_roots() -> list[Path]:
    """Where a study's data.path may lie, symlinks resolved: the folder Snakemake runs in (the project), and
    the folders the person running the pipeline lists in TUNEGRID_DATA_ROOTS. A study file cannot widen
    this: a study from elsewhere must not copy ~/.ssh or /etc files into results/ and the tracking store."""
    extra = [Path(p).expanduser().resolve() for p in os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep) if p]
    return [Path.cwd().resolve(), *extra]


def outside_roots_problem(path: Path) -> str | None:
    real = path.resolve()
    roots = data_roots()
    if any(real.is_relative_to(root) for root in roots):
        return None
    via = f" (through a symlink, it is {str(real)!r})" if real != path.absolute() else ""
    return (
        f"config key 'data.path': {str(path)!r} lies outside the project folder{via}; a study reads data from the "
        f"folder Snakemake runs in, or from folders listed in the environment variable {DATA_ROOTS_ENV} "
        f"(now: {[str(r) for r in roots[1:]]})"
    )


class DataError(ConfigError):
    """Records that do not fit the study's `data` section; the message names the key and the fix."""


def is_chat(data: dict[str, Any]) -> bool:
    return "messages" in field_map(data)


def fields_problems(data: dict[str, Any]) -> list[str]:
    if data.get("layout"):  # the tool's layout names its own fields; data.fields is not read
        if known_layout(data["layout"]):
            return []
        return [f"config key 'data.layout': {data['layout']!r} is no layout tunegrid builds (alpaca[:style], "
                "alpaca_chat, alpaca_chat.load_qa, oasst, context_qa.load_v2, input_output, prompt_completion, or an "
                "object of axolotl's custom type keys with field_instruction)"]  # fmt: skip
    fields = field_map(data)
    if "text" in fields and set(fields) != {"text"}:
        return ["config key 'data.fields': raw text is {text: <column>} alone"]
    if "text" in fields:
        return []
    if "messages" in fields and len(set(fields) - {"role", "content"}) > 1:
        return [
            "config key 'data.fields': give either {messages: <column>} or {prompt: <column>, response: <column>}, "
            "not both"
        ]
    if "messages" not in fields and not {"prompt", "response"} <= set(fields):
        return [
            "config key 'data.fields': pairs need both 'prompt' and 'response' (the column names), chats need "
            "'messages'"
        ]
    return []


def config_problems(data: dict[str, Any]) -> list[str]:
    """What can be checked before reading the data: the source's keys, the file, the first records' fields."""
    source = data["source"]
    if source == "synthetic":
        return []
    problems = fields_problems(data)
    if source == "hub":
        if not data["repo_id"]:
            problems.append("config key 'data.repo_id': required for source 'hub' (a datasets id, e.g. <owner>/<name>)")
        if data["revision"] and not PINNED_REVISION.match(data["revision"]):
            problems.append(
                "config key 'data.revision': a pinned 40-hex commit (the dataset repository's commit sha), or "
                "empty: the dataset rule then fetches data.ref and records the commit it got (tunegrid pin)"
            )
        return problems
    path = Path(data["path"]) if data["path"] else None
    if path is None or not path.is_file():
        problems.append(
            f"config key 'data.path': {data['path']!r} is not a file; give the {source} file of the training records"
        )
        return problems
    outside = outside_roots_problem(path)
    if outside:
        return [*problems, outside]
    if not problems:
        problems += [str(exc) for exc in _sample_errors(data, path)]
    return problems


def _sample_errors(data: dict[str, Any], path: Path) -> list[DataError]:
    try:
        if data["source"] == "parquet":
            import pyarrow.parquet as pq

            if pq.read_metadata(path).num_rows == 0:
                return [DataError(f"config key 'data.path': {str(path)!r} holds no records (0 rows)")]
            columns = set(pq.read_schema(path).names)
            wanted = required_fields(data)
            missing = [k for k, col in wanted.items() if col not in columns and k not in ("role", "content")]
            return [_missing(k, wanted[k], sorted(columns), layout=data.get("layout")) for k in missing]
        array = json_array(path)
        if array is not None:
            if not array:
                return [DataError(f"config key 'data.path': {str(path)!r} holds no records (an empty array)")]
            check_records(array[:SAMPLE_RECORDS], data)
            return []
        sample = read_jsonl(path, limit=SAMPLE_RECORDS)
        if not sample:
            return [DataError(f"config key 'data.path': {str(path)!r} holds no records (an empty file)")]
        check_records([record for _, record in sample], data, [line for line, _ in sample], path)
    except DataError as exc:
        return [exc]
    except (OSError, ValueError) as exc:
        return [DataError(f"config key 'data.path': {str(path)!r} cannot be read as {data['source']}: {exc}")]
    return []


def json_array(path: Path) -> list[Any] | None:
    """The records of a file that holds one JSON array (a `.json` file as axolotl and `datasets` read it), else None
    (JSON lines)."""
    with open(path, encoding="utf-8", errors="strict") as fh:
        head = fh.read(4096).lstrip()
        if not head.startswith("["):
            return None
        fh.seek(0)
        try:
            records = json.load(fh)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"config key 'data.path': {str(path)!r} line {exc.lineno}, column {exc.colno}: not one JSON array "
                f"({exc.msg})"
            ) from None
    return records if isinstance(records, list) else None


def required_fields(data: dict[str, Any]) -> dict[str, str]:
    """{key: field} each record must hold: the layout's fields (by their own names), else data.fields."""
    if data.get("layout"):
        return {name: name for name in layout_fields(data["layout"])}
    return field_map(data)


def read_jsonl(path: Path, limit: int | None = None) -> list[tuple[int, Any]]:
    """(1-based line, record) of a JSON-lines file, blank lines skipped; a line that is not one JSON value is a
    DataError naming the file, the line and what is wrong (never the line's text: it may not be ours to show)."""
    records = []
    with open(path, encoding="utf-8", errors="strict") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"config key 'data.path': {str(path)!r} line {number}, column {exc.colno}: not one JSON "
                    f"value ({exc.msg}); each line holds one JSON object"
                ) from None
            if limit is not None and len(records) >= limit:
                break
    return records


def _missing(key: str, column: str, present: Iterable[str], where: str = "", layout: Any = None) -> DataError:
    has = where + " has" if where else "the records have"
    if layout:
        return DataError(
            f"config key 'data.layout': {has} no field {column!r} (it has {sorted(present)}), which the layout "
            f"{layout!r} reads; give records with the recipe's own field names"
        )
    return DataError(
        f"config key 'data.fields.{key}': {has} no field {column!r} "
        f"(it has {sorted(present)}); set data.fields to the records' own field names"
    )


def check_records(
    records: Iterable[dict[str, Any]], data: dict[str, Any], lines: list[int] | None = None, path: Path | None = None
) -> None:
    """Every record has the study's fields; a problem names the record by its file's 1-based line (JSON lines)
    or its 1-based row (parquet, hub, a JSON array)."""
    fields = required_fields(data)
    for i, record in enumerate(records):
        where = f"{str(path)!r} line {lines[i]}" if lines is not None and path else f"record {i + 1}"
        if not isinstance(record, dict):
            raise DataError(f"config key 'data.path': {where} is a {type(record).__name__}, not an object of fields")
        for key, column in fields.items():
            if key in ("role", "content"):  # keys inside each message, not the record's
                continue
            if record.get(column) is None:  # datasets fills a field absent from some records with None
                raise _missing(key, column, [k for k, v in record.items() if v is not None], where, data.get("layout"))
        if "messages" in fields:
            messages = record[fields["messages"]]
            if isinstance(messages, list):
                messages = [message_view(m, fields) for m in messages]
            _check_messages(messages, where, fields["messages"])


def _check_messages(messages: Any, where: str, column: str) -> None:
    ok = (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
    )
    if not ok or not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"config key 'data.fields.messages': {where}: {column!r} is not a list of {{role, content}} with roles "
            f"{list(ROLES)} and at least one assistant turn"
        )
