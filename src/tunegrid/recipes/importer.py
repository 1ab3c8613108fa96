"""A study whose baseline cell is the user's recipe, and whose grid varies, around it, the settings that bear
on the failure the user names (`nan`, `oom`, `timeout`, or `all`).

`tunegrid import` writes it with a header listing what was carried, what was not and why; a study file
with a `base:` key is expanded the same way when Snakemake (or `tunegrid validate`) reads it, the file's
own keys winning over the recipe's.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from tunegrid.recipes.core import FAILURES, TOOLS, Recipe, RecipeError, read_file
from tunegrid.recipes.header_rows import with_users_dataset
from tunegrid.recipes.releases import SCRIPT_ALIASES, detect_format
from tunegrid.recipes.scope import check_scope
from tunegrid.vocabulary import LOSSES, SCALED_LOGIT_KEYS

MODEL_KEYS = {"trust_remote_code", "attn_implementation", "config_overrides"}  # go into models.<name>
RECORD_ONLY = {"model", "adapter", "data.dataset", *(f"model.{key}" for key in MODEL_KEYS)}
BASE_KEYS = {"recipe", "from", "failure", "ignore", "steps", "seq_len", "model", "dataset", "as_sft"}


def read_recipe(base: dict[str, Any]) -> Recipe:
    """The recipe a `base:` section names, read with its options (`from`, `ignore`, `model`, `dataset` …)."""
    from tunegrid.recipes.axolotl import read_axolotl
    from tunegrid.recipes.trl import read_trl

    unknown = set(base) - BASE_KEYS
    if unknown:
        raise RecipeError(f"config key 'base': unknown keys {sorted(unknown)}; allowed {sorted(BASE_KEYS)}")
    path = str(base.get("recipe") or "")
    raw = read_file(path)
    tool = base.get("from") or "auto"
    if tool == "auto":
        tool, why = detect_format(raw)
        if tool is None:
            raise RecipeError(f"recipe {path!r}: {why}; pass --from axolotl|trl|transformers to read it as one")
    raw, aliased = with_script_aliases(raw, tool)
    if tool not in TOOLS:
        raise RecipeError(f"config key 'base.from': {tool!r} is not one of {['auto', *TOOLS]}")
    raw, replaced = _with_overrides(raw, tool, base.get("model"), base.get("dataset"))
    recipe = Recipe(tool=tool, path=path, raw=raw, ignore=set(base.get("ignore") or []), aliased=aliased)
    for key, (place, why) in replaced.items():
        getattr(recipe, place)[key] = why
    check_scope(recipe, bool(base.get("as_sft")))
    if recipe.refused:  # another kind of run: say what makes it so before anything else
        raise RecipeError(
            f"recipe {path!r} (read as {tool} {recipe.version}) is not LoRA/QLoRA SFT:\n  - "
            + "\n  - ".join(recipe.refused)
        )
    reader = read_axolotl if tool == "axolotl" else read_trl
    reader(recipe, base.get("steps"), base.get("seq_len"))
    if recipe.refused:
        raise RecipeError(
            f"recipe {path!r} (read as {tool} {recipe.version}) cannot be run as it is:\n  - "
            + "\n  - ".join(recipe.refused)
        )
    return recipe


def _with_overrides(
    raw: dict[str, Any], tool: str, model: str | None, dataset: str | None
) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """`--model path|repo@rev` and `--dataset file` as the tool's own keys (a TrainingArguments file names neither),
    and the rows of what `--dataset` replaced (header_rows.with_users_dataset)."""
    raw = copy.deepcopy(raw)
    if model:
        name, _, revision = model.partition("@")
        keys = ("base_model", "revision_of_model") if tool == "axolotl" else ("model_name_or_path", "model_revision")
        raw[keys[0]] = name
        if revision:
            raw[keys[1]] = revision
    if not dataset:
        return raw, {}
    name, _, revision = dataset.partition("@")
    return raw, with_users_dataset(raw, tool, name, revision)


def with_script_aliases(raw: dict[str, Any], tool: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A training script's names for TRL keys (SCRIPT_ALIASES) as the TRL key, where the file lacks it, and
    {TRL key: the file's name} for the header."""
    if tool == "axolotl":
        return raw, {}
    out, aliased = dict(raw), {}
    for alias, key in SCRIPT_ALIASES.items():
        if alias in out and key not in out:
            out[key] = out.pop(alias)
            aliased[key] = alias
    if aliased and "lora_r" in out and "use_peft" not in out:  # a script's LoRA rank: its script trains LoRA
        out["use_peft"] = True
        aliased["use_peft"] = "lora_r"
    return out, aliased


def model_name(recipe: Recipe) -> str:
    model = recipe.settings["model"]
    base = Path(model.get("path") or model.get("repo_id")).name
    return _slug(base) or "model"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", text).strip("-.")[:64]


def _local_config(recipe: Recipe) -> dict[str, Any]:
    """The recipe's model config where it is a local folder (a hub model's is not read here: {})."""
    model = recipe.settings["model"]
    if model["source"] != "local":
        return {}
    return json.loads((Path(model["path"]) / "config.json").read_text())


def _is_moe(recipe: Recipe) -> bool:
    config = _local_config(recipe)
    return any((config.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def _chunked_loss_applies(recipe: Recipe) -> bool:
    """The chunked loss is a memory setting for this recipe: it takes the full loss (a recipe with a fused loss
    kernel is chunked already), and its model's logits are not scaled in a way the chunks do not reproduce."""
    if recipe.settings.get("train.loss", LOSSES[0]) != LOSSES[0]:
        return False
    config = _local_config(recipe)
    text = config.get("text_config") or config
    return all(text.get(key) in (None, 1, 1.0) for key in SCALED_LOGIT_KEYS)


def _smaller_micro_batch(batch: int) -> int | None:
    """The largest divisor of `batch` at most a quarter of it (else half): the same effective batch with
    accumulation, and a quarter of the activations."""
    for limit in (batch // 4, batch // 2):
        divisors = [d for d in range(1, limit + 1) if batch % d == 0]
        if divisors:
            return max(divisors)
    return None


def grid_around(recipe: Recipe, failure: str) -> tuple[dict[str, list[Any]], list[str]]:
    """The grid: every axis at the recipe's value, the axes that bear on `failure` varied around it."""
    from tunegrid.vocabulary import AXES

    s = recipe.settings
    grid: dict[str, list[Any]] = {axis: [s[f"grid.{axis}"]] for axis in AXES if f"grid.{axis}" in s}
    why: list[str] = []
    failures = {"nan", "oom", "timeout"} if failure == "all" else {failure}
    smaller = _smaller_micro_batch(s["grid.batch_size"])
    if "nan" in failures:  # every precision row tunegrid has, its fp16 fixes included, the recipe's first
        from tunegrid.meanings import PRECISION_ROWS

        rows = sorted(PRECISION_ROWS.values(), key=lambda row: row.nan_fix_rank)
        grid["precision"] += [str(row.precision) for row in rows if row.precision != s["grid.precision"]]
        own = PRECISION_ROWS[s["grid.precision"]].arithmetic  # the fixes that keep the recipe's arithmetic
        same = [str(r.precision) for r in rows if r.arithmetic == own and r.precision != s["grid.precision"]]
        why.append(f"nan: every precision tunegrid has ({', '.join(grid['precision'])}; in the recipe's own "
                   f"arithmetic: {', '.join(same) or 'none'})")  # fmt: skip
    if ("nan" in failures or "oom" in failures) and smaller:
        factor = s["grid.batch_size"] // smaller
        grid["batch_size"].append(smaller)
        grid["grad_accum"].append(s["grid.grad_accum"] * factor)
        # only the two pairs that keep the recipe's effective batch (the grid is a product otherwise)
        grid["exclude"] = [
            {"batch_size": s["grid.batch_size"], "grad_accum": s["grid.grad_accum"] * factor},
            {"batch_size": smaller, "grad_accum": s["grid.grad_accum"]},
        ]
        why.append(
            f"nan/oom: micro-batch {smaller} with {s['grid.grad_accum'] * factor} micro-batches per step "
            f"(the recipe's effective batch {s['grid.batch_size'] * s['grid.grad_accum']}, a smaller activation "
            "peak; never crossed with the recipe's own pair)"
        )
    if "oom" in failures and s.get("lora.loftq_bits"):
        why.append("oom: no quantization (LoftQ initializes over the recipe's unquantized base)")
    elif "oom" in failures:
        from tunegrid.meanings import QUANT_ROWS, memory_fix_quants

        moe = _is_moe(recipe)
        quants = [str(q) for q in memory_fix_quants() if moe or not QUANT_ROWS[q].experts_quantized]
        grid["quant"] += [q for q in quants if q not in grid["quant"]]
        why.append(f"oom: quantizations {quants}")
        if grid.get("optimizer", ["adamw"]) == ["adamw"]:  # an 8-bit recipe already keeps the smaller state
            grid["optimizer"] = ["adamw", "adamw-8bit"]
            why.append("oom: adamw-8bit (bitsandbytes' 8-bit moments) beside the recipe's AdamW")
        if not s.get("train.gradient_checkpointing"):  # at false the axis follows the recipe's own setting
            grid["activation_checkpointing"] = [False, True]
            why.append("oom: activation checkpointing off (the recipe's) and on")
        if _chunked_loss_applies(recipe):
            grid["loss"] = list(LOSSES)
            why.append("oom: the chunked loss (one chunk of the output head's logits at a time) beside the full one")
    if "timeout" in failures:
        grid["world_size"] = [1, 2]
        why.append("timeout: one rank and two (DDP; collectives with the recipe's ddp_timeout)")
    return grid, why


def build_study(recipe: Recipe, failure: str, base: dict[str, Any], study: str | None = None) -> dict[str, Any]:
    if failure not in FAILURES:
        raise RecipeError(f"config key 'base.failure': {failure!r} is not one of {list(FAILURES)}")
    name = model_name(recipe)
    model = dict(recipe.settings["model"])
    for key in sorted(MODEL_KEYS):
        if recipe.settings.get(f"model.{key}"):
            model[key] = recipe.settings[f"model.{key}"]
    grid, _ = grid_around(recipe, failure)
    out: dict[str, Any] = {
        "study": study or _slug(Path(recipe.path).stem) or "recipe",
        "base": base,
        "models": {name: model},
        "grid": {"model": [name], **grid},
    }
    # parity is judged against fp32 on the recipe's own base: a QLoRA grid has no unquantized twin
    if grid.get("quant"):
        out["review"] = {"reference": {"precision": "fp32", "quant": grid["quant"][0]}}
    for path, value in recipe.settings.items():
        if path in RECORD_ONLY or path.startswith("grid."):
            continue
        section, key = path.split(".", 1)
        out.setdefault(section, {})[key] = value
    return out


def baseline_cell_id(study: dict[str, Any]) -> str:
    from tunegrid.study.config import Cell
    from tunegrid.vocabulary import AXES

    grid = study["grid"]
    return Cell(**{axis: grid[axis][0] for axis in AXES if grid.get(axis)}).cell_id


def header(recipe: Recipe, failure: str, study: dict[str, Any]) -> list[str]:
    """What the import did, for the study file's header and the command's output."""
    _, why = grid_around(recipe, failure)
    lines = [
        f"Imported from {recipe.path} (read as {recipe.tool} {recipe.version} keys) for failure: {failure}.",
        f"Baseline cell (the recipe itself): {baseline_cell_id(study)}",
        "Grid around it: " + ("; ".join(why) or "the baseline alone"),
        "Carried over:",
    ]
    for path, keys in sorted(recipe.origin.items()):
        if keys and path != "data.dataset":
            value = recipe.settings[path]
            given = [k for k in keys if k.split(".")[0] in recipe.raw] or [f"({recipe.tool}'s default)"]
            lines.append(f"  {', '.join(given)} -> {path} = {json.dumps(value, default=str)}")
    if recipe.aliased:
        lines.append("Read as TRL's own keys (a training script's names for them):")
        lines += [f"  {alias} -> {key}" for key, alias in sorted(recipe.aliased.items())]
    if recipe.unpinned:
        lines.append("Not pinned (fetched when the study runs; `tunegrid pin <study>` writes the commit back):")
        lines += [f"  {key}: {ref}" for key, ref in sorted(recipe.unpinned.items())]
    if recipe.changed:
        lines.append("Changed to the SFT study tunegrid runs (--as-sft):")
        lines += [f"  {line}" for line in recipe.changed]
    keyed = (
        (recipe.differs, "Run differently from the recipe (they bear on memory or numerics; {n} keys):"),
        (recipe.not_carried, "Not carried over ({n} keys):"),
        (recipe.unknown, "Unknown keys ({n}; the tool itself may reject or ignore them):"),
        (recipe.ignored, "Ignored (--ignore; tunegrid cannot honour them):"),
    )
    for rows, heading in keyed:
        if rows:
            lines.append(heading.format(n=len(rows)))
            lines += [f"  {key}: {why}" for key, why in sorted(rows.items())]
    if recipe.notes:
        lines.append("Notes:")
        lines += [f"  {note}" for note in recipe.notes]
    return lines


def import_recipe(base: dict[str, Any], study: str | None = None) -> tuple[dict[str, Any], Recipe, list[str]]:
    """The study for a `base:` section: (study, the recipe as read, header lines)."""
    recipe = read_recipe(base)
    failure = base.get("failure") or "all"
    built = build_study(recipe, failure, base, study)
    return built, recipe, header(recipe, failure, built)


def expand_base(config: dict[str, Any]) -> dict[str, Any]:
    """A study with `base:` = the imported study with the file's own keys on top (deep); else unchanged."""
    if not config.get("base"):
        return config
    base = config["base"]
    if not isinstance(base, dict):
        base = {"recipe": base}
    imported, _, _ = import_recipe(base, config.get("study"))
    merged = _deep_merge(imported, {k: v for k, v in config.items() if k != "base"})
    merged["base"] = base
    return merged


def _deep_merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(under)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
