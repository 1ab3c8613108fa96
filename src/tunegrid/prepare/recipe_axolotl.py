"""An axolotl config (the YAML `axolotl train` reads) as tunegrid settings.

Key names and defaults as axolotl 0.18.0 documents them (src/axolotl/utils/schemas/: config.py, model.py,
peft.py, training.py, datasets.py; the 4-bit defaults of src/axolotl/loaders/model.py).
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
    quant_of,
    quantization,
    scheduler,
    warmup,
)

# keys that change how training is distributed or sharded: tunegrid's cells run one process per rank (DDP)
PARALLEL = ("deepspeed", "fsdp", "fsdp_config", "fsdp_version", "deepcompile")
DEGREES = ("sequence_parallel_degree", "context_parallel_size", "tensor_parallel_size", "dp_shard_size")
# LoRA variants and extras tunegrid's plain peft LoRA does not train
LORA_EXTRAS = ("peft_use_dora", "peft_use_rslora", "lora_modules_to_save", "loraplus_lr_ratio", "relora")
SILENT = "does not bear on the failures tunegrid reproduces (output, logging, evaluation, saving, hub)"


def read_axolotl(recipe: Recipe, steps: int | None, seq_len: int | None) -> None:
    raw = recipe.raw
    model_entry(recipe, "base_model", raw.get("base_model"), "revision_of_model", raw.get("revision_of_model"))
    recipe.carry("model.trust_remote_code", bool(raw.get("trust_remote_code")), "trust_remote_code")
    for key in PARALLEL:
        if raw.get(key):
            recipe.refuse(key, "tunegrid runs each rank as its own DDP process; it cannot shard the model like this")
    for key in DEGREES:
        if (raw.get(key) or 1) > 1:
            recipe.refuse(key, "tunegrid's ranks each hold the whole model (data parallel only)")
    adapter = raw.get("adapter")
    if adapter not in ("lora", "qlora"):
        recipe.refuse("adapter", f"{adapter!r}: tunegrid trains LoRA adapters (adapter: lora or qlora)")
    recipe.carry("adapter", adapter, "adapter")
    bnb = raw.get("bnb_config_kwargs") or {}
    four = bool(raw.get("load_in_4bit")) or adapter == "qlora"
    quant_type = bnb.get("bnb_4bit_quant_type", "nf4")
    quantization(
        recipe, four, bool(raw.get("load_in_8bit")), quant_type,
        ["load_in_4bit", "load_in_8bit", "adapter", "bnb_config_kwargs"],
    )  # fmt: skip
    experts = quant_of({"load_in_4bit": True, "bnb_4bit_quant_type": quant_type}, experts=True)
    if raw.get("quantize_moe_experts") and four and experts:
        recipe.carry("grid.quant", experts, "quantize_moe_experts")
    if bnb.get("bnb_4bit_use_double_quant") is False:
        recipe.notes.append("bnb_config_kwargs.bnb_4bit_use_double_quant: false; tunegrid's nf4 double-quantizes")
    bf16_key, fp16_key = axis_keys("axolotl", "precision")
    precision_flags(recipe, raw.get(bf16_key), raw.get(fp16_key), (bf16_key, fp16_key))
    for key in ("bfloat16", "float16", "float32"):
        recipe.drop(key, "the storage dtype follows the precision in tunegrid")

    (micro_key,), (accum_key,) = axis_keys("axolotl", "batch_size"), axis_keys("axolotl", "grad_accum")
    (seed_key,) = axis_keys("axolotl", "seed")
    micro = int(raw.get(micro_key) or 1)
    recipe.carry("grid.batch_size", micro, micro_key)
    recipe.carry("grid.grad_accum", int(raw.get(accum_key) or 1), accum_key)
    if raw.get("batch_size") and accum_key not in raw:
        recipe.carry("grid.grad_accum", max(1, int(raw["batch_size"]) // micro), "batch_size")
    recipe.carry("grid.seed", int(raw.get(seed_key) if raw.get(seed_key) is not None else 42), seed_key)
    recipe.carry("train.seq_len", int(seq_len or raw.get("sequence_len") or 512), "sequence_len")
    total = int(raw.get("max_steps") or 0) or steps or 50
    recipe.carry("train.steps", total, "max_steps")
    if not raw.get("max_steps"):
        recipe.not_carried["num_epochs"] = f"tunegrid trains {total} steps per cell (--steps), not epochs"
    if "learning_rate" in raw:
        recipe.carry("train.lr", float(raw["learning_rate"]), "learning_rate")
    recipe.carry("train.weight_decay", float(raw.get("weight_decay") or 0.0), "weight_decay")
    recipe.carry("train.max_grad_norm", float(raw.get("max_grad_norm") or 1.0), "max_grad_norm")
    scheduler(
        recipe, "lr_scheduler", raw.get("lr_scheduler") or "cosine", raw.get("cosine_min_lr_ratio"),
        "cosine_min_lr_ratio",
    )  # fmt: skip
    if raw.get("warmup_ratio") and not raw.get("warmup_steps"):
        warmup(recipe, float(raw["warmup_ratio"]), total, "warmup_ratio")
    else:
        warmup(recipe, raw.get("warmup_steps") or 0, total, "warmup_steps")
    (optimizer_key,) = axis_keys("axolotl", "optimizer")
    optimizer(recipe, optimizer_key, raw.get(optimizer_key) or "adamw_torch_fused")
    for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        recipe.drop(key, "tunegrid's AdamW keeps torch's betas (0.9, 0.999) and eps 1e-8")
    (checkpointing_key,) = axis_keys("axolotl", "activation_checkpointing")
    checkpointing = raw.get(checkpointing_key)
    if checkpointing not in (None, True, False):
        recipe.refuse(checkpointing_key, f"{checkpointing!r}: tunegrid checkpoints activations or not (bool)")
    recipe.carry("train.gradient_checkpointing", bool(checkpointing), checkpointing_key)
    if raw.get("ddp_timeout"):
        recipe.carry("distributed.collective_timeout_s", float(raw["ddp_timeout"]), "ddp_timeout")

    recipe.carry("lora.r", int(raw.get("lora_r") or 8), "lora_r")
    recipe.carry("lora.alpha", float(raw.get("lora_alpha") or 16), "lora_alpha")
    recipe.carry("lora.dropout", float(raw.get("lora_dropout") or 0.0), "lora_dropout")
    lora_targets(recipe, "lora_target_modules", raw.get("lora_target_modules"))
    if raw.get("lora_target_linear") and "lora.target_modules" not in recipe.settings:
        lora_targets(recipe, "lora_target_linear", "all-linear")
    if raw.get("lora_target_parameters"):
        recipe.carry("lora.target_parameters", list(raw["lora_target_parameters"]), "lora_target_parameters")
    for key in LORA_EXTRAS:
        if raw.get(key):
            recipe.refuse(key, "tunegrid trains plain LoRA (peft LoraConfig r/alpha/dropout/targets)")
    recipe.carry("data.packing", bool(raw.get("sample_packing")), "sample_packing")
    recipe.carry("data.loss_on", "all" if raw.get("train_on_inputs") else "response", "train_on_inputs")
    _datasets(recipe, raw.get("datasets"))
    recipe.account_rest(SILENT)


def _datasets(recipe: Recipe, datasets: Any) -> None:
    if not datasets:
        recipe.need("datasets", "no dataset: give one local file or pinned hub dataset, or pass --dataset")
        return
    if not isinstance(datasets, list):
        datasets = [datasets]
    for index in range(1, len(datasets)):
        recipe.refuse(f"datasets.{index}", "tunegrid trains each cell on one dataset (the first)")
    entry, key = datasets[0], "datasets.0"
    if not isinstance(entry, dict) or not entry.get("path"):
        recipe.need(key, "a dataset entry needs a path (a local file or a hub id)")
        return
    recipe.carry("data.dataset", dict(entry), "datasets")
    found = local_dataset(recipe, f"{key}.path", str(entry.get("data_files") or entry["path"]), entry.get("ds_type"))
    if found is None and "data.source" not in recipe.settings:
        revision = str(entry.get("revision") or "")
        from tunegrid.prepare.recipe import HEX40

        if not HEX40.match(revision):
            recipe.need(
                f"{key}.revision",
                f"{entry['path']!r} is no local file (looked from here and beside the recipe), so it is a hub "
                "dataset, which needs a pinned 40-hex revision",
            )
            return
        if entry.get("name"):
            recipe.refuse(f"{key}.name", "tunegrid reads a hub dataset's default configuration")
        recipe.carry("data.source", "hub", f"{key}.path")
        recipe.carry("data.repo_id", entry["path"], f"{key}.path")
        recipe.carry("data.revision", revision, f"{key}.revision")
        recipe.carry("data.split", entry.get("split") or "train", f"{key}.split")
    kind = entry.get("type")
    record = first_record(found) if found is not None and kind is None else {}
    if kind is None and {"instruction", "output"} <= set(record):
        kind = "alpaca"
    elif kind is None and "prompt" in record and ({"response", "completion"} & set(record)):
        kind = {"field_instruction": "prompt", "field_output": "response" if "response" in record else "completion"}
    if kind == "chat_template" or (kind is None and "messages" in record):
        mapping = entry.get("message_property_mappings") or {}
        if any(mapping.get(k, k) != k for k in ("role", "content")):
            recipe.refuse(f"{key}.message_property_mappings", "tunegrid reads messages as {role, content}")
        recipe.carry("data.fields", {"messages": entry.get("field_messages") or "messages"}, f"{key}.type")
        if entry.get("roles_to_train") not in (None, ["assistant"]) and not recipe.raw.get("train_on_inputs"):
            recipe.notes.append(f"{key}.roles_to_train: tunegrid trains on assistant tokens (data.loss_on: response)")
    elif kind == "alpaca":
        recipe.carry("data.fields", {"prompt": "instruction", "response": "output"}, f"{key}.type")
        recipe.notes.append(
            f"{key}.type alpaca: prompt = instruction, response = output (an `input` field is not read)"
        )
    elif isinstance(kind, dict) and kind.get("field_instruction") and kind.get("field_output"):
        recipe.carry(
            "data.fields", {"prompt": kind["field_instruction"], "response": kind["field_output"]}, f"{key}.type"
        )
    else:
        recipe.refuse(
            f"{key}.type", f"{kind!r}: tunegrid reads chat_template, alpaca or {{field_instruction, field_output}}"
        )
