"""A recipe's LoRA settings beyond r/alpha/dropout: axolotl's LoftQ initialization (`peft.loftq_config`),
carried as lora.loftq_bits: peft's own LoftQ, which replaces each adapted weight of an unquantized base by its
quantization round trip and starts the adapters from the SVD of what it lost (refused over a
bitsandbytes-quantized base, which peft cannot read); and the modules peft adapts when a TRL recipe names none.
"""

from __future__ import annotations

from tunegrid.recipes.core import Recipe, lora_targets, peft_default_targets


def loftq(recipe: Recipe, quantized: bool) -> None:
    """`peft.loftq_config` (axolotl passes loftq_bits to peft's LoftQConfig, with init_lora_weights: loftq)."""
    section = recipe.raw.get("peft")
    config = section.get("loftq_config") if isinstance(section, dict) else None
    if not config:
        return
    bits = config.get("loftq_bits") if isinstance(config, dict) else None
    if quantized:
        recipe.refuse("peft.loftq_config", "LoftQ replaces the adapted weights of an unquantized base by their "
                      "quantization round trip (axolotl: adapter lora, no load_in_4bit / load_in_8bit); peft's "
                      "loftq_init cannot read a bitsandbytes-quantized weight")  # fmt: skip
    elif bits not in (4, 8) or isinstance(bits, bool):
        recipe.refuse("peft.loftq_config.loftq_bits", f"{bits!r}: peft's LoftQ quantizes in 4 or 8 bits")
    else:
        recipe.carry("lora.loftq_bits", bits, "peft.loftq_config.loftq_bits")
        recipe.notes.append(
            "peft.loftq_config: peft's LoftQ (init_lora_weights: loftq, one iteration as axolotl passes it): each "
            "adapted weight becomes its quantization round trip and the adapters start from the SVD of what it "
            "lost; peft computes it on CUDA only, so a cell that trains on a CPU is unsupported"
        )
        for key in set(config) - {"loftq_bits"}:
            recipe.unknown[f"peft.loftq_config.{key}"] = "axolotl's LoftQConfig takes loftq_bits only"


def peft_default(recipe: Recipe, key: str) -> None:
    """`lora_target_modules` unset: TRL's LoraConfig names no modules, so peft adapts its default ones for the
    checkpoint's model type (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), carried where the checkpoint's
    config is on this machine; elsewhere the study adapts every linear layer, and a row says so."""
    model_type, targets = peft_default_targets(recipe)
    if targets:
        recipe.carry("lora.target_modules", targets, key)
        recipe.notes.append(f"{key} unset: peft's default modules for model type {model_type!r}: {targets}")
        return
    lora_targets(recipe, key, "all-linear")
    why = (
        "the checkpoint is not on this machine to read its model type"
        if model_type is None
        else f"peft has none for model type {model_type!r} (the recipe's run stops asking for target_modules)"
    )
    recipe.differs[key] = (
        f"unset: peft adapts its default modules for the model type (q_proj and v_proj for Llama-like models); "
        f"{why}, so the study adapts every linear layer but the output head (more adapters, more memory): set "
        "lora.target_modules in the study to the recipe's modules"
    )
