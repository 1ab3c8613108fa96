"""Recipe keys that change where a run keeps its tensors or which of them it trains: activation offloading,
`gradient_checkpointing: offload`, FSDP's checkpointing and parameter offloading, axolotl's `unfrozen_parameters`,
`lora_fan_in_fan_out`. Each is carried as
the study setting that does the same in the cell, accounted for with the reason it changes nothing, or refused
saying precisely why it cannot be.
"""

from __future__ import annotations

import re
from typing import Any

from tunegrid.recipes.core import Recipe

# activation_offloading values whose tensors go where tunegrid's offloading puts them (every saved tensor but
# the weights, to host memory): TRL's OffloadActivations with CUDA streams (true) or without (axolotl's legacy)
OFFLOADED = {True: "every saved tensor", "legacy": "every saved tensor (without CUDA streams)"}
# gradient_checkpointing values: axolotl 0.18 reads `offload` as checkpointing with activation_offloading: true
CHECKPOINTING = {None: False, False: False, True: True, "offload": True}
# an FSDP wrap class that is part of a decoder layer (transformers' class names: MixtralSparseMoeBlock, LlamaMLP)
PART_OF_A_LAYER = re.compile(r"Moe|MoE|Sparse|Expert|MLP|Mlp|Attention")


def checkpointing_and_offloading(
    recipe: Recipe, checkpointing_key: str, checkpointing: Any, *keys: str, offloading: bool = True
) -> None:
    """`train.gradient_checkpointing` and `train.activation_offloading` from the recipe's checkpointing switch and
    (`offloading`: the tool has the key) its `activation_offloading` (axolotl: true | legacy | disk |
    hidden_states; TRL's SFTConfig: a bool)."""
    if not isinstance(checkpointing, (bool, str, type(None))) or checkpointing not in CHECKPOINTING:
        recipe.refuse(checkpointing_key, f"{checkpointing!r}: tunegrid checkpoints activations (true), offloads "
                      "them too (offload) or neither (false); offload_disk writes them to disk")  # fmt: skip
    on = CHECKPOINTING.get(checkpointing, False) if isinstance(checkpointing, (bool, str, type(None))) else False
    recipe.carry("train.gradient_checkpointing", on, checkpointing_key, *keys)
    offloaded = recipe.raw.get("activation_offloading")
    if not offloading and offloaded not in (None, False):
        recipe.refuse("activation_offloading", f"read as {recipe.tool}, whose arguments have no such key (TRL's "
                      "SFTConfig does): import the file as trl (--from trl) to carry it")  # fmt: skip
        return
    if checkpointing == "offload":
        recipe.carry("train.activation_offloading", True, checkpointing_key)
        recipe.notes.append(
            f"{checkpointing_key}: offload is checkpointing with activation offloading (axolotl 0.18 reads it so): "
            "each checkpointed layer's input and every other saved tensor but the weights go to host memory"
        )
    if offloaded in (None, False):
        return
    if offloaded not in OFFLOADED:
        recipe.refuse("activation_offloading", f"{offloaded!r} offloads another set of tensors (disk: to files; "
                      "hidden_states: the checkpointed inputs only) than tunegrid's offloading (every saved tensor "
                      "but the weights, to host memory); set it to true")  # fmt: skip
        return
    recipe.carry("train.activation_offloading", True, "activation_offloading")
    recipe.notes.append(f"activation_offloading: {OFFLOADED[offloaded]} but the weights goes to host memory in the "
                        "forward and comes back for the backward (on a CPU cell nothing moves)")  # fmt: skip


def fan_in_fan_out(recipe: Recipe, key: str) -> None:
    """peft sets fan_in_fan_out from the adapted layer's own type (True for a Conv1D, False for nn.Linear and
    bitsandbytes' Linear8bitLt / Linear4bit, with a warning where the config says otherwise)."""
    if recipe.raw.get(key) not in (None, False):
        recipe.not_carried[key] = (
            "peft sets fan_in_fan_out from each adapted layer's type whatever the config says (Conv1D: true; "
            "nn.Linear and bitsandbytes' 8-bit/4-bit linears: false): the recipe's value changes nothing"
        )


def unfrozen_parameters(recipe: Recipe, key: str = "unfrozen_parameters") -> None:
    """axolotl's `unfrozen_parameters`: regexes matched (re.match) against the parameter names after the adapters
    are attached; every parameter no pattern matches is frozen, the adapters too. Refused, saying what it does."""
    patterns = recipe.raw.get(key)
    if not patterns:
        return
    patterns = [str(p) for p in (patterns if isinstance(patterns, list) else [patterns])]
    # anchored at the base model's own names: the adapted model's names start with base_model.model.
    unmatched = [p for p in patterns if p.startswith("^") and not p.startswith("^base_model")]
    said = f"{unmatched} match no parameter of the adapted model (its names start with base_model.model.)"
    said += ", so axolotl freezes every parameter and trains nothing; " if unmatched == patterns else "; "
    said = said if unmatched else ""
    recipe.refuse(key, (
        f"{said}axolotl freezes every parameter the patterns do not match (the adapters too unless one names them) "
        "and trains the matched base weights in full: not LoRA, and a 4-bit base cannot train them. To train "
        "lm_head / embed_tokens in full beside the adapters, use lora_modules_to_save"
    ))  # fmt: skip


def fsdp_memory(recipe: Recipe) -> None:
    """The settings of an FSDP config that change what one rank holds even at world size 1: activation
    checkpointing of each wrapped layer (carried: tunegrid checkpoints each decoder layer, non-reentrant) and
    parameter offloading to host memory (carried as train.weight_offloading, saying where tunegrid's differs).
    Sharding itself is run differently (keys.APPROXIMATED)."""
    options = recipe.raw.get("fsdp")
    options = options.split() if isinstance(options, str) else options if isinstance(options, list) else []
    config = recipe.raw.get("fsdp_config")
    config = config if isinstance(config, dict) else {}
    for key in ("activation_checkpointing", "fsdp_activation_checkpointing"):
        if config.get(key) is True:
            recipe.carry("train.gradient_checkpointing", True, f"fsdp_config.{key}")
            recipe.notes.append(f"fsdp_config.{key}: FSDP checkpoints each wrapped decoder layer; tunegrid's cells "
                                "checkpoint each decoder layer (non-reentrant)")  # fmt: skip
    said = [f"fsdp_config.{key}" for key in ("offload_params", "fsdp_offload_params") if config.get(key) is True]
    said += ["fsdp"] if "offload" in options else []  # transformers' / axolotl's options: full_shard auto_wrap offload
    for key in ("offload_params", "fsdp_offload_params"):
        if config.get(key) not in (None, False, True):
            recipe.refuse(f"fsdp_config.{key}", f"{config[key]!r}: FSDP's offload_params is true or false")
    if not said:
        return
    recipe.carry("train.weight_offloading", True, *said)
    recipe.differs[said[0]] = (
        "FSDP keeps the parameters, their gradients and the optimizer state in host memory (its optimizer steps on "
        "the CPU); tunegrid's weight offloading keeps each decoder layer's frozen base weights there and brings "
        "them to the device for the layer's forward and backward, one layer at a time, but keeps the adapters, their "
        "gradients and the optimizer state on the device (a higher peak by lora_params_grads + optimizer_state in "
        "the estimate); and tunegrid loads the whole model onto the device before it offloads (the load's peak is "
        "the unoffloaded one)"
    )
    wrapped = config.get("transformer_layer_cls_to_wrap") or config.get("fsdp_transformer_layer_cls_to_wrap")
    names = [wrapped] if isinstance(wrapped, str) else list(wrapped) if isinstance(wrapped, list) else []
    other = [str(n) for n in names if not str(n).endswith("DecoderLayer") and PART_OF_A_LAYER.search(str(n))]
    if other:
        key = next(k for k in ("transformer_layer_cls_to_wrap", "fsdp_transformer_layer_cls_to_wrap") if k in config)
        recipe.differs[f"fsdp_config.{key}"] = (
            f"{other}: FSDP offloads each such module as its own unit and keeps what no unit wraps (attention, "
            "norms, embeddings) in its root unit, on the device for the whole step; tunegrid's offloading moves "
            "each whole decoder layer (a lower peak here by every layer's weights outside those modules, but one's)"
        )
