"""Library stacks: the cache key, the study's `stacks:` and `stack` axis, and real builds by pip from a local
package index of hand-made wheels (no network): one that resolves is built once and reused, one whose pins
conflict is refused naming the packages and the conflict, by the rule, before any cell runs."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import make_study, snakemake_command, workflow_env

from tunegrid.prepare.stacks import StackError, build_stack
from tunegrid.study.config import ConfigError, cell_spec, cells_by_id, resolve_study
from tunegrid.study.stacks import (
    BASE_STACK_MEMORY,
    StackMemory,
    requirement,
    stack_dir,
    stack_key,
    stack_memory,
    stack_ref,
)

BASE = {"python": "3.11.7", "prefix": "/opt/base", "platform": "linux"}


def test_the_cache_key_follows_the_pins_not_their_order():
    pins = {"transformers": "4.57.*", "peft": "0.17.1"}
    key = stack_key(pins, BASE)
    assert stack_key(dict(reversed(list(pins.items()))), BASE) == key
    assert stack_key({**pins, "transformers": "4.56.*"}, BASE) != key  # a changed pin: another environment
    assert stack_key({**pins, "accelerate": "1.10.1"}, BASE) != key  # an added pin too
    assert stack_key(pins, {**BASE, "python": "3.12.1"}) != key  # and another base interpreter
    assert requirement("transformers", "4.57.*") == "transformers==4.57.*"
    assert requirement("transformers", ">=4.57,<5") == "transformers>=4.57,<5"


def test_a_study_without_stacks_keeps_its_ids_and_specs():
    study = resolve_study(make_study())
    (cell_id,) = cells_by_id(study)
    assert cell_id == "gemma3-hot_fp32_bs2_none_s0"
    assert "stack" not in cell_spec(study, cells_by_id(study)[cell_id]).to_json()


def test_a_stack_cell_gets_its_suffix_and_its_interpreter():
    grid = {"model": ["gemma3-hot"], "quant": ["none"], "stack": ["base", "tf-v4"]}
    study = resolve_study(make_study(grid=grid, stacks={"tf-v4": {"transformers": "4.57.*"}}))
    cells = cells_by_id(study)
    assert sorted(cells) == ["gemma3-hot_fp32_bs2_none_s0", "gemma3-hot_fp32_bs2_none_s0_stack-tf-v4"]
    stack = cell_spec(study, cells["gemma3-hot_fp32_bs2_none_s0_stack-tf-v4"]).to_json()["stack"]
    folder = stack_dir("results", {"transformers": "4.57.*"})
    assert stack == {
        "name": "tf-v4",
        "pins": {"transformers": "4.57.*"},
        "key": folder.name,
        "folder": str(folder),
        "python": str(folder / "venv" / "bin" / "python"),
    }


@pytest.mark.parametrize(
    ("stacks", "stack", "named"),
    [
        ({}, "tf-v4", "'grid.stack': 'tf-v4' is not defined under 'stacks'"),
        ({"base": {"transformers": "4.57.*"}}, "base", "'stacks.base'"),
        ({"tf-v4": {"transformers": "4.57; rm -rf /"}}, "tf-v4", "stacks.tf-v4.transformers"),
        ({"tf-v4": {}}, "tf-v4", "stacks.tf-v4"),
    ],
)
def test_bad_stacks_are_refused_naming_the_key(stacks, stack, named):
    grid = {"model": ["gemma3-hot"], "quant": ["none"], "stack": [stack]}
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("(", r"\(")):
        resolve_study(make_study(grid=grid, stacks=stacks))


def _wheel(index: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal pure-Python wheel (PEP 427), written by hand: a module and its dist-info."""
    module = name.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tunegrid-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(index / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip reads only this folder (PIP_NO_INDEX, PIP_FIND_LINKS): tg-stack-a 1.0 needs tg-stack-b < 1."""
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "tg-stack-a", "1.0", ("tg-stack-b<1",))
    _wheel(index, "tg-stack-b", "0.5")
    _wheel(index, "tg-stack-b", "2.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


def test_a_stack_is_built_once_and_reused(local_index, tmp_path):
    results, pins = tmp_path / "results", {"tg-stack-a": "1.0"}
    record = build_stack("ab", pins, results)
    assert record["reused"] is False
    assert record["layered"] == {"tg-stack-a": "1.0", "tg-stack-b": "0.5"} and record["versions"]["tg-stack-a"] == "1.0"
    assert record["versions"]["torch"]  # the base's packages are seen through the stack
    assert record["disk_bytes"] > 0 and record["build_s"] > 0
    python = stack_dir(results, pins) / "venv" / "bin" / "python"
    seen = subprocess.run(
        [str(python), "-c", "import tg_stack_b, torch; print(tg_stack_b.VERSION)"], capture_output=True, text=True
    )
    assert seen.stdout.strip() == "0.5", seen.stderr
    freeze = (stack_dir(results, pins) / "pip-freeze.txt").read_text()
    assert "tg-stack-a==1.0" in freeze and "tg-stack-b==0.5" in freeze
    # the runtime baselines of both interpreters, measured at the build: stacks of hand-made wheels import what the
    # base does, so the two hold within a tenth of each other
    baselines = record["runtime_baseline_bytes"]
    assert baselines["stack"] > 2**27 and abs(baselines["stack"] - baselines["base"]) < 0.1 * baselines["base"]
    os.environ["PIP_FIND_LINKS"] = str(tmp_path / "gone")  # a second build would fail: it must not happen
    again = build_stack("ab-again", pins, results)
    assert again["reused"] is True and again["key"] == record["key"] and again["name"] == "ab-again"
    assert again["runtime_baseline_bytes"] == baselines  # kept with the build, not measured again


def test_what_a_stack_changes_in_the_estimate_follows_its_transformers_and_its_measured_imports():
    v4 = {"versions": {"transformers": "4.57.6"}, "runtime_baseline_bytes": {"stack": 544 * 2**20, "base": 448 * 2**20}}
    assert stack_memory(v4) == StackMemory(fused_experts=False, mapped_load=True, runtime_extra_bytes=96 * 2**20)
    v5 = {**v4, "versions": {"transformers": "5.23.0"}}
    assert stack_memory(v5) == StackMemory(runtime_extra_bytes=96 * 2**20)
    # built by an earlier version (no baselines), a baseline that failed, or never built: nothing added
    assert stack_memory({"versions": {"transformers": "4.57.6"}}).runtime_extra_bytes == 0
    assert stack_memory({**v4, "runtime_baseline_bytes": {"stack": None, "base": 1}}).runtime_extra_bytes == 0
    assert stack_memory({}) == BASE_STACK_MEMORY


def test_pins_pip_cannot_resolve_are_refused_naming_the_conflict(local_index, tmp_path):
    with pytest.raises(StackError) as refused:
        build_stack("clash", {"tg-stack-a": "1.0", "tg-stack-b": "2.0"}, tmp_path / "results")
    message = str(refused.value)
    assert "stack 'clash' cannot be built: pip cannot resolve tg-stack-a==1.0 tg-stack-b==2.0" in message
    assert "the conflict is caused by" in message and "tg-stack-b<1" in message
    assert "stacks.clash" in message
    assert not (stack_dir(tmp_path / "results", {"tg-stack-a": "1.0", "tg-stack-b": "2.0"}) / "stack.json").exists()


@pytest.mark.slow
def test_the_rule_refuses_an_unresolvable_stack_before_any_cell(local_index, tmp_path):
    """A dry run shows every cell waits for every stack; the real run stops at the stack, no cell trained."""
    grid = {"model": ["gemma3-hot"], "quant": ["none"], "stack": ["base", "clash"]}
    study = make_study(grid=grid, stacks={"clash": {"tg-stack-a": "1.0", "tg-stack-b": "2.0"}})
    study.update(tracking={"enabled": False}, probe={"budget_s": 1})
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    env = workflow_env()

    def command(*args: str) -> list[str]:  # --configfile takes every word after it: last
        return snakemake_command(tmp_path, *args, "--cores", "1", "--configfile", str(tmp_path / "study.yaml"))

    dry = subprocess.run(command("-n", "-p", "all"), env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    # the stack is built where the cells' specs look for its interpreter: under the results folder all studies share
    (built_in,) = re.findall(r"stack --name clash .* --results (\S+) ", dry.stdout + dry.stderr)
    assert Path(stack_ref(resolve_study(study), "clash").folder).parents[1] == Path(built_in) == Path("results")
    inputs = re.findall(r"^rule finetune:\n\s+input: (.*)$", dry.stdout + dry.stderr, flags=re.M)
    assert len(inputs) == 2 and all("results/t/stacks/clash/stack.json" in line for line in inputs)
    run = subprocess.run(command("all"), env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "stack 'clash' cannot be built: pip cannot resolve" in run.stderr and "tg-stack-b<1" in run.stderr
    assert not list((tmp_path / "results" / "t").glob("runs/*/result.json"))
    log = json.dumps(sorted(p.name for p in (tmp_path / "results").rglob("*")))
    assert "result.json" not in log
