"""The keys the recipe tools know, in every release recipes are written for, read from the generated data
(src/tunegrid/recipes/generated/, written by scripts/generate_recipe_keys.py from axolotl's config schema at
its release tags and TRL's / Transformers' dataclass fields): a key some release knows is never "unknown",
and a hint proposes only a key that is the same word misspelt.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from pathlib import Path

GENERATED = Path(__file__).with_name("generated")
# the classes `trl sft --config` reads into (SFTConfig subclasses TrainingArguments), and Transformers' own
TRL_SFT_CLASSES = ("SFTConfig", "ModelConfig", "ScriptArguments", "DatasetMixtureConfig", "TrainingArguments")


@cache
def _data(tool: str) -> dict:
    return json.loads((GENERATED / f"{tool}_keys.json").read_text())


@cache
def axolotl_releases(key: str, dataset: bool = False) -> tuple[str, ...]:
    """The axolotl release tags whose schema (or, before it, code) knows `key`."""
    field = "dataset_keys" if dataset else "keys"
    return tuple(tag for tag, release in _data("axolotl")["versions"].items() if key in release[field])


@cache
def axolotl_keys(dataset: bool = False) -> frozenset[str]:
    field = "dataset_keys" if dataset else "keys"
    return frozenset(k for release in _data("axolotl")["versions"].values() for k in release[field])


def axolotl_renamed(key: str) -> str | None:
    """The key axolotl's validation says replaces `key` (`X is deprecated, use Y`), if any."""
    data = _data("axolotl")
    return data["renamed"].get(key)


def axolotl_remapped() -> dict[str, str]:
    """User keys axolotl's schema reads under another field name (model_revision -> revision_of_model)."""
    return dict(_data("axolotl")["remapped"])


@cache
def trl_fields(*classes: str) -> frozenset[str]:
    """The fields of these classes in every TRL / Transformers release the data holds."""
    return frozenset(f for release in _data("trl")["releases"].values() for c in classes for f in release.get(c, ()))


def trl_releases(key: str, classes: tuple[str, ...] = TRL_SFT_CLASSES) -> tuple[str, ...]:
    return tuple(
        name for name, release in _data("trl")["releases"].items() if any(key in release.get(c, ()) for c in classes)
    )


def trl_class_only(name: str) -> frozenset[str]:
    """Fields only `name` (a trainer's config: DPOConfig, GRPOConfig …) has, of every class the data holds."""
    others = {c for release in _data("trl")["releases"].values() for c in release if c != name}
    return trl_fields(name) - trl_fields(*others)


def tool_keys(tool: str) -> frozenset[str]:
    if tool == "axolotl":
        return axolotl_keys()
    if tool == "transformers":
        return trl_fields("TrainingArguments")
    return trl_fields(*TRL_SFT_CLASSES)


def releases_text(tool: str, key: str) -> str:
    """Which releases know a key, as a header says it: 'axolotl v0.3.0-v0.4.0'."""
    if tool == "axolotl":
        tags = axolotl_releases(key)
        return f"axolotl {tags[0]}" + (f"-{tags[-1]}" if len(tags) > 1 else "") if tags else ""
    names = trl_releases(key)
    return ", ".join(names)


def misspelt(key: str, known: set[str] | frozenset[str]) -> str | None:
    """A known key `key` is a misspelling of: the same words but one or two letters (never another word)."""
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.88)
    if not near:
        return None
    words, theirs = key.split("_"), near[0].split("_")
    if len(words) != len(theirs):
        return None
    vocabulary = {w for k in known for w in k.split("_")}
    changed = [(a, b) for a, b in zip(words, theirs, strict=True) if a != b]
    # a word of its own (use_lora beside use_rslora): another meaning, not a typo
    if len(changed) != 1 or changed[0][0] in vocabulary:
        return None
    return near[0]


# A training script's names for TRL's own keys (Hugging Face's example scripts and the recipes written for them):
# read as the TRL key, each said in the header
SCRIPT_ALIASES = {"dataset_id_or_path": "dataset_name", "model_name": "model_name_or_path",
                  "model_id": "model_name_or_path", "max_seq_len": "max_length", "use_lora": "use_peft"}  # fmt: skip
LLAMA_FACTORY = ("finetuning_type", "cutoff_len", "lora_rank", "lora_target", "dataset_dir")
AXOLOTL_SHARE = 0.8  # the least share of axolotl keys in an axolotl config of the public corpus is 0.9
TRL_SHARE = 0.75


def detect_format(raw: dict) -> tuple[str | None, str]:
    """(tool, "") for a file whose keys are axolotl's or TRL's / Transformers' (most of them, in some release),
    else (None, what was looked for and what the file holds instead)."""
    keys = set(raw)
    trl_known = trl_fields(*TRL_SFT_CLASSES) | set(SCRIPT_ALIASES)
    if "base_model" in keys and len(keys & axolotl_keys()) >= AXOLOTL_SHARE * len(keys):
        return "axolotl", ""
    factory = [k for k in LLAMA_FACTORY if k in keys]
    others = sorted(keys - trl_known - axolotl_keys())
    if len(factory) < 2 and len(keys & trl_known) >= TRL_SHARE * len(keys):
        only = trl_fields("SFTConfig", "ModelConfig", "ScriptArguments", "DatasetMixtureConfig") - trl_fields(
            "TrainingArguments"
        )
        return ("trl" if keys & (only | set(SCRIPT_ALIASES)) else "transformers"), ""
    what = f"a LLaMA-Factory config ({', '.join(factory)})" if len(factory) >= 2 else "neither"
    return None, (
        f"format not recognised: {what}; tunegrid reads axolotl configs (base_model and axolotl's keys) and "
        "TRL / Transformers training arguments (`trl sft --config`: model_name_or_path, dataset_name, use_peft, "
        f"SFTConfig and TrainingArguments fields); keys of neither: {', '.join(others[:8]) or 'none'}"
    )
