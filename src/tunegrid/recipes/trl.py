"""TRL's SFT arguments (the flat YAML/JSON `trl sft --config` reads: ScriptArguments + ModelConfig +
SFTConfig) and Transformers' TrainingArguments as tunegrid settings.

Key names and defaults as trl 1.16.0 (trl/trainer/sft_config.py, trl/trainer/model_config.py,
trl/scripts/utils.py) and transformers 5.23.0 (transformers/training_args.py) define them. SFTConfig's
own defaults differ from TrainingArguments' (bf16 unless fp16, activation checkpointing on, lr 2e-5,
max_length 1024), so the tool the file is read as matters; the command says which it assumed.
"""

from __future__ import annotations

from typing import Any

from tunegrid.recipes.core import (
    ATTENTION_NAMES,
    AXIS_KEYS,
    Recipe,
    axis_keys,
    epochs_not_carried,
    lora_targets,
    precision_flags,
    quantization,
    scheduler,
    warmup,
)
from tunegrid.recipes.header_rows import PADDED
from tunegrid.recipes.keys import account_rest, check_tables, lora_options, number
from tunegrid.recipes.locations import model_entry
from tunegrid.recipes.lora_keys import peft_default
from tunegrid.recipes.memory_keys import checkpointing_and_offloading, fsdp_memory
from tunegrid.recipes.optimizer_keys import optimizer
from tunegrid.recipes.trl_data import read_dataset

# trl 1.16.0 dataclass fields, by class (the exporter splits a flat file back into them)
MODEL_CONFIG_KEYS = {
    "model_name_or_path", "model_revision", "dtype", "attn_implementation", "use_peft", "lora_r", "lora_alpha",
    "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "lora_task_type",
    "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
    "bnb_4bit_quant_storage", "trust_remote_code",
}  # fmt: skip
SCRIPT_ARGUMENTS_KEYS = {
    "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
    "ignore_bias_buffers", "datasets",
}  # fmt: skip
SFT_ONLY_KEYS = {
    "model_init_kwargs", "chat_template_path", "dataset_text_field", "dataset_kwargs", "dataset_num_proc",
    "eos_token", "max_length", "truncation_mode", "shuffle_dataset", "packing", "packing_strategy", "padding_free",
    "pad_to_multiple_of", "eval_packing", "completion_only_loss", "assistant_only_loss", "loss_type",
    "router_aux_loss_coef", "activation_offloading",
}  # fmt: skip
TRL_ONLY_KEYS = (MODEL_CONFIG_KEYS - {"trust_remote_code"}) | SCRIPT_ARGUMENTS_KEYS | SFT_ONLY_KEYS
# the defaults a missing key takes, per tool (checked against the real dataclasses in the tests)
DEFAULTS = {
    "trl": {
        "learning_rate": 2e-5, "gradient_checkpointing": True, "max_length": 1024, "packing": False,
        "per_device_train_batch_size": 8, "lr_scheduler_type": "linear", "optim": "adamw_torch_fused",
        "seed": 42, "ddp_timeout": 1800, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
    },
    "transformers": {
        "learning_rate": 5e-5, "gradient_checkpointing": False, "per_device_train_batch_size": 8,
        "lr_scheduler_type": "linear", "optim": "adamw_torch_fused", "seed": 42, "ddp_timeout": 1800,
    },
}  # fmt: skip
# keys this reader reads (besides the tables of recipes.keys), for telling unknown keys from known ones
READER_KEYS = MODEL_CONFIG_KEYS | SCRIPT_ARGUMENTS_KEYS | SFT_ONLY_KEYS | {
    "max_steps",
    "num_train_epochs", "learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_steps", "warmup_ratio", "ddp_timeout",
    "max_seq_length", "dataset_mixture", "fsdp", "fsdp_config", "deepspeed", "tf32",
} | {key for keys in AXIS_KEYS.values() for key in keys["trl"]}  # fmt: skip
MAX_SEQ_LEN = 32768  # the study schema's train.seq_len maximum
MAX_STEPS = 1_000_000
# numbers carried as they are: recipe key -> (study path, integer, low, high, default), in the order they are read;
# a key the recipe leaves out takes its tool's default (DEFAULTS), `default` only stands in for an unusable value
TRAINING_NUMBERS = {
    "learning_rate": ("train.lr", False, 0, 10, 2e-5),
    "weight_decay": ("train.weight_decay", False, 0, 10, 0.0),
    "max_grad_norm": ("train.max_grad_norm", False, 0, 1e6, 1.0),
}
LORA_NUMBERS = {
    "lora_r": ("lora.r", True, 1, 4096, 16),
    "lora_alpha": ("lora.alpha", False, 0, 1e6, 32.0),
    "lora_dropout": ("lora.dropout", False, 0, 1, 0.05),
}
# peft LoraConfig options tunegrid's LoRA takes, as ModelConfig names them
LORA_OPTIONS = {"lora_modules_to_save": "lora.modules_to_save", "use_rslora": "lora.use_rslora",
                "use_dora": "lora.use_dora"}  # fmt: skip


def detect_tool(raw: dict[str, Any]) -> str:
    """axolotl names its model `base_model`; TRL's `trl sft --config` files carry ModelConfig/ScriptArguments/
    SFTConfig keys; anything else is read as Transformers' TrainingArguments."""
    if "base_model" in raw:
        return "axolotl"
    return "trl" if TRL_ONLY_KEYS & set(raw) else "transformers"


def _get(recipe: Recipe, key: str) -> Any:
    return recipe.raw[key] if key in recipe.raw else DEFAULTS[recipe.tool].get(key)


def read_trl(recipe: Recipe, steps: int | None, seq_len: int | None) -> None:
    raw = recipe.raw
    model_entry(
        recipe, "model_name_or_path", raw.get("model_name_or_path"), "model_revision", raw.get("model_revision")
    )
    recipe.carry("model.trust_remote_code", bool(raw.get("trust_remote_code")), "trust_remote_code")
    check_tables(recipe)
    _attention(recipe)
    recipe.carry("adapter", "lora", "use_peft")
    _quantization(recipe)
    _precision(recipe)
    effective = _batch(recipe)
    _length(recipe, seq_len)
    total = _steps(recipe, effective, steps)
    _optimization(recipe, total)
    _memory(recipe)
    if recipe.tool == "trl":  # TrainingArguments hold no LoRA and no packing
        _carry_numbers(recipe, LORA_NUMBERS)
        _lora_targets(recipe)
        lora_options(recipe, LORA_OPTIONS)
        _packing(recipe)
    read_dataset(recipe)
    account_rest(recipe, READER_KEYS)


def _carry_numbers(recipe: Recipe, table: dict[str, tuple[str, bool, float, float, Any]]) -> None:
    for key, (path, integer, low, high, default) in table.items():
        recipe.carry(path, number(recipe, key, _get(recipe, key), integer=integer, low=low, high=high,
                                  default=default), key)  # fmt: skip


def _attention(recipe: Recipe) -> None:
    """`attn_implementation` as the model's attention implementation (flash-attention-3 read as flash_attention_3)."""
    attention = recipe.raw.get("attn_implementation")
    if isinstance(attention, str) and attention.replace("-", "_") in ATTENTION_NAMES:
        attention = attention.replace("-", "_")
    if attention:
        if attention in ATTENTION_NAMES:
            recipe.carry("model.attn_implementation", attention, "attn_implementation")
        else:
            recipe.refuse("attn_implementation", f"{attention!r} is not one tunegrid loads ({sorted(ATTENTION_NAMES)})")


def _quantization(recipe: Recipe) -> None:
    raw = recipe.raw
    quantization(
        recipe, bool(raw.get("load_in_4bit")), bool(raw.get("load_in_8bit")), raw.get("bnb_4bit_quant_type"),
        ["load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"],
    )  # fmt: skip
    if raw.get("load_in_4bit") and not raw.get("use_bnb_nested_quant"):  # ModelConfig's default: false
        recipe.differs["use_bnb_nested_quant"] = (
            "false (TRL's default): the recipe keeps each block's fp32 absmax; tunegrid's nf4 double-quantizes them "
            "(about 0.37 bit per weight less)"
        )


def _precision(recipe: Recipe) -> None:
    raw = recipe.raw
    bf16_key, fp16_key = axis_keys(recipe.tool, "precision")
    bf16 = raw.get(bf16_key)
    if recipe.tool == "trl" and bf16 is None:
        bf16 = not raw.get(fp16_key)  # SFTConfig: bf16 unless fp16 is set
    precision_flags(recipe, bf16, raw.get(fp16_key), (bf16_key, fp16_key))


def _batch(recipe: Recipe) -> int:
    """The per-device batch, gradient accumulation and seed; the effective batch (their product) returned."""
    (batch_key,), (accum_key,) = axis_keys(recipe.tool, "batch_size"), axis_keys(recipe.tool, "grad_accum")
    (seed_key,) = axis_keys(recipe.tool, "seed")
    batch = number(recipe, batch_key, _get(recipe, batch_key), integer=True, low=1, high=4096, default=8)
    recipe.carry("grid.batch_size", batch, batch_key)
    accum = number(recipe, accum_key, recipe.raw.get(accum_key), integer=True, low=1, high=4096, default=1)
    recipe.carry("grid.grad_accum", accum, accum_key)
    recipe.carry("grid.seed", number(recipe, seed_key, _get(recipe, seed_key), integer=True, low=0,
                                     high=2**32 - 1, default=42), seed_key)  # fmt: skip
    return batch * accum


def _length(recipe: Recipe, seq_len: int | None) -> None:
    """max_length (or TRL's older max_seq_length) as the sequence length; TrainingArguments hold none."""
    raw = recipe.raw
    length_key = "max_seq_length" if "max_seq_length" in raw and "max_length" not in raw else "max_length"
    length = seq_len or number(
        recipe, length_key, _get(recipe, length_key) if length_key == "max_length" else raw[length_key],
        integer=True, low=8, high=MAX_SEQ_LEN,
    )  # fmt: skip
    if length_key == "max_seq_length":
        recipe.notes.append("max_seq_length: TRL's older name of max_length, read as it")
    if not length:
        if not recipe.refused or not any(length_key in line for line in recipe.refused):
            recipe.need(length_key, "TrainingArguments holds no sequence length; pass --seq-len")
    else:
        recipe.carry("train.seq_len", int(length), length_key)


def _steps(recipe: Recipe, effective: int, steps: int | None) -> int:
    """max_steps (-1 or unset: --steps, else 50; the epochs are not carried); the step count returned."""
    raw = recipe.raw
    max_steps = raw.get("max_steps")
    if max_steps not in (None, -1):
        max_steps = number(recipe, "max_steps", max_steps, integer=True, low=1, high=MAX_STEPS)
    total = max_steps if max_steps not in (None, -1) else (steps or 50)
    recipe.carry("train.steps", total, "max_steps")
    if max_steps in (None, -1):
        epochs = number(recipe, "num_train_epochs", raw.get("num_train_epochs"), integer=False, low=0, high=1e6,
                        default=3.0)  # fmt: skip
        epochs_not_carried(recipe, "num_train_epochs", epochs, total, effective)
    return total


def _optimization(recipe: Recipe, total: int) -> None:
    """Learning rate, weight decay, gradient clipping, the scheduler and its warmup."""
    raw = recipe.raw
    _carry_numbers(recipe, TRAINING_NUMBERS)
    kwargs = raw.get("lr_scheduler_kwargs") or {}
    scheduler(
        recipe, "lr_scheduler_type", _get(recipe, "lr_scheduler_type"), kwargs.get("min_lr_rate"), "lr_scheduler_kwargs"
    )
    warm = number(recipe, "warmup_steps", raw.get("warmup_steps"), integer=False, low=0, high=MAX_STEPS)
    ratio = number(recipe, "warmup_ratio", raw.get("warmup_ratio"), integer=False, low=0, high=1)
    if warm:
        warmup(recipe, warm, total, "warmup_steps")
    elif ratio:  # transformers 5 still reads warmup_ratio (a share of the steps)
        warmup(recipe, ratio, total, "warmup_ratio")
    else:
        warmup(recipe, 0, total, "warmup_steps")


def _memory(recipe: Recipe) -> None:
    """The optimizer, activation checkpointing (and TRL's offloading), FSDP, and the collectives' timeout."""
    tool = recipe.tool
    (optimizer_key,) = axis_keys(tool, "optimizer")
    optimizer(recipe, optimizer_key, _get(recipe, optimizer_key))
    new_key, old_key = axis_keys(tool, "activation_checkpointing")
    checkpointing = recipe.raw.get(new_key, recipe.raw.get(old_key, _get(recipe, old_key)))
    checkpointing_and_offloading(recipe, old_key, bool(checkpointing), new_key, offloading=tool == "trl")
    fsdp_memory(recipe)
    given = _get(recipe, "ddp_timeout")
    if isinstance(given, (int, float)) and not isinstance(given, bool) and given > 7 * 86400:
        recipe.differs["ddp_timeout"] = (f"{given:g} s: tunegrid's collectives wait at most 604800 s (7 days), so "
                                         "a hang is still a timeout within the study")  # fmt: skip
        given = 7 * 86400
    timeout = number(recipe, "ddp_timeout", given, integer=False, low=1, high=7 * 86400, default=1800.0)
    recipe.carry("distributed.collective_timeout_s", float(timeout), "ddp_timeout")


def _lora_targets(recipe: Recipe) -> None:
    raw = recipe.raw
    lora_targets(recipe, "lora_target_modules", raw.get("lora_target_modules"))
    if "lora.target_modules" not in recipe.settings:
        peft_default(recipe, "lora_target_modules")
    if raw.get("lora_target_parameters"):
        recipe.carry("lora.target_parameters", list(raw["lora_target_parameters"]), "lora_target_parameters")


def _packing(recipe: Recipe) -> None:
    """SFTConfig's packing, and how the batches are padded without it."""
    raw = recipe.raw
    if _get(recipe, "packing"):
        recipe.carry("data.packing", True, "packing", "packing_strategy")
    else:  # the row below says it, not a carried line
        recipe.carry("data.packing", False)
        if not raw.get("padding_free"):  # SFTTrainer's DataCollatorForLanguageModeling pads to the longest
            recipe.differs["packing"] = (
                f"{'false' if 'packing' in raw else 'unset (false)'}: TRL pads each batch to its longest "
                f"example; {PADDED}"
            )
    if raw.get("packing") and raw.get("packing_strategy") == "wrapped":
        recipe.notes.append("packing_strategy wrapped: tunegrid packs whole examples (as bfd does)")
