"""Hostile or mistaken input, refused before anything runs: sizes (alias bombs, huge strings and files),
secrets typed into a study, and model architectures transformers does not know (read from its registry
file, without importing it).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

# Token-shaped values: Hugging Face tokens, MLflow/Databricks tokens, generic API keys, bearer secrets.
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|dapi[0-9a-f]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,})")


SECRET_KEY = re.compile(r"(token|password|passwd|secret|api[_-]?key)", re.IGNORECASE)


MAX_STUDY_VALUES = 100_000  # values in a study once YAML aliases are expanded (a real study has hundreds)


MAX_STRING_CHARS = 10_000  # any one string (a path, an id, a description)


MAX_STUDY_FILE_BYTES = 1_000_000


def size_problems(raw: Any) -> list[str]:
    """Bounds checked without expanding anything: YAML aliases make one object appear many times
    ("billion laughs": nine levels of ten aliases are 10^9 values), so sizes are counted once per
    distinct object and multiplied, never walked."""
    sizes: dict[int, int] = {}
    long_strings: list[str] = []

    def count(value: Any, key: str) -> int:
        if id(value) in sizes:
            return sizes[id(value)]
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        total = 1 + sum(count(v, f"{key}.{k}" if key else str(k)) for k, v in children)
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS and len(long_strings) < 3:
            long_strings.append(
                f"config key '{key}': a string of {len(value):,} characters; the limit is {MAX_STRING_CHARS:,}"
            )
        sizes[id(value)] = total
        return total

    total = count(raw, "")
    problems = list(long_strings)
    if total > MAX_STUDY_VALUES:
        problems.append(
            f"config key '<top level>': the study expands to {total:,} values (YAML aliases?); the limit is "
            f"{MAX_STUDY_VALUES:,}: "
            "write the study out without nested aliases"
        )
    return problems


def study_file_problems(paths: list[Any]) -> list[str]:
    return [
        f"config file {str(p)!r} is {Path(p).stat().st_size:,} bytes; a study file is at most {MAX_STUDY_FILE_BYTES:,}"
        for p in paths
        if Path(p).is_file() and Path(p).stat().st_size > MAX_STUDY_FILE_BYTES
    ]


def secret_problems(value: Any, key: str = "") -> list[str]:
    """Secrets never go into a study config: everything in it reaches params, logs and artifacts."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in secret_problems(v, f"{key}.{k}" if key else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in secret_problems(v, f"{key}.{i}")]
    hint = (
        "pass secrets through the environment (HF_TOKEN, MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD), "
        "never the config"
    )
    if isinstance(value, str) and SECRET_VALUE.search(value):
        return [f"config key '{key}': holds a token-shaped value; {hint}"]
    if isinstance(value, str) and value and SECRET_KEY.search(key.rsplit(".", 1)[-1]):
        return [f"config key '{key}': looks like a secret; {hint}"]
    if key == "tracking.tracking_uri" and isinstance(value, str) and re.match(r"^[a-z+]+://[^/@]*:[^/@]*@", value):
        return [f"config key '{key}': has a password in the URI; {hint}"]
    return []


@functools.cache
def _registry_fast() -> frozenset[str]:
    """transformers' model types from its generated mapping file, read without importing transformers
    (which costs seconds at every Snakefile parse); empty where the file is not there."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    path = Path(spec.origin).parent / "models" / "auto" / "auto_mappings.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        return frozenset()
    loader = importlib.util.spec_from_file_location("_tunegrid_auto_mappings", path)
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
        return frozenset(module.CONFIG_MAPPING_NAMES)
    except Exception:  # noqa: BLE001 — a different layout: the slow path below decides
        return frozenset()


def known_architecture(model_type: str) -> bool:
    if model_type in _registry_fast():
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # the full registry (slow)

    return model_type in CONFIG_MAPPING_NAMES
