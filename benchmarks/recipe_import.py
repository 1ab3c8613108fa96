"""Import every training config under a folder as it is (no flag) and count what happens.

    python benchmarks/recipe_import.py <folder> [<folder> ...] [--show]
    python benchmarks/recipe_import.py --corpus benchmarks/recipe_corpus.tsv <folder> [--held-out no|yes]

With `--corpus`, the folder is the public corpus as benchmarks/fetch_recipe_corpus.py lays it out
(<owner>__<name>/<path>), and each file's class is the list's: its tool (`kind`: axolotl, trl, transformers, or
other: LLaMA-Factory and custom-script configs) and whether it is LoRA/QLoRA text SFT (`sft_lora`). An SFT recipe
is then counted imported, refused naming a local file that its repository does not hold (the key, the path and
the flag that supplies it: no importer can run it as it is), or refused otherwise; a non-SFT one, or one of
another format, counts as refused by name when the error says what makes it so ("is not LoRA/QLoRA SFT",
"format not recognised"). Every imported study is checked for fidelity (recipes.fidelity): each recipe value is
what the study trains on or a row of its header, and the first training record's text, where the record is on
this machine, is the text the recipe's tool builds from it. TUNEGRID_DATA_ROOTS is set to the folder, so that the
validation reads the recipes' own data files there.

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
import csv
import json
import os
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


def run(path: Path, kind: str, out: Path, fidelity: list | None = None, files: dict | None = None) -> tuple[str, str]:
    from tunegrid.recipes.importer import import_recipe
    from tunegrid.study.config import expand_cells, resolve_study
    from tunegrid.study.errors import ConfigError

    try:
        study, recipe, header = import_recipe({"recipe": str(path), "failure": "all", **(files or {})})
        cells = expand_cells(resolve_study(study))
        name = re.sub(r"[^A-Za-z0-9.-]+", "-", str(path.relative_to(path.parents[2])).removesuffix(path.suffix))
        study["study"] = name.strip("-.")[:64]
        (out / f"{study['study']}.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
        if fidelity is not None:
            from tunegrid.recipes.fidelity import check_fidelity

            fidelity.append((str(path), check_fidelity(recipe, resolve_study(study), header)))
        return "imported", f"{len(cells)} cells"
    except ConfigError as exc:
        return "refused", str(exc)
    except Exception:  # what the benchmark counts: a traceback the user would see
        return "traceback", traceback.format_exc(limit=3)


MISSING_LOCAL = re.compile(r"is not (a file|a folder|there)[^\n]*(--model|--dataset)")
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 4096, "torch_dtype": "float32"}  # fmt: skip


def user_files(detail: str, path: Path, work: Path) -> dict[str, str]:
    """For a recipe refused only because a local data file or model folder is not in its repository: what a user
    with those files passes (--dataset: two records with the recipe's own field names; --model: a tiny local
    checkpoint folder). Empty where anything else is refused too."""
    problems = [line for line in detail.splitlines() if line.strip().startswith("- ")]
    if not problems or not all(MISSING_LOCAL.search(line) for line in problems):
        return {}
    from tunegrid.recipes.core import read_file

    files = {}
    if any("--model" in line for line in problems):
        (work / "tiny-model").mkdir(exist_ok=True)
        (work / "tiny-model" / "config.json").write_text(json.dumps(TINY_LLAMA))
        files["model"] = str(work / "tiny-model")
    if any("--dataset" in line for line in problems):
        record = sample_record(read_file(path))
        data = work / f"{re.sub(r'[^A-Za-z0-9]+', '-', path.stem)}.jsonl"
        data.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
        files["dataset"] = str(data)
    return files


def sample_record(raw: dict) -> dict:
    """A record in the recipe's own dataset type and field names."""
    from tunegrid.study.prompts import SHAREGPT, layout_fields

    chat = [("user", "What is 2+2?"), ("assistant", "4")]
    entries = raw.get("datasets")
    if not (isinstance(entries, list) and entries and isinstance(entries[0], dict)):  # TRL: text or messages
        field = raw.get("dataset_text_field")
        if isinstance(field, str) and field not in ("messages", "conversations"):
            return {field: "Once upon a time there was a tiny model."}
        return {"messages": [{"role": r, "content": c} for r, c in chat]}
    entry = entries[0]
    kind = entry.get("type")
    if kind in ("completion", "text"):
        return {entry.get("field") or "text": "Once upon a time there was a tiny model."}
    if kind == "input_output":
        return {"segments": [{"label": False, "text": "2+2? "}, {"label": True, "text": "4"}]}
    if isinstance(kind, str) and kind.split(":")[0].split(".")[0] in SHAREGPT:
        field = entry.get("field_messages") or "conversations"
        return {field: [{"from": {"user": "human", "assistant": "gpt"}[r], "value": c} for r, c in chat]}
    fields = layout_fields(kind) if kind not in (None, "chat_template") else ()
    if fields:
        return {name: "2+2?" if i == 0 else "4" for i, name in enumerate(fields)}
    mapping = dict(entry.get("message_property_mappings") or {})
    role = mapping.get("role") or entry.get("message_field_role") or "role"
    content = mapping.get("content") or entry.get("message_field_content") or "content"
    return {entry.get("field_messages") or "messages": [{role: r, content: c} for r, c in chat]}


NAMED = ("is not LoRA/QLoRA SFT", "format not recognised")
CORPUS_ROWS = {
    "tool": "LoRA/QLoRA text SFT, axolotl / TRL / Transformers",
    "other": "LoRA/QLoRA text SFT, another format (LLaMA-Factory, scripts)",
    "non-sft": "not LoRA/QLoRA text SFT (any format)",
}


def corpus(args: argparse.Namespace) -> int:
    """The public corpus (its list's classes): the figures the recipes issue asks for."""
    with open(args.corpus, newline="") as handle:
        table = [r for r in csv.DictReader(handle, delimiter="\t") if r["kind"] != "data"]
    table = [r for r in table if args.held_out == "all" or r["held_out"] == args.held_out]
    root = args.folders[0].resolve()
    os.environ["TUNEGRID_DATA_ROOTS"] = str(root)
    counts: Counter[tuple[str, str]] = Counter()
    fidelity: list[tuple[str, list[str]]] = []
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        here = Path.cwd()
        os.chdir(tmp)  # a recipe's relative paths resolve beside it, never in this checkout
        try:
            for row in table:
                path = root / row["repo"].replace("/", "__") / row["path"]
                if not path.is_file():
                    counts[("missing", "")] += 1
                    continue
                cls = "non-sft" if row["sft_lora"] != "yes" else "other" if row["kind"] == "other" else "tool"
                outcome, detail = run(path, cls, out, fidelity if cls == "tool" else None)
                if outcome == "refused" and cls != "non-sft" and MISSING_LOCAL.search(detail):
                    outcome = "refused: local file not here"
                    files = user_files(detail, path, Path(tmp)) if cls == "tool" else {}
                    supplied, said = run(path, cls, out, fidelity, files) if files else ("refused", detail)
                    counts[(cls, f"with files: {supplied}")] += 1
                    if supplied != "imported":
                        first = said.strip().splitlines()
                        lines.append(f"with the user's files, {supplied}: {row['repo']}/{row['path']}: "
                                     + " | ".join(first[:4]))  # fmt: skip
                if outcome == "refused" and (cls == "non-sft" or row["kind"] == "other"):
                    outcome = "refused by name" if any(n in detail for n in NAMED) else "refused, not by name"
                counts[(cls, outcome)] += 1
                counts[(f"{cls}:{row['kind']}", outcome)] += 1
                if args.show or outcome in ("traceback", "refused", "refused, not by name"):
                    first = detail.strip().splitlines()
                    lines.append(f"{outcome:28} {row['kind']:12} {row['repo']}/{row['path']}: " + " | ".join(first[:4]))
                if outcome == "imported" and row["kind"] == "other":
                    lines.append(f"imported, another format: {row['repo']}/{row['path']}")
        finally:
            os.chdir(here)
    outcomes = ("imported", "refused: local file not here", "refused by name", "refused", "refused, not by name",
                "traceback")  # fmt: skip
    print(f"corpus {args.corpus} (held_out={args.held_out}): {len(table)} recipes, {counts[('missing', '')]} absent")
    print(f"{'class':62} {'files':>5} " + " ".join(f"{o[:18]:>18}" for o in outcomes))
    for cls, label in CORPUS_ROWS.items():
        kinds = sorted({k.split(":")[1] for k, _ in counts if k.startswith(f"{cls}:")})
        for name, shown in [(cls, label), *((f"{cls}:{k}", f"  {k}") for k in kinds)]:
            row = [counts[(name, o)] for o in outcomes]
            print(f"{shown:62} {sum(row):5} " + " ".join(f"{n:18}" for n in row))
    tool = sum(counts[("tool", o)] for o in outcomes)
    ok, local = counts[("tool", "imported")], counts[("tool", "refused: local file not here")]
    print(f"axolotl/TRL/Transformers LoRA/QLoRA text SFT imported with no flag and validated: {ok}/{tool} "
          f"({100 * ok / max(1, tool):.1f} %); of those whose files are on this machine (their repository holds "
          f"them, or hub ids): {ok}/{tool - local} ({100 * ok / max(1, tool - local):.1f} %); refused naming a "
          f"local file that is not here, its key and flag: {local}")  # fmt: skip
    supplied = counts[("tool", "with files: imported")]
    print(f"  with the user's files supplied (--dataset: records with the recipe's own field names, --model: a local "
          f"tiny checkpoint folder, where those were all that was missing): {ok + supplied}/{tool} "
          f"({100 * (ok + supplied) / max(1, tool):.1f} %); {supplied} of the {local} refused for a local "
          "file")  # fmt: skip
    every = tool + sum(counts[("other", o)] for o in outcomes)
    print(f"every LoRA/QLoRA text SFT recipe (other formats included): {ok}/{every} ({100 * ok / max(1, every):.1f} %)")
    non = sum(counts[("non-sft", o)] for o in outcomes)
    named = counts[("non-sft", "refused by name")]
    print(f"non-SFT refused by name: {named}/{non} ({100 * named / max(1, non):.1f} %)")
    other = sum(counts[("other", o)] for o in outcomes)
    print(f"other formats refused as not recognised: {counts[('other', 'refused by name')]}/{other}")
    print(f"tracebacks: {sum(v for (k, o), v in counts.items() if o == 'traceback' and ':' not in k)}")
    faithful = [p for p, problems in fidelity if not problems]
    text_checked = sum(1 for _, problems in fidelity if not any("record" in p for p in problems))
    print(
        f"fidelity: {len(faithful)}/{len(fidelity)} imported studies train on the recipe's values and text, "
        "every difference a row of the header"
    )
    for path, problems in fidelity:
        for problem in problems:
            lines.append(f"fidelity {path}: {problem}")
    del text_checked
    print("\n".join(lines))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--show", action="store_true", help="print each file's outcome")
    parser.add_argument("--keep", type=Path, help="write the imported studies into this folder (to dry-run them)")
    parser.add_argument("--corpus", type=Path, help="the public corpus's list (benchmarks/recipe_corpus.tsv)")
    parser.add_argument("--held-out", default="no", choices=["no", "yes", "all"], help="with --corpus: which recipes")
    args = parser.parse_args()
    if args.corpus:
        return corpus(args)
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
