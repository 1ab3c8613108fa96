"""A TRL recipe's dataset (ScriptArguments' dataset_name, its `datasets` list, alignment-handbook's
dataset_mixture) as the study's data settings: a local file read at import, or a hub dataset fetched by the
dataset rule, with the fields its records hold.

Key names as trl 1.16.0 defines them (trl/scripts/utils.py, trl/trainer/sft_config.py).
"""

from __future__ import annotations

from typing import Any

from tunegrid.recipes.core import HEX40, Recipe
from tunegrid.recipes.header_rows import default_config, entry_rows, local_split
from tunegrid.recipes.locations import first_record, local_dataset
from tunegrid.study.prompts import PROMPT_COMPLETION


def read_dataset(recipe: Recipe) -> None:
    """The recipe's dataset as data.*, and a row for each key of the entry read that carries nothing."""
    _read(recipe)
    raw = recipe.raw
    mixture = raw.get("dataset_mixture") if isinstance(raw.get("dataset_mixture"), dict) else {}
    key, entries = ("datasets", raw["datasets"]) if raw.get("datasets") else ("dataset_mixture.datasets", None)
    entries = entries if entries is not None else mixture.get("datasets")
    first = (entries[0] if entries else None) if isinstance(entries, list) else entries
    if isinstance(first, dict):
        entry_rows(recipe, f"{key}.0", first, "TRL")


def _read(recipe: Recipe) -> None:
    raw = recipe.raw
    if raw.get("datasets"):
        found = _from_datasets(recipe)
    elif isinstance(raw.get("dataset_mixture"), dict):  # alignment-handbook's ScriptArguments
        found = _from_mixture(recipe)
    elif raw.get("dataset_name"):
        found = _from_name(recipe)
    else:
        recipe.need("dataset_name", "no dataset: give dataset_name (a local file or a hub id) or pass --dataset")
        return
    if found is not None:  # None: a hub dataset (its records are not read at import) or no usable entry
        _fields(recipe, found)


def _from_datasets(recipe: Recipe) -> Any:
    """The `datasets` list's first entry: local files (returned as locations.local_dataset finds them), else a
    hub dataset (None returned)."""
    raw = recipe.raw
    entries = raw["datasets"] if isinstance(raw["datasets"], list) else [raw["datasets"]]
    _extra_datasets(recipe, "datasets", len(entries))
    entry = entries[0] if isinstance(entries[0], dict) else {}
    files = entry.get("data_files")
    files = files[0] if isinstance(files, list) and len(files) == 1 else files
    found = local_dataset(recipe, "datasets.0.data_files", files, entry.get("path")) if isinstance(files, str) else None
    if found is not None:  # `path` names the builder (json, parquet) that reads the files
        recipe.carry("data.source", recipe.settings["data.source"], *(["datasets.0.path"] if entry.get("path") else []))
        local_split(recipe, "datasets.0.split", entry.get("split"), "TRL")
    if found is None and entry.get("path") and not files:
        if not default_config(recipe, "datasets.0.name", entry.get("name")):
            recipe.refuse("datasets.0.name", "tunegrid reads a hub dataset's default configuration")
        _hub(recipe, "datasets.0.path", entry["path"], entry.get("revision"), entry.get("split") or "train",
             "datasets.0.split" if entry.get("split") else None)  # fmt: skip
        recipe.carry("data.dataset", dict(entry), "datasets")
        return None
    if found is None:
        recipe.need("datasets.0", "give a local JSON-lines or parquet file (data_files) or pass --dataset")
        return None
    recipe.carry("data.dataset", dict(entry), "datasets")
    return found


def _from_mixture(recipe: Recipe) -> Any:
    """alignment-handbook's `dataset_mixture`: its first entry's id, a local file (returned) or a hub dataset."""
    entries = recipe.raw["dataset_mixture"].get("datasets") or []
    entry = entries[0] if entries and isinstance(entries[0], dict) else {}
    if not entry.get("id"):
        recipe.need("dataset_mixture.datasets", "no dataset: each entry needs an id (a hub dataset)")
        return None
    _extra_datasets(recipe, "dataset_mixture.datasets", len(entries))
    if not default_config(recipe, "dataset_mixture.datasets.0.config", entry.get("config")):
        recipe.refuse("dataset_mixture.datasets.0.config", "tunegrid reads a hub dataset's default configuration")
    found = local_dataset(recipe, "dataset_mixture.datasets.0.id", str(entry["id"]))
    if found is None:
        _hub(
            recipe,
            "dataset_mixture.datasets.0.id",
            entry["id"],
            entry.get("revision"),
            entry.get("split") or "train",
            "dataset_mixture.datasets.0.split" if entry.get("split") else None,
        )
        columns = entry.get("columns") or ["messages"]
        _hub_fields(recipe, columns, "dataset_mixture.datasets.0.columns")
    recipe.carry("data.dataset", dict(entry), "dataset_mixture")
    return found


def _from_name(recipe: Recipe) -> Any:
    """ScriptArguments' `dataset_name`: a local file (returned) or a hub dataset."""
    raw = recipe.raw
    found = local_dataset(recipe, "dataset_name", str(raw["dataset_name"]))
    config = raw.get("dataset_config")
    if found is None:
        split = raw.get("dataset_train_split") or "train"
        if not default_config(recipe, "dataset_config", config):
            recipe.refuse("dataset_config", "tunegrid reads a hub dataset's default configuration")
        _hub(recipe, "dataset_name", raw["dataset_name"], None, split, *_given(raw, "dataset_train_split"))
        _hub_fields(recipe, [raw.get("dataset_text_field") or "messages"], "dataset_name")
        recipe.carry("data.dataset", {"dataset_name": raw["dataset_name"]}, "dataset_name")
        return None
    recipe.carry("data.dataset", {"dataset_name": raw["dataset_name"]}, "dataset_name")
    local_split(recipe, "dataset_train_split", raw.get("dataset_train_split"), "TRL")
    if not default_config(recipe, "dataset_config", config):
        recipe.not_carried["dataset_config"] = f"{config!r}: a local file has no configurations; tunegrid reads it"
    return found


def _fields(recipe: Recipe, found: Any) -> None:
    """What the local file's first record holds: chat messages, prompt/completion pairs or a text to model."""
    raw = recipe.raw
    record = first_record(found)
    text_field = raw.get("dataset_text_field") or "text"
    if "messages" in record:
        recipe.carry("data.fields", {"messages": "messages"}, "dataset_name")
        recipe.carry("data.loss_on", "response" if raw.get("assistant_only_loss") else "all", "assistant_only_loss")
    elif {"prompt", "completion"} <= set(record):  # TRL trains on the prompt, then the completion, as they are
        recipe.carry("data.layout", PROMPT_COMPLETION, "dataset_name")
        only = raw.get("completion_only_loss")
        recipe.carry("data.loss_on", "all" if only is False else "response", "completion_only_loss")
    elif isinstance(record.get(text_field), str):  # language modelling: every token of the text
        recipe.carry("data.fields", {"text": str(text_field)}, "dataset_name", *_given(raw, "dataset_text_field"))
        recipe.carry("data.loss_on", "all", "dataset_name")
    else:
        recipe.need(
            "dataset_text_field",
            f"records without messages, prompt/completion or a {text_field!r} text (they have {sorted(record)}): "
            "name the text's field in dataset_text_field",
        )


def _given(raw: dict[str, Any], *keys: str) -> list[str]:
    return [k for k in keys if k in raw]


def _extra_datasets(recipe: Recipe, key: str, count: int) -> None:
    for index in range(1, count):
        recipe.differs[f"{key}.{index}"] = "tunegrid trains each cell on the first dataset; this one is not mixed in"
    if count > 1:
        recipe.accounted.add(key.split(".")[0])


def _hub(recipe: Recipe, key: str, repo_id: str, revision: Any, split: str, split_key: str | None = None) -> None:
    revision = str(revision or "")
    recipe.carry("data.source", "hub", key)
    recipe.carry("data.repo_id", str(repo_id), key)
    recipe.carry("data.split", str(split), split_key or key)
    if HEX40.match(revision):
        recipe.carry("data.revision", revision, key)
        return
    recipe.carry("data.revision", "", key)
    recipe.carry("data.ref", revision or "main", key)
    recipe.unpinned[key] = revision or "main"
    recipe.notes.append(
        f"{key}: {repo_id!r} is not pinned (TRL's arguments hold no dataset revision); the dataset rule fetches "
        f"{revision or 'main'!r} and records its commit (`tunegrid pin <study>` writes it back)"
    )


def _hub_fields(recipe: Recipe, columns: list[Any], key: str) -> None:
    """A hub dataset's records are not read at import: TRL's conversational column is assumed."""
    column = str(columns[0]) if columns else "messages"
    text_field = recipe.raw.get("dataset_text_field")
    if isinstance(text_field, str) and text_field == column and column not in ("messages", "conversations"):
        recipe.carry("data.fields", {"text": column}, key, "dataset_text_field")  # language modelling: every token
        recipe.carry("data.loss_on", "all", "dataset_text_field")
        return
    if column not in ("messages", "conversations"):
        recipe.need(key, f"{column!r}: tunegrid trains on chats (a messages column) or prompt/completion pairs; "
                    "give data.fields in the study")  # fmt: skip
        return
    recipe.carry("data.fields", {"messages": column}, key)
    only = recipe.raw.get("assistant_only_loss")
    recipe.carry("data.loss_on", "response" if only else "all", "assistant_only_loss")
