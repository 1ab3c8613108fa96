"""Recipe keys that take the loss without the full logits, carried as `train.loss: chunked` (the cell's loss
over the loss tokens, a chunk of logits at a time, each rebuilt in backward: cell/memory/chunked_loss.py). The same
arithmetic per token and the same trade of one chunk's logits for one more pass of the output head as:

- axolotl's CutCrossEntropyPlugin (Apple's Cut Cross Entropy; `cut_cross_entropy` is on by default once the
  plugin is listed), its blockwise kernels never holding more than a block of logits;
- Liger's fused linear cross entropy: axolotl's `liger_fused_linear_cross_entropy` (with the LigerPlugin), and
  transformers' / TRL's `use_liger_kernel`, which turns it on with Liger's other kernels (RoPE, RMSNorm, SwiGLU:
  those the cell runs as the model's own modules, a note says so) unless `liger_kernel_config` turns it off; TRL
  0.12's `use_liger` (SFTConfig) loaded the model through Liger's AutoLigerKernelForCausalLM, the same kernels.

axolotl's `chunked_cross_entropy` is another thing (it chunks the loss over logits the model has already
built) and is not carried here.
"""

from __future__ import annotations

from tunegrid.recipes.core import Recipe

CCE_PLUGIN = "CutCrossEntropyPlugin"
LOSS_KEYS = {"cut_cross_entropy", "liger_fused_linear_cross_entropy", "use_liger_kernel", "use_liger",
             "liger_kernel_config"}  # fmt: skip
WHAT = "the loss over one chunk of tokens' logits at a time, rebuilt in backward (never the full logits)"


def _plugins(recipe: Recipe) -> list[str]:
    plugins = recipe.raw.get("plugins")
    return [str(p).rsplit(".", 1)[-1] for p in plugins] if isinstance(plugins, list) else []


def fused_loss(recipe: Recipe) -> None:
    """`train.loss: chunked` from the keys of a loss kernel that never holds the full logits."""
    raw = recipe.raw
    if CCE_PLUGIN in _plugins(recipe) and raw.get("cut_cross_entropy", True) is not False:
        recipe.carry("train.loss", "chunked", *(["cut_cross_entropy"] if "cut_cross_entropy" in raw else []))
        recipe.notes.append(f"plugins: {CCE_PLUGIN}: Cut Cross Entropy is carried as train.loss: chunked, {WHAT}")
    if raw.get("liger_fused_linear_cross_entropy"):
        recipe.carry("train.loss", "chunked", "liger_fused_linear_cross_entropy")
        recipe.notes.append(f"liger_fused_linear_cross_entropy: carried as train.loss: chunked, {WHAT}")
    config = raw.get("liger_kernel_config")
    off = isinstance(config, dict) and config.get("fused_linear_cross_entropy") is False
    key = "use_liger_kernel" if raw.get("use_liger_kernel") else "use_liger"
    if raw.get(key) and not off:
        recipe.carry("train.loss", "chunked", key, *(["liger_kernel_config"] if config else []))
        recipe.notes.append(
            f"{key}: its fused linear cross entropy is carried as train.loss: chunked, {WHAT}; Liger's "
            "other kernels (RoPE, RMSNorm, SwiGLU) keep fewer activations than the model's own modules the cell "
            "runs (a higher peak there)"
        )
