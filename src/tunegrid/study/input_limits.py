"""Hostile or mistaken input, refused before anything runs: sizes (alias bombs, huge strings and files),
secrets typed into a study, and model architectures transformers does not know (read from its registry
file, without importing it).
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

import yaml

from tunegrid.study.errors import ConfigError

# Token-shaped values: Hugging Face tokens, MLflow/Databricks tokens, generic API keys, bearer secrets.
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|dapi[0-9a-f]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,})")


SECRET_KEY = re.compile(r"(token|password|passwd|secret|api[_-]?key)", re.IGNORECASE)


MAX_STUDY_VALUES = 100_000  # values in a study once YAML aliases are expanded (a real study has hundreds)


MAX_STRING_CHARS = 10_000  # any one string (a path, an id, a description)


MAX_STUDY_FILE_BYTES = 1_000_000


MAX_NESTING = 50  # mappings/lists inside each other (a real study nests five deep)


MAX_NUMBER = 1e15  # any number in a study, in magnitude: beyond it a count, size or rate is a typo or an attack


# ---------------------------------------------------------------------------------------- reading YAML


class StudyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with two changes for study files.

    - Exponent floats without a dot (`1e-3`, `2E5`) are numbers, as in YAML 1.2 and JSON: YAML 1.1 reads
      them as strings, which a user never means in a learning rate.
    - Pure Python, not libyaml: libyaml's composer recurses in C and a file of a few thousand nested
      brackets crashes the process (segmentation fault); here it is a RecursionError, caught below.
    """


StudyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_study_yaml(path: Path) -> Any:
    """A study file's YAML, bounded before anything is expanded; ConfigError (one sentence) otherwise.

    The file is composed to YAML nodes first, where aliases are still shared; their expanded size is counted
    there (merge keys included: `{<<: *a, <<: *a}` doubles per level inside PyYAML's merge, before any
    constructed value exists to count) and only a file within the limits is constructed into Python values.
    """
    path = Path(path)
    if not path.is_file():
        raise _invalid(f"config file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_STUDY_FILE_BYTES:
        raise _invalid(study_file_problems([path])[0])
    with open(path, encoding="utf-8", errors="replace") as fh:
        loader = StudyLoader(fh)
        try:
            node = loader.get_single_node()
            problem = node_problem(node) if node is not None else None
            if problem:
                raise _invalid(f"config file {str(path)!r}: {problem}")
            return loader.construct_document(node) if node is not None else None
        except yaml.YAMLError as exc:
            raise _invalid(f"config file {str(path)!r} is not valid YAML: {exc}") from None
        except RecursionError:
            raise _invalid(
                f"config file {str(path)!r}: nested more than Python can read (thousands of levels); "
                f"a study nests at most {MAX_NESTING} levels"
            ) from None
        except ConfigError:
            raise
        except ValueError as exc:  # e.g. an integer of more than 4,300 digits (Python's own limit)
            raise _invalid(f"config file {str(path)!r}: {exc}") from None
        finally:
            loader.dispose()


def _invalid(problem: str) -> ConfigError:
    return ConfigError("invalid study config:\n  - " + problem)


def node_problem(root: yaml.Node) -> str | None:
    """Why a composed YAML document must not be constructed, or None: its size once aliases and merge keys
    are expanded, its nesting, or an alias inside itself, named by key. Counted once per distinct node
    (memoised, walked without recursion), so a bomb costs as much to check as its text."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    too_deep: tuple[str, yaml.Node] | None = None
    stack: list[tuple[yaml.Node, tuple[str, ...], bool]] = [(root, (), False)]
    while stack:
        node, keys, done = stack.pop()
        children = _labelled(node)
        if done:
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for _, c in children), MAX_STUDY_VALUES + 1)
            continue
        if id(node) in sizes:
            continue
        if id(node) in entered:
            where = f"config key '{_key(keys)}' (line {node.start_mark.line + 1})"
            return f"{where}: an alias refers to a value that contains it"
        if len(keys) >= MAX_NESTING:
            too_deep = too_deep or (_key(keys), node)
            sizes[id(node)] = 1
            continue
        entered.add(id(node))
        stack.append((node, keys, True))
        stack.extend((c, (*keys, label), False) for label, c in children if id(c) not in sizes)
    if sizes[id(root)] > MAX_STUDY_VALUES:
        key, node = _largest_branch(root, sizes)
        return (
            f"config key '{key}' (line {node.start_mark.line + 1}): expands to more than {MAX_STUDY_VALUES:,} "
            "values once its YAML aliases and merge keys (<<) are expanded; write the study out without nested aliases"
        )
    if too_deep:
        return (
            f"config key '{too_deep[0]}' (line {too_deep[1].start_mark.line + 1}): nested deeper than {MAX_NESTING} "
            "levels (aliases included); a study nests a few levels"
        )
    return None


def _key(labels: tuple[str, ...]) -> str:
    """A readable key for a path through aliases: up to a merge (whose keys belong to the mapping that
    merges them), at most six levels."""
    labels = labels[: labels.index("<<")] if "<<" in labels else labels
    return ".".join(labels[:6]) or "<top level>"


def _labelled(node: yaml.Node) -> list[tuple[str, yaml.Node]]:
    if isinstance(node, yaml.MappingNode):
        pairs = [(str(k.value) if isinstance(k, yaml.ScalarNode) else "?", k, v) for k, v in node.value]
        return [item for label, k, v in pairs for item in ((label, k), (label, v))]
    if isinstance(node, yaml.SequenceNode):
        return [(str(i), v) for i, v in enumerate(node.value)]
    return []


def _largest_branch(root: yaml.Node, sizes: dict[int, int]) -> tuple[str, yaml.Node]:
    """The key path down to the value that is over the limit by itself: the alias bomb's own key."""
    parts: list[str] = []
    node = root
    while True:
        labelled = _labelled(node)
        over = [(label, child) for label, child in labelled if sizes.get(id(child), 0) > MAX_STUDY_VALUES]
        if not over or over[0][0] == "<<":  # merged keys belong to the mapping that merges them
            return (".".join(parts) or "<top level>"), node
        parts.append(over[0][0])
        node = over[0][1]


def number_problems(value: Any, key: str = "") -> list[str]:
    """Numbers that are not finite, or beyond MAX_NUMBER in magnitude, named by key. Every later step takes
    numbers at their word (int(budget * 2**30), a step count, a rate), so NaN, infinities and 1e400 stop here."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in number_problems(v, f"{key}.{k}" if key else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in number_problems(v, f"{key}.{i}" if key else str(i))]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    if isinstance(value, float) and not math.isfinite(value):
        return [f"config key '{key}': {value} is not a finite number (a finite number is required)"]
    if abs(value) > MAX_NUMBER:
        return [f"config key '{key}': {value:.4g} is out of range; numbers in a study are at most {MAX_NUMBER:.0e}"]
    return []


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
