"""A cell of an imported study as a config of the user's own tool: the recipe file with only the keys the
cell changes relative to the baseline (the recipe itself) rewritten, so the fix goes back as a diff.

YAML recipes are edited line by line at their top-level keys (comments, order and every other key stay
as written); JSON recipes are rewritten with the same keys. Axes map back through the table the readers
read them with (recipe.AXIS_KEYS, through recipe.tool_value).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tunegrid.recipes.core import read_file, tool_value
from tunegrid.recipes.trl import DEFAULTS as TRL_DEFAULTS
from tunegrid.recipes.trl import MODEL_CONFIG_KEYS, SCRIPT_ARGUMENTS_KEYS
from tunegrid.study.errors import ConfigError
from tunegrid.vocabulary import AXES

AXOLOTL_DEFAULTS = {
    "bf16": False, "fp16": False, "bfloat16": False, "float16": False, "load_in_4bit": False, "load_in_8bit": False,
    "quantize_moe_experts": False,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 1, "seed": 42,
}  # fmt: skip


# how a tool's config says the chunked loss (train.loss: chunked; recipes/loss_keys.py reads each back)
LOSS_EXPORT = {
    "axolotl": "add axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin to `plugins` (Cut Cross Entropy: "
    "the loss without the full logits)",
    "trl": "set use_liger_kernel: true (Liger's fused linear cross entropy: the loss without the full logits; "
    "Liger's other kernels come with it unless liger_kernel_config turns them off)",
}
LOSS_OFF = "the recipe's Cut Cross Entropy plugin or Liger's fused linear cross entropy"

# SFTConfig's defaults that follow another key (trl 1.16.0 base_config.__post_init__): bf16 unless fp16
SFT_DERIVED = {"bf16": lambda raw, updated: not updated.get("fp16", raw.get("fp16", False))}


@dataclass
class Export:
    tool: str
    recipe: str
    cell_id: str
    changes: dict[str, Any]  # axis -> the cell's value where it differs from the baseline
    keys: dict[str, Any]  # recipe key -> the value written
    text: str
    diff: list[str]
    notes: list[str] = field(default_factory=list)


def _family(tool: str) -> str:
    return "axolotl" if tool == "axolotl" else "trl"


def _effective(tool: str, raw: dict[str, Any], key: str, updated: dict[str, Any]) -> Any:
    """What a key is worth in the tool when the file does not set it (SFTConfig's bf16: on unless fp16)."""
    if key in raw:
        return raw[key]
    if tool == "trl" and key in SFT_DERIVED:
        return SFT_DERIVED[key](raw, updated)
    if tool == "axolotl":
        return AXOLOTL_DEFAULTS.get(key)
    fallback = {
        "bf16": False,
        "fp16": False,
        "load_in_4bit": False,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "use_peft": False,
    }
    return TRL_DEFAULTS.get(tool, {}).get(key, fallback.get(key))


def export_cell(study: dict[str, Any], cell_id: str, to: str) -> Export:
    from tunegrid.study.config import cells_by_id

    base = study.get("base") or {}
    if not base.get("recipe"):
        raise ConfigError(
            f"study {study['study']!r} was not imported from a recipe (no base.recipe); nothing to export"
        )
    cells = cells_by_id(study)
    if cell_id not in cells:
        raise ConfigError(f"{cell_id!r} is not a cell of study {study['study']!r}")
    tool = base.get("from") or "auto"
    raw = read_file(base["recipe"])
    if tool == "auto":
        from tunegrid.recipes.trl import detect_tool

        tool = detect_tool(raw)
    if _family(tool) != to:
        raise ConfigError(f"the recipe {base['recipe']!r} is an {tool} config; export it --to {_family(tool)}")
    cell = cells[cell_id].axes()
    baseline = {axis: study["grid"][axis][0] for axis in AXES if study["grid"].get(axis)}
    differs = {axis: cell[axis] for axis in AXES if axis in baseline and cell[axis] != baseline[axis]}
    wanted: dict[str, Any] = {}
    changes: dict[str, Any] = {}
    notes = []
    for axis, value in differs.items():
        try:
            wanted.update(tool_value(tool, axis, value))
            changes[axis] = value
        except KeyError:  # an axis no recipe key says (the ranks: how many processes the user launches)
            if axis == "stack":  # the fix is the library versions the recipe runs on, not a key of it
                from tunegrid.study.stacks import requirements

                pins = " ".join(f"'{r}'" for r in requirements((study.get("stacks") or {}).get(value, {})))
                notes.append(f"stack {value}: not a key of a {tool} config; install its versions: pip install {pins}")
                changes[axis] = value
            elif axis == "loss":  # one of several kernels in the tool says it, each with more than this key
                notes.append(
                    f"loss {value}: {LOSS_EXPORT[_family(tool)] if value != 'full' else 'turn off ' + LOSS_OFF}"
                )
                changes[axis] = value
            else:
                notes.append(f"{axis} {value}: not a key of a {tool} config (e.g. launch that many processes)")
        except ValueError as exc:
            raise ConfigError(f"cell {cell_id}: {exc}") from None
    old_name = "gradient_checkpointing" in raw and "activation_checkpointing" not in raw
    if "activation_checkpointing" in wanted and old_name:
        wanted["gradient_checkpointing"] = wanted.pop("activation_checkpointing")  # the name the recipe itself uses
    keys = {k: v for k, v in wanted.items() if _effective(tool, raw, k, wanted) != v}
    original = Path(base["recipe"]).read_text()
    text = _rewrite(original, keys, Path(base["recipe"]).suffix == ".json")
    diff = list(
        difflib.unified_diff(
            original.splitlines(), text.splitlines(), f"{base['recipe']} (yours)", f"{cell_id}", lineterm=""
        )
    )
    return Export(tool, base["recipe"], cell_id, changes, keys, text, diff, notes)


def _rewrite(original: str, keys: dict[str, Any], is_json: bool) -> str:
    if not keys:
        return original
    if is_json:
        data = json.loads(original)
        data.update(keys)
        return json.dumps(data, indent=2) + "\n"
    lines = original.splitlines()
    for key, value in keys.items():
        scalar = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        pattern = re.compile(rf"^{re.escape(key)}\s*:(\s*)([^#\n]*?)(\s*#.*)?$")
        for i, line in enumerate(lines):
            match = pattern.match(line)
            if match:
                lines[i] = f"{key}:{match.group(1) or ' '}{scalar}{match.group(3) or ''}"
                break
        else:
            lines.append(f"{key}: {scalar}")
    return "\n".join(lines) + ("\n" if original.endswith("\n") else "")


def split_trl(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A flat `trl sft --config` mapping by the dataclass each key belongs to (as TrlParser splits it)."""
    parts: dict[str, dict[str, Any]] = {"ScriptArguments": {}, "ModelConfig": {}, "SFTConfig": {}}
    for key, value in flat.items():
        if key in SCRIPT_ARGUMENTS_KEYS:
            parts["ScriptArguments"][key] = value
        elif key in MODEL_CONFIG_KEYS - {"trust_remote_code"}:
            parts["ModelConfig"][key] = value
        else:
            parts["SFTConfig"][key] = value
    return parts


def exported_mapping(export: Export) -> dict[str, Any]:
    """The exported config as data (what the tool itself will read)."""
    return json.loads(export.text) if export.recipe.endswith(".json") else yaml.safe_load(export.text)


def recommended(study: dict[str, Any], recommendations: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """(the fix's change, the cell that is the recipe with it) for every fix of every recommendation whose
    failing cells include the baseline, where that cell ran ok (it is among the fix's evidence)."""
    from tunegrid.study.config import Cell

    grid = study["grid"]
    baseline = {axis: grid[axis][0] for axis in AXES if grid.get(axis)}
    baseline_id = Cell(**baseline).cell_id
    found = []
    for rec in recommendations:
        if baseline_id not in rec.get("failing", []) + rec.get("concerns", []):
            continue
        for fix in rec.get("fixes", []):
            cell_id = Cell(**{**baseline, **fix["change"]}).cell_id
            if cell_id in fix.get("evidence", []) and all(k in AXES for k in fix["change"]):
                found.append((fix["change"], cell_id))
    return found


def export_command(cell_id: str, family: str, study_dir: Path) -> str:
    """The command that writes this fix's config again, as the CLI takes it (it needs the study's folder)."""
    import shlex

    return shlex.join(["tunegrid", "export", cell_id, "--to", family, "--study-dir", str(study_dir)])


def fixes_html(study_file: Path, recommendations: list[dict[str, Any]], out_dir: Path) -> str:
    """The report's section: each recommended fix as the user's own config (a file beside the report) and
    its diff against the recipe. Empty when the study was not imported from a recipe."""
    import html

    if not study_file.is_file():
        return ""
    study = json.loads(study_file.read_text())
    base = study.get("base") or {}
    if not base.get("recipe"):
        return ""
    parts = [f"<h2>Your recipe, fixed</h2><p>From <code>{html.escape(base['recipe'])}</code>: each fix the grid "
             "proved, as a config of your own tool that changes only what the fix changes.</p>"]  # fmt: skip
    fixes = recommended(study, recommendations)
    for change, cell_id in fixes:
        try:
            done = export_cell(study, cell_id, _family(base.get("from") or "auto"))
        except (ConfigError, OSError) as exc:
            parts.append(f"<p>{html.escape(cell_id)}: not exported ({html.escape(str(exc))})</p>")
            continue
        name = f"fix-{cell_id}{Path(base['recipe']).suffix}"
        (out_dir / name).write_text(done.text)
        changed = ", ".join(f"{k}: {v}" for k, v in change.items())
        parts.append(
            f"<h3>{html.escape(changed)} — cell {html.escape(cell_id)} (ok)</h3>"
            f"<p>Config: <a href='{html.escape(name)}'>{html.escape(name)}</a>"
            f" (<code>{html.escape(export_command(cell_id, _family(done.tool), study_file.parent))}</code>)</p>"
            f"<pre class='diff'>{html.escape(chr(10).join(done.diff))}</pre>"
        )
    if not fixes:
        parts.append("<p>No fix to carry back: the recipe's own cell ended ok, or no fix ran ok.</p>")
    return "\n".join(parts)
