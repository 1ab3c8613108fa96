"""An axolotl config's `datasets:` section as the study's data settings: where the records are (a local file or a
hub dataset), which fields hold them, and the layout the dataset type builds (tunegrid.study.prompts).

Key names as axolotl 0.18.0 documents them (src/axolotl/utils/schemas/datasets.py, prompt_strategies/).
"""

from __future__ import annotations

from typing import Any

from tunegrid.recipes.core import Recipe
from tunegrid.recipes.header_rows import default_config, entry_rows, local_split
from tunegrid.recipes.locations import first_record, hub_dataset, local_dataset, looks_like_hub_id, resolve_local
from tunegrid.recipes.releases import axolotl_keys
from tunegrid.study.prompts import CUSTOM_KEYS, SEGMENTS, SHAREGPT, instruction_of

DATASET_KEYS = {  # axolotl 0.18.0 SFTDataset fields this reader reads, and what the rest becomes
    "path", "type", "split", "name", "data_files", "ds_type", "revision", "field_messages",
    "message_property_mappings", "message_field_role", "message_field_content", "roles_to_train", "train_on_eos",
    "drop_system_message", "field_system", "field_thinking", "template_thinking_key", "chat_template",
    "shards", "preprocess_shards", "trust_remote_code", "conversation", "field",
}  # fmt: skip
DATASET_NOT_CARRIED = {
    "drop_system_message": "tunegrid trains on the messages as the records hold them (system messages included)",
    "field_system": "tunegrid reads role/content messages or prompt/response pairs (no separate system field)",
    "field_thinking": "reasoning traces are rendered by the checkpoint's chat template from the messages",
    "template_thinking_key": "reasoning traces are rendered by the checkpoint's chat template from the messages",
    "chat_template": "tunegrid renders chats with the checkpoint's own chat template",
    "train_on_eos": "tunegrid's loss covers the response tokens and the end-of-turn token the template writes",
    "shards": "tunegrid reads the whole split", "preprocess_shards": "tunegrid reads the whole split",
    "trust_remote_code": "tunegrid reads data files, never a dataset's loading script",
}  # fmt: skip


def read_datasets(recipe: Recipe, datasets: Any) -> None:
    """The first dataset entry as data.*, a row for each other entry, and one for each key of the first that
    carries nothing."""
    _read_first(recipe, datasets)
    first = (datasets[0] if datasets else None) if isinstance(datasets, list) else datasets
    if isinstance(first, dict) and not recipe.refused:
        entry_rows(recipe, "datasets.0", first, "axolotl")


def _read_first(recipe: Recipe, datasets: Any) -> None:
    if not datasets:
        recipe.need("datasets", "no dataset: give one local file or a hub dataset, or pass --dataset")
        return
    if not isinstance(datasets, list):
        datasets = [datasets]
    for index in range(1, len(datasets)):
        recipe.differs[f"datasets.{index}"] = "tunegrid trains each cell on the first dataset; this one is not mixed in"
    entry, key = datasets[0], "datasets.0"
    if not isinstance(entry, dict) or not entry.get("path"):
        recipe.need(key, "a dataset entry needs a path (a local file or a hub id)")
        return
    recipe.carry("data.dataset", dict(entry), "datasets")
    _entry_keys(recipe, entry, key)
    found = _location(recipe, entry, key)
    kind = entry.get("type")
    record = first_record(found) if found is not None and kind is None else {}
    _read_type(recipe, entry, key, _kind_of(kind, record), record)


def _entry_keys(recipe: Recipe, entry: dict[str, Any], key: str) -> None:
    """The entry's keys that carry nothing, and those no axolotl release knows."""
    for sub in entry:
        if sub in DATASET_NOT_CARRIED:
            recipe.not_carried[f"{key}.{sub}"] = DATASET_NOT_CARRIED[sub]
        elif sub not in DATASET_KEYS and sub not in axolotl_keys(dataset=True):
            recipe.unknown[f"{key}.{sub}"] = "not a dataset key of any axolotl release tunegrid knows"


def _location(recipe: Recipe, entry: dict[str, Any], key: str) -> Any:
    """Where the records are: a local file (returned, as locations.local_dataset finds it), else a hub dataset
    (None returned)."""
    files = entry.get("data_files")
    files = files[0] if isinstance(files, list) and len(files) == 1 else files
    hub_files = files and looks_like_hub_id(str(entry["path"])) and not resolve_local(recipe, str(files))
    found = (
        None if hub_files else local_dataset(recipe, f"{key}.path", str(files or entry["path"]), entry.get("ds_type"))
    )
    if found is not None:  # the keys that say where the file is and how to read it
        for path, sub in (("data.path", "data_files"), ("data.source", "ds_type")):
            recipe.carry(path, recipe.settings[path], *([f"{key}.{sub}"] if entry.get(sub) else []))
        local_split(recipe, f"{key}.split", entry.get("split"), "axolotl")
    elif "data.source" not in recipe.settings:
        _hub(recipe, entry, key, files)
    return found


def _hub(recipe: Recipe, entry: dict[str, Any], key: str, files: Any) -> None:
    if not default_config(recipe, f"{key}.name", entry.get("name")):
        recipe.refuse(f"{key}.name", "tunegrid reads a hub dataset's default configuration")
    if entry.get("ds_type"):
        recipe.not_carried[f"{key}.ds_type"] = "a hub dataset's files are read in their own format"
    hub_dataset(recipe, key, entry["path"], entry.get("revision"), entry.get("split") or "train")
    if files:
        names = [files] if isinstance(files, str) else list(files)
        recipe.carry("data.data_files", [str(n) for n in names], f"{key}.data_files")


def _kind_of(kind: Any, record: dict[str, Any]) -> Any:
    """The entry's `type`; unset, the layout its first record's fields show (alpaca, or prompt/response pairs)."""
    if kind is None and {"instruction", "output"} <= set(record):
        return "alpaca"
    if kind is None and "prompt" in record and ({"response", "completion"} & set(record)):
        return {"field_instruction": "prompt", "field_output": "response" if "response" in record else "completion"}
    return kind


def _read_type(recipe: Recipe, entry: dict[str, Any], key: str, kind: Any, record: dict[str, Any]) -> None:
    """The dataset type as the fields the records hold, or the layout the dataset rule builds."""
    base = kind.split(":")[0].split(".")[0] if isinstance(kind, str) else None
    if kind == "chat_template" or (kind is None and "messages" in record):
        _chat_template(recipe, entry, key)
    elif base in SHAREGPT:  # axolotl's later releases read it as chat_template over from/value turns
        _sharegpt(recipe, entry, key, kind)
    elif instruction_of(kind) is not None:  # the dataset rule builds the tool's text (tunegrid.study.prompts)
        _instruction(recipe, key, kind)
    elif kind == SEGMENTS:  # template-free: the records' segments as they are, trained where labelled
        recipe.carry("data.layout", kind, f"{key}.type")
        recipe.differs[f"{key}.type"] = (
            "input_output: axolotl adds no BOS or EOS token (the segments' text holds what the model needs); "
            "tunegrid starts each record with the tokenizer's BOS and ends each trained segment with its EOS"
        )
    elif base in ("completion", "text"):  # raw text, every token trained (axolotl's CompletionPrompter: text + eos)
        _text(recipe, entry, key, kind, base)
    else:
        recipe.refuse(
            f"{key}.type",
            f"{kind!r}: tunegrid reads chat_template, sharegpt, alpaca (instruct, chat, chatml, phi), alpaca_chat, "
            "alpaca_chat.load_qa, alpaca_instruct (and .load_no_prompt), oasst, context_qa.load_v2, completion, "
            "input_output or a custom "
            "{field_instruction, field_output, ...} mapping",
        )


def _chat_template(recipe: Recipe, entry: dict[str, Any], key: str) -> None:
    mapping = dict(entry.get("message_property_mappings") or {})
    for old, field in (("message_field_role", "role"), ("message_field_content", "content")):
        if entry.get(old):  # axolotl's older spelling of message_property_mappings
            mapping[field] = entry[old]
    recipe.carry(
        "data.fields",
        {"messages": entry.get("field_messages") or "messages",
         **{k: str(mapping[k]) for k in ("role", "content") if mapping.get(k, k) != k}},
        f"{key}.type",
        *[f"{key}.{k}" for k in ("field_messages", "message_property_mappings", "message_field_role",
                                 "message_field_content") if k in entry],
    )  # fmt: skip
    if entry.get("roles_to_train") not in (None, ["assistant"]) and not recipe.raw.get("train_on_inputs"):
        recipe.notes.append(f"{key}.roles_to_train: tunegrid trains on assistant tokens (data.loss_on: response)")
    recipe.accounted.update({f"{key}.roles_to_train"} if "roles_to_train" in entry else set())


def _sharegpt(recipe: Recipe, entry: dict[str, Any], key: str, kind: str) -> None:
    mapping = dict(entry.get("message_property_mappings") or {})
    recipe.carry(
        "data.fields",
        {"messages": entry.get("field_messages") or "conversations", "role": str(mapping.get("role", "from")),
         "content": str(mapping.get("content", "value"))},
        f"{key}.type", *[f"{key}.{k}" for k in ("field_messages", "message_property_mappings") if k in entry],
    )  # fmt: skip
    recipe.differs[f"{key}.type"] = (
        f"{kind}: axolotl lays these ShareGPT turns out with FastChat's conversation template "
        f"({entry.get('conversation') or 'its default'}; its later releases read them as chat_template); "
        "tunegrid renders the same turns with the checkpoint's chat template"
    )
    recipe.accounted.update({f"{key}.conversation"} if "conversation" in entry else set())


def _instruction(recipe: Recipe, key: str, kind: Any) -> None:
    """A named instruction layout, or a custom {field_instruction, ...} mapping (its known keys kept)."""
    if isinstance(kind, dict) and not kind.get("field_instruction"):
        recipe.refuse(f"{key}.type", f"{kind!r}: a custom type needs field_instruction (the prompt's field)")
        return
    if isinstance(kind, dict):
        for sub in set(kind) - set(CUSTOM_KEYS):
            recipe.unknown[f"{key}.type.{sub}"] = "not a key of axolotl's custom type (field_instruction, ...)"
        kind = {k: str(kind[k]) for k in CUSTOM_KEYS if kind.get(k) is not None}
    recipe.carry("data.layout", kind, f"{key}.type")


def _text(recipe: Recipe, entry: dict[str, Any], key: str, kind: str, base: str) -> None:
    recipe.carry("data.fields", {"text": entry.get("field") or "text"}, f"{key}.type", f"{key}.field")
    recipe.carry("data.loss_on", "all", f"{key}.type")
    if base == "completion":  # prompt_strategies/completion.py: tokenize_prompt
        recipe.differs[f"{key}.type"] = (
            f"{kind}: axolotl splits a text longer than sequence_len into chunks of sequence_len tokens (up to "
            "64 of them, each an example trained in full); a cell keeps each text's first train.seq_len tokens "
            "and drops the rest (fewer tokens trained per long text; rows as long, so the same peak)"
        )
