"""Where a recipe's model and data are: a local folder or file (found from here or beside the recipe), else a
hub id. Only a name that looks like a hub id (`owner/name`, no file suffix, no leading `.`, `/` or `~`) becomes
a hub source; a local path that is not there is refused naming the recipe's key, the path, and the flag that
supplies it (--model, --dataset), never read as a hub id whose fetch would later blame the network.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tunegrid.recipes.core import HEX40, Recipe
from tunegrid.study.data_checks import DataError, json_array

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".yaml", ".yml", ".gz", ".zip")


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not name.lower().endswith(FILE_SUFFIXES) and ".." not in name


def resolve_local(recipe: Recipe, name: str) -> Path | None:
    """A path as written if it exists from here, else beside the recipe file (where its author meant it)."""
    for candidate in (Path(name).expanduser(), Path(recipe.path).parent / name):
        if candidate.exists():
            return candidate
    return None


def missing(recipe: Recipe, key: str, name: str, what: str, flag: str) -> None:
    beside = Path(recipe.path).parent / name
    recipe.need(
        key,
        f"{name!r} is not there: no {what} at {name!r} from here nor at {str(beside)!r} beside the recipe, and "
        f"it is no hub id (owner/name); pass {flag} <path or hub id> for the {what} the recipe was written with",
    )


def model_entry(recipe: Recipe, name_key: str, name: Any, revision_key: str, revision: Any) -> None:
    """`models.<name>`: a local folder (config.json inside), else a hub repo at a pinned 40-hex revision."""
    if not isinstance(name, str) or not name:
        recipe.need(name_key, "no model: give the base model (a local folder or a hub id), or pass --model")
        return
    folder = resolve_local(recipe, name)
    if folder is not None:
        if not (folder / "config.json").is_file():
            recipe.need(name_key, f"{name!r} is a folder without config.json; give a transformers checkpoint folder")
            return
        recipe.carry("model", {"source": "local", "path": str(folder)}, name_key)
        recipe.drop(revision_key, "a local folder has no revision")
        return
    if not looks_like_hub_id(name):
        missing(recipe, name_key, name, "model folder", "--model")
        return
    rev = str(revision or "")
    if not HEX40.match(rev):  # resolved by the checkpoint rule when it fetches, recorded, `tunegrid pin` writes it
        ref = rev or "main"
        recipe.unpinned[name_key] = ref
        recipe.notes.append(
            f"{name_key}: {name!r} is not pinned; the checkpoint rule fetches {ref!r} and records its commit "
            "(manifest, study, MLflow, report); `tunegrid pin <study>` writes it back"
        )
        recipe.carry("model", {"source": "hub", "repo_id": name, "revision": "", "ref": ref}, name_key, revision_key)
        return
    recipe.carry("model", {"source": "hub", "repo_id": name, "revision": rev}, name_key, revision_key)


def local_dataset(recipe: Recipe, key: str, path: str, fmt: str | None = None) -> Path | None:
    """A local jsonl/parquet file: `data.source` and `data.path`; None if `path` is no local file (a name that is
    no hub id and is not there is refused here, naming `key` and --dataset)."""
    found = resolve_local(recipe, path)
    if found is None or not found.is_file():
        if found is None and not looks_like_hub_id(path):
            missing(recipe, key, path, "data file", "--dataset")
        elif found is not None:
            recipe.need(key, f"{path!r} is a folder; tunegrid reads one JSON-lines or parquet file: pass --dataset")
        return None
    suffix = (fmt or found.suffix.lstrip(".")).lower()
    source = {"json": "jsonl", "jsonl": "jsonl", "parquet": "parquet"}.get(suffix)
    if source is None:
        recipe.refuse(key, f"{path!r}: tunegrid reads JSON lines (.jsonl), JSON arrays (.json) or parquet files")
        return None
    recipe.carry("data.source", source, key)
    recipe.carry("data.path", str(found), key)
    return found


def first_record(path: Path) -> dict[str, Any]:
    """The first record of a local dataset file (to tell pairs from chats)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).slice(0, 1).to_pylist()
        return rows[0] if rows else {}
    try:
        array = json_array(path)
    except (DataError, UnicodeDecodeError):
        return {}
    if array is not None:
        return array[0] if array and isinstance(array[0], dict) else {}
    with open(path) as handle:
        for line in handle:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return {}
                return record if isinstance(record, dict) else {}
    return {}


def hub_dataset(recipe: Recipe, key: str, repo_id: str, revision: Any, split: str) -> None:
    """A hub dataset, pinned or not: an unpinned one is fetched at `ref` when the dataset rule runs."""
    revision = str(revision or "")
    recipe.carry("data.source", "hub", f"{key}.path")
    recipe.carry("data.repo_id", repo_id, f"{key}.path")
    recipe.carry("data.split", split, f"{key}.split")
    if HEX40.match(revision):
        recipe.carry("data.revision", revision, f"{key}.revision")
        return
    ref = revision or "main"
    said = f"{key}.revision" if revision else f"{key}.path"
    recipe.carry("data.revision", "", said)
    recipe.carry("data.ref", ref, said)
    recipe.unpinned[f"{key}.path"] = ref
    recipe.notes.append(
        f"{key}.path: {repo_id!r} is not pinned; the dataset rule fetches {ref!r} and records its commit "
        "(`tunegrid pin <study>` writes it back)"
    )
