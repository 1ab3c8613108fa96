"""A recipe's optimizer as tunegrid's optimizer axis: the names transformers' OptimizerNames (5.23.0) and
axolotl 0.18's own optimizers take, as the axis value that trains the same update, the nearest one (and what
differs), or refused."""

from __future__ import annotations

from typing import Any

from tunegrid.recipes.core import MAPPED_VERSIONS, OPTIMIZER_AXIS, Recipe

# the other OptimizerNames, and axolotl 0.18's own (CustomSupportedOptimizers): known, but not what tunegrid trains
OTHER_OPTIMIZERS = {
    "adamw_torch_xla", "adamw_torch_npu_fused", "adafactor", "adamw_anyprecision", "adamw_torch_4bit",
    "adamw_torch_8bit", "ademamix", "sgd", "adagrad", "ademamix_8bit", "lion_8bit",
    "lion_32bit", "paged_adamw_32bit", "paged_ademamix_32bit", "paged_ademamix_8bit",
    "paged_lion_32bit", "paged_lion_8bit", "rmsprop", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
    "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise", "lomo", "adalomo", "grokadamw", "schedule_free_radam", "schedule_free_adamw",
    "schedule_free_sgd", "apollo_adamw", "apollo_adamw_layerwise", "stable_adamw",
    "optimi_adamw", "ao_adamw_4bit", "ao_adamw_8bit", "ao_adamw_fp8", "adopt_adamw", "came_pytorch", "muon",
}  # fmt: skip
# optimizers whose update is AdamW's but whose state is kept otherwise: the nearest axis value, and what differs
NEAREST_OPTIMIZER = {
    "adamw_torch_8bit": ("adamw-8bit", "torchao's 8-bit AdamW; tunegrid's 8-bit moments are bitsandbytes' (the "
                         "same bytes, another quantizer)"),
    "adamw_torch_4bit": ("adamw-8bit", "torchao's 4-bit AdamW; tunegrid's smallest moments are 8-bit "
                         "(bitsandbytes), so its optimizer state is about twice the recipe's"),
    "ao_adamw_8bit": ("adamw-8bit", "torchao's 8-bit AdamW; tunegrid's 8-bit moments are bitsandbytes'"),
    "ao_adamw_4bit": ("adamw-8bit", "torchao's 4-bit AdamW; tunegrid's smallest moments are 8-bit"),
    "paged_adamw_32bit": ("adamw", "bitsandbytes' paged 32-bit AdamW (the same state, paged to host under "
                          "pressure); tunegrid's AdamW is not paged"),
}  # fmt: skip


def optimizer(recipe: Recipe, key: str, name: Any) -> None:
    """The recipe's optimizer as the baseline cell's `grid.optimizer`."""
    name = str(getattr(name, "value", name))
    if name in OPTIMIZER_AXIS:
        recipe.carry("grid.optimizer", OPTIMIZER_AXIS[name], key)
        if OPTIMIZER_AXIS[name] == "adamw" and name != "adamw_torch":
            recipe.notes.append(f"{key}: {name} trains as torch AdamW (the same update; fused is a kernel choice)")
        elif name == "adamw_8bit":
            recipe.notes.append(f"{key}: adamw_8bit is transformers' alias of adamw_bnb_8bit (bitsandbytes AdamW8bit)")
    elif name in NEAREST_OPTIMIZER:
        axis, why = NEAREST_OPTIMIZER[name]
        recipe.carry("grid.optimizer", axis, key)
        recipe.differs[key] = f"{name}: {why}"
    elif name in OTHER_OPTIMIZERS:
        recipe.refuse(key, f"optimizer {name!r} is not one tunegrid trains with ({sorted(OPTIMIZER_AXIS)})")
    else:
        recipe.refuse(key, f"unknown optimizer {name!r} (transformers {MAPPED_VERSIONS['transformers']} names)")
