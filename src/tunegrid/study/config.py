"""Study configuration: schema validation with friendly errors, defaults, and grid-cell expansion.

This module is imported when the Snakefile is parsed, so it must stay light: no torch, no
transformers at import time.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tunegrid.cell_spec import CellSpec
from tunegrid.study.errors import ConfigError
from tunegrid.study.grid import Cell, cell_class, excluded, exclusion_problems, exclusion_schema
from tunegrid.study.input_limits import (
    known_architecture,
    number_problems,
    read_study_yaml,
    secret_problems,
    size_problems,
)
from tunegrid.vocabulary import BASE_STACK, PRECISIONS, QUANTS, axis_names, axis_table

if TYPE_CHECKING:  # jsonschema is imported where a config is validated: the cell supervisor never needs it
    import jsonschema

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


# libyaml's loader when PyYAML has it: the schema is read at every `snakemake` parse (0.13 s in pure Python)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_schema() -> dict[str, Any]:
    """The study's JSON schema: the YAML file, with its `grid` built from the axis table."""
    with open(SCHEMA_PATH) as fh:
        schema = yaml.load(fh, Loader=_SAFE_LOADER)  # a safe loader (libyaml when present)
    schema["properties"]["grid"] = grid_schema()
    schema["properties"]["grid"]["properties"]["exclude"] = exclusion_schema()  # keyed by the same table
    # the reference twin's settings take the same values as the axes they name
    reference = schema["properties"]["review"]["properties"]["reference"]["properties"]
    reference["precision"]["enum"], reference["quant"]["enum"] = list(PRECISIONS), list(QUANTS)
    return schema


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    return ".".join(parts) if parts else "<top level>"


def _describe(error: jsonschema.ValidationError) -> str:
    """One sentence for one schema violation: the key, what was wrong, what is allowed."""
    key = _key_path(error)
    schema = error.schema if isinstance(error.schema, dict) else {}
    hint = schema.get("description", "")
    if error.validator == "additionalProperties":
        allowed = sorted((error.schema.get("properties") or {}).keys())
        unknown = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        return (
            f"config key '{key}': unknown key(s) {unknown}; allowed keys: {allowed}"
            if allowed
            else f"config key '{key}': unknown key(s) {unknown}"
        )
    if error.validator == "enum":
        return f"config key '{key}': {error.instance!r} is not allowed; choose one of {error.validator_value}"
    if error.validator == "required":
        return f"config key '{key}': {error.message}"
    if error.validator == "pattern":
        return f"config key '{key}': {error.instance!r} does not match {error.validator_value!r} ({hint})"
    msg = f"config key '{key}': {error.message}"
    return f"{msg} ({hint})" if hint else msg


def defaulting_validator() -> type[jsonschema.protocols.Validator]:
    """Draft 2020-12 validator that fills `default`s as it descends (as snakemake's validate does)."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):  # type: ignore[no-untyped-def]
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})


def resolve_study(raw: dict[str, Any]) -> dict[str, Any]:
    """Validate a study config, fill defaults, and check what the schema cannot say.

    Returns a new dict; raises ConfigError with every problem found, one per line.
    """
    bounds = size_problems(raw)  # before anything walks or copies it: a hostile file must not hang us
    bounds = bounds or number_problems(raw)  # NaN, infinities, 1e400: before any step computes with them
    if bounds:
        raise ConfigError("invalid study config:\n  - " + "\n  - ".join(bounds))
    config = copy.deepcopy(raw)
    secrets = secret_problems(config)  # first, and alone: other messages may quote values
    if secrets:
        raise ConfigError("invalid study config:\n  - " + "\n  - ".join(secrets))
    validator = defaulting_validator()(load_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    problems = [_describe(e) for e in errors]
    if not problems:
        problems = _semantic_problems(config)
    if problems:
        raise ConfigError("invalid study config:\n  - " + "\n  - ".join(problems))
    return config


def probe_world_sizes(study: dict[str, Any]) -> list[int]:
    """The process counts the probe's all-reduce benchmark runs at: the study's own (`probe.world_sizes`), else the
    grid's world sizes above 1. The figure is a fact of the report, measured where the study has collectives."""
    given = study["probe"]["world_sizes"]
    return sorted(set(given)) if given is not None else sorted({int(w) for w in study["grid"]["world_size"] if w > 1})


def _semantic_problems(config: dict[str, Any]) -> list[str]:
    """What the schema cannot say of a study: models, grid, stacks, adapters, data, debug and tracking checked
    against each other and against this installation."""
    problems = _architecture_problems(config["models"])
    problems += exclusion_problems(config["grid"])
    from tunegrid.study.stacks import stack_problems

    problems += stack_problems(config)
    if not problems and not expand_cells(config):
        problems.append("config key 'grid.exclude': leaves no cell of the grid; remove an entry")
    problems += _model_problems(config["models"], config["grid"]["model"])
    problems += _adapter_problems(config["lora"], config["grid"]["quant"])
    from tunegrid.study.data_checks import config_problems

    problems += config_problems(config["data"])
    from tunegrid.study.grid_axes import debug_problems

    problems += debug_problems(config)
    tracking = config["tracking"]
    if tracking["ui_host"] not in LOOPBACK_HOSTS and not tracking["ui_allowed_hosts"]:
        problems.append(
            f"config key 'tracking.ui_host': {tracking['ui_host']!r} exposes the MLflow server beyond this machine; "
            "also set 'tracking.ui_allowed_hosts' (MLflow's --allowed-hosts), or keep 127.0.0.1"
        )
    return problems


def _architecture_problems(models: dict[str, Any]) -> list[str]:
    return [
        f"config key 'models.{name}.architecture': {spec['architecture']!r} is not a model type this "
        "transformers knows (a config.json `model_type`, e.g. gemma3_text, qwen3_moe, olmoe, llama)"
        for name, spec in models.items()
        if spec["source"] == "synthetic" and not known_architecture(spec["architecture"])
    ]


def _model_problems(models: dict[str, Any], grid_models: list[str]) -> list[str]:
    """The grid's models defined, and each model's source complete: where it is read from, and no remote code
    outside a pinned hub source."""
    problems = [
        f"config key 'grid.model': {name!r} is not defined under 'models'; defined: {sorted(models)}"
        for name in grid_models
        if name not in models
    ]
    for name, spec in models.items():
        key = f"models.{name}"
        if spec["trust_remote_code"] and spec["source"] != "hub":
            problems.append(
                f"config key '{key}.trust_remote_code': remote code runs only for source 'hub', and only once its "
                "revision is pinned (so the code that runs is the code you reviewed); turn it off"
            )
        if spec["source"] == "hub":
            if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") and not spec["path"]:
                problems.append(
                    f"config key '{key}.source': 'hub' cannot be fetched while HF_HUB_OFFLINE is set; download it "
                    "where there is network and use source: local with path: <folder>"
                )
            if not spec["repo_id"]:
                problems.append(f"config key '{key}.repo_id': required for source 'hub' (e.g. google/gemma-3-4b-it)")
        elif spec["source"] == "local":
            path = Path(spec["path"]) if spec["path"] else None
            if path is None or not path.is_dir():
                problems.append(
                    f"config key '{key}.path': {spec['path']!r} is not a directory; give the checkpoint's folder"
                )
        elif spec["source"] == "gguf":
            from tunegrid.study.gguf_files import gguf_spec_problems

            problems += gguf_spec_problems(spec, key)
    return problems


def _adapter_problems(lora: dict[str, Any], quants: list[str]) -> list[str]:
    """Adapters that name something to attach to, and LoRA settings the grid's quantizations can train."""
    from tunegrid.meanings import QUANT_ROWS

    problems = []
    if not lora["target_modules"] and not lora["target_parameters"] and not lora.get("target_regex"):
        problems.append(
            "config key 'lora.target_modules': empty, and so is lora.target_parameters: name the modules that get "
            "adapters (e.g. [q_proj, v_proj], or [all-linear])"
        )
    quantized = [q for q in quants if QUANT_ROWS[q].quantizes]
    if lora.get("loftq_bits") and quantized:
        problems.append(
            f"config key 'lora.loftq_bits': LoftQ replaces each adapted weight of an unquantized base by its "
            f"quantization round trip; grid.quant {quantized} loads a quantized one: keep quant none"
        )
    after_load = [q for q in quants if QUANT_ROWS[q].experts_after_load]
    if after_load and lora["target_parameters"]:
        problems.append(
            f"config key 'lora.target_parameters': adapters on expert tensors train over an NF4 base "
            f"(quant nf4-experts), not over the row-wise int8 experts of {after_load}; drop one of the two"
        )
    return problems


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


DEFAULT_STUDY_PATH = REPO_ROOT / "configs" / "config.yaml"  # the study when no study file is given


def read_yaml(path: Path) -> dict[str, Any]:
    with open(path) as fh:
        return yaml.load(fh, Loader=_SAFE_LOADER) or {}


def load_study(path: str | Path) -> dict[str, Any]:
    """Read a study YAML (bounded: input_limits.read_study_yaml) and resolve it; a missing or unparsable
    file is a ConfigError too."""
    return resolve_study(read_study_file(path))


def read_study_file(path: str | Path) -> dict[str, Any]:
    """A study YAML as written, read bounded (input_limits.read_study_yaml), not yet resolved."""
    raw = read_study_yaml(Path(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(raw).__name__}")
    return raw


def expand_cells(study: dict[str, Any]) -> list[Cell]:
    """The grid as cells, in a stable order (the product of the axes as listed in the config), less those
    `grid.exclude` names."""
    grid, table = study["grid"], axis_table()
    cell = cell_class(table)
    names = [a.name for a in table]
    exclusions = grid.get("exclude", [])  # absent from a study.json written before exclusions existed
    product = (dict(zip(names, values)) for values in itertools.product(*(grid[name] for name in names)))
    return [cell(**axes) for axes in product if not excluded(axes, exclusions)]


def cells_by_id(study: dict[str, Any]) -> dict[str, Cell]:
    return {cell.cell_id: cell for cell in expand_cells(study)}


def baseline_cell(study: dict[str, Any], cell_id: str = "") -> Cell:
    """The cell the doctor reproduces: `cell_id`, else the first value of every axis (an imported recipe's own
    cell). An id the study lacks is a ValueError naming some of its cells."""
    cells = cells_by_id(study)
    if not cell_id:
        return Cell(**{axis: study["grid"][axis][0] for axis in axis_names()})
    if cell_id not in cells:
        shown = ", ".join(list(cells)[:6]) + (" …" if len(cells) > 6 else "")
        raise ValueError(f"{cell_id!r} is not a cell of study {study['study']!r} ({len(cells)} cells: {shown})")
    return cells[cell_id]


def cell_spec(study: dict[str, Any], cell: Cell) -> CellSpec:
    """Everything one cell needs to train, fully resolved: what result.json records as `cell`. The axes that
    stand for a study setting (activation checkpointing, the loss, the collective timeout, the rank faults) are
    written into it, so the trainer reads one place. Every default is the resolved study's (the schema's)."""
    from tunegrid.study.grid_axes import cell_debug, setting_values

    settings = setting_values(study, cell)
    sections = {
        "model": {"name": cell.model, **study["models"][cell.model]},
        "train": {
            **study["train"],
            "gradient_checkpointing": settings["activation_checkpointing"],
            "loss": settings["loss"],
        },
        "lora": study["lora"],
        "data": study["data"],
        "debug": cell_debug(study["debug"], cell.fault, cell.repeat),
        # the job's host-memory request is not how the cell trains: changing it re-runs no cell
        "hardware": {key: value for key, value in study["hardware"].items() if key != "mem_mb"},
        "distributed": {**study["distributed"], "collective_timeout_s": settings["collective_timeout_s"]},
    }
    stack = None
    if cell.stack != BASE_STACK:  # only then: the spec of a cell on the base stack is what it was before stacks
        from tunegrid.study.stacks import stack_ref

        stack = stack_ref(study, cell.stack)
    return CellSpec.of(study["study"], cell, sections, stack)


def study_cell_spec(study_file: str | Path, cell_id: str) -> CellSpec:
    """A cell's spec from the resolved study the workflow wrote once (results/<study>/study.json): jobs
    get a file path and a cell id, never the spec itself on their command line."""
    with open(study_file) as fh:
        study = json.load(fh)
    cells = cells_by_id(study)
    if cell_id not in cells:
        raise ConfigError(f"{cell_id!r} is not a cell of study {study['study']!r} ({study_file})")
    return cell_spec(study, cells[cell_id])


def spec_json(spec: dict[str, Any]) -> str:
    """Canonical JSON of a spec: identical config gives identical text (Snakemake's params trigger)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def grid_schema() -> dict[str, Any]:
    """The JSON schema of the study's `grid` key, built from the table: one array property per axis."""
    properties: dict[str, Any] = {}
    for row in axis_table():
        prop: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "uniqueItems": True,
            "items": dict(row.items),
            "description": row.description,
        }
        if row.default is not None:
            prop["default"] = list(row.default)
        properties[row.name] = prop
    return {
        "type": "object",
        "description": "the axes crossed into cells (every combination is one fine-tune)",
        "additionalProperties": False,
        "required": [a.name for a in axis_table() if a.default is None],
        "default": {},
        "properties": properties,
    }
