"""Every key of a recipe in exactly one place: carried (with the value it became), not carried with the reason
of its family, run differently (it bears on memory or numerics and tunegrid runs without it: the header says
which way), refused (the key and what to do), or unknown (with the nearest known key).

`FAMILIES` is the one table of keys tunegrid does not take over and why; `APPROXIMATED` the keys that bear on
memory or numerics and that the study runs without, each with what that does to the measurement; `REFUSED`
the keys that, when set, make the recipe another run than any tunegrid cell. Names as axolotl 0.18.0
(src/axolotl/utils/schemas/) and trl 1.16.0 / transformers 5.23.0 (their dataclasses) define them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tunegrid.recipes.core import Recipe
from tunegrid.recipes.header_rows import TOKENIZER_ROWS, adam_default
from tunegrid.recipes.loss_keys import CCE_PLUGIN, LOSS_KEYS, fused_loss
from tunegrid.recipes.releases import misspelt, releases_text, tool_keys


@dataclass(frozen=True)
class KeyFamily:
    name: str
    reason: str
    keys: frozenset[str]
    prefixes: tuple[str, ...] = ()

    def holds(self, key: str) -> bool:
        return key in self.keys or key.startswith(self.prefixes)


def _family(name: str, reason: str, keys: str, prefixes: tuple[str, ...] = ()) -> KeyFamily:
    return KeyFamily(name, reason, frozenset(keys.split()), prefixes)


FAMILIES = (
    _family(
        "logging/output",
        "logging and output locations: tunegrid writes its own records (metrics.jsonl, MLflow) under results/",
        "output_dir logging_steps logging_first_step logging_strategy logging_dir log_level log_on_each_node "
        "report_to run_name use_wandb use_tensorboard use_mlflow use_comet use_otel_metrics debug "
        "disable_tqdm overwrite_output_dir log_completions include_tokens_per_second include_num_input_tokens_seen "
        "logging_nan_inf_filter",
        ("wandb_", "swanlab_", "trackio_", "mlflow_", "comet_", "otel_metrics_", "use_swanlab"),
    ),
    _family(
        "config checking",
        "how strictly the tool checks its own config; tunegrid accounts for every key itself (this header)",
        "strict",
    ),
    _family(
        "hub upload",
        "hub upload and authentication: tunegrid uploads nothing and reads a token from HF_TOKEN only",
        "hub_model_id hub_strategy hub_token hub_private_repo push_to_hub push_dataset_to_hub hf_use_auth_token "
        "hub_revision hub_always_push",
    ),
    _family(
        "evaluation",
        "evaluation between training steps: tunegrid's cells train only (the peak they measure is the training step's)",
        "val_set_size evals_per_epoch eval_steps eval_strategy evaluation_strategy do_eval do_train eval_batch_size "
        "per_device_eval_batch_size eval_sample_packing eval_table_size eval_max_new_tokens eval_causal_lm_metrics "
        "do_causal_lm_eval dataset_test_split eval_packing eval_on_start load_best_model_at_end "
        "metric_for_best_model greater_is_better early_stopping_patience test_datasets prediction_loss_only "
        "eval_accumulation_steps loss_watchdog_threshold loss_watchdog_patience",
    ),
    _family(
        "saving",
        "checkpoint saving and resuming: each cell trains from the base weights (the failure shows in its first "
        "steps) and saves its adapter once",
        "saves_per_epoch save_steps save_strategy save_total_limit save_only_model save_safetensors "
        "auto_resume_from_checkpoints save_first_step hub_model_revision resume_from_checkpoint",
    ),
    _family(
        "data preparation",
        "data preparation (caching, workers, shuffling): the dataset rule writes the records once and cells read "
        "them in the order of the cell's seed",
        "dataset_prepared_path skip_prepare_dataset dataset_num_proc dataset_processes preprocessing_num_workers "
        "dataset_exact_deduplication shuffle_merged_datasets shuffle_before_merging_datasets remove_unused_columns "
        "dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor dataloader_drop_last "
        "dataset_streaming streaming streaming_multipack_buffer_size group_by_length sample_packing_eff_est "
        "total_num_tokens sample_packing_sequentially curriculum_sampling dataset_kwargs shuffle_dataset "
        "dataset_keep_in_memory",
    ),
    _family(
        "tokenizer",
        "tokenizer and chat template: tunegrid uses the checkpoint's own tokenizer and its chat template",
        "tokenizer_type tokenizer_config tokenizer_use_fast tokenizer_legacy tokenizer_use_mistral_common "
        "tokenizer_name_or_path eot_tokens chat_template chat_template_path chat_template_jinja "
        "model_type eos_token added_tokens_overrides resize_token_embeddings_to_32x chat_template_kwargs "
        "tokenizer_save_jinja_files tokenizer_padding_side",
    ),
    _family(
        "download",
        "download filters and loading placement: the checkpoint rule fetches safetensors and the cell loads on "
        "its device",
        "base_model_ignore_patterns low_cpu_mem_usage device_map experimental_skip_move_to_device torchdistx_path "
        "use_cpu",
    ),
    _family(
        "launcher",
        "the launcher's own settings: tunegrid starts one process per rank itself (the world_size axis)",
        "local_rank accelerator_config use_ray ray_num_workers ray_run_name ddp_find_unused_parameters "
        "ddp_bucket_cap_mb ddp_broadcast_buffers ddp_backend",
    ),
    _family(
        "storage dtype",
        "the storage dtype follows the precision in tunegrid (grid.precision)",
        "dtype torch_dtype bfloat16 float16 float32",
    ),
)

# keys that bear on memory or numerics, that tunegrid's cells run without, and what that does to a measurement
APPROXIMATED = {
    "plugins:LigerPlugin": "Liger's fused kernels keep fewer activations; tunegrid's cells run the model's own "
    "modules (a higher peak, the same arithmetic up to rounding)",
    "plugins:KernelsPlugin": "hub kernels (fused MoE / norms) replace the model's modules; tunegrid's cells run "
    "the model's own (the same arithmetic up to rounding, another peak)",
    "flash_attn_cross_entropy": "a fused loss kernel; tunegrid's cells compute the plain cross entropy",
    "liger_rope": "a fused kernel; tunegrid's cells run the model's own module (a higher peak)",
    "liger_rms_norm": "a fused kernel; tunegrid's cells run the model's own module (a higher peak)",
    "liger_rms_norm_gated": "a fused kernel; tunegrid's cells run the model's own module (a higher peak)",
    "liger_glu_activation": "a fused kernel; tunegrid's cells run the model's own module (a higher peak)",
    "liger_layer_norm": "a fused kernel; tunegrid's cells run the model's own module (a higher peak)",
    "lora_mlp_kernel": "axolotl's fused LoRA kernels save fewer activations; tunegrid runs peft's LoRA",
    "lora_qkv_kernel": "axolotl's fused LoRA kernels save fewer activations; tunegrid runs peft's LoRA",
    "lora_o_kernel": "axolotl's fused LoRA kernels save fewer activations; tunegrid runs peft's LoRA",
    "flash_attn_rms_norm": "a fused kernel; tunegrid's cells run the model's own module",
    "flash_attn_fuse_mlp": "a fused kernel; tunegrid's cells run the model's own module",
    "fused_attn_kernel": "a fused attention kernel; tunegrid's cells run the model's attention implementation",
    "flash_optimum": "BetterTransformer attention; tunegrid's cells run the model's attention implementation",
    "use_kernels": "hub kernels replace the model's modules; tunegrid's cells run the model's own",
    "use_scattermoe": "a fused MoE kernel; tunegrid's cells run the model's own experts (another peak)",
    "use_sonicmoe": "a fused MoE kernel; tunegrid's cells run the model's own experts (another peak)",
    "experts_implementation": "an experts kernel choice; tunegrid's cells run transformers' default",
    "llama4_linearized_experts": "experts as separate linears; tunegrid's cells run the checkpoint's layout",
    "use_dsv4_kernels": "model-specific kernels; tunegrid's cells run the model's own modules",
    "use_glm_dsa_kernels": "model-specific kernels; tunegrid's cells run the model's own modules",
    "gemma4_hybrid_attn_impl": "a per-layer attention choice; tunegrid's cells run one implementation",
    "flex_attn_compile_kwargs": "flex attention's compile options; tunegrid's cells run eager attention kernels",
    "tiled_mlp": "tiled MLP computes in chunks (a lower peak); tunegrid's cells run the whole MLP at once",
    "torch_compile": "a compiled graph (another peak, fused arithmetic); tunegrid's cells run eagerly",
    "torch_compile_mode": "a compiled graph; tunegrid's cells run eagerly",
    "torch_compile_backend": "a compiled graph; tunegrid's cells run eagerly",
    "tf32": "TF32 matmuls (a 10-bit mantissa on GPUs that have it); tunegrid's fp32 cells multiply in full fp32",
    "gradient_checkpointing_kwargs": "checkpointing options (reentrant or not); tunegrid checkpoints each "
    "decoder layer non-reentrantly (the same activations kept)",
    "adam_beta1": "tunegrid's AdamW keeps torch's betas (0.9, 0.999) and eps 1e-8",
    "adam_beta2": "tunegrid's AdamW keeps torch's betas (0.9, 0.999) and eps 1e-8",
    "adam_epsilon": "tunegrid's AdamW keeps torch's betas (0.9, 0.999) and eps 1e-8",
    "adam_eps": "tunegrid's AdamW keeps torch's betas (0.9, 0.999) and eps 1e-8",
    "cosine_constant_lr_ratio": "a constant phase in the cosine schedule; tunegrid runs the plain cosine",
    "lr_quadratic_warmup": "a quadratic warmup; tunegrid warms up linearly",
    "eta_min": "the schedule's floor; tunegrid's cosine decays to 0 unless cosine_min_lr_ratio says otherwise",
    "max_packed_sequence_len": "an older packing length; tunegrid packs up to train.seq_len",
    "fsdp": "the recipe shards the model across ranks; tunegrid's ranks hold all of it (DDP): a peak measured here "
    "is the unsharded one (the same at one rank)",
    "fsdp_config": "the recipe shards the model across ranks; tunegrid's ranks hold all of it (DDP): a peak "
    "measured here is the unsharded one (the same at one rank; its activation checkpointing and parameter "
    "offloading are carried)",
    "fsdp_version": "the recipe shards the model across ranks; tunegrid's ranks hold all of it (DDP)",
    "dp_shard_size": "the recipe shards the model across ranks; tunegrid's ranks hold all of it (DDP)",
    "deepspeed": "the recipe shards states across ranks (ZeRO); tunegrid's ranks hold all of them (DDP): a peak "
    "measured here is the unsharded one",
    "deepcompile": "DeepSpeed's compiler; tunegrid's ranks run DDP eagerly",
    "dp_replicate_size": "the recipe's replica count; the world_size axis says tunegrid's",
    "ddp": "the recipe's launcher switch; the world_size axis says tunegrid's",
    "parallelism_config": "accelerate's parallelism layout; tunegrid's ranks run DDP (the world_size axis)",
    "label_smoothing_factor": "a smoothed loss; tunegrid computes the plain cross entropy",
    "padding_free": "padding-free batches; tunegrid pads each batch (or packs with data.packing)",
    "pad_to_multiple_of": "padding to a multiple; tunegrid pads every sequence to train.seq_len",
    "truncation_mode": "where long examples are cut; tunegrid keeps the first train.seq_len tokens",
    "neftune_noise_alpha": "noise on the embeddings; tunegrid's cells add none",
}

# keys that, when set (truthy), make another run than any tunegrid cell: refused naming the key
REFUSED = {
    "gptq": "a GPTQ-quantized base: tunegrid loads bitsandbytes quantizations (grid.quant); give the unquantized "
    "base with load_in_4bit / load_in_8bit",
    "gptq_model_v1": "a GPTQ-quantized base: tunegrid loads bitsandbytes quantizations (grid.quant)",
    "gptq_groupsize": "a GPTQ-quantized base: tunegrid loads bitsandbytes quantizations (grid.quant)",
    "gptq_disable_exllama": "a GPTQ-quantized base: tunegrid loads bitsandbytes quantizations (grid.quant)",
    "model_quantization_config": "a non-bitsandbytes quantization of the base; tunegrid loads bitsandbytes "
    "quantizations (grid.quant)",
    "model_quantization_config_kwargs": "a non-bitsandbytes quantization of the base; tunegrid loads bitsandbytes "
    "quantizations (grid.quant)",
    "qat": "quantization-aware training; tunegrid trains LoRA over a frozen (optionally bitsandbytes) base",
    "fp8": "fp8 training; tunegrid's precisions are fp32, bf16 and the fp16 family (grid.precision)",
    "fp8_enable_fsdp_float8_all_gather": "fp8 training; tunegrid's precisions are fp32, bf16 and the fp16 family",
    "llmcompressor": "a compressed (sparse/quantized) base; tunegrid loads bitsandbytes quantizations",
    "use_onebitllms": "a 1-bit base; tunegrid loads bitsandbytes quantizations",
    "nvfp4_merge_aware": "an nvfp4 base; tunegrid loads bitsandbytes quantizations",
    "dsv4_fp4_grouped_mode": "an fp4 base; tunegrid loads bitsandbytes quantizations",
    "lora_model_dir": "starts from an existing adapter; tunegrid's cells start fresh adapters on the base",
    "overrides_of_model_config": "overrides the checkpoint's config.json; tunegrid loads the checkpoint's own",
    "model_init_kwargs": "extra loading arguments; tunegrid loads the checkpoint with its own settings",
    "s2_attention": "shifted sparse attention; tunegrid's cells run the model's attention implementation",
    "sequence_parallel_degree": "splits each sequence across ranks; tunegrid's ranks each hold whole sequences",
    "context_parallel_size": "splits each sequence across ranks; tunegrid's ranks each hold whole sequences",
    "tensor_parallel_size": "splits each layer across ranks; tunegrid's ranks each hold the whole model",
    "expert_parallel_size": "splits the experts across ranks; tunegrid's ranks each hold the whole model",
    "lisa_n_layers": "trains a rotating subset of layers; tunegrid trains LoRA adapters",
    "use_eaft": "another training loss; tunegrid trains with the plain next-token cross entropy",
    "freeze_mm_modules": "a multimodal model; tunegrid trains text-only causal LMs",
    "processor_type": "a multimodal processor; tunegrid trains text-only causal LMs on text records",
    "image_size": "a multimodal model; tunegrid trains text-only causal LMs",
    "loftq_config": "LoftQ, as no key of this tool: set the study's lora.loftq_bits (peft's LoftQ; axolotl's "
    "peft.loftq_config is carried so)",
    "init_lora_weights": "another adapter initialization; tunegrid initializes peft's LoRA plainly",
}
# what one of these keys is when it is set to something else than it would be anyway (off/empty/1)
PLUGIN_FAMILY = {"SwanLabPlugin": "logging/output"}


def known_keys(extra: set[str]) -> set[str]:
    """Every key this table or a reader knows (the reader's own keys passed in)."""
    names = {k for family in FAMILIES for k in family.keys} | set(APPROXIMATED) | set(REFUSED) | LOSS_KEYS | extra
    names |= set(TOKENIZER_ROWS)
    return {k.split(":")[0] for k in names}


def family_of(key: str) -> KeyFamily | None:
    return next((family for family in FAMILIES if family.holds(key)), None)


def check_tables(recipe: Recipe) -> None:
    """Refuse the REFUSED keys that are set, note the APPROXIMATED ones (plugins one by one), and carry the loss
    kernels that never hold the full logits (recipes.loss_keys)."""
    raw = recipe.raw
    for key, why in REFUSED.items():
        if _is_set(raw.get(key)):
            recipe.refuse(key, why)
    for key, why in {**APPROXIMATED, **TOKENIZER_ROWS}.items():
        if ":" in key or not _is_set(raw.get(key)):
            continue
        if adam_default(key, raw[key]):  # the recipe spells out the value tunegrid trains with anyway
            recipe.not_carried[key] = f"{raw[key]:g}: torch AdamW's own value, the one tunegrid's optimizers keep"
        else:
            recipe.differs[key] = why
    plugins = raw.get("plugins") or []
    if plugins and not isinstance(plugins, list):
        recipe.refuse("plugins", "a list of plugin class paths")
        return
    for plugin in plugins if isinstance(plugins, list) else []:
        name = str(plugin).rsplit(".", 1)[-1]
        if name == CCE_PLUGIN:  # carried as train.loss: chunked (recipes.loss_keys)
            continue
        if f"plugins:{name}" in APPROXIMATED:
            recipe.differs[f"plugins: {name}"] = APPROXIMATED[f"plugins:{name}"]
        elif name in PLUGIN_FAMILY:
            recipe.not_carried[f"plugins: {name}"] = family_reason(PLUGIN_FAMILY[name])
        else:
            recipe.refuse("plugins", f"{plugin!r} is a plugin tunegrid does not know what it changes; remove it")
    if plugins:
        recipe.accounted.add("plugins")
    fused_loss(recipe)


def family_reason(name: str) -> str:
    return next(family.reason for family in FAMILIES if family.name == name)


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", [], {}, 0, 1, "none", "None") or value is True


def account_rest(recipe: Recipe, reader_keys: set[str]) -> None:
    """Every top-level key neither carried, refused, ignored nor listed: its family's reason, else unknown
    with the nearest known key. A key near one tunegrid carries and the recipe lacks is refused (a typo
    would otherwise leave the setting at its default silently)."""
    used = {k.split(".")[0] for keys in recipe.origin.values() for k in keys} | recipe.accounted
    listed = {k.split(".")[0].split(":")[0] for k in (*recipe.not_carried, *recipe.differs, *recipe.ignored)}
    refused = {line.split("'")[1].split(".")[0] for line in recipe.refused if line.startswith("recipe key '")}
    known = known_keys(reader_keys)
    for key in recipe.raw:
        if key in used or key in listed or key in refused:
            continue
        family = family_of(key)
        if family is not None:
            recipe.not_carried[key] = family.reason
            continue
        if key in known:  # a key a reader knows and left at a value that changes nothing (off, empty)
            recipe.not_carried[key] = "set to its default (off or empty): nothing to carry"
            continue
        releases = releases_text(recipe.tool, key)
        if releases:  # a key of the tool, in this release or another, that tunegrid does not read
            recipe.not_carried[key] = f"a key of {releases} that does not change the run tunegrid measures"
            continue
        near = misspelt(key, known | tool_keys(recipe.tool))
        if near and near in reader_keys and near not in recipe.raw:
            recipe.refuse(key, f"unknown key; did you mean {near!r}? (tunegrid would otherwise use its default for it)")
        else:
            hint = f"; a misspelling of {near!r}?" if near else ""
            recipe.unknown[key] = f"not a key of any {recipe.tool} release tunegrid knows{hint}"


def number(recipe: Recipe, key: str, value: Any, *, integer: bool, low: float, high: float, default: Any = None) -> Any:
    """A recipe's number, checked as a study file's are: finite, of its type, within bounds; else refused
    naming the recipe key (and `default` returned so the reading goes on)."""
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok and integer and isinstance(value, float):
        ok = value.is_integer()
    if not ok:
        kind = "an integer" if integer else "a finite number"
        recipe.need(key, f"{value!r} is not {kind}; give {kind} in [{low:g}, {high:g}]")
        return default
    if not low <= value <= high:
        recipe.need(key, f"{value!r} is outside [{low:g}, {high:g}] (what tunegrid can run)")
        return default
    return int(value) if integer else float(value)


def lora_options(recipe: Recipe, options: dict[str, str]) -> None:
    """peft LoraConfig options the recipe sets (modules_to_save, rsLoRA, DoRA) as the study's lora.* keys."""
    for key, path in options.items():
        value = recipe.raw.get(key)
        if value in (None, False, [], ""):
            continue
        if path.endswith("modules_to_save"):
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                recipe.need(key, f"{value!r}: a list of module names (peft's modules_to_save)")
                continue
            recipe.carry(path, list(names), key)
        elif value is True:
            recipe.carry(path, True, key)
        else:
            recipe.need(key, f"{value!r}: true or false")


def config_overrides(recipe: Recipe, key: str) -> None:
    """The recipe's overrides of the checkpoint's config.json (scalars), loaded with the model."""
    value = recipe.raw.get(key)
    if value in (None, {}):
        return
    scalars = isinstance(value, dict) and all(
        isinstance(v, (bool, int, float, str)) and (not isinstance(v, float) or math.isfinite(v))
        for v in value.values()
    )
    if not scalars:
        recipe.refuse(key, f"{value!r}: tunegrid loads config.json values given as a mapping of scalars")
        return
    recipe.carry("model.config_overrides", dict(value), key)
