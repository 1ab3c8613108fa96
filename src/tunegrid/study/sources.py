"""Where a study's hub model and dataset came from, as their fetch recorded it: the model's manifest.json and the
dataset's source file beside train.jsonl (written by tunegrid.prepare.hub), read back for a cell's result (its
MLflow tags) and the report's header.

Light module: standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunegrid.runtime.files import read_json

DATA_SOURCE_SUFFIX = ".source.json"  # beside the dataset rule's train.jsonl


def fetched_line(what: str, source: dict[str, Any]) -> str:
    """The report header's line for one fetched source."""
    where = f"{what} {source.get('repo_id')}"
    if source.get("pinned", True):
        return f"{where}: pinned at {source.get('revision')}"
    return f"{where}: not pinned; fetched at {source.get('revision')} ({source.get('ref')!r})"


def fetched_sources(study_dir: Path) -> list[str]:
    """One line per hub model and dataset a study fetched (their manifests), for the report's header."""
    lines = []
    for manifest in sorted((study_dir / "models").glob("*/manifest.json")):
        source = read_json(manifest).get("source") or {}
        if source.get("kind") == "hub":
            lines.append(fetched_line(f"model {manifest.parent.name}:", source))
    for sidecar in sorted((study_dir / "data").glob(f"*{DATA_SOURCE_SUFFIX}")):
        source = read_json(sidecar)
        if source.get("kind") == "hub":
            lines.append(fetched_line("dataset:", source))
    return lines


def fetched_env(model_dir: Path, data_path: Path) -> dict[str, Any]:
    """The cell result's record of where its model and data came from (the MLflow tags read it)."""
    env: dict[str, Any] = {}
    manifest = Path(model_dir) / "manifest.json"
    if manifest.is_file():
        source = read_json(manifest).get("source") or {}
        if source.get("kind") == "hub":
            env["model_source"] = {k: source.get(k) for k in ("repo_id", "revision", "pinned")}
    sidecar = data_source_path(data_path)
    if sidecar.is_file():
        source = read_json(sidecar)
        env["data_source"] = {k: source.get(k) for k in ("repo_id", "revision", "pinned")}
    return env


def data_source_path(data_path: str | Path) -> Path:
    path = Path(data_path)
    return path.with_name(path.stem + DATA_SOURCE_SUFFIX)
