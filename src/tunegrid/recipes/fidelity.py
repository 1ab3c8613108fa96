"""Nothing changes silently: every difference between a recipe and the study imported from it is a row of the
study's header, by key. `check_fidelity` reads the recipe file again and the study, and names each difference
that has no row: a key the header does not name (a dataset entry's own keys included), a value the study trains
with that is not the recipe's, and the first training record's text (where the record is on this machine): what
a cell trains on, through the dataset rule's own code, that is not what the recipe's tool builds from it
(tunegrid.study.prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunegrid.recipes.core import Recipe, read_file
from tunegrid.recipes.header_rows import rows
from tunegrid.recipes.locations import first_record
from tunegrid.study.prompts import PROMPT_COMPLETION, study_text, tool_text

# recipe keys whose value the study keeps as it is, and where (each tool's names)
SAME_VALUE = {
    "learning_rate": "train.lr", "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "sequence_len": "train.seq_len", "max_length": "train.seq_len", "max_seq_length": "train.seq_len",
    "micro_batch_size": "grid.batch_size", "per_device_train_batch_size": "grid.batch_size",
    "gradient_accumulation_steps": "grid.grad_accum", "seed": "grid.seed", "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm", "max_steps": "train.steps", "warmup_steps": "train.warmup_steps",
    "lora_target_modules": "lora.target_modules", "ddp_timeout": "distributed.collective_timeout_s",
}  # fmt: skip


# the recipe's lists of dataset entries, each entry's keys checked one by one
DATASET_LISTS = ("datasets", "dataset_mixture.datasets")


def _entry_keys(raw: dict[str, Any]) -> list[str]:
    """`datasets.0.split`: every key of every dataset entry the recipe lists."""
    keys = []
    for path in DATASET_LISTS:
        entries: Any = raw
        for part in path.split("."):
            entries = entries.get(part) if isinstance(entries, dict) else None
        for index, entry in enumerate(entries if isinstance(entries, list) else []):
            keys += [f"{path}.{index}.{sub}" for sub in (entry if isinstance(entry, dict) else {})]
    return keys


def _covered(key: str, named: set[str]) -> bool:
    """A row names the entry's key, the whole entry (a dataset not mixed in), or a value inside the key."""
    entry = key.rsplit(".", 1)[0]
    return key in named or entry in named or any(n.startswith(f"{key}.") for n in named)


def _study_value(study: dict[str, Any], path: str) -> Any:
    section, key = path.split(".", 1)
    value = study.get(section, {}).get(key)
    return value[0] if section == "grid" and isinstance(value, list) and value else value


def _same(given: Any, used: Any) -> bool:
    if isinstance(given, bool) or isinstance(used, bool):
        return given == used
    if isinstance(given, (int, float)) and isinstance(used, (int, float)):
        return abs(float(given) - float(used)) <= 1e-12 * max(1.0, abs(float(given)))
    if isinstance(given, str) and isinstance(used, list):
        return used == [given]
    return given == used


def check_fidelity(recipe: Recipe, study: dict[str, Any], header: list[str] | None = None) -> list[str]:
    problems = []
    named = rows(recipe)
    tops = {k.split(".")[0].split(":")[0].split(" ")[0] for k in named}
    original = read_file(recipe.path)
    for key in original:
        if key not in named and key not in tops:
            problems.append(f"recipe key {key!r} has no row in the header")
    for key in _entry_keys(original):
        if not _covered(key, named):
            problems.append(f"recipe key {key!r} has no row in the header")
    for key, path in SAME_VALUE.items():
        given = recipe.raw.get(key)
        if given is None or key in recipe.differs or key not in recipe.origin.get(path, []):
            continue
        used = _study_value(study, path)
        if not _same(given, used) and not any(key in note for note in recipe.notes):
            problems.append(
                f"recipe key {key!r} = {given!r}, the study trains with {path} = {used!r} and no row says so"
            )
    problems += _first_record(recipe, study)
    return problems


def _first_record(recipe: Recipe, study: dict[str, Any]) -> list[str]:
    """The first record's text as the recipe's tool builds it against what the study trains on."""
    data = study.get("data") or {}
    if data.get("source") not in ("jsonl", "parquet"):
        return []  # a hub dataset is not on this machine at import: checked when the dataset rule fetches it
    record = first_record(Path(data["path"]))
    if recipe.tool == "axolotl":
        entry = (recipe.raw.get("datasets") or [{}])[0]
        kind, field = entry.get("type"), entry.get("field") or "text"
        row = "datasets.0.type"
    else:
        kind = PROMPT_COMPLETION if {"prompt", "completion"} <= set(record) else "completion"
        kind = None if "messages" in record else kind
        field, row = recipe.raw.get("dataset_text_field") or "text", "dataset_text_field"
    try:
        built = tool_text(kind, record, field)
        trained = study_text(data, record)
    except (KeyError, TypeError, ValueError) as exc:
        return [f"first record: the recipe's fields are not in it ({exc})"]
    if built is None or trained is None or "".join(built) == trained:
        return []
    if row in recipe.differs:
        return []
    return [f"first record: the recipe trains on {''.join(built)[:80]!r}…, the study on {trained[:80]!r}…"]
