"""An axolotl recipe's LoftQ initialization (`peft.loftq_config`), carried as lora.loftq_bits: peft's own
LoftQ, which replaces each adapted weight of an unquantized base by its quantization round trip and starts the
adapters from the SVD of what it lost. Refused over a bitsandbytes-quantized base, which peft cannot read.
"""

from __future__ import annotations

from tunegrid.recipes.recipe import Recipe


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
