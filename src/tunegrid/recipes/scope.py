"""Whether a recipe is what tunegrid trains: supervised fine-tuning (SFT) of LoRA / QLoRA adapters.

A preference (DPO, ORPO, KTO, SimPO, APO), reinforcement (GRPO, PPO), reward-model, pretraining or full
fine-tune recipe is refused naming what makes it so, unless `--as-sft` asks for the SFT study tunegrid would
run instead; then each key that made it another kind of run is dropped (or, for a full fine-tune, adapters
added) and the header says so.
"""

from __future__ import annotations

import re
from typing import Any

from tunegrid.recipes.core import Recipe

WHAT_TUNEGRID_TRAINS = "tunegrid trains LoRA/QLoRA supervised fine-tuning (SFT)"
AS_SFT = "pass --as-sft for the SFT study tunegrid would run instead"

# axolotl 0.18.0: keys that make a run another kind than SFT (schemas/config.py, schemas/trl.py)
AXOLOTL_KINDS = {
    "rl": "a {value} run (preference / reinforcement learning)",
    "reward_model": "a reward-model run",
    "process_reward_model": "a process-reward-model run",
    "pretraining_dataset": "a pretraining run (raw text streamed, no prompts/responses)",
    "num_labels": "a sequence-classification run",
    "cls_model_config": "a sequence-classification run",
    "diffusion": "a diffusion-LM run",
    "ebft": "an energy-based fine-tuning run",
}
# keys the other runs' own settings sections use (dropped with them under --as-sft)
AXOLOTL_COMPANIONS = (
    "trl", "rl_beta", "orpo_alpha", "kto_desirable_weight", "kto_undesirable_weight", "dpo_beta", "simpo_gamma",
    "vllm", "center_rewards_coefficient", "pretrain_multipack_attn", "pretrain_multipack_buffer_size",
    "dpo_use_weighting", "dpo_label_smoothing", "rl_adapter_ref_model", "ebft",
)  # fmt: skip
# trl 1.16.0: fields only one trainer's config class has (DPOConfig, ORPOConfig, KTOConfig, CPOConfig,
# GRPOConfig, RLOOConfig, PPOConfig, RewardConfig), by the class they name
TRL_CLASS_KEYS = {
    "DPOConfig": ("ref_model_init_kwargs", "reference_free", "precompute_ref_log_probs", "rpo_alpha", "sync_ref_model",
                  "ref_adapter_name", "f_divergence_type", "use_weighting", "ld_alpha", "generate_during_eval"),
    "DPO/ORPO/CPO/KTO config (beta)": ("beta", "max_prompt_length"),
    "KTOConfig": ("desirable_weight", "undesirable_weight"),
    "CPOConfig": ("cpo_alpha", "simpo_gamma"),
    "GRPOConfig": ("num_generations", "reward_funcs", "reward_weights", "use_vllm", "max_completion_length",
                   "num_iterations", "epsilon_high", "scale_rewards"),
    "PPOConfig": ("kl_coef", "cliprange", "vf_coef", "num_ppo_epochs", "reward_model_path"),
    "RewardConfig": ("center_rewards_coefficient",),
}  # fmt: skip


# what a run's own name says it is, where no key does (a TrainingArguments file run by a GRPO script)
RUN_NAMES = ("run_name", "output_dir", "hub_model_id")
OTHER_RUN_WORDS = re.compile(r"(?:^|[-_/.\s])(grpo|dpo|orpo|kto|ppo|rloo|simpo|reward[-_]?model)(?:$|[-_/.\s])", re.I)
# vision-language checkpoints (their names), and axolotl's multimodal keys
VISION_WORDS = re.compile(r"(?:^|[-_/.])(vl|llava\w*|idefics\d*|paligemma\d*|smolvlm\w*|internvl\w*|pixtral\w*|vision)"
                          r"(?:$|[-_/.])", re.I)  # fmt: skip
MULTIMODAL_KEYS = ("processor_type", "image_size", "freeze_mm_modules")


def multimodal(recipe: Recipe) -> tuple[str, str] | None:
    """(key, why) where the recipe trains a vision-language model: no --as-sft makes it a text SFT study."""
    raw = recipe.raw
    for key in MULTIMODAL_KEYS:
        if is_set(raw.get(key)):
            return key, "a multimodal (vision-language) run"
    key = "base_model" if recipe.tool == "axolotl" else "model_name_or_path"
    name = raw.get(key)
    if isinstance(name, str) and VISION_WORDS.search(name):
        return key, f"{name!r} is a vision-language model (images and text)"
    return None


def other_kinds(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, what it makes the recipe) for each thing that makes it other than LoRA/QLoRA SFT."""
    raw = recipe.raw
    found: list[tuple[str, str]] = []
    if recipe.tool == "axolotl":
        for key, what in AXOLOTL_KINDS.items():
            if raw.get(key):
                found.append((key, what.format(value=raw[key])))
        if raw.get("adapter") in (None, "", "full") or raw.get("full_finetune"):
            found.append(("adapter", "a full fine-tune of every weight (no adapter: lora or qlora)"))
        entries = raw.get("datasets") if isinstance(raw.get("datasets"), list) else []
        for index, entry in enumerate(entries):
            if isinstance(entry, dict) and entry.get("type") == "pretrain":
                found.append((f"datasets.{index}.type", "a continued-pretraining run (type pretrain: raw text)"))
        return found
    for class_name, keys in TRL_CLASS_KEYS.items():
        named = [k for k in keys if k in raw]
        if named:
            found.append((named[0], f"a {class_name} field ({', '.join(named)}): not an SFTConfig run"))
    if recipe.tool == "trl" and not raw.get("use_peft"):
        found.append(("use_peft", "a full fine-tune of every weight (use_peft is not on)"))
    if not found:
        for key in RUN_NAMES:
            word = OTHER_RUN_WORDS.search(str(raw.get(key) or ""))
            if word:
                found.append(
                    (key, f"{raw[key]!r} names a {word.group(1).upper()} run (no SFTConfig key says otherwise)")
                )
                break
    return found


def check_scope(recipe: Recipe, as_sft: bool) -> None:
    """Refuse a recipe of another kind naming what makes it so; with `as_sft`, turn it into the SFT study."""
    vision = multimodal(recipe)
    if vision is not None:  # no SFT study of a text decoder stands for it, --as-sft or not
        recipe.need(vision[0], f"{vision[1]}; {WHAT_TUNEGRID_TRAINS} of text decoders")
        return
    found = other_kinds(recipe)
    if not found:
        return
    if not as_sft:
        for key, what in found:
            recipe.need(key, f"{what}; {WHAT_TUNEGRID_TRAINS}: {AS_SFT}")
        return
    raw = recipe.raw
    for key, what in found:
        if key in ("adapter", "use_peft"):
            if recipe.tool == "axolotl":
                raw["adapter"] = "lora"
            else:
                raw["use_peft"] = True
            recipe.changed.append(
                f"{key}: {what} -> LoRA adapters (tunegrid's lora.r/alpha unless the recipe sets them)"
            )
        elif key.startswith("datasets."):  # axolotl's pretrain type: the same text, trained as completion
            raw["datasets"][int(key.split(".")[1])]["type"] = "completion"
            recipe.changed.append(f"{key}: {what} -> completion (every token of the text trained)")
        elif key in RUN_NAMES:
            recipe.changed.append(f"{key}: {what} -> trained as SFT on the recipe's data")
        else:
            recipe.changed.append(f"{key}: {what} -> dropped; trained as SFT on the recipe's data")
            raw.pop(key, None)
    if recipe.tool == "axolotl":
        for key in AXOLOTL_COMPANIONS:
            if key in raw:
                raw.pop(key)
                recipe.changed.append(f"{key}: a setting of that other run -> dropped")
    else:
        for keys in TRL_CLASS_KEYS.values():
            for key in keys:
                if key in raw:
                    raw.pop(key)
                    recipe.changed.append(f"{key}: a setting of that other run -> dropped")


def other_kind_keys() -> set[str]:
    keys = set(AXOLOTL_KINDS) | set(AXOLOTL_COMPANIONS) | {"full_finetune"}
    return keys | {k for group in TRL_CLASS_KEYS.values() for k in group}


def is_set(value: Any) -> bool:
    return value not in (None, False, "", [], {})
