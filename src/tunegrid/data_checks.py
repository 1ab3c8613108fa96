"""The study's `data` section checked before anything trains: the source's keys, the file, the records' fields.

Light (standard library; pyarrow only to read a parquet schema), so the config can run these checks at
parse time and name the key at fault; the dataset rule checks every record again as it writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tunegrid.errors import ConfigError

LOCAL_SOURCES = ("jsonl", "parquet")


PINNED_REVISION = re.compile(r"^[0-9a-f]{40}$")


ROLES = ("system", "user", "assistant")


SAMPLE_RECORDS = 100  # records checked at config time; every record is checked when the set is written


class DataError(ConfigError):
    """Records that do not fit the study's `data` section; the message names the key and the fix."""


def field_map(data: dict[str, Any]) -> dict[str, str]:
    return dict(data.get("fields") or {})


def is_chat(data: dict[str, Any]) -> bool:
    return "messages" in field_map(data)


def fields_problems(data: dict[str, Any]) -> list[str]:
    fields = field_map(data)
    if "messages" in fields and len(fields) > 1:
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
        if not PINNED_REVISION.match(data["revision"] or ""):
            problems.append(
                "config key 'data.revision': hub datasets need a pinned 40-hex commit (the dataset repository's "
                "commit sha), not a branch, tag or nothing, so every run trains on the same records"
            )
        return problems
    path = Path(data["path"]) if data["path"] else None
    if path is None or not path.is_file():
        problems.append(
            f"config key 'data.path': {data['path']!r} is not a file; give the {source} file of the training records"
        )
        return problems
    if not problems:
        problems += [str(exc) for exc in _sample_errors(data, path)]
    return problems


def _sample_errors(data: dict[str, Any], path: Path) -> list[DataError]:
    try:
        if data["source"] == "parquet":
            import pyarrow.parquet as pq

            columns = set(pq.read_schema(path).names)
            missing = [k for k, col in field_map(data).items() if col not in columns]
            return [_missing(k, field_map(data)[k], sorted(columns)) for k in missing]
        check_records(_first_jsonl_records(path, SAMPLE_RECORDS), data)
    except DataError as exc:
        return [exc]
    except (OSError, ValueError) as exc:
        return [DataError(f"config key 'data.path': {str(path)!r} cannot be read as {data['source']}: {exc}")]
    return []


def _first_jsonl_records(path: Path, n: int) -> list[dict[str, Any]]:
    records = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                records.append(json.loads(line))
            if len(records) >= n:
                break
    return records


def _missing(key: str, column: str, present: Iterable[str]) -> DataError:
    return DataError(
        f"config key 'data.fields.{key}': the records have no field {column!r} (they have {sorted(present)}); "
        "set data.fields to the records' own field names"
    )


def check_records(records: Iterable[dict[str, Any]], data: dict[str, Any]) -> None:
    fields = field_map(data)
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"config key 'data.path': record {i} is a {type(record).__name__}, not an object of fields")
        for key, column in fields.items():
            if record.get(column) is None:  # datasets fills a field absent from some records with None
                raise _missing(key, column, [k for k, v in record.items() if v is not None])
        if "messages" in fields:
            _check_messages(record[fields["messages"]], i, fields["messages"])


def _check_messages(messages: Any, i: int, column: str) -> None:
    ok = (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
    )
    if not ok or not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"config key 'data.fields.messages': record {i}'s {column!r} is not a list of {{role, content}} with roles "
            f"{list(ROLES)} and at least one assistant turn"
        )
