"""Library stacks, the light part every stage reads: a stack's requirements, its cache key and folder, the
reference a cell's spec holds, and the study's checks (tunegrid.prepare.stacks builds them).

    results/stacks/<key>/            the cache every study shares; <key> hashes the pins and the base interpreter
        venv/                        python -m venv --without-pip, plus a .pth that adds the base's site-packages
        stack.json                   written last: the pins, the resolved versions, build seconds, disk bytes
        pip-freeze.txt               every package the stack's interpreter sees (its own first, then the base's)

Light module: standard library only (the workflow computes each stack's key when it parses).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunegrid.cell_spec import StackRef
from tunegrid.vocabulary import BASE_STACK

STACKS_FOLDER = "stacks"  # under the results folder every study shares
RECORD_FILE = "stack.json"
FREEZE_FILE = "pip-freeze.txt"
# what a stack's record reports beside its pins: the libraries whose versions decide how a cell loads and trains
REPORTED_PACKAGES = ("torch", "transformers", "tokenizers", "huggingface_hub", "peft", "accelerate", "bitsandbytes")


def requirement(package: str, spec: str) -> str:
    """`transformers` + `4.57.*` -> `transformers==4.57.*`; a spec with an operator is kept as written."""
    spec = spec.strip()
    return f"{package}{spec}" if spec[:1] in "=!<>~" else f"{package}=={spec}"


def requirements(pins: dict[str, str]) -> list[str]:
    return [requirement(package, pins[package]) for package in sorted(pins, key=str.lower)]


def base_identity() -> dict[str, str]:
    """The interpreter a stack is layered on: a stack built over another base is another stack."""
    return {"python": sys.version.split()[0], "prefix": str(Path(sys.prefix).resolve()), "platform": sys.platform}


def stack_key(pins: dict[str, str], base: dict[str, str] | None = None) -> str:
    """The cache key of a stack: its requirements (sorted, so the order they are written in does not matter)
    and the base interpreter. A different pin is a different key, hence a different environment."""
    text = json.dumps({"requirements": requirements(pins), "base": base or base_identity()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stacks_root(results: str | Path) -> Path:
    return Path(results) / STACKS_FOLDER


def stack_dir(results: str | Path, pins: dict[str, str]) -> Path:
    return stacks_root(results) / stack_key(pins)


def stack_python(folder: Path) -> Path:
    return Path(folder) / "venv" / "bin" / "python"


def stack_ref(study: dict[str, Any], name: str, results: str | Path = "results") -> StackRef:
    if name == BASE_STACK:
        return StackRef(name=BASE_STACK, pins={}, key="", folder="", python="")
    pins = study["stacks"][name]
    folder = stack_dir(results, pins)
    return StackRef(name=name, pins=dict(pins), key=folder.name, folder=str(folder), python=str(stack_python(folder)))


def stack_problems(config: dict[str, Any]) -> list[str]:
    """Every `stack` value of the grid names a stack (or is the base); `base` is not a stack's name."""
    stacks = config.get("stacks") or {}
    problems = []
    if BASE_STACK in stacks:
        problems.append(
            f"config key 'stacks.{BASE_STACK}': {BASE_STACK!r} is the environment tunegrid runs in; name the stack "
            "otherwise"
        )
    for name in config["grid"].get("stack", [BASE_STACK]):
        if name != BASE_STACK and name not in stacks:
            problems.append(
                f"config key 'grid.stack': {name!r} is not defined under 'stacks'; defined: {sorted(stacks)} "
                f"(or {BASE_STACK!r}, the environment tunegrid runs in)"
            )
    return problems


def read_stack_record(folder: str | Path) -> dict[str, Any]:
    """The built stack's record, from its folder (results/stacks/<key>); empty where it was never built."""
    path = Path(folder) / RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass(frozen=True)
class StackMemory:
    """What a cell's library stack changes in its memory estimate (tunegrid.prepare.memory_estimate), from the
    stack's record. transformers 5 builds a MoE layer's experts as fused 3-D parameters, and tunegrid reads its
    checkpoint into private memory; 4.x keeps one nn.Linear per expert (bitsandbytes quantizes each as any linear
    layer) and reads through a mapping of the safetensors files, whose pages stay resident until the load ends
    (tunegrid.cell.load.model.load_causal_lm). The stack's own imports hold more or less than the base's: the
    difference of the two interpreters' runtime baselines, measured one after the other when the stack was built
    (tunegrid.prepare.stacks)."""

    fused_experts: bool = True
    mapped_load: bool = False
    runtime_extra_bytes: int = 0


BASE_STACK_MEMORY = StackMemory()


def stack_memory(record: dict[str, Any]) -> StackMemory:
    """The stack's memory facts from its record (read_stack_record); the base's where it was never built."""
    version = str((record.get("versions") or {}).get("transformers") or "")
    if not version[:1].isdigit():
        return BASE_STACK_MEMORY
    major = int(version.split(".")[0])
    baselines = record.get("runtime_baseline_bytes") or {}
    stack, base = baselines.get("stack"), baselines.get("base")
    extra = int(stack - base) if isinstance(stack, int) and isinstance(base, int) else 0
    return StackMemory(fused_experts=major >= 5, mapped_load=major < 5, runtime_extra_bytes=extra)
