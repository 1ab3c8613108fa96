"""A study as the command line gives it: the study files (read by tunegrid's bounded loader, not taken
from Snakemake's copy) with the `--config` overrides, typed by the schema, on top."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from tunegrid.study.config import DEFAULT_STUDY_PATH, load_schema, read_yaml
from tunegrid.study.errors import ConfigError
from tunegrid.study.input_limits import read_study_yaml, size_problems

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def coerce_overrides(values: Any, schema: dict[str, Any] | None = None) -> Any:
    """Command-line overrides typed by the schema.

    Snakemake passes nested `--config` values as strings (`train={steps: 5}` arrives as {"steps": "5"}),
    so each string is converted to the type the schema declares at its key (boolean, integer, number,
    or a list of those, also from a "[2, 4]" literal). A string that does not convert is left as it is:
    validation then names the key and what is allowed, as for a study file.
    """
    schema = load_schema() if schema is None else schema
    if isinstance(values, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {
            k: coerce_overrides(v, props.get(k) or (extra if isinstance(extra, dict) else {}))
            for k, v in values.items()
        }
    if isinstance(values, list):
        return [coerce_overrides(v, schema.get("items") or {}) for v in values]
    return _coerce_string(values, schema) if isinstance(values, str) else values


def _coerce_string(value: str, schema: dict[str, Any]) -> Any:
    """One string at a key of the schema, as the first type it declares that the text reads as (the string as it
    is where none does)."""
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types} if types else set()
    text = value.strip()
    enum = schema.get("enum") or []
    if value not in enum and any(text == str(v) for v in enum):  # `gpus_per_rank: 0` arrives as "0"
        return next(v for v in enum if text == str(v))
    if "array" in types and text.startswith("["):
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError:
            return value
        return coerce_overrides(parsed, schema) if isinstance(parsed, list) else value
    if "boolean" in types and text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    if "integer" in types and re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if "number" in types:
        try:
            return float(text)
        except ValueError:
            return value
    if "null" in types and text.lower() in {"null", "none", "~"}:
        return None
    return value


STUDY_PATH_KEY = "study_path"  # `--config study_path=<file>`: a study file only tunegrid reads (docs/guide/security.md)
STUDY_KEY = "study"  # `--config study=<file>.yaml`, the short form of the same; `study=<name>` renames the study
STUDY_FILE_SUFFIXES = (".yaml", ".yml")
STUDY_FILE_ENV = "TUNEGRID_STUDY_FILE"  # the study file named by `--config study=`, for each cell's re-run command


def study_file_named(overrides: dict[str, Any]) -> str | None:
    """The study file the command line names for tunegrid's bounded loader, taken out of `overrides`:
    `study=<path>` where the value is a path (it holds a '/', which a study's name cannot, or ends in
    .yaml/.yml), or the long form `study_path=<path>`. Any other `study=` value renames the study, as before.
    Both forms at once are refused, naming the two."""
    short = overrides.get(STUDY_KEY)
    is_file = isinstance(short, str) and ("/" in short or short.endswith(STUDY_FILE_SUFFIXES))
    by_path = overrides.pop(STUDY_PATH_KEY, None)
    if is_file and by_path is not None:
        raise ConfigError(
            f"config key 'study': --config study={short} and study_path={by_path} both name a study file; keep one"
        )
    if is_file:
        return str(overrides.pop(STUDY_KEY))
    return None if by_path is None else str(by_path)


def study_config(config: dict[str, Any], overrides: Any, study_files: list[Any]) -> dict[str, Any]:
    """The study Snakemake should run: the study file(s) given, or the default study when none is,
    with the command-line overrides (`--config`, typed by the schema) on top. The schema supplies the rest.

    The study files are read again here with tunegrid's bounded loader rather than taken from Snakemake's
    copy, so `tunegrid validate` and Snakemake see the same values (`lr: 1e-3` is a number in both)."""
    from snakemake.utils import update_config

    overrides = dict(overrides or {})
    by_path = study_file_named(overrides)
    files = [*study_files, *([by_path] if by_path is not None else [])]
    base: dict[str, Any] = {} if files else read_yaml(DEFAULT_STUDY_PATH)
    for path in files:
        raw = read_study_yaml(Path(path)) or {}  # first: it names the key of an alias bomb
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(raw).__name__}")
        update_config(base, raw)
    problems = size_problems(config)  # what snakemake made of it all, overrides included
    if problems:
        raise ConfigError("invalid study config:\n  - " + "\n  - ".join(problems))
    overrides = coerce_overrides(copy.deepcopy(overrides))
    update_config(base, overrides)
    return without_moot_exclusions(base, overrides.get("grid"))


def without_moot_exclusions(study: dict[str, Any], grid_overrides: Any) -> dict[str, Any]:
    """The study without the `grid.exclude` entries its files wrote for values a command-line override took out of
    the grid (`--config "grid={batch_size: [2]}"` on a study that excludes batch_size 4 with grad_accum 4): such an
    entry excludes nothing any more. An override that writes `grid.exclude` itself is checked as the file's is."""
    grid = study.get("grid")
    if not isinstance(grid_overrides, dict) or "exclude" in grid_overrides or not isinstance(grid, dict):
        return study
    listed = {axis: values for axis, values in grid_overrides.items() if isinstance(values, list)}
    exclude = grid.get("exclude")
    if isinstance(exclude, list):
        grid["exclude"] = [
            entry
            for entry in exclude
            if not isinstance(entry, dict) or all(value in listed.get(axis, [value]) for axis, value in entry.items())
        ]
    return study
