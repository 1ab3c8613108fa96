"""`tunegrid pin <study file>`: the commits an unpinned study's hub models and dataset were fetched at (their
manifest.json / train.source.json, written by the checkpoint and dataset rules) written into the study file
as `revision:`, so every later run fetches exactly those files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from tunegrid.runtime.files import read_json
from tunegrid.study.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pin", help="write the commits an unpinned study's hub model/dataset were fetched at into it")
    p.add_argument("study_file", help="the study file (e.g. configs/<study>.yaml) whose study has fetched")
    p.add_argument("--results", default="results", help="the results folder the study ran in")
    p.set_defaults(func=pin_study)


def pins(study: dict[str, Any], study_dir: Path) -> dict[str, str]:
    """{study key: commit} for each unpinned hub source whose fetch recorded a commit."""
    from tunegrid.study.sources import data_source_path

    found: dict[str, str] = {}
    for name, spec in (study.get("models") or {}).items():
        manifest = study_dir / "models" / name / "manifest.json"
        if spec.get("source") == "hub" and not spec.get("revision") and manifest.is_file():
            source = read_json(manifest).get("source") or {}
            if source.get("repo_id") == spec.get("repo_id") and source.get("revision"):
                found[f"models.{name}.revision"] = source["revision"]
    data = study.get("data") or {}
    sidecar = data_source_path(study_dir / "data" / "train.jsonl")
    if data.get("source") == "hub" and not data.get("revision") and sidecar.is_file():
        source = read_json(sidecar)
        if source.get("repo_id") == data.get("repo_id") and source.get("revision"):
            found["data.revision"] = source["revision"]
    return found


def pin_study(args: argparse.Namespace) -> None:
    path = Path(args.study_file)
    if not path.is_file():
        raise ConfigError(f"study file {str(path)!r} does not exist")
    text = path.read_text()
    study = yaml.safe_load(text) or {}
    if not isinstance(study, dict) or not study.get("study"):
        raise ConfigError(f"{path}: not a study file (no `study:` key)")
    study_dir = Path(args.results) / str(study["study"])
    found = pins(study, study_dir)
    unpinned = [f"models.{n}" for n, s in (study.get("models") or {}).items() if s.get("source") == "hub"]
    unpinned = [k for k in unpinned if not study["models"][k.split(".", 1)[1]].get("revision")]
    unpinned += (
        ["data"] if (study.get("data") or {}).get("source") == "hub" and not study["data"].get("revision") else []
    )
    missing = [k for k in unpinned if not any(p.startswith(k + ".") or p == f"{k}.revision" for p in found)]
    if not found:
        why = f"{', '.join(missing)} not fetched yet under {study_dir}" if missing else "every hub source is pinned"
        raise ConfigError(f"{path}: nothing to pin: {why} (the checkpoint and dataset rules record the commits)")
    for key, commit in found.items():
        section, *rest = key.split(".")
        target = study[section]
        for part in rest[:-1]:
            target = target[part]
        target[rest[-1]] = commit
        target.pop("ref", None)  # a pinned source fetches its commit, whatever the branch does
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    path.write_text(header + ("\n" if header else "") + yaml.safe_dump(study, sort_keys=False))
    for key, commit in found.items():
        print(f"{key}: {commit}")
    if missing:
        print(f"not fetched yet, left unpinned: {', '.join(missing)}")
    print(f"pinned in {path}")
