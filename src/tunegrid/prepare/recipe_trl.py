"""TRL's SFT arguments (the flat YAML/JSON `trl sft --config` reads: ScriptArguments + ModelConfig +
SFTConfig) and Transformers' TrainingArguments as tunegrid settings.

Key names and defaults as trl 1.16.0 (trl/trainer/sft_config.py, trl/trainer/model_config.py,
trl/scripts/utils.py) and transformers 5.23.0 (transformers/training_args.py) define them. SFTConfig's
own defaults differ from TrainingArguments' (bf16 unless fp16, activation checkpointing on, lr 2e-5,
max_length 1024), so the tool the file is read as matters; the command says which it assumed.
"""

from __future__ import annotations

from typing import Any

from tunegrid.prepare.recipe import (
    Recipe,
    axis_keys,
    first_record,
    local_dataset,
    lora_targets,
    model_entry,
    optimizer,
    precision_flags,
    quantization,
    scheduler,
    warmup,
)

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
    "router_aux_loss_coef",
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
SILENT = "does not bear on the failures tunegrid reproduces (output, logging, evaluation, saving, hub, reporting)"


def detect_tool(raw: dict[str, Any]) -> str:
    """axolotl names its model `base_model`; TRL's `trl sft --config` files carry ModelConfig/ScriptArguments/
    SFTConfig keys; anything else is read as Transformers' TrainingArguments."""
    if "base_model" in raw:
        return "axolotl"
    return "trl" if TRL_ONLY_KEYS & set(raw) else "transformers"


def _get(recipe: Recipe, key: str) -> Any:
    return recipe.raw[key] if key in recipe.raw else DEFAULTS[recipe.tool].get(key)


def read_trl(recipe: Recipe, steps: int | None, seq_len: int | None) -> None:
    raw, tool = recipe.raw, recipe.tool
    model_entry(
        recipe, "model_name_or_path", raw.get("model_name_or_path"), "model_revision", raw.get("model_revision")
    )
    recipe.carry("model.trust_remote_code", bool(raw.get("trust_remote_code")), "trust_remote_code")
    for key in ("deepspeed", "fsdp", "fsdp_config", "parallelism_config"):
        if raw.get(key):
            recipe.refuse(key, "tunegrid runs each rank as its own DDP process; it cannot shard the model like this")
    if tool == "trl" and not raw.get("use_peft"):
        recipe.refuse("use_peft", "without use_peft TRL fine-tunes every weight; tunegrid trains LoRA adapters")
    recipe.carry("adapter", "lora", "use_peft")
    quantization(
        recipe, bool(raw.get("load_in_4bit")), bool(raw.get("load_in_8bit")), raw.get("bnb_4bit_quant_type"),
        ["load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"],
    )  # fmt: skip
    if "use_bnb_nested_quant" in raw and not raw["use_bnb_nested_quant"]:
        recipe.notes.append("use_bnb_nested_quant: false; tunegrid's nf4 double-quantizes (nested)")
    bf16_key, fp16_key = axis_keys(tool, "precision")
    bf16 = raw.get(bf16_key)
    if tool == "trl" and bf16 is None:
        bf16 = not raw.get(fp16_key)  # SFTConfig: bf16 unless fp16 is set
    precision_flags(recipe, bf16, raw.get(fp16_key), (bf16_key, fp16_key))
    recipe.drop("dtype", "the storage dtype follows the precision in tunegrid")
    recipe.drop("use_cpu", "tunegrid trains on the device it finds (the probe records it)")

    (batch_key,), (accum_key,) = axis_keys(tool, "batch_size"), axis_keys(tool, "grad_accum")
    (seed_key,) = axis_keys(tool, "seed")
    recipe.carry("grid.batch_size", int(_get(recipe, batch_key)), batch_key)
    recipe.carry("grid.grad_accum", int(raw.get(accum_key) or 1), accum_key)
    recipe.carry("grid.seed", int(_get(recipe, seed_key)), seed_key)
    length = seq_len or _get(recipe, "max_length")
    if not length:
        recipe.need("max_length", "TrainingArguments holds no sequence length; pass --seq-len")
    else:
        recipe.carry("train.seq_len", int(length), "max_length")
    total = int(raw.get("max_steps") or -1)
    total = total if total > 0 else (steps or 50)
    recipe.carry("train.steps", total, "max_steps")
    if int(raw.get("max_steps") or -1) <= 0:
        recipe.not_carried["num_train_epochs"] = f"tunegrid trains {total} steps per cell (--steps), not epochs"
    recipe.carry("train.lr", float(_get(recipe, "learning_rate")), "learning_rate")
    recipe.carry("train.weight_decay", float(raw.get("weight_decay") or 0.0), "weight_decay")
    recipe.carry("train.max_grad_norm", float(raw.get("max_grad_norm", 1.0)), "max_grad_norm")
    kwargs = raw.get("lr_scheduler_kwargs") or {}
    scheduler(
        recipe, "lr_scheduler_type", _get(recipe, "lr_scheduler_type"), kwargs.get("min_lr_rate"), "lr_scheduler_kwargs"
    )
    warmup(recipe, raw.get("warmup_steps") or raw.get("warmup_ratio") or 0, total, "warmup_steps")
    (optimizer_key,) = axis_keys(tool, "optimizer")
    optimizer(recipe, optimizer_key, _get(recipe, optimizer_key))
    for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        recipe.drop(key, "tunegrid's AdamW keeps torch's betas (0.9, 0.999) and eps 1e-8")
    new_key, old_key = axis_keys(tool, "activation_checkpointing")
    checkpointing = raw.get(new_key, raw.get(old_key, _get(recipe, old_key)))
    recipe.carry("train.gradient_checkpointing", bool(checkpointing), old_key, new_key)
    recipe.carry("distributed.collective_timeout_s", float(_get(recipe, "ddp_timeout")), "ddp_timeout")

    if tool == "trl":
        recipe.carry("lora.r", int(_get(recipe, "lora_r")), "lora_r")
        recipe.carry("lora.alpha", float(_get(recipe, "lora_alpha")), "lora_alpha")
        recipe.carry("lora.dropout", float(_get(recipe, "lora_dropout")), "lora_dropout")
        lora_targets(recipe, "lora_target_modules", raw.get("lora_target_modules"))
        if "lora.target_modules" not in recipe.settings:
            lora_targets(recipe, "lora_target_modules", "all-linear")
            recipe.notes.append(
                "lora_target_modules unset: peft picks per architecture; tunegrid names the projections"
            )
        if raw.get("lora_target_parameters"):
            recipe.carry("lora.target_parameters", list(raw["lora_target_parameters"]), "lora_target_parameters")
        for key in ("use_dora", "use_rslora", "lora_modules_to_save"):
            if raw.get(key):
                recipe.refuse(key, "tunegrid trains plain LoRA (peft LoraConfig r/alpha/dropout/targets)")
        recipe.carry("data.packing", bool(_get(recipe, "packing")), "packing")
        if raw.get("packing") and raw.get("packing_strategy") == "wrapped":
            recipe.notes.append("packing_strategy wrapped: tunegrid packs whole examples (as bfd does)")
    _dataset(recipe)
    recipe.account_rest(SILENT)


def _dataset(recipe: Recipe) -> None:
    raw = recipe.raw
    found = None
    if raw.get("datasets"):
        entries = raw["datasets"] if isinstance(raw["datasets"], list) else [raw["datasets"]]
        for index in range(1, len(entries)):
            recipe.refuse(f"datasets.{index}", "tunegrid trains each cell on one dataset (the first)")
        entry = entries[0] if isinstance(entries[0], dict) else {}
        files = entry.get("data_files")
        files = files[0] if isinstance(files, list) and len(files) == 1 else files
        if isinstance(files, str):
            found = local_dataset(recipe, "datasets.0.data_files", files, entry.get("path"))
        if found is None:
            recipe.need("datasets.0", "give a local JSON-lines or parquet file (data_files) or pass --dataset")
            return
        recipe.carry("data.dataset", dict(entry), "datasets")
    elif raw.get("dataset_name"):
        found = local_dataset(recipe, "dataset_name", str(raw["dataset_name"]))
        if found is None:
            recipe.need(
                "dataset_name",
                f"{raw['dataset_name']!r} is no local file, so a hub dataset, and TRL's arguments hold no revision "
                "to pin it: give a local JSON-lines or parquet file (dataset_name or --dataset)",
            )
            return
        recipe.carry("data.dataset", {"dataset_name": raw["dataset_name"]}, "dataset_name")
    else:
        recipe.need("dataset_name", "no dataset: give dataset_name (a local file) or pass --dataset")
        return
    record = first_record(found)
    text_field = raw.get("dataset_text_field") or "text"
    if "messages" in record:
        recipe.carry("data.fields", {"messages": "messages"}, "dataset_name")
        recipe.carry("data.loss_on", "response" if raw.get("assistant_only_loss") else "all", "assistant_only_loss")
    elif {"prompt", "completion"} <= set(record):
        recipe.carry("data.fields", {"prompt": "prompt", "response": "completion"}, "dataset_name")
        only = raw.get("completion_only_loss")
        recipe.carry("data.loss_on", "all" if only is False else "response", "completion_only_loss")
    else:
        recipe.need(
            "dataset_text_field",
            f"records with only a {text_field!r} text: tunegrid trains on prompt/completion pairs or messages",
        )
