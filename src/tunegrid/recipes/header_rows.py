"""Rows of a study's header for what a recipe's tool does that no study setting carries, so that nothing the
recipe says changes silently: padding to the batch's longest sequence, tokens added to the vocabulary, Adam's
constants at the values tunegrid trains with anyway, the datasets `--dataset` replaces, and each key of a dataset
entry that no reader carried. `rows` is the set of recipe keys the header names (recipes.fidelity checks it).
"""

from __future__ import annotations

import math
from typing import Any

from tunegrid.recipes.core import Recipe

# why a recipe that pads each batch to its longest sequence runs differently: a cell pads every row to
# train.seq_len (cell/data/packing.py), packed or not
PADDED = (
    "a cell pads every row to train.seq_len, so the activation peak it measures is that of a batch whose longest "
    "sequence fills train.seq_len: the recipe's worst batch, above its typical one"
)
# keys that change the vocabulary, or the token that ends each example: set, they run differently
TOKENIZER_ROWS = {
    "tokens": "tokens added to the vocabulary: axolotl resizes the input embeddings and the output head to hold "
    "them (larger matrices, more memory); tunegrid keeps the checkpoint's vocabulary, so these strings are split "
    "into its existing tokens",
    "special_tokens": "the tokenizer's special tokens (pad, BOS, EOS ...): one not in the vocabulary is added and "
    "the input embeddings and output head resized, and the EOS given ends each example; tunegrid keeps the "
    "checkpoint's own",
}
# torch's AdamW constants, which tunegrid's optimizers (and bitsandbytes' 8-bit AdamW) keep
ADAM = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "adam_eps": 1e-8}
WHERE_KEYS = ("path", "data_files", "ds_type", "revision", "name", "split")  # where a dataset entry's file is
NOT_MIXED = "--dataset gave one data file for the recipe's datasets; this one is not mixed in"
PREFERENCE = "a field of axolotl's preference (DPO/KTO) dataset types; an SFT dataset's type does not read it"
# a dataset entry's keys that no reader carries, and what they are
ENTRY_REASONS = {
    **dict.fromkeys(("field_prompt", "field_completion", "field_chosen", "field_rejected", "field_label",
                     "prompt_format", "completion_format", "chosen_format", "rejected_format"), PREFERENCE),
    "train_on_split": "not a key axolotl's SFT datasets read (its validation warns that it is ignored; `split` "
    "names the split)",
    "field": "the text field of axolotl's completion type; this entry's type does not read it",
    **dict.fromkeys(("field_instruction", "field_input", "field_output", "format", "no_input_format",
                     "system_format", "system_prompt"),
                    "a field of axolotl's custom type, read under `type:`; beside it, this entry's type does not "
                    "read it"),
    "data_dir": "a folder of the hub repository the recipe loads from; tunegrid loads the repository's default "
    "data files (give data.data_files in the study to choose others)",
    "weight": "the share of this dataset's records the mixture takes; tunegrid reads every record of the split",
}  # fmt: skip


def rows(recipe: Recipe) -> set[str]:
    """The recipe keys the header names (carried, not carried, run differently, unknown, ignored, accounted). The
    header prints no line for data.dataset (the entry as a whole), so a key carried only there is no row."""
    named = {k for path, keys in recipe.origin.items() if path != "data.dataset" for k in keys}
    named |= set(recipe.not_carried) | set(recipe.differs) | set(recipe.unknown) | set(recipe.ignored)
    return named | recipe.accounted | set(recipe.aliased.values())


def adam_default(key: str, value: Any) -> bool:
    """Whether an Adam constant is the one tunegrid's AdamW uses anyway."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return key in ADAM and number and math.isclose(float(value), ADAM[key], rel_tol=1e-9)


def entry_rows(recipe: Recipe, key: str, entry: dict[str, Any], tool: str) -> None:
    """A row for each key of a dataset entry that none names yet (what it is, or that it is not read)."""
    named = rows(recipe)
    for sub in entry:
        name = f"{key}.{sub}"
        if name in named or any(n.startswith(f"{name}.") for n in named):
            continue
        recipe.not_carried[name] = ENTRY_REASONS.get(sub) or (
            f"a key of {tool}'s dataset entries that tunegrid does not read for this entry (what it changes in "
            "the recipe's records is not carried)"
        )


def local_split(recipe: Recipe, key: str, split: Any, tool: str) -> None:
    """A split named for a local file: the file's one split (train) is what tunegrid reads, whole."""
    if split is None:
        return
    if str(split) == "train":
        recipe.not_carried[key] = f"train: a local file is one split, read whole, as {tool} reads it"
    else:
        recipe.differs[key] = f"{split!r}: the recipe reads that split of the local file; tunegrid reads every record"


def default_config(recipe: Recipe, key: str, name: Any) -> bool:
    """A dataset configuration tunegrid reads (none, or `default`): a row for `default`; False for another."""
    if name in (None, "", "default"):
        if name == "default":
            recipe.not_carried[key] = "default: the dataset's default configuration, the one tunegrid reads"
        return True
    return False


def with_users_dataset(raw: dict[str, Any], tool: str, name: str, revision: str) -> dict[str, tuple[str, str]]:
    """`--dataset <file>` written into the recipe's own keys (axolotl: its first entry, type and mappings kept),
    and a row for each dataset and location key it replaces: {key: (differs | not_carried, why)}."""
    replaced: dict[str, tuple[str, str]] = {}
    where = f"where the recipe's records were; --dataset gave {name!r}"
    if tool == "axolotl":
        entries = raw.get("datasets")
        entries = entries if isinstance(entries, list) else [entries] if entries else []
        first = entries[0] if entries and isinstance(entries[0], dict) else {}
        replaced |= {f"datasets.0.{k}": ("not_carried", where) for k in WHERE_KEYS if k in first and k != "path"}
        replaced |= {f"datasets.{index}": ("differs", NOT_MIXED) for index in range(1, len(entries))}
        kept = {k: v for k, v in first.items() if k not in WHERE_KEYS}
        raw["datasets"] = [{**kept, "path": name, **({"revision": revision} if revision else {})}]
        return replaced
    raw["dataset_name"] = name
    for top, key in (("datasets", "datasets"), ("dataset_mixture", "dataset_mixture.datasets")):
        value = raw.pop(top, None)
        entries = value.get("datasets") if top == "dataset_mixture" and isinstance(value, dict) else value
        entries = entries if isinstance(entries, list) else [entries] if entries else []
        replaced |= {f"{key}.{index}": ("differs", NOT_MIXED) for index in range(len(entries))}
        if top == "dataset_mixture" and isinstance(value, dict):
            replaced |= {f"{top}.{k}": ("not_carried", where) for k in value if k != "datasets"}
    return replaced
