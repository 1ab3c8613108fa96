"""An axolotl config (the YAML `axolotl train` reads) as tunegrid settings.

Key names and defaults as axolotl 0.18.0 documents them (src/axolotl/utils/schemas/: config.py, model.py,
peft.py, training.py, datasets.py; the 4-bit defaults of src/axolotl/loaders/model.py).
"""

from __future__ import annotations

import math
from typing import Any

from tunegrid.recipes.axolotl_data import read_datasets
from tunegrid.recipes.core import (
    ATTENTION_NAMES,
    AXIS_KEYS,
    Recipe,
    axis_keys,
    epochs_not_carried,
    lora_targets,
    precision_flags,
    quant_of,
    quantization,
    scheduler,
    warmup,
)
from tunegrid.recipes.header_rows import PADDED
from tunegrid.recipes.keys import account_rest, check_tables, config_overrides, lora_options, number
from tunegrid.recipes.locations import model_entry
from tunegrid.recipes.lora_keys import loftq
from tunegrid.recipes.memory_keys import (
    checkpointing_and_offloading,
    fan_in_fan_out,
    fsdp_memory,
    unfrozen_parameters,
)
from tunegrid.recipes.optimizer_keys import optimizer

# LoRA variants and extras tunegrid's plain peft LoRA does not train
LORA_EXTRAS = ("loraplus_lr_ratio", "relora")
# peft LoraConfig options tunegrid's LoRA takes, as axolotl names them
LORA_OPTIONS = {"lora_modules_to_save": "lora.modules_to_save", "peft_use_rslora": "lora.use_rslora",
                "peft_use_dora": "lora.use_dora"}  # fmt: skip
# axolotl's attention switches (schemas/config.py), as transformers' attn_implementation names
ATTENTION_FLAGS = {
    "flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager",
    "flex_attention": "flex_attention", "xformers_attention": "sdpa",
}  # fmt: skip
READER_KEYS = {
    "base_model", "revision_of_model", "trust_remote_code", "bnb_config_kwargs", "sequence_len", "max_steps",
    "num_epochs", "learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler", "cosine_min_lr_ratio",
    "warmup_ratio", "warmup_steps", "ddp_timeout", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
    "lora_target_linear", "lora_target_parameters", "sample_packing", "train_on_inputs", "datasets",
    "attn_implementation", "pad_to_sequence_len", "peft", "lora_fan_in_fan_out", "lora_task_type",
    "sample_packing_seq_len_multiplier", "eval_sample_packing", "model_config", "activation_offloading",
    "unfrozen_parameters", *LORA_EXTRAS, *LORA_OPTIONS,
    *ATTENTION_FLAGS,
} | {key for keys in AXIS_KEYS.values() for key in keys["axolotl"]} | {"batch_size"}  # fmt: skip
MAX_SEQ_LEN = 32768  # the study schema's train.seq_len maximum
MAX_STEPS = 1_000_000
# numbers carried as they are: recipe key -> (study path, integer, low, high, default), in the order they are read
TRAINING_NUMBERS = {
    "weight_decay": ("train.weight_decay", False, 0, 10, 0.0),
    "max_grad_norm": ("train.max_grad_norm", False, 0, 1e6, 1.0),
}
LORA_NUMBERS = {
    "lora_r": ("lora.r", True, 1, 4096, 8),
    "lora_alpha": ("lora.alpha", False, 0, 1e6, 16.0),
    "lora_dropout": ("lora.dropout", False, 0, 1, 0.0),
}


def read_axolotl(recipe: Recipe, steps: int | None, seq_len: int | None) -> None:
    raw = recipe.raw
    model_entry(recipe, "base_model", raw.get("base_model"), "revision_of_model", raw.get("revision_of_model"))
    recipe.carry("model.trust_remote_code", bool(raw.get("trust_remote_code")), "trust_remote_code")
    check_tables(recipe)
    _attention(recipe)
    _quantization(recipe)
    _precision(recipe)
    micro = _batch(recipe)
    total = _length_and_steps(recipe, micro, steps, seq_len)
    _optimization(recipe, total)
    _memory(recipe)
    _lora(recipe)
    config_overrides(recipe, "model_config")
    _padding(recipe)
    recipe.carry("data.loss_on", "all" if raw.get("train_on_inputs") else "response", "train_on_inputs")
    read_datasets(recipe, raw.get("datasets"))
    account_rest(recipe, READER_KEYS)


def _carry_numbers(recipe: Recipe, table: dict[str, tuple[str, bool, float, float, Any]]) -> None:
    for key, (path, integer, low, high, default) in table.items():
        value = number(recipe, key, recipe.raw.get(key), integer=integer, low=low, high=high, default=default)
        recipe.carry(path, value, key)


def _quantization(recipe: Recipe) -> None:
    """The adapter (LoRA or QLoRA) and the base's bitsandbytes load: 4-bit, 8-bit, the MoE experts."""
    raw = recipe.raw
    adapter = raw.get("adapter")
    if adapter not in ("lora", "qlora"):
        recipe.refuse("adapter", f"{adapter!r}: tunegrid trains LoRA adapters (adapter: lora or qlora)")
    recipe.carry("adapter", adapter, "adapter")
    bnb = raw.get("bnb_config_kwargs") or {}
    four = bool(raw.get("load_in_4bit")) or adapter == "qlora"
    loftq(recipe, four or bool(raw.get("load_in_8bit")))
    quant_type = bnb.get("bnb_4bit_quant_type", "nf4")
    quantization(
        recipe, four, bool(raw.get("load_in_8bit")), quant_type,
        ["load_in_4bit", "load_in_8bit", "adapter", "bnb_config_kwargs"],
    )  # fmt: skip
    _moe_experts(recipe, four, quant_type)
    if bnb.get("bnb_4bit_use_double_quant") is False:
        recipe.differs["bnb_config_kwargs.bnb_4bit_use_double_quant"] = (
            "false: the recipe keeps each block's fp32 absmax; tunegrid's nf4 double-quantizes them (about 0.37 bit "
            "per weight less)"
        )


def _moe_experts(recipe: Recipe, four: bool, quant_type: Any) -> None:
    """`quantize_moe_experts` as the experts' quantization: nf4-experts, or int8-experts (axolotl's row-wise
    int8)."""
    raw = recipe.raw
    eight = bool(raw.get("load_in_8bit")) and not four
    loads = {"load_in_4bit": True, "bnb_4bit_quant_type": quant_type} if four else {"load_in_8bit": True}
    experts = quant_of(loads, experts=True) if four or eight else None
    if raw.get("quantize_moe_experts") and experts:
        recipe.carry("grid.quant", experts, "quantize_moe_experts")
        if eight:
            recipe.differs["quantize_moe_experts"] = (
                "axolotl quantizes each expert tensor as the checkpoint is read onto a GPU; tunegrid quantizes them "
                "once the 8-bit load is done, the same way (row-wise int8, dequantized to fp32 on use), so its load "
                "holds the experts at full width first (a higher load peak; the step is the same)"
            )
    elif raw.get("quantize_moe_experts"):
        recipe.refuse("quantize_moe_experts", "axolotl quantizes MoE experts under load_in_4bit or load_in_8bit; "
                      "the recipe loads neither")  # fmt: skip


def _batch(recipe: Recipe) -> int:
    """The micro batch, gradient accumulation (or a total `batch_size` divided by the micro batch) and seed; the
    micro batch returned."""
    raw = recipe.raw
    (micro_key,), (accum_key,) = axis_keys("axolotl", "batch_size"), axis_keys("axolotl", "grad_accum")
    (seed_key,) = axis_keys("axolotl", "seed")
    micro = number(recipe, micro_key, raw.get(micro_key), integer=True, low=1, high=4096, default=1)
    recipe.carry("grid.batch_size", micro, micro_key)
    accum = number(recipe, accum_key, raw.get(accum_key), integer=True, low=1, high=4096, default=1)
    recipe.carry("grid.grad_accum", accum, accum_key)
    total_batch = number(recipe, "batch_size", raw.get("batch_size"), integer=True, low=1, high=1 << 20)
    if total_batch and accum_key not in raw:
        recipe.carry("grid.grad_accum", max(1, total_batch // micro), "batch_size")
    seed = number(recipe, seed_key, raw.get(seed_key), integer=True, low=0, high=2**32 - 1, default=42)
    recipe.carry("grid.seed", seed, seed_key)
    return micro


def _length_and_steps(recipe: Recipe, micro: int, steps: int | None, seq_len: int | None) -> int:
    """The sequence length and the step count (max_steps, else --steps, else 50; epochs are not carried); the step
    count returned."""
    raw = recipe.raw
    length = seq_len or number(
        recipe, "sequence_len", raw.get("sequence_len"), integer=True, low=8, high=MAX_SEQ_LEN, default=512
    )  # axolotl's own default is 512 (schemas/config.py)
    recipe.carry("train.seq_len", int(length), "sequence_len")
    max_steps = number(recipe, "max_steps", raw.get("max_steps"), integer=True, low=1, high=MAX_STEPS)
    total = max_steps or steps or 50
    recipe.carry("train.steps", total, "max_steps")
    epochs = number(recipe, "num_epochs", raw.get("num_epochs"), integer=False, low=0, high=1e6, default=1.0)
    if not max_steps:
        effective = micro * recipe.settings["grid.grad_accum"]
        epochs_not_carried(recipe, "num_epochs", epochs, total, effective)
    return total


def _optimization(recipe: Recipe, total: int) -> None:
    """Learning rate, weight decay, gradient clipping, the scheduler and its warmup."""
    raw = recipe.raw
    lr = number(recipe, "learning_rate", raw.get("learning_rate"), integer=False, low=0, high=10)
    if lr is not None:
        recipe.carry("train.lr", lr, "learning_rate")
    _carry_numbers(recipe, TRAINING_NUMBERS)
    min_ratio = number(recipe, "cosine_min_lr_ratio", raw.get("cosine_min_lr_ratio"), integer=False, low=0, high=1)
    scheduler(recipe, "lr_scheduler", raw.get("lr_scheduler") or "cosine", min_ratio, "cosine_min_lr_ratio")
    _warmup(recipe, total)


def _warmup(recipe: Recipe, total: int) -> None:
    """axolotl's trainer builder (core/builders/base.py) counts the warmup itself: a share rounded down, else 3 %
    of the steps (at most 100), and one warmup step raised to two."""
    raw = recipe.raw
    ratio = number(recipe, "warmup_ratio", raw.get("warmup_ratio"), integer=False, low=0, high=1)
    warm = number(recipe, "warmup_steps", raw.get("warmup_steps"), integer=False, low=0, high=MAX_STEPS)
    key = "warmup_steps" if warm is not None or ratio is None else "warmup_ratio"
    if warm is not None or ratio is not None:
        count = warmup(recipe, warm if warm is not None else ratio, total, key, math.floor)
    else:
        count = min(int(0.03 * total), 100)
        recipe.carry("train.warmup_steps", count, key)
        recipe.notes.append("warmup_steps unset: axolotl's default, 3 % of the steps (at most 100)")
    if count == 1:
        recipe.carry("train.warmup_steps", min(2, total), key)
        recipe.notes.append(f"{key}: one warmup step, which axolotl's trainer builder raises to two")


def _memory(recipe: Recipe) -> None:
    """The optimizer, activation checkpointing and offloading, FSDP, and the collectives' timeout."""
    raw = recipe.raw
    (optimizer_key,) = axis_keys("axolotl", "optimizer")
    optimizer(recipe, optimizer_key, raw.get(optimizer_key) or "adamw_torch_fused")
    (checkpointing_key,) = axis_keys("axolotl", "activation_checkpointing")
    checkpointing_and_offloading(recipe, checkpointing_key, raw.get(checkpointing_key))
    fsdp_memory(recipe)
    if raw.get("ddp_timeout"):
        timeout = number(recipe, "ddp_timeout", raw["ddp_timeout"], integer=False, low=1, high=7 * 86400)
        if timeout:
            recipe.carry("distributed.collective_timeout_s", timeout, "ddp_timeout")


def _lora(recipe: Recipe) -> None:
    """The adapter's rank, alpha, dropout, targets and peft options; LoRA variants tunegrid does not train are
    refused."""
    raw = recipe.raw
    _carry_numbers(recipe, LORA_NUMBERS)
    _lora_targets(recipe)
    fan_in_fan_out(recipe, "lora_fan_in_fan_out")
    unfrozen_parameters(recipe)
    for key in LORA_EXTRAS:
        if raw.get(key):
            recipe.refuse(key, "tunegrid trains peft's LoRA (r/alpha/dropout/targets, modules_to_save, rsLoRA, DoRA)")
    lora_options(recipe, LORA_OPTIONS)


def _lora_targets(recipe: Recipe) -> None:
    """The named modules, `lora_target_linear` (every linear layer, plus the named ones axolotl adds to them) and
    `lora_target_parameters`."""
    raw = recipe.raw
    lora_targets(recipe, "lora_target_modules", raw.get("lora_target_modules"))
    if raw.get("lora_target_linear"):
        _linear_targets(recipe)
    if raw.get("lora_target_parameters"):
        recipe.carry("lora.target_parameters", list(raw["lora_target_parameters"]), "lora_target_parameters")
    if "lora.target_modules" not in recipe.settings:
        if raw.get("lora_target_parameters"):  # axolotl passes no modules: only the parameters get adapters
            recipe.carry("lora.target_modules", [], "lora_target_modules", "lora_target_parameters")
        else:
            recipe.differs["lora_target_modules"] = (
                "unset: peft picks its default modules for the architecture; tunegrid adapts the attention and MLP "
                "projections (lora.target_modules in the study says which)"
            )


def _linear_targets(recipe: Recipe) -> None:
    named = recipe.raw.get("lora_target_modules")
    named = [named] if isinstance(named, str) else list(named or [])
    lora_targets(recipe, "lora_target_linear", "all-linear")
    targets = recipe.settings["lora.target_modules"]
    extra = [m for m in named if m not in targets and m != "all-linear"]
    if extra and targets != ["all-linear"]:  # axolotl adds the named modules to the linear ones (lm_head)
        recipe.carry("lora.target_modules", sorted({*targets, *extra}), "lora_target_linear", "lora_target_modules")
    elif extra:
        recipe.differs["lora_target_modules"] = (
            f"{extra} beside lora_target_linear: axolotl adapts them too; peft's all-linear (resolved when the "
            "checkpoint is fetched) leaves the output head out; add them to lora.target_modules once resolved"
        )


def _padding(recipe: Recipe) -> None:
    """Sample packing, and how the batches are padded without it."""
    raw = recipe.raw
    packing = bool(raw.get("sample_packing"))
    recipe.carry("data.packing", packing, "sample_packing", "sample_packing_seq_len_multiplier")
    if raw.get("pad_to_sequence_len"):  # tunegrid's rows are train.seq_len wide, packed or not: carried as it is
        recipe.carry("train.seq_len", recipe.settings["train.seq_len"], "pad_to_sequence_len")
        recipe.notes.append("pad_to_sequence_len: every batch padded to train.seq_len, as tunegrid's cells pad "
                            "every row (it decides the peak)")  # fmt: skip
    elif not packing:  # axolotl's DataCollatorForSeq2Seq pads to the batch's longest (core/builders/causal.py)
        unset = raw.get("pad_to_sequence_len") is None
        recipe.differs["pad_to_sequence_len"] = (
            f"{'unset' if unset else 'false'}, without sample_packing: axolotl pads each batch to its longest "
            f"sequence{' (rounded up to a multiple of 64)' if unset else ''}; {PADDED}"
        )


def _precision(recipe: Recipe) -> None:
    """bf16 / fp16 as the precision axis; `bfloat16` turns bf16 on as well (axolotl's trainer builder trains with
    `bf16 or bfloat16`), and `float16` alone stores the weights in fp16 with no mixed precision."""
    raw = recipe.raw
    bf16_key, fp16_key = axis_keys("axolotl", "precision")
    bf16, keys = raw.get(bf16_key), (bf16_key, fp16_key)
    if raw.get("bfloat16") and bf16 is not True:
        bf16, keys = True, ("bfloat16", bf16_key, fp16_key)
    elif raw.get("float16") and not (bf16 or raw.get(fp16_key)):
        recipe.differs["float16"] = (
            "true, with fp16 and bf16 off: axolotl loads the base weights in float16 and trains without mixed "
            "precision (peft's default keeps the adapters in fp32); the study's fp32 cell holds the base in fp32 "
            "(twice its weight memory, fp32 arithmetic); the grid's fp16 cells are the nearest"
        )
    precision_flags(recipe, bf16, raw.get(fp16_key), keys)


def _attention(recipe: Recipe) -> None:
    """`attn_implementation` (or axolotl's older switches) as the model's attention implementation."""
    raw = recipe.raw
    name = raw.get("attn_implementation")
    keys = ["attn_implementation"] if name else []
    for flag, implementation in ATTENTION_FLAGS.items():
        if raw.get(flag) and not name:
            name, keys = implementation, [flag]
            if flag == "xformers_attention":
                recipe.differs[flag] = "xformers' memory-efficient attention; tunegrid runs torch's sdpa (the same "
                "memory-efficient kernel family)"
    if not name:
        return
    if name == "xformers":
        recipe.differs[keys[0]] = "xformers' memory-efficient attention; tunegrid runs torch's sdpa (the same "
        "memory-efficient kernel family)"
        name = "sdpa"
    if name not in ATTENTION_NAMES:
        recipe.refuse(
            keys[0], f"{name!r} is not an attention implementation tunegrid loads ({sorted(ATTENTION_NAMES)})"
        )
        return
    recipe.carry("model.attn_implementation", name, *keys)
