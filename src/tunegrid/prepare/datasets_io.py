"""A study's own training records: a local jsonl/parquet file or a pinned hub dataset, read with `datasets`.

Whatever the source, the records are written once (the `dataset` rule) in one of the shapes the rest of
tunegrid reads: pairs `{"instruction", "response"}` (the generated set's shape), chats `{"messages": [...]}`,
raw text `{"text"}`, or, where data.layout names a tool's layout, the text that tool builds `{"text", "pieces"}`
(tunegrid.study.prompts).
Cells then read that file and never touch the network.

Config-time checks stay light (no `datasets` import): they run at every Snakefile parse.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tunegrid.study.data_checks import DataError, check_records, config_problems, json_array, read_jsonl
from tunegrid.study.prompts import normalize


def load_records(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every record of the configured source, checked and normalized (raises DataError naming the key)."""
    problems = config_problems(data)
    if problems:
        raise DataError("; ".join(problems))
    array = json_array(Path(data["path"])) if data["source"] == "jsonl" else None
    if array is not None:  # one JSON array (a .json file): a bad record is named by its 1-based index
        table = array
        check_records(table, data)
    elif data["source"] == "jsonl":  # read here, line by line: a bad line is named by its 1-based line number
        numbered = read_jsonl(Path(data["path"]))
        table = [record for _, record in numbered]
        check_records(table, data, [line for line, _ in numbered], Path(data["path"]))
    else:
        table = _load_table(data)
        check_records(table, data)
    return [normalize(record, data) for record in table]


def _load_table(data: dict[str, Any]) -> list[dict[str, Any]]:
    from datasets import load_dataset

    if data["source"] == "hub":  # the one path that needs the network (and, for gated sets, HF_TOKEN)
        revision = data["revision"] or hub_commit(data)
        files = {"data_files": list(data["data_files"])} if data.get("data_files") else {}
        dataset = load_dataset(
            data["repo_id"], revision=revision, split=data["split"], token=os.environ.get("HF_TOKEN") or None, **files
        )
        return dataset.to_list()
    builder = "parquet"  # JSON lines are read by data_checks.read_jsonl
    # a throwaway cache: a local file is read once, and stale arrow caches of an edited file are a trap
    with tempfile.TemporaryDirectory(prefix="tunegrid-data-") as cache:
        dataset = load_dataset(builder, data_files=str(Path(data["path"]).resolve()), split="train", cache_dir=cache)
        return dataset.to_list()


def write_records(path: str | Path, records: list[dict[str, Any]]) -> None:
    from tunegrid.runtime.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))


def hub_commit(data: dict[str, Any]) -> str:
    """An unpinned hub dataset's commit now (what `data.ref` points at), resolved once per dataset rule."""
    from tunegrid.prepare import hub

    revision, _ = hub.resolve("dataset", data["repo_id"], "", data.get("ref") or "main", "data", DataError)
    data["revision"] = revision  # the records read below are this commit's
    return revision


def write_study_dataset(path: str | Path, data: dict[str, Any]) -> int:
    """The `dataset` rule: generated pairs, or the configured source's records; returns how many. A hub
    dataset's commit is written beside them (train.source.json: pinned or fetched at)."""
    if data["source"] == "hub":
        from tunegrid.prepare import hub
        from tunegrid.runtime.files import write_json
        from tunegrid.study.sources import data_source_path

        data = dict(data)
        pinned = bool(data["revision"])
        records = load_records(data)
        source = hub.source_record(data["repo_id"], data["revision"], pinned, data.get("ref") or "main")
        write_json(data_source_path(path), source)
        if not records:
            raise DataError("config key 'data.repo_id': the source holds no records")
        write_records(path, records)
        return len(records)
    if data["source"] == "synthetic":
        from tunegrid.prepare.data import write_dataset

        write_dataset(path, data["examples"], data["seed"])
        return data["examples"]
    records = load_records(data)
    if not records:
        raise DataError(
            f"config key 'data.{'repo_id' if data['source'] == 'hub' else 'path'}': the source holds no records"
        )
    write_records(path, records)
    return len(records)
