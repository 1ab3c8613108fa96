"""A user's training recipe (an axolotl config, or TRL / Transformers training arguments) read into the
settings of a tunegrid study, with every key of the source accounted for.

`Recipe` is what crosses from the readers (recipes.axolotl, recipes.trl) to the study builder
(recipes.importer) and back out to the exporter (recipes.export): `settings` maps tunegrid's own config
paths (`grid.precision`, `train.lr`, `lora.r`, `data.fields` …) to the recipe's values; `origin` says
which recipe keys each came from; `not_carried` lists, with the reason, every key tunegrid does not take
over (never dropped silently); `ignored` the keys it cannot honour that the user chose to drop (`--ignore`).
A key it cannot honour and the user did not list is a `RecipeError` naming it.

The field names are read from the tools' own schemas at the versions in `MAPPED_VERSIONS`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunegrid.meanings import PRECISION_ROWS, QUANT_ROWS
from tunegrid.study.errors import ConfigError
from tunegrid.study.input_limits import read_study_yaml, study_file_problems

MAPPED_VERSIONS = {"axolotl": "0.18.0", "trl": "1.16.0", "transformers": "5.23.0"}
TOOLS = ("axolotl", "trl", "transformers")
FAILURES = ("nan", "oom", "timeout", "all")
HEX40 = re.compile(r"^[0-9a-f]{40}$")
# transformers' OptimizerNames (5.23.0; axolotl's `optimizer` takes the same names) that tunegrid's optimizer
# axis trains: torch AdamW (fused is a kernel choice), and bitsandbytes' AdamW with optim_bits=8, unpaged or paged
# (what transformers' trainer_optimizer builds for these names: AdamW8bit / PagedAdamW8bit)
OPTIMIZER_AXIS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw": "adamw",
    "adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit", "paged_adamw_8bit": "paged-adamw-8bit",
}  # fmt: skip
# each axis value as the tools' own name (export)
TOOL_OPTIMIZER = {"adamw": "adamw_torch", "adamw-8bit": "adamw_bnb_8bit", "paged-adamw-8bit": "paged_adamw_8bit"}
# Each grid axis as the keys that say it in a tool's file: the import reads them, the export writes them. The
# "trl" column is TRL's SFT arguments and Transformers' TrainingArguments alike; a key listed first is the one
# written (activation_checkpointing: transformers 5's name, read before the older one).
AXIS_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "precision": {"axolotl": ("bf16", "fp16"), "trl": ("bf16", "fp16")},
    "batch_size": {"axolotl": ("micro_batch_size",), "trl": ("per_device_train_batch_size",)},
    "grad_accum": {"axolotl": ("gradient_accumulation_steps",), "trl": ("gradient_accumulation_steps",)},
    "seed": {"axolotl": ("seed",), "trl": ("seed",)},
    "quant": {
        "axolotl": ("load_in_4bit", "load_in_8bit", "adapter", "quantize_moe_experts"),
        "trl": ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_peft"),
    },
    "optimizer": {"axolotl": ("optimizer",), "trl": ("optim",)},
    "activation_checkpointing": {
        "axolotl": ("gradient_checkpointing",),
        "trl": ("activation_checkpointing", "gradient_checkpointing"),
    },
}
SCHEDULERS = {"cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr"}  # train.lr_scheduler
ATTENTION_NAMES = {"flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention"}  # attn_implementation
LINEAR_SUFFIXES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class RecipeError(ConfigError):
    """A recipe tunegrid cannot take as it is: every problem, one per line, each naming the recipe key."""


@dataclass
class Recipe:
    tool: str
    path: str
    raw: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, list[str]] = field(default_factory=dict)
    not_carried: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    ignore: set[str] = field(default_factory=set)
    differs: dict[str, str] = field(default_factory=dict)  # bears on memory/numerics; the study runs without it
    unknown: dict[str, str] = field(default_factory=dict)  # no tool key of this name (the nearest known said)
    accounted: set[str] = field(default_factory=set)  # read by a reader that put their meaning elsewhere
    changed: list[str] = field(default_factory=list)  # what --as-sft changed to make it an SFT study
    unpinned: dict[str, str] = field(default_factory=dict)  # hub ids without a 40-hex revision -> the ref fetched
    aliased: dict[str, str] = field(default_factory=dict)  # a TRL key -> a training script's name for it in the file

    @property
    def version(self) -> str:
        return MAPPED_VERSIONS[self.tool]

    def carry(self, path: str, value: Any, *keys: str) -> None:
        self.settings[path] = value
        self.origin.setdefault(path, []).extend(k for k in keys if k not in self.origin.get(path, []))

    def drop(self, key: str, why: str) -> None:
        """A key of the recipe tunegrid does not take over (listed in the study's header)."""
        if key in self.raw:
            self.not_carried[key] = why

    def refuse(self, key: str, why: str) -> None:
        """A key tunegrid cannot honour: an error naming it, unless `--ignore` lists it."""
        if key in self.ignore or key.split(".")[0] in self.ignore:
            self.ignored[key] = why
        else:
            self.refused.append(f"recipe key {key!r}: {why}; change it, or pass --ignore {key} to drop it")

    def need(self, key: str, why: str) -> None:
        """Something a study cannot do without (the model, the data): an error, whatever `--ignore` says."""
        self.refused.append(f"recipe key {key!r}: {why}")


def read_file(path: str | Path) -> dict[str, Any]:
    """A recipe file as a mapping: YAML (.yaml/.yml) or JSON (.json)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r} does not exist")
    if path.suffix != ".json":  # read as a study file is: bounded before anything is expanded, YAML 1.2 numbers
        raw = read_study_yaml(path)
    else:
        try:
            raw = json.loads(path.read_text()) if not study_file_problems([path]) else None
        except ValueError as exc:
            raise RecipeError(f"recipe {str(path)!r} is not valid JSON: {exc}") from None
        if raw is None:
            raise RecipeError(study_file_problems([path])[0])
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {str(path)!r} must hold a mapping of keys, not {type(raw).__name__}")
    return raw


def scheduler(recipe: Recipe, key: str, name: Any, min_lr_rate: float | None = None, *keys: str) -> None:
    name = str(getattr(name, "value", name))
    if name not in SCHEDULERS:
        recipe.refuse(key, f"learning-rate schedule {name!r} is not one tunegrid runs ({sorted(SCHEDULERS)})")
        return
    if name == "cosine" and min_lr_rate:
        name = "cosine_with_min_lr"
    recipe.carry("train.lr_scheduler", name, key, *keys)
    if name == "cosine_with_min_lr":
        recipe.carry("train.min_lr_rate", float(min_lr_rate or 0.0), key, *keys)


def warmup(recipe: Recipe, value: Any, steps: int, key: str, share: Any = math.ceil) -> int:
    """An int is steps; a float in (0, 1) a share of the steps, rounded as the tool rounds it: up in transformers'
    `get_warmup_steps` (TRL's too), down where axolotl computes it (`int(warmup_ratio * total)`). Returns the
    count before any cut to the study's steps."""
    number = float(value or 0)
    count = int(share(steps * number)) if 0 < number < 1 else int(number)
    recipe.carry("train.warmup_steps", min(count, steps), key)
    if count > steps:
        recipe.differs[key] = (
            f"{count} warmup steps, more than the study's {steps} steps per cell: cut to {steps} (the learning "
            "rate still rises at the last step, as in the recipe's first steps)"
        )
    return count


def lora_targets(recipe: Recipe, key: str, value: Any) -> None:
    if value in (None, [], ""):
        return
    if value == "all-linear" or value == ["all-linear"]:
        recipe.settings.pop("lora.target_regex", None)  # axolotl lists a regex string beside every linear name
        recipe.origin.pop("lora.target_regex", None)
        found = linear_modules(recipe)
        if found:
            recipe.carry("lora.target_modules", found, key)
            recipe.notes.append(f"{key}: all-linear resolved against the checkpoint's own linear layers: {found}")
        else:  # a hub id not yet fetched: peft resolves it when the cell attaches the adapters
            recipe.carry("lora.target_modules", ["all-linear"], key)
            recipe.notes.append(f"{key}: all-linear, resolved by peft against the fetched checkpoint's linear layers")
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        recipe.carry("lora.target_modules", list(value), key)
    elif isinstance(value, str) and re.fullmatch(r"[\w.]+", value):  # one module name
        recipe.carry("lora.target_modules", [value], key)
    elif isinstance(value, str) and value:  # peft reads a string as a regex full-matched against module names
        try:
            re.compile(value)
        except re.error as exc:
            recipe.refuse(key, f"{value!r} is not a regular expression peft can match ({exc})")
            return
        recipe.carry("lora.target_modules", [], key)
        recipe.carry("lora.target_regex", value, key)
    else:
        recipe.refuse(key, f"{value!r}: tunegrid takes a list of module-name suffixes")


def linear_modules(recipe: Recipe) -> list[str] | None:
    """The suffixes of the checkpoint's linear layers but the output head (what peft's all-linear picks), read
    from its config.json on the meta device; None when the checkpoint is not on this machine."""
    folder = checkpoint_folder(recipe)
    return built_linear_modules(folder) if folder is not None else None


def peft_default_targets(recipe: Recipe) -> tuple[str | None, list[str] | None]:
    """(model_type, the modules peft adapts for it when a LoraConfig names none: its
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); (None, None) when the checkpoint is not on this machine,
    (model_type, None) when peft has no default for it."""
    folder = checkpoint_folder(recipe)
    if folder is None:
        return None, None
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError:
        return None, None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return None, None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    targets = DEFAULTS.get(model_type)
    return model_type, (sorted(targets) if isinstance(targets, (list, tuple, set)) else None)


def checkpoint_folder(recipe: Recipe) -> Path | None:
    """The recipe's checkpoint folder on this machine (a local one, or a hub one in the cache), holding config.json."""
    model = recipe.settings.get("model") or {}
    folder = Path(model["path"]) if model.get("source") == "local" else None
    if model.get("source") == "hub" and model.get("repo_id"):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model["repo_id"], "config.json", revision=model.get("revision") or None)
        except Exception:  # no cache, no hub library: resolved when fetched
            cached = None
        folder = Path(cached).parent if isinstance(cached, str) else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def built_linear_modules(folder: Path) -> list[str] | None:
    """The suffixes of a checkpoint's linear layers but the output head (what peft's all-linear picks), built
    from its config.json on the meta device; None when this transformers cannot build it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
    except Exception:  # an architecture this transformers lacks: peft resolves all-linear when the cell loads it
        return None
    head = built.get_output_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in built.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    return sorted(names) or None


def precision_of(dtype: str) -> str:
    """The precision whose row (tunegrid.meanings) computes in this torch dtype."""
    return str(next(row.precision for row in PRECISION_ROWS.values() if row.dtype == dtype))


def quant_of(bnb: dict[str, Any] | None, experts: bool = False) -> str | None:
    """The quantization whose row loads with these BitsAndBytesConfig settings (None: none does)."""
    for row in QUANT_ROWS.values():
        if bnb is None and row.bits is None:
            return str(row.quant)
        if bnb and row.bnb and row.experts_quantized == experts and all(row.bnb.get(k) == v for k, v in bnb.items()):
            return str(row.quant)
    return None


def precision_flags(recipe: Recipe, bf16: Any, fp16: Any, keys: tuple[str, ...], tf32_key: str = "tf32") -> None:
    if bf16 == "auto":  # axolotl's resolve_dtype: fp16 wins where it is set, else bf16 where the GPU has it
        bf16 = not fp16
        recipe.notes.append(
            f"{keys[0]}: auto, resolved as the tool does: "
            + ("fp16 is on, so bf16 is off" if fp16 else "bf16 on a GPU that has it (an fp16 run elsewhere: the "
               "grid's fp16 cells)")
        )  # fmt: skip
    if fp16 and bf16:
        recipe.refuse(keys[0], "both bf16 and fp16 are on; a run trains in one of them")
        return
    precision = precision_of("float16" if fp16 else "bfloat16" if bf16 else "float32")
    recipe.carry("grid.precision", precision, *keys)


def quantization(recipe: Recipe, four: bool, eight: bool, quant_type: Any, keys: list[str]) -> None:
    """`load_in_4bit` (with its bnb_4bit_quant_type) or `load_in_8bit` as the quantization that loads so."""
    given = [k for k in keys if k in recipe.raw]
    if four and eight:
        recipe.refuse("load_in_8bit", "both 4-bit and 8-bit loading are on; a model loads in one of them")
        return
    bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": str(quant_type or "nf4")} if four else None
    bnb = {"load_in_8bit": True} if eight else bnb
    quant = quant_of(bnb)
    if quant is None:
        recipe.refuse(keys[-1], f"{bnb}: no tunegrid quantization loads with these bitsandbytes settings")
        return
    recipe.carry("grid.quant", quant, *given)


def axis_keys(tool: str, axis: str) -> tuple[str, ...]:
    """The keys of `tool`'s file that say `axis` (AXIS_KEYS); KeyError for an axis no key says."""
    return AXIS_KEYS[axis]["axolotl" if tool == "axolotl" else "trl"]


def tool_value(tool: str, axis: str, value: Any) -> dict[str, Any]:
    """The keys of `tool`'s file that say a tunegrid axis value (for export): only what the axis sets."""
    keys = axis_keys(tool, axis)
    if axis == "precision":
        row = PRECISION_ROWS[value]
        what = "fp32 islands" if row.fp32_islands else "an fp32 residual stream" if row.residual_fp32 else ""
        if what:  # tunegrid-only fixes: written as the tool's plain fp16, they would be the failing setting again
            raise ValueError(f"precision {value} ({what}) is not a setting of a {tool} config")
        said = dict(zip(keys, (row.dtype == "bfloat16", row.dtype == "float16"), strict=True))
        if tool == "axolotl":  # axolotl's storage switches too: bfloat16: true would keep an fp32 fix in bf16
            said.update({"bfloat16": row.dtype == "bfloat16", "float16": row.dtype == "float16"})
        return said
    if axis == "quant":
        row = QUANT_ROWS[value]
        if row.experts_quantized and "quantize_moe_experts" not in keys:
            raise ValueError(f"TRL's ModelConfig has no setting that quantizes MoE experts ({value})")
        bnb = row.bnb or {}
        four = bool(bnb.get("load_in_4bit"))
        said = {
            "load_in_4bit": four,
            "load_in_8bit": bool(bnb.get("load_in_8bit")),
            "adapter": "qlora" if four else "lora",
            "quantize_moe_experts": row.experts_quantized,
            "use_peft": True,  # TRL trains adapters only with use_peft (an --ignore'd recipe may lack it)
            **({"bnb_4bit_quant_type": bnb["bnb_4bit_quant_type"]} if four else {}),
        }
        return {key: said[key] for key in keys if key in said}
    if axis == "optimizer":
        return {keys[0]: TOOL_OPTIMIZER[value]}
    if axis == "activation_checkpointing":  # at false a cell follows the recipe's own checkpointing key
        return {keys[0]: True} if value else {}
    return {keys[0]: value}


def epochs_not_carried(recipe: Recipe, key: str, epochs: float, total: int, effective: int) -> None:
    """The recipe's epochs as a row: a cell trains a number of steps, not passes over the recipe's data."""
    recipe.not_carried[key] = (
        f"{epochs:g} epoch(s) of the recipe's data; tunegrid trains {total} steps per cell (--steps), "
        f"{total * effective} sequences at the recipe's effective batch {effective} (the failures show in the "
        "first steps; the recipe's epoch length depends on its dataset's size)"
    )
    recipe.accounted.add(key)
