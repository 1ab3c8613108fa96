"""Write the keys the recipe tools know, read from their own published definitions, as the generated data the
importer reads (src/tunegrid/recipes/generated/*.json). Nothing here is written by hand: rerun it to add a
release.

    python scripts/generate_recipe_keys.py axolotl <axolotl git clone> [<tag> ...]
    python scripts/generate_recipe_keys.py trl [<trl/transformers wheel> ...]

axolotl: at each release tag, the field names (and aliases) of every pydantic model of its config schema
(src/axolotl/utils/schemas/, earlier src/axolotl/utils/config/models/input/), the `cfg.<key>` reads of its
code (the releases before the schema), the dataset entries' fields, and the keys its validation says are
deprecated or renamed ("X is deprecated, use Y"). trl: the dataclass fields of SFTConfig, ModelConfig,
ScriptArguments, the other trainers' configs and Transformers' TrainingArguments of the installed packages, and
of the older releases' wheels named (read from their source, never imported).
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "tunegrid" / "recipes" / "generated"
AXOLOTL_TAGS = ["v0.2.0", "v0.3.0", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0", "v0.8.0", "v0.9.0", "v0.10.0",
                "v0.12.0", "v0.14.0", "v0.16.0", "v0.18.0"]  # fmt: skip
SCHEMA_DIRS = ("src/axolotl/utils/schemas/", "src/axolotl/utils/config/models/input/")
DATASET_CLASS = re.compile(r"Dataset|PrompterType|DPOType|KTOType|UserDefined|MessageProperty|StepwiseSupervised")
DATASET_NAMES = {"d", "config_dataset", "ds_cfg", "dataset_cfg", "ds_config"}  # a dataset entry, not a Dataset
RENAMED = re.compile(
    r"`?([a-z][a-z0-9_]+)`?(?: parameter)? (?:is|has been|was) (?:now )?(?:deprecated|renamed)[^\"'\n]{0,80}?"
    r"(?:use|to|in favor of|instead of)\s+`?([a-z][a-z0-9_]+)`?"
)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _fields(tree: ast.AST, aliases: dict[str, str] | None = None) -> tuple[set[str], set[str]]:
    """(config fields, dataset fields) of the pydantic models in one module; `aliases` gets alias -> field."""
    config, dataset = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        into = dataset if DATASET_CLASS.search(node.name) else config
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                if not item.target.id.startswith("_") and item.target.id != "model_config":
                    into.add(item.target.id)
                for call in ast.walk(item):
                    if isinstance(call, ast.Call):
                        for kw in call.keywords:
                            if kw.arg in ("alias", "validation_alias") and isinstance(kw.value, ast.Constant):
                                into.add(str(kw.value.value))
                                if aliases is not None:
                                    aliases[str(kw.value.value)] = item.target.id
    return config, dataset


def _reads(tree: ast.AST) -> tuple[set[str], set[str]]:
    """`cfg.<key>` / `cfg["key"]` / `cfg.get("key")` reads, and the same on a dataset entry's usual names."""
    config, dataset = set(), set()
    for node in ast.walk(tree):
        base, key = None, None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            base, key = node.value, node.attr
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            base, key = node.value, node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant):
                base, key = node.func.value, node.args[0].value
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if not isinstance(key, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", key) or key == "get":
            continue
        if name == "cfg":
            config.add(key)
        elif name in DATASET_NAMES:
            dataset.add(key)
    return config, dataset


def axolotl(repo: Path, tags: list[str]) -> dict:
    versions, renamed, remapped = {}, {}, {}
    for tag in tags:
        commit = _git(repo, "rev-list", "-n", "1", tag).strip()
        names = [n for n in _git(repo, "ls-tree", "-r", "--name-only", commit).split() if n.endswith(".py")]
        names = [n for n in names if n.startswith(("src/axolotl/", "scripts/")) and "/tests/" not in n]
        schema = [n for n in names if n.startswith(SCHEMA_DIRS)]
        config, dataset, code_reads = set(), set(), set()
        for name in names:
            text = _git(repo, "show", f"{commit}:{name}")
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            if name in schema:
                got = _fields(tree, remapped)
                config |= got[0]
                dataset |= got[1]
            reads = _reads(tree)
            code_reads |= reads[0]
            if not schema:  # before the schema, a dataset entry's keys are what the code reads of it
                dataset |= reads[1]
            if name in schema or name.endswith(("utils/config.py", "utils/config/__init__.py")):
                for old, new in RENAMED.findall(text):
                    if old != new:
                        renamed.setdefault(old, new)
        if not schema:  # before the schema, the keys are what the code reads
            config |= code_reads
        versions[tag] = {"commit": commit, "schema": bool(schema), "keys": sorted(config),
                         "dataset_keys": sorted(dataset)}  # fmt: skip
    deprecated = sorted({k for tag in tags for k in _deprecated(repo, versions[tag]["commit"])})
    return {"tool": "axolotl", "versions": versions, "renamed": dict(sorted(renamed.items())),
            "remapped": dict(sorted(remapped.items())), "deprecated": deprecated}  # fmt: skip


def _deprecated(repo: Path, commit: str) -> set[str]:
    try:
        text = _git(repo, "show", f"{commit}:src/axolotl/utils/schemas/deprecated.py")
    except subprocess.CalledProcessError:
        return set()
    tree = ast.parse(text)
    return {
        i.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "DeprecatedParameters"
        for i in node.body
        if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
    }


TRL_CLASSES = {  # the module (in the package) of each dataclass `trl sft --config` and the other trainers read
    "SFTConfig": "trl/trainer/sft_config.py", "ModelConfig": "trl/trainer/model_config.py",
    "ScriptArguments": "trl/scripts/utils.py", "DatasetMixtureConfig": "trl/scripts/utils.py",
    "DPOConfig": "trl/trainer/dpo_config.py", "ORPOConfig": "trl/trainer/orpo_config.py",
    "KTOConfig": "trl/trainer/kto_config.py", "CPOConfig": "trl/trainer/cpo_config.py",
    "GRPOConfig": "trl/trainer/grpo_config.py", "RLOOConfig": "trl/trainer/rloo_config.py",
    "PPOConfig": "trl/trainer/ppo_config.py", "RewardConfig": "trl/trainer/reward_config.py",
    "TrainingArguments": "transformers/training_args.py",
}  # fmt: skip
OLD_PLACES = {"ScriptArguments": ("trl/commands/cli_utils.py", "trl/utils.py"),
              "ModelConfig": ("trl/trainer/model_config.py",)}  # fmt: skip


def _dataclass_fields(text: str, name: str) -> list[str] | None:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)]
    return None


def trl(wheels: list[Path]) -> dict:
    import importlib

    releases = {}
    for package in ("trl", "transformers"):
        module = importlib.import_module(package)
        root = Path(module.__file__).parent.parent
        releases[f"{package} {module.__version__}"] = _read_classes(lambda p, root=root: _text(root / p), package)
    for wheel in wheels:
        package, version = wheel.name.split("-")[:2]
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            releases[f"{package} {version}"] = _read_classes(
                lambda p, a=archive, n=names: a.read(p).decode() if p in n else None, package
            )
    return {"tool": "trl", "releases": releases}


def _text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _read_classes(read, package: str) -> dict[str, list[str]]:
    """Each class's own fields (its base classes' are read under their own names)."""
    found = {}
    for name, place in TRL_CLASSES.items():
        if not place.startswith(f"{package}/"):
            continue
        for candidate in (place, *OLD_PLACES.get(name, ())):
            text = read(candidate)
            fields = _dataclass_fields(text, name) if text else None
            if fields is not None:
                found[name] = sorted(fields)
                break
    return found


def main() -> int:
    tool, *rest = sys.argv[1:]
    OUT.mkdir(parents=True, exist_ok=True)
    if tool == "axolotl":
        data = axolotl(Path(rest[0]), rest[1:] or AXOLOTL_TAGS)
        data["made_by"] = "python scripts/generate_recipe_keys.py axolotl <axolotl clone> " + " ".join(
            rest[1:] or AXOLOTL_TAGS
        )
    else:
        data = trl([Path(w) for w in rest])
        data["made_by"] = "python scripts/generate_recipe_keys.py trl " + " ".join(Path(w).name for w in rest)
    buffer = io.StringIO()
    json.dump(data, buffer, indent=1, sort_keys=False)
    (OUT / f"{tool}_keys.json").write_text(buffer.getvalue() + "\n")
    print(f"wrote {OUT / f'{tool}_keys.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
