"""`tunegrid import` (a recipe in, a study out) and `tunegrid export` (a cell out as the recipe's own tool)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from tunegrid.cli.doctor import TARGET_NAMES
from tunegrid.runtime.files import read_json
from tunegrid.study.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="a study from an axolotl config or TRL / Transformers training arguments")
    p.add_argument("recipe", help="axolotl YAML, or TRL SFTConfig / TrainingArguments as YAML or JSON")
    p.add_argument("--from", dest="tool", default="auto", choices=["auto", "axolotl", "trl", "transformers"])
    p.add_argument("--failure", default="all", choices=["nan", "oom", "timeout", "all"], help="what the grid varies")
    p.add_argument("--ignore", nargs="*", default=[], help="recipe keys tunegrid cannot honour, to drop")
    p.add_argument(
        "--as-sft", action="store_true", help="a DPO/GRPO/reward/full fine-tune recipe as the LoRA SFT study"
    )
    p.add_argument("--model", default="", help="when the recipe names none: a folder or <hub id>@<40-hex revision>")
    p.add_argument(
        "--dataset",
        default="",
        help="the recipe's data as a jsonl/json/parquet file (its type and field mappings kept)",
    )
    p.add_argument("--steps", type=int, default=0, help="steps per cell when the recipe counts epochs (default 50)")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length when the recipe holds none")
    p.add_argument("--study", default="", help="the study's name (default: the recipe file's)")
    p.add_argument("--out", default="", help="the study file to write (default configs/<study>.yaml)")
    p.add_argument(
        "--target",
        default="",
        choices=["", *TARGET_NAMES],
        help="the card the recipe is for (hardware.target; a recipe names none)",
    )
    p.set_defaults(func=import_recipe)

    p = sub.add_parser("export", help="a cell of an imported study as a config of the recipe's own tool")
    p.add_argument("cell_id", help="a cell of the study, or `recommended`: the report's first fix of the recipe")
    p.add_argument("--to", required=True, choices=["axolotl", "trl"])
    p.add_argument("--study-dir", required=True, help="results/<study> of the imported study (its study.json)")
    p.add_argument("--out", default="", help="the config to write (default: print it)")
    p.set_defaults(func=export_cell)


def import_recipe(args: argparse.Namespace) -> None:
    from tunegrid.recipes.importer import import_recipe as build
    from tunegrid.study.config import expand_cells, resolve_study

    base = {"recipe": args.recipe, "from": args.tool, "failure": args.failure, "ignore": list(args.ignore)}
    base.update({k: v for k, v in (("model", args.model), ("dataset", args.dataset)) if v})
    if args.as_sft:
        base["as_sft"] = True
    base.update({k: v for k, v in (("steps", args.steps), ("seq_len", args.seq_len)) if v})
    study, recipe, header = build(base, args.study or None)
    study["base"]["from"] = recipe.tool  # the tool it was read as, so a re-read never guesses differently
    if args.target:  # the user's card: a recipe names none
        study["hardware"] = {**(study.get("hardware") or {}), "target": args.target}
    cells = expand_cells(resolve_study(study))  # the schema and every cross-check, before anything is written
    out = Path(args.out or f"configs/{study['study']}.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    comment = "\n".join(f"# {line}" if line else "#" for line in header)
    out.write_text(comment + "\n\n" + yaml.safe_dump(study, sort_keys=False))
    print("\n".join(header))
    print(f"\nstudy {study['study']!r}: {len(cells)} cells, written to {out}")
    print(f"run it: snakemake --cores 8 all --config study={out}")


def export_cell(args: argparse.Namespace) -> None:
    from tunegrid.recipes.export import export_cell as export

    study_file = Path(args.study_dir) / "study.json"
    if not study_file.is_file():
        raise ConfigError(f"{study_file} does not exist: run the study first (the study_config rule writes it)")
    study = read_json(study_file)
    cell_id = args.cell_id
    if cell_id == "recommended":  # the first fix the report carries back to the recipe
        from tunegrid.recipes.export import recommended

        recs_file = Path(args.study_dir) / "report" / "recommendations.json"
        fixes = recommended(study, read_json(recs_file)) if recs_file.is_file() else []
        if not fixes:
            raise ConfigError(f"{recs_file}: no fix of the recipe's own cell ran ok; name a cell instead")
        done = None
        # the first fix the tool's own keys can say (fp32 islands and an fp32 residual stream are tunegrid's)
        for _, fix_cell in fixes:
            try:
                done = export(study, fix_cell, args.to)
                break
            except ConfigError as exc:
                print(f"note: {fix_cell} skipped: {exc}", file=sys.stderr, flush=True)
        if done is None:
            raise ConfigError(f"{recs_file}: no recommended fix is a setting of a {args.to} config; name a cell")
    else:
        done = export(study, cell_id, args.to)
    changed = ", ".join(f"{k}: {v}" for k, v in done.keys.items()) or "nothing (this cell is the recipe itself)"
    print(f"{done.cell_id} as {done.tool} config, changing {changed}", file=sys.stderr, flush=True)
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(done.text)
        print(f"written to {args.out}")
        print("\n".join(done.diff))
    else:
        print(done.text, end="")
