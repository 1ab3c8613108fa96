"""Import every training config under a folder as it is (no flag) and count what happens.

    python benchmarks/recipe_import.py <folder> [<folder> ...] [--show]

Each file is classified from its own keys, independently of the importer: an axolotl file is SFT LoRA/QLoRA
when it has `adapter: lora|qlora` and no `rl`, `reward_model`, `process_reward_model`, `pretraining_dataset`,
`num_labels`; a TRL / alignment-handbook file when it sets `use_peft` and lives under no dpo/orpo/kto/grpo
folder and has none of DPOConfig's `beta`. Files naming no model (accelerate/launcher configs) are skipped.
Two kinds of SFT LoRA recipe are counted apart, because tunegrid does not train them: multimodal ones
(`processor_type`, `image_size`, `freeze_mm_modules`), and LoRA over a base checkpoint stored in a quantization
that is not bitsandbytes' (axolotl's `gptq`, `model_quantization_config` such as Mxfp4Config, `nvfp4_merge_aware`,
`dsv4_fp4_grouped_mode`, `llmcompressor`, `use_onebitllms`: GPTQ, MXFP4, NVFP4, compressed or 1-bit bases).
Both are expected to be refused by name, and are printed in their own rows, never dropped from the table.
An SFT LoRA/QLoRA recipe counts as imported when `tunegrid import` writes its study and the study passes
every check `tunegrid validate` runs (schema, cross-checks, cells); a non-SFT one counts as refused by name
when the error names the key that makes it so. Any other exception is a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import yaml

NON_SFT_FOLDERS = re.compile(r"/(dpo|orpo|kto|grpo|rl|reward|ppo|apo|simpo)/", re.IGNORECASE)
MULTIMODAL = ("processor_type", "image_size", "freeze_mm_modules")
PREQUANTIZED = ("gptq", "model_quantization_config", "nvfp4_merge_aware", "dsv4_fp4_grouped_mode", "llmcompressor",
                "use_onebitllms")  # fmt: skip
KINDS = {
    "sft-lora": "SFT LoRA/QLoRA, text",
    "sft-prequantized": "SFT LoRA over a GPTQ/MXFP4/NVFP4/... checkpoint",
    "sft-multimodal": "SFT LoRA/QLoRA, multimodal",
    "non-sft": "not SFT (DPO/ORPO/KTO/GRPO/reward/pretraining/full)",
}


def classify(path: Path, raw: dict) -> str | None:
    if "base_model" in raw:
        if raw.get("rl") or raw.get("reward_model") or raw.get("process_reward_model") or raw.get("num_labels"):
            return "non-sft"
        if raw.get("pretraining_dataset") or raw.get("adapter") not in ("lora", "qlora"):
            return "non-sft"
        if any(raw.get(k) for k in PREQUANTIZED):
            return "sft-prequantized"
        return "sft-multimodal" if any(raw.get(k) for k in MULTIMODAL) else "sft-lora"
    if "model_name_or_path" in raw:
        if NON_SFT_FOLDERS.search(str(path)) or "beta" in raw or not raw.get("use_peft"):
            return "non-sft"
        return "sft-lora"
    return None


def run(path: Path, kind: str, out: Path) -> tuple[str, str]:
    from tunegrid.recipes.recipe_study import import_recipe
    from tunegrid.study.config import expand_cells, resolve_study
    from tunegrid.study.errors import ConfigError

    try:
        study, recipe, _ = import_recipe({"recipe": str(path), "failure": "all"})
        cells = expand_cells(resolve_study(study))
        name = re.sub(r"[^A-Za-z0-9.-]+", "-", str(path.relative_to(path.parents[2])).removesuffix(path.suffix))
        study["study"] = name.strip("-.")[:64]
        (out / f"{study['study']}.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
        return "imported", f"{len(cells)} cells"
    except ConfigError as exc:
        return "refused", str(exc)
    except Exception:  # what the benchmark counts: a traceback the user would see
        return "traceback", traceback.format_exc(limit=3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--show", action="store_true", help="print each file's outcome")
    parser.add_argument("--keep", type=Path, help="write the imported studies into this folder (to dry-run them)")
    args = parser.parse_args()
    counts: Counter[tuple[str, str]] = Counter()
    refused_sft: list[tuple[str, str]] = []
    unnamed: list[str] = []
    tracebacks: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        files = sorted(p for folder in args.folders for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))
        for path in files:
            try:
                raw = yaml.safe_load(path.read_text())
            except yaml.YAMLError:
                continue
            kind = classify(path, raw) if isinstance(raw, dict) else None
            if kind is None:
                continue
            outcome, detail = run(path, kind, out)
            counts[(kind, outcome)] += 1
            if outcome == "traceback":
                tracebacks.append((str(path), detail))
            elif kind != "non-sft" and outcome == "refused":  # text, pre-quantized and multimodal alike
                refused_sft.append((str(path), detail))
            elif kind == "non-sft" and outcome == "refused" and "is not LoRA/QLoRA SFT" not in detail:
                unnamed.append(f"{path}: {detail.splitlines()[-1]}")
            elif kind == "non-sft" and outcome == "imported":
                unnamed.append(f"{path}: imported")
            if args.show:
                print(f"{outcome:9} {kind:15} {path}")
    total = {kind: sum(v for (k, _), v in counts.items() if k == kind) for kind in KINDS}
    named = total["non-sft"] - len(unnamed) - counts[("non-sft", "traceback")]
    print(f"files read as recipes: {sum(total.values())}")
    print(f"{'class':52} {'files':>5} {'imported':>8} {'refused':>7} {'traceback':>9}")
    for kind, label in KINDS.items():
        row = [counts[(kind, outcome)] for outcome in ("imported", "refused", "traceback")]
        print(f"{label:52} {total[kind]:5} {row[0]:8} {row[1]:7} {row[2]:9}")
    sft_ok, text = counts[("sft-lora", "imported")], total["sft-lora"]
    print(
        f"SFT LoRA/QLoRA (text): {sft_ok}/{text} imported with no flag and validated "
        f"({100 * sft_ok / max(1, text):.1f} %)"
    )
    every = text + total["sft-prequantized"] + total["sft-multimodal"]
    every_ok = sft_ok + counts[("sft-prequantized", "imported")] + counts[("sft-multimodal", "imported")]
    print(
        f"every SFT LoRA recipe (text, pre-quantized, multimodal): {every_ok}/{every} "
        f"({100 * every_ok / max(1, every):.1f} %)"
    )
    print(
        f"non-SFT: {named}/{total['non-sft']} refused naming what makes them so "
        f"({100 * named / max(1, total['non-sft']):.1f} %)"
    )
    print(f"tracebacks: {len(tracebacks)}")
    keys = Counter(
        key for _, detail in refused_sft for key in dict.fromkeys(re.findall(r"recipe key '([^']+)'", detail))
    )
    print(
        "keys refused in SFT recipes (a recipe can name several): "
        + ", ".join(f"{k} {n}" for k, n in keys.most_common())
    )
    for path, detail in refused_sft:
        print(f"\nrefused SFT recipe {path}:\n{detail}")
    for line in unnamed:
        print(f"\nnon-SFT not refused by name: {line}")
    for path, detail in tracebacks:
        print(f"\ntraceback {path}:\n{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
