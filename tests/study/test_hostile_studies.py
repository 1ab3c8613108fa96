"""Hostile study files, generated: YAML alias bombs of every shape (list, mapping, merge-key, mixed, nested
at any key) and non-finite or huge numbers in every numeric field of the schema. `tunegrid validate` (its
loader: config.load_study) refuses each within 2 s naming the key; snakemake does too within 5 s, except
where its own loader expands the file before the Snakefile runs (test_snakemake_* below show where, and
that `--config study=` (or its long form `study_path=`) avoids it)."""

from __future__ import annotations

import math
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_study, snakemake_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunegrid.study.config import ConfigError, load_schema, load_study
from tunegrid.study.input import coerce_overrides, study_config

# ------------------------------------------------------------------------------------------ the corpus


def bomb_yaml(shape: str, levels: int, width: int) -> str:
    """Anchors `l0`..`lN`, each level `width` references to the one below: width**levels values expanded.
    merge: `{<<: *x, <<: *x}` (repeated merge keys, each doubling inside PyYAML's merge); merge-list:
    `{<<: [*x, *x, ...]}`; mixed alternates list and mapping levels."""
    lines = ["l0: &l0 {" + ", ".join(f"k{i}: x" for i in range(width)) + "}"]
    for level in range(1, levels + 1):
        below = f"*l{level - 1}"
        kind = shape if shape != "mixed" else ("list", "mapping")[level % 2]
        if kind == "list":
            body = "[" + ", ".join([below] * width) + "]"
        elif kind == "mapping":
            body = "{" + ", ".join(f"k{i}: {below}" for i in range(width)) + "}"
        elif kind == "merge":
            body = "{" + ", ".join([f"<<: {below}"] * width) + f", own{level}: x}}"
        else:  # merge-list
            body = "{<<: [" + ", ".join([below] * width) + f"], own{level}: x}}"
        lines.append(f"l{level}: &l{level} {body}")
    return "\n".join(lines)


# where a bomb may sit: an unknown top-level key, free-form model config, a list axis, a nested section
BOMB_PLACES = [("anchors",), ("models", "gemma3-hot", "config", "rope_scaling"), ("train", "extra"), ("grid", "seed")]


def study_with_bomb(shape: str, levels: int, width: int, place: tuple[str, ...]) -> tuple[str, str]:
    """(YAML text, the key the refusal must name): the anchors live under `place`, the top level of the bomb."""
    bomb = bomb_yaml(shape, levels, width)
    study = make_study()
    node = study
    for part in place[:-1]:
        node = node.setdefault(part, {})
    node[place[-1]] = "__BOMB__"
    text = yaml.safe_dump(study, sort_keys=False)
    indent = " " * 2 * (len(place))
    block = "\n" + "\n".join(indent + line for line in bomb.splitlines())
    return text.replace(" __BOMB__", block), ".".join(place)


def numeric_paths(schema: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key the schema types as a number or an integer (or a list of them), `[]` for list items."""
    if "$ref" in schema:
        schema = load_schema()["definitions"][schema["$ref"].rsplit("/", 1)[-1]]
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    found = []
    if types & {"number", "integer"} or any(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in schema.get("enum", [])
    ):
        found.append(prefix)
    for name, sub in (schema.get("properties") or {}).items():
        found += numeric_paths(sub, (*prefix, name))
    if isinstance(schema.get("items"), dict):
        found += numeric_paths(schema["items"], (*prefix, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        found += numeric_paths(schema["additionalProperties"], (*prefix, "gemma3-hot"))
    return found


NUMERIC_PATHS = numeric_paths(load_schema())
BAD_NUMBERS = [".nan", ".NaN", ".inf", "-.inf", "+.inf", "1e400", "-1e400", "1.5e300", "10" + "0" * 30, "-9e99"]


def study_with_number(path: tuple[str, ...], literal: str) -> tuple[str, str]:
    """(YAML text, key): the default test study with `literal` at `path` (`[]`: the first item of a list)."""

    def put(node: dict | list, parts: tuple[str, ...]) -> dict | list:
        if not parts:
            return "__NUMBER__"
        if parts[0] == "[]":
            return [put({}, parts[1:])]
        node = dict(node) if isinstance(node, dict) else {}
        node[parts[0]] = put(node.get(parts[0], {}), parts[1:])
        return node

    study = put(make_study(), path)
    return yaml.safe_dump(study, sort_keys=False).replace("__NUMBER__", literal), ".".join(path).replace("[]", "0")


def _names(out: str | None, key: str) -> bool:
    """A refusal naming the key, or one inside it."""
    return (
        out is not None and "invalid study config" in out and bool(re.search(rf"config key '{re.escape(key)}[.']", out))
    )


def _refused_naming(path: Path, key: str) -> str:
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_study(path)
    # A hang guard, not a speed test: the refusal does bounded work before anything is built (about 0.1 s on an
    # idle 2-core host), where an expanded bomb runs for minutes; 20 s leaves room for a loaded host.
    assert time.monotonic() - started < 20, "validation took longer than 20 s: is the bomb being expanded?"
    message = str(caught.value)
    assert _names(message, key), message
    assert "Traceback" not in message
    return message


# ------------------------------------------------------------------------------------------ validate


def test_the_corpus_covers_every_numeric_field():
    keys = {".".join(p) for p in NUMERIC_PATHS}
    assert {"train.lr", "train.steps", "hardware.memory_budget_gb", "train.time_limit_s", "grid.[]"} & keys
    assert "hardware.gpus_per_rank" in keys and "grid.batch_size.[]" in keys and len(keys) > 20


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.sampled_from(["list", "mapping", "merge", "merge-list", "mixed"]),
    levels=st.integers(12, 40),
    width=st.integers(2, 10),
    place=st.sampled_from(BOMB_PLACES),
)
def test_validate_refuses_every_bomb_shape_within_2s_naming_its_key(tmp_path, shape, levels, width, place):
    levels = max(levels, math.ceil(6 / math.log10(width)))  # a bomb: at least a million values expanded
    text, key = study_with_bomb(shape, levels, width, place)
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    message = _refused_naming(study, key)
    assert "aliases" in message


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(NUMERIC_PATHS), literal=st.sampled_from(BAD_NUMBERS))
def test_validate_refuses_non_finite_and_huge_numbers_in_every_numeric_field(tmp_path, path, literal):
    text, key = study_with_number(path, literal)
    study = tmp_path / "number.yaml"
    study.write_text(text)
    message = _refused_naming(study, key)
    assert re.search(r"not a finite number|out of range", message), message


def test_tunegrid_validate_command_refuses_a_merge_key_bomb(tmp_path):
    text, key = study_with_bomb("merge", 30, 2, ("anchors",))
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "tunegrid.cli", "validate", str(study)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and _names(done.stderr, key) and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_deep_nesting_and_self_reference_are_refused_not_crashed(tmp_path):
    cases = {
        "deep": ("study: deep\nx: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested"),
        "deep-block": (
            "study: deep\n" + "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "v: 1\n",
            "nested deeper",
        ),
        "self": ("study: self\nx: &x [1, *x]\n", "contains it"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=expected):
            load_study(path)


def test_exponent_numbers_are_numbers_in_validate_and_snakemake(tmp_path):
    """YAML 1.1 reads `1e-3` as a string; a study means a number (YAML 1.2, JSON), in both readers."""
    study = make_study()
    text = yaml.safe_dump(study, sort_keys=False).replace("lr: 0.01", "lr: 1e-3")
    assert "lr: 1e-3" in text
    path = tmp_path / "study.yaml"
    path.write_text(text)
    assert load_study(path)["train"]["lr"] == 0.001
    from tunegrid.study.input import study_config

    snakemakes = yaml.load(text, Loader=yaml.FullLoader)  # what snakemake's --configfile loader makes of it
    assert snakemakes["train"]["lr"] == "1e-3"
    assert study_config(snakemakes, {}, [str(path)])["train"]["lr"] == 0.001


def test_typed_overrides_of_every_schema_type(tmp_path):
    """`--config` nested values arrive as strings: integers, numbers, booleans, null, lists and enums of
    numbers (gpus_per_rank: [0, 1]) all become what the schema says; enums of strings stay strings."""
    typed = coerce_overrides(
        {
            "hardware": {"gpus_per_rank": "0", "memory_budget_gb": "12.5"},
            "train": {"steps": "5", "lr": "1e-3", "gradient_checkpointing": "off"},
            "grid": {"batch_size": "[2, 4]", "precision": "[fp32]"},
            "debug": {"inject_nonfinite": {"value": "nan"}},
        }
    )
    assert typed["hardware"] == {"gpus_per_rank": 0, "memory_budget_gb": 12.5}
    assert typed["train"] == {"steps": 5, "lr": 0.001, "gradient_checkpointing": False}
    assert typed["grid"] == {"batch_size": [2, 4], "precision": ["fp32"]}
    assert typed["debug"]["inject_nonfinite"]["value"] == "nan"
    with pytest.raises(ConfigError, match=r"train\.lr': nan is not a finite number"):
        from tunegrid.study.config import resolve_study

        resolve_study(
            make_study(train={**make_study()["train"], **coerce_overrides({"train": {"lr": "nan"}})["train"]})
        )


# ------------------------------------------------------------------------------------------ snakemake


def _snakemake(tmp_path: Path, *args: str, wait_s: float) -> tuple[str | None, float]:
    """(output, seconds), or (None, seconds) when it was still running after `wait_s` (then killed). Under a
    2 GiB address-space cap so that a bomb cannot take the host's memory."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    started = time.monotonic()
    proc = subprocess.Popen(
        snakemake_command(tmp_path, "-n", "--cores", "1", "all", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=cap,
    )
    try:
        out, _ = proc.communicate(timeout=wait_s)
        return out, time.monotonic() - started
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, time.monotonic() - started


SNAKEMAKE_BOMBS = {  # shape: (levels, width); each is at least 10^8 values expanded
    "list": (8, 10),
    "mapping": (8, 10),
    "merge": (28, 2),
    "merge-list": (28, 2),
    "mixed": (8, 10),
}
# Snakemake reads --configfile (yaml FullLoader, then a deep merge) before the Snakefile runs; these shapes
# are expanded there: the merge keys inside PyYAML's merge, the mappings by snakemake.utils.update_config.
# A list level stops the merge's descent (lists are assigned, not copied): "mixed" has a list on top.
EXPANDED_BY_SNAKEMAKE = {"mapping", "merge", "merge-list"}


@pytest.mark.parametrize("shape", sorted(SNAKEMAKE_BOMBS))
def test_snakemake_refuses_a_bomb_by_study_path_within_5s(tmp_path, shape):
    """The safe route: `--config study_path=<file>` hands the file to tunegrid's bounded loader only."""
    text, key = study_with_bomb(shape, *SNAKEMAKE_BOMBS[shape], ("anchors",))
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    out, seconds = _snakemake(tmp_path, "--config", f"study_path={study}", wait_s=60)
    assert _names(out, key), (out or "")[-2000:]
    assert "Traceback" not in out and seconds < 45  # a hang guard (under 5 s idle)
    assert not (tmp_path / "results").exists()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.sampled_from(["list", "mapping", "merge", "merge-list", "mixed"]),
    levels=st.integers(8, 40),
    width=st.integers(2, 10),
    place=st.sampled_from(BOMB_PLACES),
)
def test_the_shown_study_form_refuses_every_bomb_shape_in_2_cpu_seconds(tmp_path, shape, levels, width, place):
    """`--config study=<file>` (the form README and the docs show) as the Snakefile reads it: the file goes to
    tunegrid's bounded loader only, which refuses a bomb of any shape at any place in at most 2 s of CPU time
    (CPU time, so another process's load on the host does not count), naming the key."""
    levels = max(levels, math.ceil(8 / math.log10(width)))  # at least 10^8 values expanded
    text, key = study_with_bomb(shape, levels, width, place)
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    started = time.process_time()
    with pytest.raises(ConfigError) as caught:
        study_config({}, {"study": str(study)}, [])
    assert time.process_time() - started <= 2.0
    assert _names(str(caught.value), key) and "aliases" in str(caught.value), str(caught.value)


def test_study_names_a_file_or_renames_the_study(tmp_path, monkeypatch):
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump(make_study(study="from-file")))
    assert study_config({}, {"study": str(study)}, [])["study"] == "from-file"
    monkeypatch.chdir(tmp_path)
    assert study_config({}, {"study": "s.yaml"}, [])["study"] == "from-file"  # a .yaml name is a file
    renamed = study_config({}, {"study_path": str(study), "study": "renamed"}, [])
    assert renamed["study"] == "renamed"  # a name (no '/', no .yaml) stays an override of the study's name
    with pytest.raises(ConfigError, match="both name a study file"):
        study_config({}, {"study_path": str(study), "study": str(study)}, [])


def test_an_override_that_narrows_an_axis_drops_the_files_exclusions_it_made_moot(tmp_path):
    """`--config "grid={batch_size: [2]}"` on a study whose file excludes pairs of other batch sizes: those entries
    exclude nothing any more and are dropped; an entry the override leaves in reach stays, and one the override
    writes itself is checked as a file's is."""
    grid = {"model": ["gemma3-hot"], "batch_size": [4, 1], "grad_accum": [1, 4], "quant": ["none", "nf4"]}
    grid["exclude"] = [{"batch_size": 4, "grad_accum": 4}, {"batch_size": 1, "grad_accum": 1}, {"quant": "nf4"}]
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump(make_study(grid=grid)))
    narrowed = study_config({}, {"study": str(study), "grid": {"batch_size": "[2]"}}, [])
    assert narrowed["grid"]["batch_size"] == [2] and narrowed["grid"]["exclude"] == [{"quant": "nf4"}]
    load_study_from = tmp_path / "narrowed.yaml"
    load_study_from.write_text(yaml.safe_dump(narrowed))
    assert load_study(load_study_from)["grid"]["exclude"] == [{"quant": "nf4"}]  # valid as it stands
    own = study_config({}, {"study": str(study), "grid": {"batch_size": "[2]", "exclude": "[{batch_size: 4}]"}}, [])
    own_file = tmp_path / "own.yaml"
    own_file.write_text(yaml.safe_dump(own))
    with pytest.raises(ConfigError, match="'grid.exclude.0.batch_size': 4 is not a value of grid.batch_size"):
        load_study(own_file)


@pytest.mark.parametrize("shape", sorted(SNAKEMAKE_BOMBS))
def test_snakemake_refuses_a_bomb_by_the_shown_study_form(tmp_path, shape):
    """Through Snakemake as README shows it: `--config study=<file>`. Refused naming the key, no traceback; the
    2 s bound is the loader's (above): this run adds Snakemake's own start."""
    text, key = study_with_bomb(shape, *SNAKEMAKE_BOMBS[shape], ("anchors",))
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    out, seconds = _snakemake(tmp_path, "--config", f"study={study}", wait_s=60)
    assert _names(out, key), (out or "")[-2000:]
    assert "Traceback" not in out and seconds < 45  # a hang guard; an expanded bomb runs for minutes
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("shape", sorted(set(SNAKEMAKE_BOMBS) - EXPANDED_BY_SNAKEMAKE))
def test_snakemake_configfile_refuses_the_bombs_its_loader_keeps_shared(tmp_path, shape):
    """By --configfile: list bombs stay shared through snakemake's loader and are refused by the Snakefile,
    naming the key (the shapes it expands: the next test)."""
    text, key = study_with_bomb(shape, *SNAKEMAKE_BOMBS[shape], ("anchors",))
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    out, _ = _snakemake(tmp_path, "--configfile", str(study), wait_s=20)
    assert _names(out, key), (out or "")[-2000:]
    assert not (tmp_path / "results").exists()


def _snakemake_configfile(path: Path) -> tuple[dict, dict[int, int]]:
    """What `snakemake --configfile <path>` builds before the Snakefile runs, the way it builds it
    (ConfigSettings._get_overwrite_config: load_configfile, then update_config into a new dict), and how many
    key/value pairs PyYAML's constructor walked for each mapping (merge keys flattened in), by its line."""
    from snakemake.common.configfile import load_configfile
    from snakemake.utils import update_config

    walked: dict[int, int] = {}
    construct = yaml.FullLoader.construct_mapping  # yte's yaml.load(..., Loader=yaml.FullLoader)

    def counting(self, node, deep=False):
        mapping = construct(self, node, deep=deep)
        walked[node.start_mark.line] = len(node.value)
        return mapping

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(yaml.FullLoader, "construct_mapping", counting)
        config: dict = {}
        update_config(config, load_configfile(path))
    return config, walked


def _containers(value: object, seen: set[int] | None = None) -> int:
    """Distinct dicts and lists reachable from `value`, by identity: a shared (aliased) one counts once."""
    seen = set() if seen is None else seen
    if isinstance(value, (dict, list)) and id(value) not in seen:
        seen.add(id(value))
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, seen)
    return len(seen)


@pytest.mark.parametrize("shape", sorted(EXPANDED_BY_SNAKEMAKE))
def test_snakemake_configfile_expands_the_other_bombs_before_the_snakefile(tmp_path, shape):
    """By --configfile, the limitation docs/guide/security.md documents, counted rather than timed: a small bomb
    (4 levels of 3) read the way Snakemake reads it comes out expanded. The mapping bomb leaves the config
    merge as a tree of copies (3^k dicts where the aliases made one per level); each merge-key level makes
    PyYAML's constructor walk 3 times the level below (the dict it builds keeps one of each key, the work does
    not shrink). At full size (SNAKEMAKE_BOMBS, 10^8 values) that runs for minutes or until memory runs out,
    before the Snakefile starts, whose own reading of that file refuses it at once, naming the key."""
    levels, width = 4, 3
    text, _ = study_with_bomb(shape, levels, width, ("anchors",))
    study = tmp_path / "bomb.yaml"
    study.write_text(text)
    config, walked = _snakemake_configfile(study)
    if shape == "mapping":
        copies = [1]  # dicts in level k once copied: its own and `width` copies of level k - 1's
        for _ in range(levels):
            copies.append(1 + width * copies[-1])
        expanded, unexpanded = 1 + sum(copies), 1 + len(copies)  # `anchors` and its levels
        found = _containers(config["anchors"])
    else:
        pairs = [width]  # pairs walked for level k: `width` times level k - 1's, flattened in, and its own key
        for _ in range(levels):
            pairs.append(width * pairs[-1] + 1)
        top = next(i for i, line in enumerate(text.splitlines()) if f"l{levels}: &l{levels} " in line)
        expanded, unexpanded = pairs[-1], width + levels  # each key once: what the dict holds
        found = walked.get(top)
        assert len(config["anchors"][f"l{levels}"]) == unexpanded
    assert expanded > 10 * unexpanded
    assert found == expanded, f"snakemake no longer expands it: fix the docs ({found} found, {expanded} expanded)"

    text, key = study_with_bomb(shape, *SNAKEMAKE_BOMBS[shape], ("anchors",))
    study.write_text(text)
    with pytest.raises(ConfigError) as caught:
        study_config({}, {}, [str(study)])  # as the Snakefile reads the --configfile files
    assert _names(str(caught.value), key) and "aliases" in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "literal, path",
    [(".nan", ("train", "lr")), ("1e400", ("hardware", "memory_budget_gb")), (".inf", ("train", "time_limit_s"))],
)
def test_snakemake_configfile_refuses_non_finite_numbers_naming_the_key(tmp_path, literal, path):
    text, key = study_with_number(path, literal)
    study = tmp_path / "number.yaml"
    study.write_text(text)
    out, seconds = _snakemake(tmp_path, "--configfile", str(study), wait_s=60)
    assert out is not None and f"config key '{key}'" in out and "Traceback" not in out, (out or "")[-2000:]
    assert not (tmp_path / "results").exists()


def test_snakemake_typed_override_of_an_integer_enum(tmp_path):
    out, _ = _snakemake(tmp_path, "--config", "hardware={gpus_per_rank: 0}", "grid={batch_size: [2]}", wait_s=120)
    assert out is not None and "invalid study config" not in out and "finetune" in out, (out or "")[-2000:]


if __name__ == "__main__":  # print one corpus file, to look at: python test_hostile_studies.py merge 5 2
    print(study_with_bomb(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), ("anchors",))[0])
